# Two entry points for a fresh clone: `make demo` (the main job) and `make test` (the tests).
# Each creates .venv with Python 3.11 and installs what it needs; torch is pinned to 2.13.0,
# the CPU build (a plain `torch` would pull a multi-GB CUDA build).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0
EXTRAS ?= test

.PHONY: demo test venv clean

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

clean:
	rm -rf $(VENV) build *.egg-info
