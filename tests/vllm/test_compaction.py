"""probkv.vllm.compaction: a paged kernel that reads the compacted block table and lengths gives,
for every row, attention over exactly the kept prompt positions and every position after the
prompt, at the rows' true positions; chunks crossing the prompt's end split in two. Pure
tensors: the kernel is a slow, obviously correct paged attention written here."""

from __future__ import annotations

import pytest
import torch

from probkv.vllm.compaction import CompactPlan, block_indices, compact

BS, H, D, W = 4, 2, 8, 12  # block size, heads, head size, table width


def paged_attention(query, keys, values, qsl, seq_lens, table):
    """vLLM's kernel, slowly: sequence s's q rows are its last q positions of seq_lens[s]
    entries read through table[s] (causal)."""
    out = torch.zeros_like(query)
    for s in range(seq_lens.numel()):
        lo, hi, n = int(qsl[s]), int(qsl[s + 1]), int(seq_lens[s])
        idx = torch.arange(n)
        slots = table[s, idx // BS] * BS + idx % BS
        k, v = keys[slots], values[slots]  # [n, H, D]
        for i, row in enumerate(range(lo, hi)):
            visible = n - (hi - lo) + i + 1
            logits = torch.einsum("hd,nhd->hn", query[row], k[:visible])
            out[row] = torch.einsum("hn,nhd->hd", logits.softmax(-1), v[:visible])
    return out


def reference(query, keys, values, rows, kept_positions):
    """Attention of each query row over the positions it may read: its request's kept prompt
    positions (or all of them for a prompt row), every later position up to its own."""
    out = torch.zeros_like(query)
    for row, (slots_of, position, prompt_length) in rows.items():
        if position < prompt_length:
            visible = list(range(position + 1))
        else:
            visible = kept_positions + list(range(prompt_length, position + 1))
        slots = torch.tensor([slots_of(p) for p in visible])
        logits = torch.einsum("hd,nhd->hn", query[row], keys[slots])
        out[row] = torch.einsum("hn,nhd->hd", logits.softmax(-1), values[slots])
    return out


def physical_table(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(rows * W, generator=g)[: rows * W].reshape(rows, W).to(torch.int32)


@pytest.mark.parametrize("prompt_length", [17, 20, 33])  # partial last block, whole, partial
@pytest.mark.parametrize("query_shape", ["decode", "crossing", "prompt-only"])
def test_the_kernel_on_compacted_metadata_reads_the_kept_set(prompt_length, query_shape):
    g = torch.Generator().manual_seed(prompt_length)
    whole = prompt_length // BS
    kept = torch.tensor([b for b in range(whole) if b % 3 != 1], dtype=torch.int64)
    plan = CompactPlan(prompt_length, kept, BS)
    kept_positions = [p for b in kept.tolist() for p in range(b * BS, (b + 1) * BS)]
    kept_positions += list(range(whole * BS, prompt_length))  # the partial block: always read
    table = physical_table(prompt_length, 2)
    keys = torch.randn(2 * W * BS, H, D, generator=g)
    values = torch.randn(2 * W * BS, H, D, generator=g)
    # row 0: the evicted request; row 1: a request without eviction, 3 query rows
    n0 = {"decode": prompt_length + 5, "crossing": prompt_length + 4, "prompt-only": prompt_length}
    q0 = {"decode": 1, "crossing": prompt_length + 4, "prompt-only": 7}[query_shape]
    n0 = n0[query_shape]
    qsl = torch.tensor([0, q0, q0 + 3], dtype=torch.int32)
    seq_lens = torch.tensor([n0, 30], dtype=torch.int32)
    query = torch.randn(q0 + 3, H, D, generator=g)
    got = compact(qsl, seq_lens, table, [plan, None])
    out = paged_attention(query, keys, values, got.query_start_loc, got.seq_lens, got.block_table)

    def slots_of(r):
        return lambda p: int(table[r, p // BS]) * BS + p % BS

    rows = {i: (slots_of(0), n0 - q0 + i, prompt_length) for i in range(q0)}
    rows.update({q0 + i: (slots_of(1), 27 + i, 10**9) for i in range(3)})
    torch.testing.assert_close(out, reference(query, keys, values, rows, kept_positions))
    expected_seqs = 3 if query_shape == "crossing" else 2
    assert got.num_seqs == expected_seqs
    assert got.max_seq_len == int(got.seq_lens.max())
    assert got.query_start_loc.dtype == qsl.dtype and got.seq_lens.dtype == seq_lens.dtype


def test_a_cached_index_gives_the_same_metadata_and_inputs_stay_unchanged():
    plan = CompactPlan(21, torch.tensor([0, 3], dtype=torch.int64), BS)
    table = physical_table(0, 3)
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    seq_lens = torch.tensor([25, 9, 30], dtype=torch.int32)
    before = (table.clone(), seq_lens.clone())
    plans = [None, plan, plan]
    with pytest.raises(ValueError, match="plans for"):
        compact(qsl, seq_lens, table, plans[:2])
    a = compact(qsl, seq_lens, table, plans)
    b = compact(qsl, seq_lens, table, plans, index=block_indices(plans, W))
    assert torch.equal(a.block_table, b.block_table) and torch.equal(a.seq_lens, b.seq_lens)
    assert torch.equal(table, before[0]) and torch.equal(seq_lens, before[1])
    assert a.seq_lens.tolist() == [25, 9, 30 - plan.evicted]  # row 1 is still in its prompt
    assert plan.evicted == 3 * BS


@pytest.mark.parametrize(
    "kept", [[5], [1, 1], [2, 1], [-1]], ids=["outside", "repeated", "unsorted", "negative"]
)
def test_a_plan_refuses_blocks_it_cannot_describe(kept):
    with pytest.raises(ValueError, match="kept_blocks"):
        CompactPlan(21, torch.tensor(kept, dtype=torch.int64), BS)
