# Two commands on a fresh machine: `make serve` and `make test`.
# GPU users override the torch pin, e.g. `make test TORCH_SPEC="torch==2.13.0" TORCH_INDEX=--index-url=...`.
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
MODEL_PATH  ?=
PYTEST_ARGS ?=
SERVE_ARGS  ?=

PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test serve lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]'
	# build the C++ CPU kernels now rather than at the first server start (a fallback remains)
	$(PY) -c "import kernels.cpp_build as b; b.load()"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The HTTP server on 127.0.0.1:30000; with no MODEL_PATH it serves the tiny preset (written on
# first use to ~/.cache/hybrid-serve/tiny). More flags: make serve SERVE_ARGS="--port 8000".
serve: $(STAMP)
	$(VENV)/bin/hybrid-serve $(if $(MODEL_PATH),--model-path $(MODEL_PATH)) $(SERVE_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache
