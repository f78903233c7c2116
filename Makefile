# Two commands on a fresh machine: `make serve` and `make test`.
# GPU users override the torch pin, e.g. `make test TORCH_SPEC="torch==2.13.0" TORCH_INDEX=--index-url=...`.
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
MODEL_PATH  ?=
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
	$(VENV)/bin/hybrid-serve generate $(if $(MODEL_PATH),--model-path $(MODEL_PATH),)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache
