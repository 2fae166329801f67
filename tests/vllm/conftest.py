"""Shared by the vLLM tests: in-process engines of one module are collected before the next
module starts its own. With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` an engine lives in the test
process, and one collected late (during the next engine's start-up) tears down vLLM's global
tensor-parallel group under it ("tensor model parallel group is not initialized")."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True, scope="module")
def collect_engines_between_modules():
    gc.collect()
    yield
    gc.collect()
