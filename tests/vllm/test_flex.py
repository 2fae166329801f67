"""probkv.vllm.flex: torch's flex_attention with probkv's score_mod / mask_mod equals corrected
attention (S4) over each request's kept entries with their log-weights, in both environments
(pure torch; eager flex_attention runs on the CPU). The test of vLLM's FlexAttention metadata
imports vLLM inside itself and is skipped where vLLM is not installed. On a machine with CUDA the
compiled kernel is checked as well (docs/vllm.md, "FlexAttention, and the GPU path")."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention

from probkv.estimation import corrected_attention, corrected_attention_reference
from probkv.vllm.flex import (
    KeptTables,
    kept_tables,
    mask_mod,
    score_mod,
)
from probkv.vllm.request_eviction import decode_attention

HQ, HKV, D = 9, 3, 16  # SmolLM2's 9 query / 3 KV heads
SCALE = D**-0.5
# per request: prompt length t, tokens after the prompt g (queries are the last q of t + g)
PROMPTS, AFTER = (37, 16, 29), (6, 3, 9)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
    ),
]


def eager_flex(*args, **kwargs):
    """flex_attention without torch.compile: its unfused reference path, which runs on the CPU
    (it warns that it materialises the scores; that is what a test wants)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without torch.compile.*")
        return flex_attention(*args, **kwargs)


