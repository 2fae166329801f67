"""Decode attention after eviction (``probkv.hf.attention``, S4): the batched ragged path.

A ragged prefix (heads keeping different numbers of entries, some none) is attended in one
segment softmax over the flattened layout; the reference is the per-head Python loop it
replaced (``ragged_merge_per_head``). Both compute the same sums in a different order.
Decode logits are float32 whatever the inputs' dtype, so both paths round each logit to
float32 (relative 2^-24, absolute ~1e-6 for ``|logit| <~ 10``): probabilities agree to ~1e-6
relative and outputs (``|v| ~ 1``, convex combinations) to ~1e-6 absolute; 1e-5 allows for
the different summation orders. With one row block and float64 values, row blocks change
nothing but the order of the rows, so they agree to 1e-12 (float64 values).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import probkv.hf.attention as attention_module
from probkv.hf.attention import evicted_attention, ragged_merge_per_head
from probkv.hf.prefix import RaggedPrefix
from probkv.scores.observation import causal_offset_mask

torch.set_num_threads(1)

TOLERANCE = 1e-5


def make_layer(lengths, g, q_len, n_tail, *, weighted, dtype, seed, d=8, dv=6):
    gen = torch.Generator().manual_seed(seed)
    h, n = len(lengths), sum(lengths)
    prefix = RaggedPrefix(
        keys=torch.randn(n, d, generator=gen, dtype=torch.float64).to(dtype),
        values=torch.randn(n, dv, generator=gen, dtype=torch.float64).to(dtype),
        log_weights=(torch.rand(n, generator=gen) * 3).float() if weighted else None,
        lengths=list(lengths),
    )
    tail_k = torch.randn(1, h, n_tail, d, generator=gen, dtype=torch.float64).to(dtype)
    tail_v = torch.randn(1, h, n_tail, dv, generator=gen, dtype=torch.float64).to(dtype)
    layer = SimpleNamespace(prefix=prefix, num_heads=h, tail_keys=tail_k, tail_values=tail_v)
    query = torch.randn(h * g, q_len, d, generator=gen, dtype=torch.float64).to(dtype)
    return layer, query


def reference(layer, query, scale):
    """The per-head loop, fed the same tail logits as ``evicted_attention`` builds."""
    h = layer.num_heads
    hq, q_len, d = query.shape
    g = hq // h
    qg = query.reshape(h, g * q_len, d)
    tail_k, tail_v = layer.tail_keys[0], layer.tail_values[0]
    tail_logits = torch.matmul(qg, tail_k.transpose(1, 2)).float().mul_(scale)
    if q_len > 1:
        causal = causal_offset_mask(q_len, tail_k.shape[1], query.device).repeat(g, 1)
        tail_logits.masked_fill_(~causal, float("-inf"))
    out = ragged_merge_per_head(layer.prefix, qg, tail_logits, tail_v, scale)
    return out.reshape(hq, q_len, -1)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=2, max_size=5).filter(
        lambda x: len(set(x)) > 1  # ragged: the uniform path is a separate branch
    ),
    g=st.integers(1, 3),
    q_len=st.integers(1, 4),
    extra_tail=st.integers(0, 5),
    weighted=st.booleans(),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    seed=st.integers(0, 10_000),
)
def test_batched_ragged_decode_equals_per_head_loop(
    lengths, g, q_len, extra_tail, weighted, dtype, seed
):
    # hypothesis forbids function-scoped fixtures: set the switch by hand
    attention_module.RAGGED_BATCHED_ON_CPU = True
    try:
        _check_batched_against_loop(lengths, g, q_len, extra_tail, weighted, dtype, seed)
    finally:
        attention_module.RAGGED_BATCHED_ON_CPU = False


def _check_batched_against_loop(lengths, g, q_len, extra_tail, weighted, dtype, seed):
    layer, query = make_layer(
        lengths, g, q_len, q_len + extra_tail, weighted=weighted, dtype=dtype, seed=seed
    )
    scale = 8**-0.5
    out = evicted_attention(layer, query, scale)
    ref = reference(layer, query, scale)
    assert out.shape == ref.shape == (len(lengths) * g, q_len, 6)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("block_bytes", [1, 4 * 3 * 50, 2**30])
def test_row_blocks_do_not_change_the_result(monkeypatch, block_bytes):
    """Row blocks bound the scratch: one row at a time, a few rows, all rows."""
    layer, query = make_layer([7, 0, 19], 3, 5, 9, weighted=True, dtype=torch.float64, seed=3)
    monkeypatch.setattr(attention_module, "RAGGED_BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(attention_module, "RAGGED_BATCHED_ON_CPU", True)
    out = evicted_attention(layer, query, 0.3)
    torch.testing.assert_close(out, reference(layer, query, 0.3), rtol=TOLERANCE, atol=TOLERANCE)
    if block_bytes == 1:  # against the one-block result: same logits, float64 arithmetic
        monkeypatch.setattr(attention_module, "RAGGED_BLOCK_BYTES", 2**30)
        whole = evicted_attention(layer, query, 0.3)
        torch.testing.assert_close(out, whole, rtol=1e-12, atol=1e-12)


def test_head_index_names_each_entrys_head():
    prefix = RaggedPrefix(
        keys=torch.zeros(6, 2), values=torch.zeros(6, 2), log_weights=None, lengths=[2, 0, 4]
    )
    assert prefix.head_index.tolist() == [0, 0, 2, 2, 2, 2]
    assert prefix.head_index.device == prefix.keys.device
