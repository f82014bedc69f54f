# Two commands do all set-up on a fresh machine (see README.md):
#   make demo   - planned heterogeneous training run on this machine
#   make test   - the test suite (what CI runs)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench-emulated bench-comm clean

setup: $(STAMP)

$(STAMP): setup.py $(wildcard csrc/*)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	# torch first and pinned: on a CPU machine this is the CPU wheel, not a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	# ninja: the extension's sources compile in parallel (torch's builder uses it when present)
	$(PY) -m pip install --quiet ninja
	$(PY) -m pip install --quiet --no-build-isolation -e '.[test]'
	touch $@

demo: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH bash examples/run_demo.sh

test: $(STAMP)
	$(PY) -m pytest

# Predictor accuracy, plan quality and NIC awareness measured on emulated clusters (root).
bench-emulated: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/emulated_bench.py

# The hetero backend: cross-vendor all-reduce vs flat gloo, pass-through vs native (root).
bench-comm: $(STAMP)
	$(PY) bench/comm_bench.py

clean:
	rm -rf $(VENV) build *.egg-info
