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
# The compile-matrix test builds the C++ kernels for the other architecture too.
ARCH := $(shell uname -m)
CROSS_PKG := $(if $(filter aarch64,$(ARCH)),g++-x86-64-linux-gnu,g++-aarch64-linux-gnu)
CROSS_CXX := $(if $(filter aarch64,$(ARCH)),x86_64-linux-gnu-g++,aarch64-linux-gnu-g++)

.PHONY: install test serve lint clean cross-compiler

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]'
	# this CPU's level of the C++ kernels, now rather than at the first server start: a failed
	# build stops here with the compiler's first error (no compiler: a warning, the references)
	$(PY) -m kernels.prebuild
	touch $(STAMP)

test: $(STAMP) cross-compiler
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Debian's cross compiler for the other architecture, installed where missing (as root)
cross-compiler:
	@command -v $(CROSS_CXX) >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get install -y -q $(CROSS_PKG) >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null && apt-get install -y -q $(CROSS_PKG) >/dev/null; }; \
	  else echo "install $(CROSS_PKG) (the kernels' compile-matrix test needs $(CROSS_CXX))"; fi; }

# The HTTP server on 127.0.0.1:30000; with no MODEL_PATH it serves the tiny preset (written on
# first use to ~/.cache/hybrid-serve/tiny). More flags: make serve SERVE_ARGS="--port 8000".
serve: $(STAMP)
	$(VENV)/bin/hybrid-serve $(if $(MODEL_PATH),--model-path $(MODEL_PATH)) $(SERVE_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache
