# Two commands do everything (see README): `make train` and `make test`.
# Each creates .venv idempotently (re-installs only when pyproject.toml or this file change).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: train test lint bench clean-venv

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU build of torch first: it satisfies the project's torch range, so nothing bigger is pulled.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,parity]'
	# torchrec names the CUDA fbgemm-gpu; the parity extra installed fbgemm-gpu-cpu instead.
	$(PIP) install -q --no-deps torchrec==1.8.0
	# the fused CPU kernels (C++ through jax.ffi); without g++ the XLA path is used
	$(PY) -m sparse_jax._kernels.build || echo "CPU kernels not built: the XLA path will be used"
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m hybrid.train --config configs/movielens.toml --mesh data=2,model=4

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check sparse_jax dense_torch hybrid tests benchmarks

bench: $(STAMP)
	$(PY) -m benchmarks.xla_vs_fbgemm

clean-venv:
	rm -rf $(VENV)
