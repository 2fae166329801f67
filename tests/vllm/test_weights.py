"""probkv.vllm.weights: the log-weights in spare key columns. The pure parts on CPU tensors;
then vLLM's own CPU kernel over a cache written by vLLM's own writer, widened and weighted,
against ``decode_attention`` (S4's corrected attention) over each request's kept positions."""

from __future__ import annotations

import math

import pytest
import torch

from probkv.vllm.request_eviction import decode_attention
from probkv.vllm.weights import (
    SPARE,
    next_head_size,
    padded_entries,
    padded_head_size,
    padded_queries,
    spare_key_columns,
    write_spare_columns,
)

SIZES = [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]  # vLLM 0.32's CPU kernel


def test_padded_head_size_is_the_smallest_with_two_columns_to_spare():
    assert padded_head_size(64, SIZES) == 80
    assert padded_head_size(78, SIZES) == 80
    assert padded_head_size(79, SIZES) == 96
    assert padded_head_size(128, SIZES) == 160
    with pytest.raises(ValueError, match=r"no head size above 512 \+ 2.*top-k method"):
        padded_head_size(512, SIZES)
    assert next_head_size(256, SIZES) == 512
    # Gemma-3: twice the bytes of every layer, more than r = 0.5 frees: refused with the figure
    with pytest.raises(ValueError, match=r"head size 256 .* next size is 512, 2.00x.*snapkv"):
        padded_head_size(256, SIZES)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 0.0), (torch.bfloat16, 2e-4)])
def test_the_spare_columns_sum_to_log_w_over_scale(dtype, tol):
    """The high part in ``dtype`` plus the low remainder: exact in float32; in bfloat16 the
    low part's rounding, 2^-8 of a remainder itself below 2^-8 of the value (|v| < 40 here)."""
    g = torch.Generator().manual_seed(0)
    logw = -torch.rand(1000, generator=g) * 5
    scale = 0.125
    cols = spare_key_columns(logw, scale, dtype)
    assert cols.shape == (1000, SPARE) and cols.dtype == dtype
    back = cols.float().sum(-1) * scale
    assert (back - logw).abs().max().item() <= tol * 8
    assert torch.equal(
        spare_key_columns(torch.zeros(3), scale, dtype), torch.zeros(3, 2, dtype=dtype)
    )


def test_padding_keeps_the_entries_and_marks_the_rows_that_read_weights():
    q = torch.randn(5, 3, 8)
    wide = padded_queries(q, 16, torch.tensor([1, 3]))
    assert torch.equal(wide[..., :8], q) and torch.equal(wide[..., 10:], torch.zeros(5, 3, 6))
    assert wide[[0, 2, 4], :, 8:10].eq(1).all() and wide[[1, 3], :, 8:10].eq(0).all()
    k = torch.randn(4, 2, 8)
    assert torch.equal(padded_entries(k, 16)[..., :8], k)
    assert padded_entries(k, 16)[..., 8:].eq(0).all()


@pytest.mark.parametrize("layout", ["token", "dim"])
def test_write_spare_columns_reaches_every_head_of_the_given_slots(layout):
    blocks, h, block, width, d = 3, 2, 4, 16, 8
    cache = torch.zeros(blocks, h, block, width)
    ids, offsets = torch.tensor([0, 2, 2]), torch.tensor([1, 0, 3])
    cols = torch.tensor([[1.0, 0.5], [2.0, 0.25], [3.0, 0.125]])
    write_spare_columns(cache, layout, ids, offsets, d, cols)
    # "dim": each block and head holds [width, block]
    dense = cache if layout == "token" else cache.reshape(blocks, h, width, block).transpose(2, 3)
    for (b, o), c in zip(zip(ids.tolist(), offsets.tolist()), cols):
        assert torch.equal(dense[b, :, o, d : d + 2], c.expand(h, 2))
    assert dense.ne(0).sum() == 3 * h * 2


vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs it")


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_vllms_kernel_with_spare_columns_is_the_corrected_attention(dtype, atol):
    """Two requests, each a compacted table of kept blocks with per-block log-weights, one
    decode row and one chunk of three rows after its prompt; the row that reads no weights
    (a recomputed prompt row) equals the kernel without them."""
    from vllm import _custom_ops as ops

    from probkv.vllm import internals
    from probkv.vllm.paged import cache_layout
    from probkv.vllm.weights import padded_head_size

    hq, hkv, d, block = 6, 2, 64, 32
    width = padded_head_size(d, internals.cpu_head_sizes())
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block, width)  # the instruction set vLLM picks for the width
    scale = d**-0.5
    g = torch.Generator().manual_seed(1)
    num_blocks = 16
    cache = torch.zeros(num_blocks, hkv, 2 * block, width, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    layout = cache_layout(isa, block, width, dtype)
    # request 0: prompt 96 (3 blocks), keeps blocks 0 and 2, then 5 new tokens (block 3);
    # request 1: prompt 64, keeps block 1 only, then 3 new tokens
    specs = [
        dict(table=[4, 5, 6, 7], kept_blocks=[0, 2], prompt=96, new=5, rows=1),
        dict(table=[9, 10, 11], kept_blocks=[1], prompt=64, new=3, rows=3),
    ]
    queries, refs, unweighted, tables, seq_lens, starts = [], [], [], [], [], [0]
    for spec in specs:
        n = spec["prompt"] + spec["new"]
        keys = torch.randn(n, hkv, d, generator=g).to(dtype)
        values = torch.randn(n, hkv, d, generator=g).to(dtype)
        slots = torch.tensor(
            [spec["table"][p // block] * block + p % block for p in range(n)], dtype=torch.int64
        )
        internals.cpu_cache_writer()(
            padded_entries(keys, width), padded_entries(values, width), key_cache, value_cache,
            slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
        )  # fmt: skip
        kept = torch.cat([torch.arange(b * block, (b + 1) * block) for b in spec["kept_blocks"]])
        logw = torch.cat(
            [torch.full((block,), -math.log(0.3 + 0.2 * b)) for b in spec["kept_blocks"]]
        )
        blocks = torch.tensor([spec["table"][p // block] for p in kept.tolist()])
        write_spare_columns(key_cache, layout[0], blocks, kept % block, d,
                            spare_key_columns(logw, scale, dtype))  # fmt: skip
        visible = torch.cat([kept, torch.arange(spec["prompt"], n)])
        vis_logw = torch.cat([logw, torch.zeros(spec["new"])])
        q = torch.randn(spec["rows"], hq, d, generator=g).to(dtype)
        refs.append(
            decode_attention(
                q.float(), keys[visible].float(), values[visible].float(), vis_logw, scale=scale
            )
        )
        unweighted.append(
            decode_attention(
                q.float(),
                keys[visible].float(),
                values[visible].float(),
                torch.zeros_like(vis_logw),
                scale=scale,
            )
        )
        queries.append(q)
        # the compacted table: the kept prompt blocks, then the blocks after the prompt
        after = spec["table"][spec["prompt"] // block :]
        tables.append([spec["table"][b] for b in spec["kept_blocks"]] + after)
        seq_lens.append(len(spec["kept_blocks"]) * block + spec["new"])
        starts.append(starts[-1] + spec["rows"])
    width_table = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width_table - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.tensor(starts, dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.cat(queries)

    def kernel(wide_query):
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=2, num_heads=hq, num_kv_heads=hkv, head_dim=width, seq_lens=sl,
            dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=False,
        )  # fmt: skip
        out = torch.empty_like(wide_query)
        ops.cpu_attention_with_kv_cache(
            query=wide_query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=qsl, seq_lens=sl, scale=scale, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=table, softcap=0.0, scheduler_metadata=meta,
            s_aux=None,
        )  # fmt: skip
        return out[..., :d].float()

    got = kernel(padded_queries(query, width))
    expected = torch.cat(refs)
    assert (got - expected).abs().max().item() < atol
    # row 0 reads no weights (a recomputed prompt row): plain attention over its positions
    plain = kernel(padded_queries(query, width, torch.tensor([0])))
    assert (plain[0] - unweighted[0][0]).abs().max().item() < atol
    assert torch.equal(plain[1:], got[1:])
    assert (plain[0] - got[0]).abs().max().item() > 10 * atol  # the weights mattered
