# Two commands on a fresh machine: `make serve` and `make test`.
# GPU users override the torch pin, e.g. `make test TORCH_SPEC="torch==2.13.0" TORCH_INDEX=--index-url=...`.
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
MODEL_DIR   ?= $(HOME)/.cache/hybrid-serve/tiny
PYTEST_ARGS ?=

PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test serve lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

serve: $(STAMP)
	$(VENV)/bin/hybrid-serve serve --model-path $(MODEL_DIR)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache
