"""probkv.vllm.worker pieces that need no engine: ``attach`` never writes onto a shared output
object, and the seeded requests whose sample vLLM discards draw nothing from their own
generator (probkv.vllm.internals.no_draws_for_discarded_samples)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs it")

from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

from probkv.vllm import internals
from probkv.vllm.options import EngineEviction
from probkv.vllm.worker import OUTPUT_FIELD, WorkerEviction


def test_attach_never_writes_onto_vllms_shared_empty_output():
    state = WorkerEviction(EngineEviction("snapkv", 0.5), 32, runner=None)
    state.pending["r1"] = {"freed": [0, 1]}
    out = state.attach(EMPTY_MODEL_RUNNER_OUTPUT)
    assert out is not EMPTY_MODEL_RUNNER_OUTPUT
    assert getattr(out, OUTPUT_FIELD) == {"r1": {"freed": [0, 1]}}
    assert getattr(EMPTY_MODEL_RUNNER_OUTPUT, OUTPUT_FIELD, None) is None
    assert not state.pending
    assert state.attach(EMPTY_MODEL_RUNNER_OUTPUT) is EMPTY_MODEL_RUNNER_OUTPUT  # nothing due


def test_a_discarded_sample_draws_nothing_from_its_requests_generator():
    generators = {i: torch.Generator().manual_seed(i) for i in range(3)}
    batch = SimpleNamespace(num_reqs=3, generators=dict(generators))
    runner = SimpleNamespace(
        input_batch=batch, discard_request_mask=SimpleNamespace(np=np.array([0, 1, 0, 1]))
    )
    states = {i: g.get_state() for i, g in generators.items()}
    with internals.no_draws_for_discarded_samples(runner):
        assert set(batch.generators) == {0, 2}  # row 1's chunk ends before its prompt
        for g in batch.generators.values():
            torch.rand(4, generator=g)
    assert batch.generators == generators  # the same objects, back at their rows
    assert torch.equal(generators[1].get_state(), states[1])
    assert not torch.equal(generators[0].get_state(), states[0])