def kept_sets(seed: int, block: int, weighted: bool, prompts=PROMPTS):
    """Per request the kept prompt positions and log-weights: whole units of ``block``
    positions, about half of them, the last (partial) unit kept or not; ``-log P`` per unit."""
    g = torch.Generator().manual_seed(seed)
    positions, log_weights = [], []
    for t in prompts:
        units = -(-t // block)
        kept = torch.rand(units, generator=g) < 0.5
        kept[torch.randint(units, (1,), generator=g)] = True  # never empty
        inclusion = torch.rand(units, generator=g) * 0.9 + 0.05
        unit_logw = -torch.log(inclusion) if weighted else torch.zeros(units)
        pos = torch.arange(t)
        keep = kept[pos // block]
        positions.append(pos[keep])
        log_weights.append(unit_logw[pos // block][keep].float())
    return positions, log_weights


def batch(seed: int, dtype, queries: int):
    """Right-padded ``q [R, Hq, Q, D]``, ``k``/``v [R, Hkv, N, D]`` of the requests; padding is
    huge, so that reading it shows."""
    g = torch.Generator().manual_seed(seed)
    lengths = [t + a for t, a in zip(PROMPTS, AFTER)]
    n, r = max(lengths), len(PROMPTS)
    q = torch.full((r, HQ, queries, D), 1e4, dtype=dtype)
    k = torch.full((r, HKV, n, D), 1e4, dtype=dtype)
    v = torch.full((r, HKV, n, D), 1e6, dtype=dtype)
    for i, length in enumerate(lengths):
        q[i] = torch.randn(HQ, queries, D, generator=g, dtype=dtype)
        k[i, :, :length] = 2 * torch.randn(HKV, length, D, generator=g, dtype=dtype)
        v[i, :, :length] = torch.randn(HKV, length, D, generator=g, dtype=dtype)
    return q, k, v, lengths


def causal(lengths, queries: int, device="cpu"):
    """Row ``b``'s query ``j`` sits at position ``n_b - queries + j`` and sees ``kv <= it``."""
    last = torch.tensor(lengths, device=device) - queries

    def causal_mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= last[b] + q_idx

    return causal_mask_mod


def attend(q, k, v, tables, lengths, *, kept_mask=False):
    """Eager flex_attention of the padded batch: probkv's score_mod under the causal mask
    (and with ``kept_mask``, probkv's mask_mod too, which adds block sparsity: the score_mod
    hides evicted entries by itself)."""
    mod = causal(lengths, q.shape[2])
    if kept_mask:
        mod = and_masks(mod, mask_mod(tables))
    mask = create_block_mask(mod, q.shape[0], None, q.shape[2], k.shape[2], "cpu", 8)
    return eager_flex(
        q, k, v, score_mod=score_mod(tables), block_mask=mask, scale=SCALE, enable_gqa=True
    )


def reference(q, k, v, lengths, positions, log_weights, queries, i):
    """Corrected attention of request ``i`` over its kept prompt positions and every position
    after its prompt (``probkv.estimation.corrected_attention``)."""
    t, n = PROMPTS[i], lengths[i]
    index = torch.cat([positions[i], torch.arange(t, n)])
    logw = torch.cat([log_weights[i], torch.zeros(n - t)]).to(q.dtype)
    return corrected_attention(
        q[i],
        k[i][:, index],
        v[i][:, index],
        logw.expand(HKV, -1),
        scale=SCALE,
        causal_offset=index.numel() - queries,
    )


TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("queries", [1, 3], ids=["decode", "chunk"])
@pytest.mark.parametrize("block", [1, 4])
@pytest.mark.parametrize("with_mask", [False, True], ids=["score_mod", "and_mask_mod"])
def test_flex_equals_corrected_attention(dtype, queries, block, with_mask):
    positions, log_weights = kept_sets(1, block, weighted=True)
    tables = kept_tables(positions, log_weights, PROMPTS, block=block)
    q, k, v, lengths = batch(2, dtype, queries)
    out = attend(q, k, v, tables, lengths, kept_mask=with_mask)
    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    for i in range(len(PROMPTS)):
        expected = reference(q, k, v, lengths, positions, log_weights, queries, i)
        torch.testing.assert_close(out[i], expected, rtol=tol, atol=tol)


def test_decode_equals_algorithm_1_in_float64():
    """One decode query against the paper's Algorithm 1, literally (two normalisers)."""
    positions, log_weights = kept_sets(3, 4, weighted=True)
    tables = kept_tables(positions, log_weights, PROMPTS, block=4)
    q, k, v, lengths = batch(4, torch.float64, 1)
    out = attend(q, k, v, tables, lengths)
    group = HQ // HKV
    for i, (t, n) in enumerate(zip(PROMPTS, lengths)):
        for h in range(HQ):
            kv = h // group
            expected = corrected_attention_reference(
                q[i, h, 0],
                k[i, kv, positions[i]],
                v[i, kv, positions[i]],
                log_weights[i],
                k[i, kv, t:n],
                v[i, kv, t:n],
                scale=SCALE,
            )
            torch.testing.assert_close(out[i, h, 0], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("queries", [1, 3], ids=["decode", "chunk"])
def test_top_k_is_plain_attention_over_the_kept_positions(queries):
    """Weights 0 (top-k): a plain softmax over the kept prompt positions and what follows."""
    positions, log_weights = kept_sets(5, 4, weighted=False)
    tables = kept_tables(positions, log_weights, PROMPTS, block=4)
    q, k, v, lengths = batch(6, torch.float64, queries)
    out = attend(q, k, v, tables, lengths)
    for i, (t, n) in enumerate(zip(PROMPTS, lengths)):
        index = torch.cat([positions[i], torch.arange(t, n)])
        keys = k[i][:, index].repeat_interleave(HQ // HKV, 0)
        values = v[i][:, index].repeat_interleave(HQ // HKV, 0)
        logits = SCALE * q[i] @ keys.transpose(1, 2)  # [Hq, queries, n']
        visible = (
            torch.arange(index.numel()) <= index.numel() - queries + torch.arange(queries)[:, None]
        )
        logits = logits.masked_fill(~visible, -math.inf)
        expected = torch.softmax(logits, -1) @ values
        torch.testing.assert_close(out[i], expected, rtol=1e-12, atol=1e-12)


def test_evicted_positions_get_no_mass_even_with_huge_keys():
    """Keys aligned with the query at 1e4 times its norm and values of 1e6 at every evicted
    position change nothing: the score_mod alone (no mask) gives them -inf."""
    positions, log_weights = kept_sets(7, 4, weighted=True)
    tables = kept_tables(positions, log_weights, PROMPTS, block=4)
    q, k, v, lengths = batch(8, torch.float32, 1)
    huge_k, huge_v = k.clone(), v.clone()
    for i, t in enumerate(PROMPTS):
        evicted = torch.ones(t, dtype=torch.bool)
        evicted[positions[i]] = False
        direction = q[i, :: HQ // HKV, 0]  # [Hkv, D]: the first query head of each group
        huge_k[i, :, :t][:, evicted] = 1e4 * direction[:, None, :]
        huge_v[i, :, :t][:, evicted] = 1e6
    out = attend(q, huge_k, huge_v, tables, lengths)
    assert torch.isfinite(out).all() and out.abs().max() < 100
    for i in range(len(PROMPTS)):
        expected = reference(q, k, v, lengths, positions, log_weights, 1, i)
        torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-5)


def test_tables_hold_log_weights_minus_inf_and_lengths():
    positions = [torch.tensor([0, 1, 2, 3, 8, 9]), torch.tensor([], dtype=torch.int64)]
    log_weights = [torch.tensor([0.5] * 4 + [1.5] * 2), torch.tensor([])]
    tables = kept_tables(positions, log_weights, [10, 0], block=4)
    inf = math.inf
    assert torch.equal(tables.log_weights, torch.tensor([[0.5, -inf, 1.5], [-inf, -inf, -inf]]))
    assert tables.prompt_lengths.tolist() == [10, 0] and tables.block == 4
    by_position = kept_tables(positions, log_weights, [10, 0])
    assert by_position.log_weights[0].tolist() == [0.5] * 4 + [-inf] * 4 + [1.5] * 2


def test_tables_written_in_place_equal_new_ones():
    """Fixed-size tables refilled step after step (a compiled kernel keeps its shapes)."""
    out = KeptTables.empty(5, 12, 4)
    for seed in (11, 12):
        positions, log_weights = kept_sets(seed, 4, weighted=True)
        fresh = kept_tables(positions, log_weights, PROMPTS, block=4)
        filled = kept_tables(positions, log_weights, PROMPTS, block=4, out=out)
        assert filled is out
        rows, width = fresh.log_weights.shape
        assert torch.equal(out.log_weights[:rows, :width], fresh.log_weights)
        assert (out.log_weights[rows:] == -math.inf).all()
        assert (out.log_weights[:, width:] == -math.inf).all()
        assert out.prompt_lengths.tolist() == [*PROMPTS, 0, 0]
    with pytest.raises(ValueError, match="units of 4"):
        kept_tables([torch.arange(100)], [torch.zeros(100)], [100], block=4, out=out)


@pytest.mark.parametrize(
    ("positions", "log_weights", "lengths", "block", "match"),
    [
        ([torch.tensor([0, 1, 2])], [torch.zeros(3)], [8], 4, "block of 4 positions 0 is not"),
        ([torch.tensor([0, 1, 2, 3])], [torch.tensor([0.0, 0, 0, 1])], [8], 4, "one log-weight"),
        ([torch.tensor([0, 1, 2, 2])], [torch.zeros(4)], [8], 4, "twice"),
        ([torch.tensor([8])], [torch.zeros(1)], [8], 1, "outside its prompt"),
        ([torch.tensor([-1])], [torch.zeros(1)], [8], 1, "outside its prompt"),
        ([torch.tensor([0])], [torch.tensor([math.nan])], [8], 1, "finite"),
        ([torch.tensor([0])], [torch.zeros(2)], [8], 1, "shape"),
        ([torch.tensor([0])], [torch.zeros(1)], [8, 4], 1, "prompt_lengths"),
        ([torch.tensor([0])], [torch.zeros(1)], [8], 0, "block"),
        ([], [], [], 1, "one tensor per request"),
    ],
)
def test_bad_kept_sets_are_refused(positions, log_weights, lengths, block, match):
    with pytest.raises(ValueError, match=match):
        kept_tables(positions, log_weights, lengths, block=block)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_kernel_traces_the_mods(device):
    """torch.compile(flex_attention, fullgraph=True), as vLLM calls it: the mods trace without
    a graph break and give the eager result (on CUDA: the Triton kernel a GPU run uses)."""
    positions, log_weights = kept_sets(13, 16, weighted=True, prompts=(70, 40))
    tables = kept_tables(positions, log_weights, (70, 40), block=16, device=device)
    g = torch.Generator().manual_seed(14)
    q = torch.randn(2, HQ, 16, D, generator=g).to(device)
    k = torch.randn(2, HKV, 128, D, generator=g).to(device)
    v = torch.randn(2, HKV, 128, D, generator=g).to(device)
    lengths = [128, 80]
    both = and_masks(causal(lengths, 16, device), mask_mod(tables))
    mask = create_block_mask(both, 2, None, 16, 128, device)
    # fresh: after an engine through FLEX_ATTENTION in this process (test_budget_engine's,
    # test_pressure's), torch's CPU code for the shapes it marked dynamic fails to build
    # ("'cur_qSplitSize1' was not declared")
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, fullgraph=True)
    out = compiled(
        q, k, v, score_mod=score_mod(tables), block_mask=mask, scale=SCALE, enable_gqa=True
    )
    expected = eager_flex(
        q, k, v, score_mod=score_mod(tables), block_mask=mask, scale=SCALE, enable_gqa=True
    )
    tol = 1e-5 if device == "cpu" else 1e-3  # a GPU's kernel may round matmuls (TF32)
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


PAGED_BLOCK, PAGED_BLOCKS = 16, 20
PAGED_PROMPTS, PAGED_LENGTHS, PAGED_QUERIES = (70, 40, 33, 20), (75, 43, 53, 26), (1, 3, 1, 2)
PAGED_KEPT = ([0, 2, 3], [1], [0], None)  # kept whole blocks of the prompt (None: no eviction)
STALE = 7  # a stale block id left in the table past a request's blocks (vLLM's is append-only)


def paged_requests():
    """Four requests in a paged cache of vLLM's FlexAttention layout (``[slot, Hkv, D]``): the
    block table of the compacted metadata (each evicted request's kept blocks, then its blocks
    from the prompt's last partial one on; the rest of the row holds stale ids of blocks other
    requests use), the compact lengths, each request's visible true positions with their
    log-weights (per slot), packed queries, keys and values. Freed blocks hold keys of 1e3."""
    block, num_blocks = PAGED_BLOCK, PAGED_BLOCKS
    g = torch.Generator().manual_seed(15)
    physical = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # 0 is the null block
    table = torch.full((4, 8), STALE, dtype=torch.int32)
    lengths, visible = [], []
    k = 1e3 * torch.ones(num_blocks * block, HKV, D)
    v = 1e3 * torch.ones(num_blocks * block, HKV, D)
    slot_logw = torch.zeros(num_blocks * block)
    for r, (t, n, kept) in enumerate(zip(PAGED_PROMPTS, PAGED_LENGTHS, PAGED_KEPT)):
        whole = t // block if kept is not None else 0
        blocks = list(kept or []) + list(range(whole, -(-n // block)))
        ids = [physical.pop() for _ in blocks]
        table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        positions = torch.cat([torch.arange(b * block, (b + 1) * block) for b in blocks])
        positions = positions[positions < n]
        slots = torch.tensor(ids)[torch.arange(positions.numel()) // block] * block
        slots = slots + positions % block
        logw = torch.zeros(positions.numel())
        if kept is not None:
            prompt = positions < whole * block
            unit = -torch.log(torch.rand(len(kept), generator=g) * 0.9 + 0.05)
            logw[prompt] = unit[torch.arange(int(prompt.sum())) // block]
        slot_logw[slots] = logw
        k[slots] = torch.randn(slots.numel(), HKV, D, generator=g)
        v[slots] = torch.randn(slots.numel(), HKV, D, generator=g)
        lengths.append(positions.numel())
        visible.append((slots, logw))
    q = torch.randn(sum(PAGED_QUERIES), HQ, D, generator=g)
    return table, lengths, visible, slot_logw, q, k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_vllm_flex_metadata_with_probkvs_slot_weights_equals_decode_attention(compiled, device):
    """vLLM's own FlexAttention metadata over compacted block tables with stale ids past each
    request's blocks (``paged_requests``), given probkv's score_mod (``SlotLogWeights``, set as
    in ``flex_backend``): flex_attention, eager or compiled as vLLM calls it, equals
    ``decode_attention`` over each request's visible positions with their log-weights; the
    rows of request 1 read none (rows computed again after a preemption), and a slot written
    by the step's keys loses its weight."""
    pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs it")
    from vllm.v1.attention.backends.flex_attention import (
        FlexAttentionMetadata,
        flex_attention_compiled,
        physical_to_logical_mapping,
    )

    from probkv.vllm import internals
    from probkv.vllm.flex import SlotLogWeights

    block, num_blocks, queries = PAGED_BLOCK, PAGED_BLOCKS, PAGED_QUERIES
    table, seq_lens, visible, slot_logw, q, k, v = paged_requests()
    total = sum(queries)
    query_lens = torch.tensor(queries, dtype=torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0)]).int()
    lengths = torch.tensor(seq_lens, dtype=torch.int32)

    def on(x):
        return x.to(device)

    metadata = FlexAttentionMetadata(
        causal=True, num_actual_tokens=total, max_query_len=max(queries),
        query_start_loc=on(starts), query_start_loc_cpu=starts, max_seq_len=max(seq_lens),
        seq_lens=on(lengths), block_table=on(table),
        slot_mapping=on(torch.zeros(total, dtype=torch.int64)),
        total_cache_tokens=num_blocks * block, block_size=block, max_possible_sequence_length=128,
        num_reqs=4,
        physical_to_logical=physical_to_logical_mapping(on(table), on(lengths), block, num_blocks),
        decode_offset=on(lengths - query_lens), num_blocks_per_seq=on(-(-lengths // block)),
        persistent_kv_indices=on(torch.empty(4, 16 * 8, dtype=torch.int32)),
        persistent_kv_num_blocks=on(torch.empty(4, dtype=torch.int32)),
        persistent_doc_ids=on(torch.empty(64, dtype=torch.int32)), q_block_size=16,
        kv_block_size=block,
    )  # fmt: skip
    metadata.block_mask = metadata._build_block_mask_direct()
    weights = SlotLogWeights(num_blocks * block, 64, block, device)
    every = torch.arange(num_blocks * block)
    stale_slot = int(visible[0][0][0])  # request 0's first kept slot, written again this step
    unweighted = torch.arange(int(starts[1]), int(starts[2]))
    weights.update(
        torch.tensor([stale_slot, -1]),
        (every // block, every % block, slot_logw),
        unweighted,
    )
    assert float(weights.slot[stale_slot]) == float(slot_logw[stale_slot])  # writes come after
    weights.update(torch.tensor([stale_slot, -1]), None, unweighted)
    assert float(weights.slot[stale_slot]) == 0.0
    slot_logw[stale_slot] = 0.0
    internals.set_flex_score_mod(metadata, weights.score_mod)
    if compiled:  # fresh: torch's CPU code for shapes marked dynamic by an earlier test fails
        torch._dynamo.reset()  # to build ("'cur_qSplitSize8' was not declared")
    attention = flex_attention_compiled if compiled else eager_flex
    out = (
        attention(
            on(q.transpose(0, 1)[None]),
            on(k.transpose(0, 1)[None]),
            on(v.transpose(0, 1)[None]),
            score_mod=metadata.transformed_score_mod,
            block_mask=metadata.block_mask,
            scale=SCALE,
            enable_gqa=True,
        )[0]
        .transpose(0, 1)
        .cpu()
    )  # [T, Hq, D]
    tol = 1e-5 if device == "cpu" else 1e-3  # a GPU's kernel may round matmuls (TF32)
    for r, (slots, _) in enumerate(visible):
        lo, hi = int(starts[r]), int(starts[r + 1])
        logw = slot_logw[slots] if r != 1 else torch.zeros(slots.numel())
        expected = decode_attention(q[lo:hi], k[slots], v[slots], logw, scale=SCALE)
        torch.testing.assert_close(out[lo:hi], expected, rtol=tol, atol=tol)


def test_torch_cache_write_equals_vllms_layout():
    """``internals.write_flex_cache`` (vLLM's CPU build lacks the CUDA writer FlexAttention
    calls): slot s lands at block s // b, offset s % b of the keys and values halves; padded
    slots (-1) write nothing."""
    from probkv.vllm import internals

    g = torch.Generator().manual_seed(3)
    blocks, block = 5, 4
    storage = torch.zeros(blocks, block, HKV, 2 * D)  # vLLM's physical order
    kv_cache = storage.permute(0, 2, 1, 3)  # [blocks, Hkv, block, 2 D], as the backend sees it
    key, value = torch.randn(4, HKV, D, generator=g), torch.randn(4, HKV, D, generator=g)
    slots = torch.tensor([0, 9, -1, 19])
    internals.write_flex_cache(key, value, kv_cache, slots, D)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        torch.testing.assert_close(storage[s // block, s % block, :, :D], key[i])
        torch.testing.assert_close(storage[s // block, s % block, :, D:], value[i])
    assert int((storage != 0).any(-1).any(-1).sum()) == 3


def test_flex_backend_uses_probkvs_builder_and_refuses_full_cuda_graphs():
    """The backend class vLLM would load: probkv's builder, no full CUDA graph (a graph would
    replay its capture step's tables); ``register_flex_backend`` points FLEX_ATTENTION at it."""
    pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs it")
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from probkv.vllm import flex_backend

    builder = flex_backend.ProbKVFlexBackend.get_builder_cls()
    assert builder is flex_backend.ProbKVFlexMetadataBuilder
    assert builder.get_cudagraph_support(None, None) == AttentionCGSupport.NEVER
    flex = AttentionBackendEnum.FLEX_ATTENTION
    earlier = flex.get_path() if flex.is_overridden() else None  # an earlier FLEX engine's
    flex.clear_override()
    assert flex.get_path() == flex.value  # vLLM's own backend, not probkv's
    try:
        flex_backend.register_flex_backend()
        assert flex.get_class() is flex_backend.ProbKVFlexBackend
    finally:
        flex.clear_override()
        if earlier is not None:
            register_backend(flex, earlier)
