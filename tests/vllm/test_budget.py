"""probkv.vllm.budget and the decode budget's options (pure Python and tensors: runs without
vLLM): the budget's option read and refused by name, stages due when a request holds ``B + K``
positions, a stage's kept blocks back to B over the held positions, and a recomputed chunk
read under the plan each of its rows was first computed under (``CompactPlan.earlier``)."""

from __future__ import annotations

import pytest
import torch

from probkv.vllm.budget import Budget, RequestStages
from probkv.vllm.compaction import CompactPlan, compact
from probkv.vllm.options import (
    EngineEviction,
    check_budget,
    policy_for,
    read_options,
    request_eviction,
    request_options,
)
from probkv.vllm.request_eviction import KeptPrefix

from .test_compaction import BS, D, H, W, paged_attention, physical_table

ENGINE = EngineEviction("snapkv", 0.5)
BUDGET_ENGINE = EngineEviction("snapkv", 0.5, max_entries=256, every=32)


def test_the_budget_takes_the_transformers_names_and_flat_request_keys():
    assert read_options({"method": "tova", "max_entries": 256, "every": 32}).every == 32
    assert read_options({"method": "tova", "max_entries": 256}).every is None
    flat = request_options("tova", 0.5, max_entries=128, every=16)
    assert flat == {"probkv_method": "tova", "probkv_max_entries": 128, "probkv_every": 16}
    chosen = request_eviction(flat, ENGINE)
    assert (chosen.method, chosen.max_entries, chosen.every) == ("tova", 128, 16)
    assert request_eviction({"probkv_method": "tova"}, BUDGET_ENGINE).max_entries == 256
    off = request_eviction({"probkv_max_entries": 0, "probkv_ratio": 0.25}, BUDGET_ENGINE)
    assert off.max_entries is None and off.ratio == 0.25
    assert request_eviction({"probkv_every": 8}, BUDGET_ENGINE).every == 8


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"probkv_max_entries": -1}, r"probkv_max_entries must be a whole number.*-1"),
        ({"probkv_max_entries": 2.5}, r"probkv_max_entries must be a whole number.*2\.5"),
        ({"probkv_max_entries": True}, r"probkv_max_entries must be a whole number.*True"),
        ({"probkv_max_entries": 64, "probkv_every": 0}, r"probkv_every must be >= 1.*0"),
        ({"probkv_every": 8}, r"probkv_every=8 needs a decode budget"),
        ({"probkv_max_entries": 64, "probkv_ratio": 0.5}, r"probkv_ratio=0\.5 with a decode"),
        ({"probkv_max_entrys": 64}, r"unknown.*probkv_max_entrys.*allowed.*probkv_max_entries"),
    ],
)
def test_bad_budget_values_are_refused_with_the_value_and_what_is_allowed(args, match):
    with pytest.raises(ValueError, match=match):
        request_eviction(args, ENGINE)


@pytest.mark.parametrize(
    ("method", "max_entries", "match"),
    [
        ("snapkv", 16, r"max_entries=16: a stage keeps whole blocks of 32.*>= 32"),
        ("prob:snapkv", 256, r"'prob:snapkv' under a decode budget.*prob: methods are not run"),
        ("h2o", 256, r"'h2o' under a decode budget.*column sums"),
        ("topk:min-h", 256, r"column sums"),
        ("full", 256, r"keeps every position"),
        ("kvzip", 256, r"repeat the context"),
    ],
)
def test_what_a_stage_cannot_run_is_refused_by_name(method, max_entries, match):
    chosen = EngineEviction(method, 0.5, max_entries=max_entries)
    with pytest.raises(ValueError, match=match):
        check_budget(chosen, 32)


def test_scores_a_serving_step_can_afford_pass():
    for method in ("snapkv", "tova", "knorm", "streaming_llm"):
        assert check_budget(EngineEviction(method, 0.5, max_entries=64), 32) == Budget(64, 32)


