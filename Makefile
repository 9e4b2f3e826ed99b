# Two entry points for a fresh clone: `make demo` (the main job) and `make test` (the tests).
# Each creates .venv with Python 3.11 and installs what it needs; torch is pinned to 2.13.0.
# On Linux without CUDA (no working nvidia-smi) torch comes from PyTorch's CPU wheel index
# (TORCH_CPU_INDEX; a plain `torch` from the package registry is the multi-GB CUDA build there),
# with the package registry as the fallback when that index cannot be reached; with CUDA, and on
# macOS / Windows (whose registry wheels are the CPU ones), from the package registry.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
EXTRAS ?= test
TORCH_NAME := $(firstword $(subst ==, ,$(TORCH)))
CPU_TORCH := $(shell [ "$$(uname -s)" = Linux ] && ! nvidia-smi -L >/dev/null 2>&1 && echo 1)

# $(call install_torch,PYTHON): torch's CPU build where CPU_TORCH (PyTorch's index first, if it
# answers within 10 s; the registry as the fallback), else the registry's
define install_torch
	@if [ -n "$(CPU_TORCH)" ] && $(1) -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip('/') + '/$(TORCH_NAME)/', timeout=10)" "$(TORCH_CPU_INDEX)" 2>/dev/null; then \
	  echo "$(1) -m pip install $(TORCH) --index-url $(TORCH_CPU_INDEX)  (torch's CPU build)"; \
	  $(1) -m pip install --quiet --index-url $(TORCH_CPU_INDEX) "$(TORCH)" \
	  || { echo "PyTorch's CPU index $(TORCH_CPU_INDEX) failed: $(TORCH) from the package registry instead"; \
	       $(1) -m pip install --quiet "$(TORCH)"; }; \
	elif [ -n "$(CPU_TORCH)" ]; then \
	  echo "PyTorch's CPU index $(TORCH_CPU_INDEX) does not answer: $(TORCH) from the package registry (its Linux build is the CUDA one, which runs on the CPU, unless a local wheel provides the CPU build)"; \
	  $(1) -m pip install --quiet "$(TORCH)"; \
	else \
	  echo "$(1) -m pip install $(TORCH)  (the package registry's build)"; \
	  $(1) -m pip install --quiet "$(TORCH)"; \
	fi
endef

# `make test-megatron MCORE=0.19.2`: the Megatron tests against another megatron-core release, in
# its own environment (.venv-mcore-<version>). megatron-core 0.17 and later need Python 3.12
# (PY312); torch as above (PyTorch's CPU index has no Python 3.12 build of 2.13.0 on some machines:
# then the registry's CUDA build, which runs on CPU, ~4.8 GB).
MCORE ?= 0.19.2
PY312 ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12; do $$p -c '' >/dev/null 2>&1 && { echo $$p; break; }; done)
MVENV := .venv-mcore-$(MCORE)
ifeq ($(findstring 0.16.,$(MCORE)),0.16.)
MPYTHON := $(PYTHON)
else
MPYTHON := $(PY312)
endif

.PHONY: demo test test-release test-megatron test-torch gpu-wheels results venv torch clean

$(VENV)/.installed-$(EXTRAS): setup.cfg pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found: set PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(call install_torch,$(PY))
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]" "$(TORCH)"
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(VENV)/.installed-$(EXTRAS)

# `make torch`: only the torch step, into $(VENV) (made if absent)
torch:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(call install_torch,$(PY))

demo: venv
	$(PY) -m striped_sp.demo --world-size 2
	$(PY) examples/megatron/train_tiny_gpt.py
	$(PY) examples/megatron/train_tiny_gpt.py --packed --steps 40 --batch 4 --seq-length 256

