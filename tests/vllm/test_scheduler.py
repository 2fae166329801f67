"""probkv.vllm.scheduler without an engine: what a request recomputed after a preemption under a
decode budget frees, step by step, and how much of its prefix it may take from the cache (the
engine runs are in test_budget_engine.py and test_pressure.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs it")

from probkv import scores
from probkv.vllm import request_options
from probkv.vllm.options import EngineEviction
from probkv.vllm.scheduler import ProbKVScheduler

BLOCK = 32
NULL = SimpleNamespace(is_null=True)


def scheduler(blocks: list, request):
    """A ProbKVScheduler holding one request's block list (no engine, no pool)."""
    freed = []
    manager = SimpleNamespace(
        req_to_blocks={"r": blocks},
        _null_block=NULL,
        block_pool=SimpleNamespace(free_blocks=freed.extend),
    )
    sched = object.__new__(ProbKVScheduler)
    sched.block_size = BLOCK
    sched.probkv = EngineEviction("snapkv", 0.5)
    sched.requests = {"r": request}
    sched.kv_cache_manager = SimpleNamespace(
        coordinator=SimpleNamespace(single_type_managers=[manager])
    )
    sched.probkv_recomputing = {}
    sched.probkv_groups = (0,)  # the one group (full attention)
    # stage 1 at the prompt's 200 positions freed blocks 1-3, stage 2 at 240 blocks 4-5
    stages = [(200, [1, 2, 3]), (240, [4, 5])]
    sched.probkv_evicted = {
        "r": {"freed": [1, 2, 3, 4, 5], "stage_frees": stages, "max_entries": 64, "every": 32}
    }
    return sched, freed


def test_a_recomputation_frees_each_stage_once_it_has_passed_it():
    blocks = [SimpleNamespace(is_null=False, id=i) for i in range(9)]
    request = SimpleNamespace(num_computed_tokens=0)
    sched, freed = scheduler(blocks, request)
    sched.probkv_recomputing["r"] = 0  # just preempted
    for computed, expected in (
        (128, []),
        (208, [1, 2, 3]),
        (236, [1, 2, 3]),
        (256, [1, 2, 3, 4, 5]),
    ):
        request.num_computed_tokens = computed
        sched._free_passed_stages("r")
        assert [b.id for b in freed] == expected, computed
    assert "r" not in sched.probkv_recomputing  # past its last stage
    assert [b.is_null for b in blocks] == [False, *[True] * 5, False, False, False]


def test_a_recomputations_prefix_hit_stops_where_the_next_stages_window_begins():
    sched, _ = scheduler([], None)
    request = SimpleNamespace(
        request_id="r",
        sampling_params=SimpleNamespace(extra_args=request_options("snapkv", 0.5)),
    )
    window = scores.last_query_rows("snapkv", {})
    # 5 blocks evicted: the next stage is due when 64 + 32 positions are held past them
    assert sched._prefix_hit_limit(request) == 5 * BLOCK + 64 + 32 - window
    del sched.probkv_evicted["r"]["max_entries"]  # no budget: nothing more is selected
    assert sched._prefix_hit_limit(request) is None


def test_blocks_are_freed_in_the_evicting_groups_only():
    """A hybrid model's groups (each its own block ids): the full-attention ones lose the freed
    logical blocks, a sliding-window one keeps its list for vLLM's own manager."""
    from probkv.vllm import internals

    lists = [[SimpleNamespace(is_null=False, id=(g, i)) for i in range(6)] for g in range(3)]
    freed = []
    managers = [
        SimpleNamespace(
            req_to_blocks={"r": blocks},
            _null_block=NULL,
            block_pool=SimpleNamespace(free_blocks=freed.extend),
        )
        for blocks in lists
    ]
    sched = SimpleNamespace(
        kv_cache_manager=SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=managers))
    )
    assert internals.free_logical_blocks(sched, "r", [1, 3], (0, 2)) == 4
    assert sorted(b.id for b in freed) == [(0, 1), (0, 3), (2, 1), (2, 3)]
    assert [b.is_null for b in lists[1]] == [False] * 6
    assert [i for i, b in enumerate(lists[2]) if b.is_null] == [1, 3]
