# Two commands on a fresh machine: `make serve` and `make test`.
# GPU users override the torch pin, e.g. `make test TORCH_SPEC="torch==2.13.0" TORCH_INDEX=--index-url=...`.
# Everything but torch and triton installs at the versions of constraints.txt, the set the suite
# last passed with; `make constraints` rewrites it after a green run.
PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
MODEL_PATH  ?=
PYTEST_ARGS ?=
# pytest processes side by side, sharing out the test files (tests/shards.py; each test runs one
# torch thread): the CI machine's 2 cores. TEST_SHARDS=1: one plain pytest.
TEST_SHARDS ?= 2
SERVE_ARGS  ?=

PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONSTRAINTS := constraints.txt
# The kernels' level tests build the C++ kernels for the other architecture too, and run them
# under qemu-user.
ARCH := $(shell uname -m)
OTHER := $(if $(filter aarch64,$(ARCH)),x86_64,aarch64)
CROSS_PKG := $(if $(filter aarch64,$(ARCH)),g++-x86-64-linux-gnu,g++-aarch64-linux-gnu)

.PHONY: install test serve lint clean cross-tools constraints

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch alone from TORCH_INDEX (which may lack the pinned releases of torch's dependencies);
	# the next line brings those to the tested versions
	$(PY) -m pip install --quiet $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[dev]'
	# this CPU's level of the C++ kernels, now rather than at the first server start: a failed
	# build stops here with the compiler's first error (no compiler: a warning, the references)
	$(PY) -m hybrid_serve.kernels.prebuild
	touch $(STAMP)

test: $(STAMP) cross-tools
	$(PY) -m tests.shards --shards $(TEST_SHARDS) -q $(PYTEST_ARGS)

# Debian's cross compiler for the other architecture and qemu-user, installed where missing
# (as root; elsewhere the level tests say what to install)
cross-tools:
	@command -v $(OTHER)-linux-gnu-g++ >/dev/null && command -v qemu-$(OTHER) >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get install -y -q $(CROSS_PKG) qemu-user >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null && apt-get install -y -q $(CROSS_PKG) qemu-user >/dev/null; }; \
	  else echo "install $(CROSS_PKG) and qemu-user (the kernels' level tests use them)"; fi; }

# The HTTP server on 127.0.0.1:30000; with no MODEL_PATH it serves the tiny preset (written on
# first use to ~/.cache/hybrid-serve/tiny). More flags: make serve SERVE_ARGS="--port 8000".
serve: $(STAMP)
	$(VENV)/bin/hybrid-serve $(if $(MODEL_PATH),--model-path $(MODEL_PATH)) $(SERVE_ARGS)

# After a green run: the suite, then constraints.txt rewritten from .venv's `pip freeze` (each
# line's reason kept; torch and triton left out).
constraints: test
	$(PY) -m tests.constraints

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache
