"""Tests of probkv.scores.column_sums: the chunked causal kernel and its column sums (S1, S2).

Every result is compared with a dense ``t x t`` reference written as plainly as possible.
Float64 inputs are computed in float64 by the kernel, so those comparisons check the logic
to 1e-12; float32 comparisons use tolerances from float32 rounding (stated where used).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from probkv.scores.column_sums import (
    _chunked_attention,
    attention_rows,
    attention_with_log_normalisers,
    causal_attention_rows_with_column_sums,
    causal_attention_with_column_sums,
    column_sums_from_log_normalisers,
    default_chunk_size,
    harmonic_row_weights,
    uniform_row_weights,
)

torch.set_num_threads(1)

F64 = torch.float64


def make_layer(t, hkv, g, d=8, dv=5, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(hkv * g, t, d, generator=gen, dtype=F64).to(dtype)
    k = torch.randn(hkv, t, d, generator=gen, dtype=F64).to(dtype)
    v = torch.randn(hkv, t, dv, generator=gen, dtype=F64).to(dtype)
    return q, k, v


def dense_probabilities(q, k, scale):
    """[Hq, t, t] causal softmax, one query head at a time, in float64 (S1)."""
    hq, t, _ = q.shape
    g = hq // k.shape[0]
    p = torch.zeros(hq, t, t, dtype=F64)
    for h in range(hq):
        logits = scale * q[h].double() @ k[h // g].double().T
        for j in range(t):
            p[h, j, : j + 1] = torch.softmax(logits[j, : j + 1], dim=0)
    return p


def dense_output(p, v):
    g = p.shape[0] // v.shape[0]
    return torch.stack([p[h] @ v[h // g].double() for h in range(p.shape[0])])


def dense_column_sums(p, weights):
    """[S, Hq, t]: sum_j w_s[j] p_j(i) (S2)."""
    return torch.einsum("sj,hji->shi", weights.double(), p)


def harmonic_reference(t):
    h_t = sum(1.0 / k for k in range(1, t + 1))
    return torch.tensor([1.0 / ((t - j + 1) * h_t) for j in range(1, t + 1)], dtype=F64)


SHAPES = [(1, 1, 1), (2, 1, 2), (17, 2, 3), (64, 3, 1), (130, 1, 3), (211, 3, 2)]
CHUNKS = [1, 7, "t", "t+5", None]


def _chunk(c, t):
    return {"t": t, "t+5": t + 5}.get(c, c)


@pytest.mark.parametrize("t,hkv,g", SHAPES)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_output_and_column_sums_equal_dense_reference_float64(t, hkv, g, chunk):
    """S1/S2: exact attention and weighted column sums, any chunking (float64: 1e-12)."""
    q, k, v = make_layer(t, hkv, g, seed=t + 10 * hkv + g)
    scale = 8**-0.5
    w = torch.stack([uniform_row_weights(t, dtype=F64), harmonic_row_weights(t, dtype=F64)])
    out, sums = causal_attention_with_column_sums(
        q, k, v, scale=scale, row_weights=w, chunk_size=_chunk(chunk, t)
    )
    p = dense_probabilities(q, k, scale)
    assert out.dtype == F64 and out.shape == (hkv * g, t, v.shape[-1])
    assert sums.shape == (2, hkv * g, t)
    torch.testing.assert_close(out, dense_output(p, v), rtol=0, atol=1e-12)
    torch.testing.assert_close(sums, dense_column_sums(p, w), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("t,hkv,g", [(1, 1, 1), (33, 2, 3), (211, 3, 3)])
@pytest.mark.parametrize("chunk", [1, 7, None])
def test_float32_kernel_close_to_float64_reference(t, hkv, g, chunk):
    """float32 arithmetic: logits ~ N(0, 1) have absolute error ~ d * 2^-24, so every
    probability has relative error below ~1e-5 and the outputs (|v| ~ 1) absolute error
    below ~1e-5; column sums add <= t such terms (relative 1e-5)."""
    q, k, v = make_layer(t, hkv, g, seed=5, dtype=torch.float32)
    scale = 8**-0.5
    w = torch.stack([uniform_row_weights(t), harmonic_row_weights(t)])
    out, sums = causal_attention_with_column_sums(
        q, k, v, scale=scale, row_weights=w, chunk_size=chunk
    )
    assert out.dtype == torch.float32 and sums.dtype == torch.float32
    p = dense_probabilities(q, k, scale)
    torch.testing.assert_close(out.double(), dense_output(p, v), rtol=0, atol=2e-5)
    torch.testing.assert_close(sums.double(), dense_column_sums(p, w), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("t,hkv,g", [(1, 1, 1), (50, 3, 3), (300, 2, 2)])
def test_output_equals_sdpa_causal(t, hkv, g):
    """The kernel's output is what the layer computes anyway (float32, same tolerance as
    above: both sides round logits at ~1e-6 relative)."""
    q, k, v = make_layer(t, hkv, g, d=16, dv=16, seed=3, dtype=torch.float32)
    scale = 16**-0.5
    out, _ = causal_attention_with_column_sums(q, k, v, scale=scale, row_weights=None)
    ref = F.scaled_dot_product_attention(
        q[None],
        k.repeat_interleave(g, 0)[None],
        v.repeat_interleave(g, 0)[None],
        is_causal=True,
        scale=scale,
    )[0]
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("t", [1, 9, 200])
def test_uniform_column_sums_add_up_to_t(t):
    """Every causal row is a distribution, so uniform column sums total t per head (S2)."""
    q, k, _ = make_layer(t, 2, 3, seed=1)
    _, sums = causal_attention_with_column_sums(
        q, k, None, scale=1.0, row_weights=uniform_row_weights(t, dtype=F64)[None], chunk_size=7
    )
    torch.testing.assert_close(sums[0].sum(-1), torch.full((6,), float(t), dtype=F64))


def test_chunking_does_not_change_results():
    """Chunked == unchunked (float64): the row log-sum-exp is over the full causal prefix."""
    t = 97
    q, k, v = make_layer(t, 3, 2, seed=7)
    w = harmonic_row_weights(t, dtype=F64)[None]
    ref_out, ref_sums = causal_attention_with_column_sums(
        q, k, v, scale=0.3, row_weights=w, chunk_size=t
    )
    for chunk in (1, 2, 7, 32, 96):
        out, sums = causal_attention_with_column_sums(
            q, k, v, scale=0.3, row_weights=w, chunk_size=chunk
        )
        torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-13)
        torch.testing.assert_close(sums, ref_sums, rtol=0, atol=1e-13)


@pytest.mark.parametrize("heads_per_block", [1, 2, 3])
def test_head_blocks_agree(heads_per_block):
    """The CPU path (one KV head at a time) and the batched path (used off CPU) agree."""
    t, hkv, g = 45, 3, 2
    q, k, v = make_layer(t, hkv, g, seed=11)
    w = torch.stack([uniform_row_weights(t, dtype=F64), harmonic_row_weights(t, dtype=F64)])
    out, sums = _chunked_attention(
        q, k, v, scale=0.4, row_weights=w, chunk=8, heads_per_block=heads_per_block, dtype=F64
    )
    p = dense_probabilities(q, k, 0.4)
    torch.testing.assert_close(out.reshape(hkv * g, t, -1), dense_output(p, v), rtol=0, atol=1e-12)
    torch.testing.assert_close(
        sums.reshape(hkv * g, 2, t).transpose(0, 1), dense_column_sums(p, w), rtol=0, atol=1e-12
    )


def test_value_none_and_no_row_weights():
    t = 20
    q, k, v = make_layer(t, 1, 3, seed=2)
    w = uniform_row_weights(t, dtype=F64)[None]
    out, sums = causal_attention_with_column_sums(q, k, None, scale=0.5, row_weights=w)
    assert out is None
    _, sums_with_v = causal_attention_with_column_sums(q, k, v, scale=0.5, row_weights=w)
    torch.testing.assert_close(sums, sums_with_v, rtol=0, atol=0)
    out, sums = causal_attention_with_column_sums(q, k, v, scale=0.5, row_weights=None)
    assert sums.shape == (0, 3, t)
    torch.testing.assert_close(
        out, dense_output(dense_probabilities(q, k, 0.5), v), rtol=0, atol=1e-12
    )


def test_low_precision_inputs_compute_in_float32():
    """bf16 inputs: output in bf16, statistics float32 and equal to the float32 computation on
    the same (upcast) values."""
    t = 40
    q, k, v = (x.to(torch.bfloat16) for x in make_layer(t, 2, 2, seed=4, dtype=torch.float32))
    w = uniform_row_weights(t)[None]
    out, sums = causal_attention_with_column_sums(q, k, v, scale=0.35, row_weights=w, chunk_size=6)
    assert out.dtype == torch.bfloat16 and sums.dtype == torch.float32
    out32, sums32 = causal_attention_with_column_sums(
        q.float(), k.float(), v.float(), scale=0.35, row_weights=w, chunk_size=6
    )
    torch.testing.assert_close(sums, sums32, rtol=0, atol=0)
    torch.testing.assert_close(out, out32.to(torch.bfloat16), rtol=0, atol=0)


def test_non_contiguous_inputs():
    """transformers hands over [B, H, t, d] views of [B, t, H, d] projections."""
    t, hkv, g, d = 30, 2, 2, 8
    q, k, v = make_layer(t, hkv, g, d=d, dv=d, seed=9)
    q_nc = q.transpose(0, 1).contiguous().transpose(0, 1)
    k_nc = k.transpose(0, 1).contiguous().transpose(0, 1)
    assert not q_nc.is_contiguous() and not k_nc.is_contiguous()
    w = uniform_row_weights(t, dtype=F64)[None]
    out, sums = causal_attention_with_column_sums(
        q_nc, k_nc, v, scale=0.3, row_weights=w, chunk_size=4
    )
    ref_out, ref_sums = causal_attention_with_column_sums(
        q, k, v, scale=0.3, row_weights=w, chunk_size=4
    )
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-14)
    torch.testing.assert_close(sums, ref_sums, rtol=0, atol=1e-14)


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(1, 60),
    hkv=st.integers(1, 3),
    g=st.integers(1, 3),
    chunk=st.integers(1, 70),
    seed=st.integers(0, 10_000),
)
def test_property_column_sums_and_rows(t, hkv, g, chunk, seed):
    """Any shape and chunk: uniform column sums total t, each column sum is at most the
    number of rows that see the column (t - i), and the kernel equals the dense reference."""
    q, k, v = make_layer(t, hkv, g, seed=seed)
    w = uniform_row_weights(t, dtype=F64)[None]
    out, sums = causal_attention_with_column_sums(
        q, k, v, scale=0.5, row_weights=w, chunk_size=chunk
    )
    p = dense_probabilities(q, k, 0.5)
    torch.testing.assert_close(sums, dense_column_sums(p, w), rtol=0, atol=1e-12)
    torch.testing.assert_close(out, dense_output(p, v), rtol=0, atol=1e-12)
    assert torch.allclose(sums[0].sum(-1), torch.full((hkv * g,), float(t), dtype=F64))
    visible = torch.arange(t, 0, -1, dtype=F64)  # rows j >= i see column i
    assert (sums[0] <= visible + 1e-12).all() and (sums[0] >= 0).all()


# --------------------------------------------------------------------- attention_rows


@pytest.mark.parametrize("t,hkv,g", [(1, 1, 1), (25, 2, 3), (90, 3, 1)])
def test_attention_rows_equal_dense_rows(t, hkv, g):
    q, k, _ = make_layer(t, hkv, g, seed=21)
    positions = sorted({0, t // 2, t - 1})
    rows = attention_rows(q[:, positions], k, scale=0.7, row_positions=positions)
    p = dense_probabilities(q, k, 0.7)
    torch.testing.assert_close(rows, p[:, positions], rtol=0, atol=1e-12)
    torch.testing.assert_close(rows.sum(-1), torch.ones(hkv * g, len(positions), dtype=F64))


def test_attention_rows_float32_and_arbitrary_positions():
    """Rows need not be the queries at those positions: a query placed at position p sees
    keys 0..p (causal by position). float32 output, rows sum to 1."""
    t = 12
    q, k, _ = make_layer(t, 1, 2, seed=3, dtype=torch.float32)
    rows = attention_rows(q[:, :2], k, scale=0.5, row_positions=torch.tensor([4, 0]))
    assert rows.dtype == torch.float32 and rows.shape == (2, 2, t)
    assert (rows[:, 0, 5:] == 0).all() and (rows[:, 1, 1:] == 0).all()
    torch.testing.assert_close(rows[:, 1, 0], torch.ones(2))
    expected = torch.softmax(0.5 * q[:, 0].double() @ k[0, :5].double().T, -1)
    torch.testing.assert_close(rows[:, 0, :5].double(), expected, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------ row weights


@pytest.mark.parametrize("t", [1, 2, 10, 1000])
def test_harmonic_row_weights(t):
    """S2: h_j = 1 / ((t - j + 1) H_t), sums to 1, last row largest."""
    h = harmonic_row_weights(t, dtype=F64)
    torch.testing.assert_close(h, harmonic_reference(t), rtol=1e-13, atol=0)
    assert math.isclose(float(h.sum()), 1.0, rel_tol=1e-12)
    assert int(h.argmax()) == t - 1
    assert (h[1:] > h[:-1]).all()
    assert harmonic_row_weights(t).dtype == torch.float32


def test_uniform_row_weights_and_default_chunk():
    assert torch.equal(uniform_row_weights(4), torch.ones(4))
    assert default_chunk_size(9, 8192, max_rows=64) == 64
    assert default_chunk_size(9, 8192) == (64 * 2**20) // (9 * 8192 * 4)  # 227 rows
    assert default_chunk_size(9, 10) == 10
    assert default_chunk_size(1, 10**9) == 1  # never below one row


# ------------------------------------------------------------------------- bad input


def test_bad_input_raises_value_error_naming_the_value():
    q, k, v = make_layer(10, 2, 2)
    w = uniform_row_weights(10, dtype=F64)[None]
    call = causal_attention_with_column_sums
    with pytest.raises(ValueError, match="t = 0"):
        call(q[:, :0], k[:, :0], v[:, :0], scale=1.0, row_weights=None)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        call(q[:3], k, v, scale=1.0, row_weights=w)
    with pytest.raises(ValueError, match="query length 9 must equal key length 10"):
        call(q[:, :9], k, v, scale=1.0, row_weights=w)
    with pytest.raises(ValueError, match="head dim"):
        call(q[..., :4], k, v, scale=1.0, row_weights=w)
    with pytest.raises(ValueError, match="value must be"):
        call(q, k, v[:, :5], scale=1.0, row_weights=w)
    with pytest.raises(ValueError, match=r"row_weights must be \[S, t\] with t = 10"):
        call(q, k, v, scale=1.0, row_weights=w[0])
    with pytest.raises(ValueError, match="row_weights contains NaN"):
        call(q, k, v, scale=1.0, row_weights=w * math.nan)
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        call(q, k, v, scale=1.0, row_weights=w, chunk_size=0)
    for bad in (0.0, -1.0, math.inf, math.nan, "1"):
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            call(q, k, v, scale=bad, row_weights=w)
    with pytest.raises(ValueError, match="query must be a floating-point"):
        call(q.long(), k, v, scale=1.0, row_weights=w)
    with pytest.raises(ValueError, match=r"row_positions must lie in \[0, 9\]"):
        attention_rows(q[:, :1], k, scale=1.0, row_positions=[10])
    with pytest.raises(ValueError, match=r"row_positions must be \[w\] with w = 1"):
        attention_rows(q[:, :1], k, scale=1.0, row_positions=[1, 2])
    with pytest.raises(ValueError, match="row_positions must be integers"):
        attention_rows(q[:, :1], k, scale=1.0, row_positions=[1.0])
    with pytest.raises(ValueError, match="t must be >= 1, got 0"):
        harmonic_row_weights(0)


@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(1, 60),
    hkv=st.integers(1, 3),
    g=st.integers(1, 3),
    cuts=st.lists(st.integers(1, 59), max_size=4),
    chunk=st.one_of(st.none(), st.integers(1, 9)),
)
def test_rows_at_an_offset_add_up_to_the_one_pass_kernel(t, hkv, g, cuts, chunk):
    """A prefill in chunks (issue 11): each chunk's rows attend to every earlier key, so the
    chunks' outputs are the one-pass rows and their column sums add up to the one-pass sums,
    the harmonic weighting included (weights of the final t sliced per chunk); float64."""
    q, k, v = make_layer(t, hkv, g, seed=t)
    w = torch.stack([uniform_row_weights(t, dtype=F64), harmonic_reference(t)])
    ref_out, ref_sums = causal_attention_with_column_sums(q, k, v, scale=0.4, row_weights=w)
    bounds = sorted({0, t, *(c for c in cuts if c < t)})
    outputs, sums = [], torch.zeros_like(ref_sums)
    for a, b in itertools.pairwise(bounds):
        out, part = causal_attention_rows_with_column_sums(
            q[:, a:b], k[:, :b], v[:, :b], scale=0.4, row_weights=w[:, a:b], chunk_size=chunk
        )
        outputs.append(out)
        sums[..., :b] += part
    torch.testing.assert_close(torch.cat(outputs, 1), ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(sums, ref_sums, rtol=0, atol=1e-12)


def test_rows_at_an_offset_refuse_more_rows_than_keys():
    q, k, v = make_layer(10, 2, 2)
    with pytest.raises(ValueError, match="query_rows has 10 rows but there are only 9 keys"):
        causal_attention_rows_with_column_sums(q, k[:, :9], v[:, :9], scale=1.0, row_weights=None)


# ------------------------------------------- torch's fused kernel + tiled column sums


def dense_log_normalisers(q, k, scale, offset):
    """[Hq, q] log-sum-exp of each row's causal logits (row r at position offset + r)."""
    g = q.shape[0] // k.shape[0]
    logits = scale * q.double() @ k.double().repeat_interleave(g, 0).transpose(1, 2)
    rows = torch.arange(q.shape[1])[:, None] + offset
    logits.masked_fill_(torch.arange(k.shape[1])[None, :] > rows, -math.inf)
    return torch.logsumexp(logits, -1)


