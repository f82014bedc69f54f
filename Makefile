# Two commands do all set-up on a fresh machine (see README.md):
#   make demo   - planned heterogeneous training run on this machine
#   make test   - the test suite (what CI runs): all of it on megatron-core 0.16.1, then the
#                 tests marked core019 on megatron-core 0.19.2
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# megatron-core 0.19.2 (and triton, which its MoE code imports) in a folder put before .venv's
# packages on PYTHONPATH: the second tested release over the same torch and dependencies (its
# dependencies are 0.16.1's). Its wheel asks for Python >= 3.12 but runs on 3.11.
CORE019 := .core019
CORE019_STAMP := $(CORE019)/.installed
CORE019_PIP := --no-deps $(shell $(PYTHON) -c 'import sys; print("--ignore-requires-python" if sys.version_info < (3, 12) else "")' 2>/dev/null)

.PHONY: setup demo test bench-emulated bench-comm clean

setup: $(STAMP)

$(STAMP): setup.py $(wildcard csrc/*)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	# torch first and pinned: on a CPU machine this is the CPU wheel, not a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	# ninja: the extension's sources compile in parallel (torch's builder uses it when present)
	$(PY) -m pip install --quiet ninja
	# the release the whole suite runs on (setup.py also accepts 0.19.2, the newest on Python >= 3.12)
	$(PY) -m pip install --quiet megatron-core==0.16.1
	$(PY) -m pip install --quiet --no-build-isolation -e '.[test]'
	touch $@

$(CORE019_STAMP): $(STAMP)
	rm -rf $(CORE019)
	$(PY) -m pip install --quiet $(CORE019_PIP) --target $(CORE019) megatron-core==0.19.2 triton==3.9.0
	touch $@

demo: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH bash examples/run_demo.sh

test: $(STAMP) $(CORE019_STAMP)
	$(PY) -m pytest
	PYTHONPATH=$(CURDIR)/$(CORE019) $(PY) -m pytest -m core019

# Predictor accuracy, plan quality and NIC awareness measured on emulated clusters (root).
bench-emulated: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/emulated_bench.py

# The hetero backend: cross-vendor all-reduce vs flat gloo, pass-through vs native (root).
bench-comm: $(STAMP)
	$(PY) bench/comm_bench.py

clean:
	rm -rf $(VENV) $(CORE019) build *.egg-info
