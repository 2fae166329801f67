"""probkv.vllm.worker's step output: the blocks to free reach the scheduler on a copy of vLLM's
output (never on a shared object such as ``EMPTY_MODEL_RUNNER_OUTPUT``), and under async
scheduling through what ``AsyncModelRunnerOutput.get_output`` returns (vLLM's CPU platform
turns async scheduling off, so no engine here runs it: these are the worker's own objects);
and the seeded requests whose sample vLLM discards draw nothing from their own generator
(probkv.vllm.internals.no_draws_for_discarded_samples)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs it")

from vllm.v1.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    AsyncModelRunnerOutput,
    ModelRunnerOutput,
)

from probkv.vllm import internals
from probkv.vllm.options import EngineEviction
from probkv.vllm.worker import OUTPUT_FIELD, WorkerEviction, activated, active

FREED = {"req-0": {"freed": [1, 2], "kept_positions": 40}}


def state_with_pending() -> WorkerEviction:
    state = WorkerEviction(EngineEviction("snapkv", 0.5), 32, None)
    state.pending.update(FREED)
    return state


def test_the_shared_empty_output_is_never_changed():
    state = state_with_pending()
    out = state.attach(EMPTY_MODEL_RUNNER_OUTPUT)
    assert out is not EMPTY_MODEL_RUNNER_OUTPUT and getattr(out, OUTPUT_FIELD) == FREED
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, OUTPUT_FIELD)
    assert out.req_ids == EMPTY_MODEL_RUNNER_OUTPUT.req_ids and not state.pending
    again = state.attach(EMPTY_MODEL_RUNNER_OUTPUT)  # nothing pending: vLLM's object as it is
    assert again is EMPTY_MODEL_RUNNER_OUTPUT


def test_async_outputs_carry_the_freed_blocks_to_get_output():
    class Later(AsyncModelRunnerOutput):
        def __init__(self, output: ModelRunnerOutput) -> None:
            self.output = output

        def get_output(self) -> ModelRunnerOutput:
            return self.output

    inner = ModelRunnerOutput(req_ids=["req-0"], req_id_to_index={"req-0": 0})
    state = state_with_pending()
    out = state.attach(Later(inner))
    assert isinstance(out, AsyncModelRunnerOutput) and not state.pending
    got = out.get_output()
    assert getattr(got, OUTPUT_FIELD) == FREED and got.req_ids == ["req-0"]
    assert not hasattr(inner, OUTPUT_FIELD)


def test_a_workers_state_is_active_during_its_call_only():
    """Each worker call activates its own state and restores the one before it, an error
    raised inside included: an engine's step never reads another in-process engine's state."""
    first, second = state_with_pending(), state_with_pending()
    assert active() is None
    with activated(first):
        assert active() is first
        with pytest.raises(RuntimeError), activated(second):
            assert active() is second
            raise RuntimeError("the step failed")
        assert active() is first
        with activated(None):  # a plain engine's worker call: the backends pass through
            assert active() is None
    assert active() is None


def test_no_output_yet_keeps_the_list_for_the_next_one():
    state = state_with_pending()
    assert state.attach(None) is None and state.pending == FREED


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
