"""Decode attention after eviction (``probkv.hf.attention``, S4): every fast path against one
slow, obviously correct reference.

The reference is ``probkv.estimation.ragged_corrected_attention``: per (sequence,) KV head,
its kept entries then its tail through ``probkv.estimation.corrected_attention`` (the function
vLLM's kernels are tested against, itself tested against the paper's Algorithm 1 written
literally), in at least float32. The fast paths: a uniform prefix (one batched softmax), a
ragged one as a segment softmax over the flattened layout (``RAGGED_BATCHED_ON_CPU``, with row
blocks) or a per-head loop (the CPU default), a left-padded batch's segments in one call.

Tolerance by dtype. The fast paths compute logits as ``matmul`` in the inputs' dtype, then
float32: for float64 and float32 inputs each logit is rounded to float32 (relative 2^-24,
absolute ~1e-6 for ``|logit| <~ 10``), so probabilities agree to ~1e-6 relative and outputs
(``|v| ~ 1``, convex combinations) to ~1e-6 absolute; 1e-5 allows for the summation orders.
For bfloat16 the logits' matmul and the probabilities fed to the values' matmul are rounded to
bfloat16 (relative 2^-8: ~1e-2 on a logit of ~3): 3e-2 absolute and relative.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import probkv.hf.attention as attention_module
from probkv.estimation import ragged_corrected_attention
from probkv.hf.attention import batched_evicted_attention, evicted_attention
from probkv.hf.prefix import RaggedPrefix

torch.set_num_threads(1)

TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-5, torch.bfloat16: 3e-2}
DTYPES = list(TOLERANCE)


def assert_close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


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
    """``evicted_attention``'s result the slow way (module docstring)."""
    h = layer.num_heads
    hq, q_len, d = query.shape
    p = layer.prefix
    out = ragged_corrected_attention(
        query.reshape(h, hq // h, q_len, d),
        p.keys,
        p.values,
        p.log_weights,
        p.lengths,
        layer.tail_keys[0],
        layer.tail_values[0],
        scale=scale,
    )
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
    dtype=st.sampled_from(DTYPES),
    batched=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_ragged_decode_equals_the_reference(
    lengths, g, q_len, extra_tail, weighted, dtype, batched, seed
):
    """Both ragged paths: the segment softmax (``batched``) and the per-head loop."""
    # hypothesis forbids function-scoped fixtures: set the switch by hand
    attention_module.RAGGED_BATCHED_ON_CPU = batched
    try:
        layer, query = make_layer(
            lengths, g, q_len, q_len + extra_tail, weighted=weighted, dtype=dtype, seed=seed
        )
        out = evicted_attention(layer, query, 8**-0.5)
    finally:
        attention_module.RAGGED_BATCHED_ON_CPU = False
    assert out.shape == (len(lengths) * g, q_len, 6)
    assert_close(out, reference(layer, query, 8**-0.5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [0, 1, 13])
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("weighted", [False, True])
def test_uniform_decode_equals_the_reference(dtype, length, q_len, weighted):
    """Every head keeping the same count (an empty prefix included: the tail alone)."""
    layer, query = make_layer(
        [length] * 3, 2, q_len, q_len + 4, weighted=weighted, dtype=dtype, seed=length
    )
    assert_close(evicted_attention(layer, query, 0.4), reference(layer, query, 0.4), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", [[5, 5, 5, 5], [3, 0, 9, 4]])
def test_a_padded_batch_equals_the_reference_per_sequence(dtype, lengths):
    """``batched_evicted_attention``: 2 sequences of 2 KV heads, the prefix's segments
    sequence after sequence, the tail shared; tail slots that are padding of sequence 1 (an
    earlier input padded on the left: ``False`` in the mask) are no entry of it."""
    batch, h, g, q_len, n_tail = 2, 2, 3, 2, 7
    layer, query = make_layer(lengths, g, q_len, n_tail, weighted=True, dtype=dtype, seed=5)
    layer.tail_keys = layer.tail_keys.reshape(batch, h, n_tail, -1)
    layer.tail_values = layer.tail_values.reshape(batch, h, n_tail, -1)
    layer.num_heads = h
    query = query.reshape(batch, h * g, q_len, -1)
    mask = torch.ones(batch, 1, q_len, n_tail, dtype=torch.bool)
    mask[1, :, :, 1:4] = False
    out = batched_evicted_attention(layer, query, 0.4, mask)
    excluded = (~mask[:, 0, 0]).repeat_interleave(h, 0)  # [B Hkv, T]
    p = layer.prefix
    ref = ragged_corrected_attention(
        query.reshape(batch * h, g, q_len, -1),
        p.keys,
        p.values,
        p.log_weights,
        p.lengths,
        layer.tail_keys.reshape(batch * h, n_tail, -1),
        layer.tail_values.reshape(batch * h, n_tail, -1),
        scale=0.4,
        new_excluded=excluded,
    )
    assert_close(out, ref.reshape(batch, h * g, q_len, -1), dtype)


@pytest.mark.parametrize("block_bytes", [1, 4 * 3 * 50, 2**30])
def test_row_blocks_do_not_change_the_result(monkeypatch, block_bytes):
    """Row blocks bound the scratch: one row at a time, a few rows, all rows."""
    layer, query = make_layer([7, 0, 19], 3, 5, 9, weighted=True, dtype=torch.float64, seed=3)
    monkeypatch.setattr(attention_module, "RAGGED_BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(attention_module, "RAGGED_BATCHED_ON_CPU", True)
    out = evicted_attention(layer, query, 0.3)
    assert_close(out, reference(layer, query, 0.3), torch.float64)
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