def plan_positions(plan: CompactPlan, upto: int) -> list[int]:
    """The positions a row at position ``upto`` reads under ``plan``."""
    kept = [p for b in plan.kept_blocks.tolist() for p in range(b * BS, (b + 1) * BS)]
    return kept + list(range((plan.prompt_length // BS) * BS, upto + 1))


def staged_plans():
    """A prompt of 18 positions, then stages at lengths 30 and 41 (blocks of 4)."""
    p0 = CompactPlan(18, torch.tensor([0, 2]), BS)
    p1 = CompactPlan(30, torch.tensor([0, 5, 6]), BS, earlier=(p0,))
    p2 = CompactPlan(41, torch.tensor([0, 8, 9]), BS, earlier=(p0, p1))
    return p0, p1, p2


def test_a_recomputed_chunk_reads_each_row_under_the_plan_it_was_first_computed_under():
    g = torch.Generator().manual_seed(0)
    plans = staged_plans()
    table = physical_table(3, 3)
    keys = torch.randn(3 * W * BS, H, D, generator=g)
    values = torch.randn(3 * W * BS, H, D, generator=g)
    # row 0: a recomputation of positions 10..45; row 1: a chunk 20..35 (plans 0 and 1);
    # row 2: a decode step at position 46 under the last plan
    chunks = [(10, 46), (20, 36), (46, 47)]
    qsl = torch.tensor([0, 36, 52, 53], dtype=torch.int32)
    seq_lens = torch.tensor([hi for _, hi in chunks], dtype=torch.int32)
    query = torch.randn(53, H, D, generator=g)
    last = plans[-1]
    got = compact(qsl, seq_lens, table, [last, last, last])
    out = paged_attention(query, keys, values, got.query_start_loc, got.seq_lens, got.block_table)
    expected = torch.zeros_like(query)
    for r, (lo, hi) in enumerate(chunks):
        for i, p in enumerate(range(lo, hi)):
            if p < 18:
                visible = list(range(p + 1))
            else:
                plan = [q for q in plans if q.prompt_length <= p][-1]
                visible = plan_positions(plan, p)
            slots = torch.tensor([int(table[r, v // BS]) * BS + v % BS for v in visible])
            row = int(qsl[r]) + i
            logits = torch.einsum("hd,nhd->hn", query[row], keys[slots])
            expected[row] = torch.einsum("hn,nhd->hd", logits.softmax(-1), values[slots])
    torch.testing.assert_close(out, expected)
    assert got.num_seqs == 4 + 2 + 1  # the prompt's rows, then one sequence per plan
    assert got.seq_lens.tolist()[-1] == 47 - last.evicted


def test_earlier_plans_must_end_before_the_later_ones():
    p0 = CompactPlan(18, torch.tensor([0, 2]), BS)
    with pytest.raises(ValueError, match="increasing lengths"):
        CompactPlan(18, torch.tensor([0]), BS, earlier=(p0,))


def stages(method: str, budget: Budget, layers=(0, 1)) -> RequestStages:
    policy = policy_for(method, 0.5, BS)
    return RequestStages(budget, policy, layers, 0.125, BS)


def kept_prefix(plan: CompactPlan) -> KeptPrefix:
    positions = torch.tensor(plan_positions(plan, plan.prompt_length - 1))
    return KeptPrefix(positions, torch.zeros(len(positions)), (), plan.prompt_length, 0, plan)


def test_a_stage_is_due_when_the_held_positions_reach_b_plus_k():
    state = stages("streaming_llm", Budget(8, 4))
    kept = kept_prefix(CompactPlan(18, torch.tensor([0]), BS))  # holds 4 + 2 = 6 positions
    state.note(None, 18)
    assert state.due is None  # the prompt is not selected yet
    state.note(kept, 23)
    assert state.due is None  # 11 held
    state.note(kept, 24)
    assert state.due == (24, kept.plan)  # 12 = B + K held
    state.note(kept, 17)  # a recomputation before the last stage's length
    assert state.due is None


def fake_cache(blocks: int, h: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(blocks, h, BS, d, generator=g), torch.randn(blocks, h, BS, d, generator=g)


def test_a_stage_keeps_the_last_partial_block():
    state = stages("tova", Budget(8, 4))
    plan = CompactPlan(16, torch.tensor([0, 3]), BS)  # holds blocks 0, 3
    n = 22  # holds 8 + 6: blocks 0, 3, 4 and the partial block 5 (positions 20, 21)
    state.note(kept_prefix(plan), n)
    caches = fake_cache(W + 8, 1, D, 2)
    for layer in (0, 1):
        state.attend(layer, torch.randn(1, 3, D), caches, ("token", "token"), torch.arange(W), n)
    new = state.select(kept_prefix(plan))
    assert {20, 21} <= set(new.positions.tolist()) and len(new.freed) == 2


@pytest.mark.parametrize("method", ["streaming_llm", "tova", "snapkv/window=3"])
def test_a_stage_keeps_whole_blocks_back_to_b_and_frees_the_rest(method):
    budget = Budget(8, 4)
    state = stages(method, budget)
    plan = CompactPlan(18, torch.tensor([0]), BS)  # holds blocks 0, 4 (positions 16, 17), ...
    kept = kept_prefix(plan)
    n = 24  # holds 4 + 8 = 12 positions: whole blocks 0, 4, 5
    table = torch.arange(W, dtype=torch.int32) + 7
    caches = fake_cache(W + 8, 1, D, 1)
    state.note(kept, n)
    for layer in (0, 1):
        query = torch.randn(3, 3, D)  # rows of positions 21..23, three query heads
        state.attend(layer, query, caches, ("token", "token"), table, n)
    assert state.observed
    new = state.select(kept)
    assert new.prompt_length == n and new.plan.earlier == (plan,)
    assert new.positions.numel() <= budget.max_entries
    freed = set(new.freed)
    assert len(freed) == 1 and freed <= {0, 4, 5}  # one of the three held blocks
    assert new.positions.numel() == 2 * BS
    assert not freed & set(new.plan.kept_blocks.tolist())
    assert state.stage == 2 and not state.observations
    if method == "streaming_llm":
        assert new.plan.kept_blocks.tolist() == [0, 5] and freed == {4}  # sinks, most recent
