# Two entry points for a fresh clone: `make demo` (the main job) and `make test` (the tests).
# Each creates .venv with Python 3.11 and installs what it needs; torch is pinned to 2.13.0,
# the CPU build (a plain `torch` would pull a multi-GB CUDA build).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0
EXTRAS ?= test

# `make test-megatron MCORE=0.19.2`: the Megatron tests against another megatron-core release, in
# its own environment (.venv-mcore-<version>). megatron-core 0.17 and later need Python 3.12
# (PY312); there torch 2.13.0 comes from the registry as its CUDA build, which runs on CPU (~4.8 GB).
MCORE ?= 0.19.2
PY312 ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12; do $$p -c '' >/dev/null 2>&1 && { echo $$p; break; }; done)
MVENV := .venv-mcore-$(MCORE)
ifeq ($(findstring 0.16.,$(MCORE)),0.16.)
MPYTHON := $(PYTHON)
else
MPYTHON := $(PY312)
endif

.PHONY: demo test test-megatron results venv clean

$(VENV)/.installed-$(EXTRAS): setup.cfg pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found: set PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]" $(TORCH)
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(VENV)/.installed-$(EXTRAS)

demo: venv
	$(PY) -m striped_sp.demo --world-size 2
	$(PY) examples/megatron/train_tiny_gpt.py
	$(PY) examples/megatron/train_tiny_gpt.py --packed --steps 40 --batch 4 --seq-length 256

test: venv
	$(PY) -m pytest -q

# `make results`: docs/results.md's tables and the plots in docs/ (python -m striped_sp.bench.results --help)
results: venv
	$(PY) -m striped_sp.bench.results

$(MVENV)/.installed: setup.cfg pyproject.toml
	@test -n "$(MPYTHON)" || { echo "megatron-core $(MCORE) needs Python 3.12: set PY312=/path/to/python3.12"; exit 1; }
	test -x $(MVENV)/bin/python || $(MPYTHON) -m venv $(MVENV)
	$(MVENV)/bin/python -m pip install --quiet --upgrade pip
	$(MVENV)/bin/python -m pip install --quiet $(TORCH)
	$(MVENV)/bin/python -m pip install --quiet -e . "megatron-core==$(MCORE)" "pytest>=7" einops $(TORCH)
	touch $@

test-megatron: $(MVENV)/.installed
	$(MVENV)/bin/python -m pytest -q tests/integration/megatron

clean:
	rm -rf $(VENV) .venv-mcore-* build *.egg-info