# `make test`: every test but those marked `release` (setup.cfg: the planted-bug runs of Megatron-LM's
# real loop and the long sweeps), which `make test-release` runs; CI (.ci/run) runs both.
# TEST_JOBS pytest-xdist workers (one thread each: tests/conftest.py), a test file's tests on one
# worker (--dist loadfile: a file's gloo cases run in one spawn, its cases_test / module state), the
# files dealt in tests/conftest.py's order (--no-loadscope-reorder: xdist would deal the files with
# the most tests first, leaving the long launches of few tests to the end);
# TEST_JOBS=0: one process.
TEST_JOBS ?= 2
XDIST = $(if $(filter-out 0,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder)
test: venv
	$(PY) -m pytest -q $(XDIST) -m "not release"

test-release: venv
	$(PY) -m pytest -q $(XDIST) -m release

# `make results`: docs/results.md's tables and the plots in docs/ (python -m striped_sp.bench.results --help)
results: venv
	$(PY) -m striped_sp.bench.results

$(MVENV)/.installed: setup.cfg pyproject.toml
	@test -n "$(MPYTHON)" || { echo "megatron-core $(MCORE) needs Python 3.12: set PY312=/path/to/python3.12"; exit 1; }
	test -x $(MVENV)/bin/python || $(MPYTHON) -m venv $(MVENV)
	$(MVENV)/bin/python -m pip install --quiet --upgrade pip
	$(call install_torch,$(MVENV)/bin/python)
	$(MVENV)/bin/python -m pip install --quiet -e . "megatron-core==$(MCORE)" "pytest>=7" "pytest-xdist>=3.8" einops "$(TORCH)"
	touch $@

test-megatron: $(MVENV)/.installed
	$(MVENV)/bin/python -m pytest -q $(XDIST) tests/integration/megatron

# `make test-torch TORCH_VERSION=2.11.0` (or TORCH=2.11.0): the core tests (CORE_TESTS: the engine,
# the plans and the kernels on CPU, no Megatron / DeepSpeed / transformers; test_docs.py checks
# Megatron-LM flags, so it is left to `make test`) against another torch
# release, in its own Python 3.11 environment (.venv-torch-<version>), torch installed as
# install_torch does (PyTorch's CPU index, else the registry). CORE_DEPS: what those tests import
# besides torch.
CORE_TESTS ?= tests/unit tests/dist --ignore=tests/dist/test_docs.py -m "not integration and not gpu"
CORE_DEPS ?= "pytest>=7" "pytest-xdist>=3.8" "setuptools>=70.1" "matplotlib>=3.7" "tqdm>=4.60" "einops>=0.8"
TORCH_VERSION ?= $(patsubst torch==%,%,$(TORCH))
TVENV := .venv-torch-$(TORCH_VERSION)

$(TVENV)/.installed: setup.cfg pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found: set PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(TVENV)/bin/python || $(PYTHON) -m venv $(TVENV)
	$(TVENV)/bin/python -m pip install --quiet --upgrade pip
	$(MAKE) --no-print-directory torch VENV=$(TVENV) TORCH=torch==$(TORCH_VERSION)
	$(TVENV)/bin/python -m pip install --quiet -e . $(CORE_DEPS) "torch==$(TORCH_VERSION)"
	touch $@

test-torch: $(TVENV)/.installed
	$(TVENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(TVENV)/bin/python -m pytest -q $(XDIST) $(CORE_TESTS)

# `make gpu-wheels PYVER=3.12 CUDA=13`: flash-attn-4 and its dependencies (torch aside) as wheel files
# for a GPU machine without network (docs/gpu.md): downloaded for that Python and CUDA major (13
# for torch +cu130, 12 otherwise) into gpu-wheels/py312-cu13/, files over 60 MiB split into parts,
# dealt into transfer-1/, transfer-2/ (each <= 56 MiB) with a manifest of sizes and sha256.
# There: `python3 tools/gpu_wheels.py install gpu-wheels/py312-cu13`. DRY_RUN=1: the command only.
PYVER ?= 3.12
CUDA ?= 13
gpu-wheels:
	$(PYTHON) tools/gpu_wheels.py download --python $(PYVER) --cuda $(CUDA) --out gpu-wheels $(if $(DRY_RUN),--dry-run)

clean:
	rm -rf $(VENV) .venv-mcore-* .venv-torch-* build *.egg-info
