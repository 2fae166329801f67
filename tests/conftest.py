"""Shared fixtures: the real models, loaded once per test session.

Real models come from the normal cache (``$PROBKV_CACHE_DIR`` or ``~/.cache/probkv``), not a
temporary one: a GGUF is converted once per machine (~20 s for SmolLM2, ~60 s for Gemma-3), and
later sessions, CI runs included, load the converted copy in seconds. Tests that exercise the
conversion itself use tiny GGUF files and their own temporary cache folders.
"""

from __future__ import annotations

import os

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
