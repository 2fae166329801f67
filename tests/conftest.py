"""Shared fixtures: the real models, loaded once per test session.

Real models come from the normal cache (``$PROBKV_CACHE_DIR`` or ``~/.cache/probkv``), not a
temporary one: a GGUF is converted once per machine (~20 s for SmolLM2, ~60 s for Gemma-3), and
later sessions, CI runs included, load the converted copy in seconds. Tests that exercise the
conversion itself use tiny GGUF files and their own temporary cache folders.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# One torch thread per process measured faster than two on the 2-core machines we run on.
torch.set_num_threads(1)

# Property tests draw the same examples on every run ("ci", the default), so a failure in CI
# reproduces anywhere; HYPOTHESIS_PROFILE=explore draws fresh ones to hunt for new failures.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of the default model SmolLM2-135M-Instruct, float32, eval, sdpa."""
    from probkv.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3():
    """``(model, tokenizer)`` of Gemma-3 270M (base model; sliding-window and global layers)."""
    from probkv.models import load_model

    return load_model("gemma3-270m")


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="session")
def load_benchmark():
    """``load_benchmark("bench_x")``: the script ``benchmarks/bench_x.py`` as a module (the
    scripts are not a package)."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """A saved tiny random Llama with its tokenizer: a model folder any command can load."""
    from probkv.models.testing import save_tiny_model_folder

    folder = tmp_path_factory.mktemp("tiny-llama")
    return str(save_tiny_model_folder(folder, "llama", max_position_embeddings=4096))