@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(1, 60),
    offset_fraction=st.floats(0.0, 1.0),
    hkv=st.integers(1, 3),
    g=st.integers(1, 3),
    block_rows=st.integers(1, 70),
    block_keys=st.integers(1, 70),
    d_v=st.sampled_from([5, 8, 11]),
    seed=st.integers(0, 10_000),
)
def test_log_normaliser_path_equals_chunked_kernel_and_dense_reference(
    t, offset_fraction, hkv, g, block_rows, block_keys, d_v, seed
):
    """S1/S2 by the other route: torch's fused kernel gives the output and each row's
    log-normaliser; the column sums follow tile by tile. Any shape, tiling and causal offset
    (the last q of t rows), float64: equal to the chunked kernel and the dense reference to
    1e-12, the log-normalisers to a dense log-sum-exp."""
    q_len = max(1, round(t * (1 - offset_fraction)))
    q, k, _ = make_layer(t, hkv, g, seed=seed)
    v = torch.randn(hkv, t, d_v, generator=torch.Generator().manual_seed(seed), dtype=F64)
    rows = q[:, t - q_len :]
    w = torch.stack([uniform_row_weights(t, dtype=F64), harmonic_reference(t)])[:, t - q_len :]
    out, lse = attention_with_log_normalisers(rows, k, v, scale=0.4)
    sums = column_sums_from_log_normalisers(
        rows, k, lse, scale=0.4, row_weights=w, block_rows=block_rows, block_keys=block_keys
    )
    ref_out, ref_sums = causal_attention_rows_with_column_sums(rows, k, v, scale=0.4, row_weights=w)
    assert out.dtype == sums.dtype == F64
    torch.testing.assert_close(
        lse, dense_log_normalisers(rows, k, 0.4, t - q_len), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(sums, ref_sums, rtol=0, atol=1e-12)
    p = dense_probabilities(q, k, 0.4)[:, t - q_len :]
    torch.testing.assert_close(sums, torch.einsum("sj,hji->shi", w, p), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_normaliser_path_float32_close_to_chunked_kernel(dtype):
    """float32 arithmetic (bfloat16 inputs upcast, as in the chunked kernel): logits ~ N(0, 1)
    carry absolute error ~ d * 2^-24 in either kernel, so probabilities agree to ~1e-5
    relative, outputs (|v| ~ 1) to ~1e-5 and column sums (<= t terms) to 1e-5 relative."""
    q, k, v = make_layer(97, 2, 3, seed=7, dtype=dtype)
    w = torch.stack([uniform_row_weights(97), harmonic_row_weights(97)])
    out, lse = attention_with_log_normalisers(q, k, v, scale=8**-0.5)
    sums = column_sums_from_log_normalisers(q, k, lse, scale=8**-0.5, row_weights=w)
    ref_out, ref_sums = causal_attention_with_column_sums(q, k, v, scale=8**-0.5, row_weights=w)
    assert sums.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(
        out.to(dtype), ref_out, rtol=0, atol=2e-5 if dtype == torch.float32 else 1e-2
    )
    torch.testing.assert_close(sums, ref_sums, rtol=2e-5, atol=1e-6)


def test_log_normaliser_path_bad_input():
    q, k, v = make_layer(10, 2, 2)
    with pytest.raises(ValueError, match=r"log_normalisers must be \[Hq, q\] = \[4, 10\]"):
        column_sums_from_log_normalisers(
            q, k, torch.zeros(4, 9, dtype=F64), scale=1.0, row_weights=torch.ones(1, 10, dtype=F64)
        )
    with pytest.raises(ValueError, match="block_rows must be"):
        column_sums_from_log_normalisers(
            q,
            k,
            torch.zeros(4, 10, dtype=F64),
            scale=1.0,
            row_weights=torch.ones(1, 10, dtype=F64),
            block_rows=0,
        )
    with pytest.raises(ValueError, match="row_weights must be an"):
        column_sums_from_log_normalisers(
            q, k, torch.zeros(4, 10, dtype=F64), scale=1.0, row_weights=None
        )
    with pytest.raises(ValueError, match="query_rows has 10 rows but there are only 9 keys"):
        attention_with_log_normalisers(q, k[:, :9], v[:, :9], scale=1.0)
