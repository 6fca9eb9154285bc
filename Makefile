# Two commands do everything (see README): `make train` and `make test`.
# Each creates .venv idempotently (re-installs only when pyproject.toml or this file change).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: help train test test-lowest lint bench mutation mutation-core clean-venv

help:
	@echo "make train         set up .venv (once), then train DLRM on MovieLens-100K on a data=2,model=4 mesh"
	@echo "                   (ARGS=... passes flags to python -m hybrid.train, e.g. ARGS=--overwrite)"
	@echo "make test          set up .venv (once), then run the whole suite (what CI runs: .ci/run)"
	@echo "make test-lowest   the suite on the oldest supported torchmetrics"
	@echo "make lint          ruff check and format --check"
	@echo "make bench         python -m benchmarks.xla_vs_fbgemm (XLA / C++ vs FBGEMM)"
	@echo "make mutation      mutation testing of MODULE= with TESTS= (mutation-core: the core modules)"
	@echo "make clean-venv    remove .venv"

$(STAMP): pyproject.toml Makefile
	@echo "== [1/5] virtual environment $(VENV)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --progress-bar on --upgrade pip
	@echo "== [2/5] torch 2.13.0, CPU build (~1 min; first, so nothing pulls the multi-GB CUDA build)"
	$(PIP) install --progress-bar on torch==2.13.0
	@echo "== [3/5] hybridrec with the test and parity extras: jax, optax, fbgemm-gpu-cpu, ... (~2 min)"
	$(PIP) install --progress-bar on -e '.[test,parity]'
	@echo "== [4/5] torchrec 1.8.0 without its dependencies (it names the CUDA fbgemm-gpu)"
	$(PIP) install --progress-bar on --no-deps torchrec==1.8.0
	@echo "== [5/5] the fused CPU kernels (C++ through jax.ffi; without g++ the XLA path is used)"
	$(PY) -m sparse_jax._kernels.build || echo "CPU kernels not built: the XLA path will be used"
	touch $(STAMP)
	@echo "== ready: $(VENV)"

# ARGS: more flags for the training script, e.g. make train ARGS=--overwrite
ARGS ?=
train: $(STAMP)
	$(PY) -m hybrid.train --config configs/movielens.toml --mesh data=2,model=4 $(ARGS)

# Two pytest workers (pytest-xdist), one test file each at a time (module fixtures stay in one
# process): the suite is mostly single-threaded XLA compiles, so 2 cores run two at once.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

# The suite on the oldest supported torchmetrics (1.0.3, what torchrec 1.8 was released with),
# overlaid on .venv; `make test` covers the newest.
test-lowest: $(STAMP)
	$(PIP) install --progress-bar on --no-deps --upgrade --target $(VENV)/lowest torchmetrics==1.0.3
	PYTHONPATH=$(VENV)/lowest $(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check sparse_jax dense_torch hybrid tests benchmarks tools
	$(PY) -m ruff format --check sparse_jax dense_torch hybrid tests benchmarks tools

# Mutation testing, one module at a time (mutmut 3, forkserver workers; see tools/mutation.sh):
#   make mutation MODULE=sparse_jax/planner/_constraints.py TESTS=tests/test_planner.py
MODULE ?= sparse_jax/_validate.py
TESTS  ?= tests/test_jagged.py tests/test_embedding_bag.py
mutation: $(STAMP)
	$(PIP) install --progress-bar off -e '.[mutation]'  # -e: a plain install would shadow the tree
	PY=$(PY) tools/mutation.sh $(MODULE) $(TESTS)

# Every module of the numeric and safety core with its own test selection (tools/mutation_core.sh);
# MODULES="sparse_jax/_update.py ..." picks some. The scores are in docs/mutation.md.
MODULES ?=
mutation-core: $(STAMP)
	$(PIP) install --progress-bar off -e '.[mutation]'  # -e: a plain install would shadow the tree
	PY=$(PY) MODULES="$(MODULES)" tools/mutation_core.sh

bench: $(STAMP)
	$(PY) -m benchmarks.xla_vs_fbgemm

clean-venv:
	rm -rf $(VENV)
