"""A decode budget's statistics read the decode attention's own probabilities (S4, S10.5).

``evicted_attention_with_probabilities`` hands over the softmax it computed; the slow
reference recomputes it from every head's entries (``padded_entries`` then
``decode_probabilities``, the form the statistics used before). Both compute the same float32
logits in a different order (one matmul over prefix and tail vs two, a segment softmax on the
batched ragged path), so they agree to float32 rounding (relative 2^-24 per logit: ~1e-6 on
probabilities); 1e-5 allows for the different summation orders, as in test_hf_attention.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import probkv.hf.attention as attention_module
from probkv.hf import ProbKVCache, prepare_model
from probkv.hf.attention import evicted_attention, evicted_attention_with_probabilities
from probkv.hf.prefix import RaggedPrefix
from probkv.models.testing import tiny_model
from probkv.policies import parse_method
from probkv.scores.decode_statistics import decode_probabilities

torch.set_num_threads(1)

TOLERANCE = 1e-5
# pps blocks of K = 3 entries keep B - 2 .. B + 2 entries per head (S10.3): ragged heads.
RAGGED = "prob:h2o"


def make_layer(lengths, g, q_len, n_tail, *, weighted, seed, d=8, dv=6):
    """A stand-in for an evicted layer: a ragged prefix (``lengths``) and a dense tail."""
    gen = torch.Generator().manual_seed(seed)
    h, n = len(lengths), sum(lengths)
    prefix = RaggedPrefix(
        keys=torch.randn(n, d, generator=gen),
        values=torch.randn(n, dv, generator=gen),
        log_weights=(torch.rand(n, generator=gen) * 3) if weighted else None,
        lengths=list(lengths),
    )
    tail_k = torch.randn(1, h, n_tail, d, generator=gen)
    tail_v = torch.randn(1, h, n_tail, dv, generator=gen)
    layer = SimpleNamespace(prefix=prefix, num_heads=h, tail_keys=tail_k, tail_values=tail_v)
    return layer, torch.randn(h * g, q_len, d, generator=gen)


def padded_entries(layer):
    """Every head's entries now (prefix, then tail) padded to the longest, one head at a time:
    keys ``[Hkv, n, d]``, prefix log-weights ``[Hkv, n]`` (zero on the tail; ``None``
    without weights) and the heads' lengths."""
    prefix = layer.prefix
    tail_k = layer.tail_keys[0]
    lengths = [n + tail_k.shape[1] for n in prefix.lengths]
    keys = tail_k.new_zeros(layer.num_heads, max(lengths), tail_k.shape[2])
    log_weights = None
    if prefix.log_weights is not None:
        log_weights = torch.zeros(layer.num_heads, max(lengths))
    for i in range(layer.num_heads):
        k, _, lw = prefix.head(i)
        keys[i, : k.shape[0]] = k
        keys[i, k.shape[0] : lengths[i]] = tail_k[i]
        if lw is not None:
            log_weights[i, : lw.shape[0]] = lw
    return keys, log_weights, lengths


def _reference(layer, query, scale):
    keys, log_weights, lengths = padded_entries(layer)
    return decode_probabilities(query, keys, log_weights, lengths, scale)


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("block_bytes", [1, 2**30])
@pytest.mark.parametrize(
    ("lengths", "q_len", "n_tail"),
    [([9, 9, 9], 1, 4), ([9, 9], 3, 5), ([7, 0, 19], 1, 3), ([0, 5], 2, 2), ([0, 0], 1, 1)],
)
@pytest.mark.parametrize("weighted", [False, True])
def test_reused_probabilities_equal_the_recomputed_ones(
    monkeypatch, batched, block_bytes, lengths, q_len, n_tail, weighted
):
    """Uniform and ragged heads (some empty), several query rows (causal among them), the
    per-head and the batched ragged paths, one row per block or all rows in one."""
    monkeypatch.setattr(attention_module, "RAGGED_BATCHED_ON_CPU", batched)
    monkeypatch.setattr(attention_module, "RAGGED_BLOCK_BYTES", block_bytes)
    layer, query = make_layer(lengths, 3, q_len, n_tail, weighted=weighted, seed=len(lengths))
    scale = 8**-0.5
    out, probs = evicted_attention_with_probabilities(layer, query, scale)
    expected = _reference(layer, query, scale)
    assert probs.shape == expected.shape == (len(lengths), 3, q_len, max(lengths) + n_tail)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, expected, rtol=TOLERANCE, atol=TOLERANCE)
    assert torch.equal(out, evicted_attention(layer, query, scale))


def _layers(cache):
    return [cache.layers[i] for i in cache.evicting_layers]


@pytest.mark.parametrize("method", ["prob:h2o-h", "h2o", "tova", RAGGED])
def test_statistics_receive_the_recomputed_probabilities_on_a_tiny_model(monkeypatch, method):
    """Every decode step of every layer: what the statistics receive equals the slow
    reference recomputed from the layer's entries, ragged heads included (pps blocks keep
    a few entries more or fewer than B); scores without column sums receive them only on stage steps."""
    model = prepare_model(tiny_model("llama", seed=0))
    scale = model.config.head_dim**-0.5  # the model's attention scaling
    original = attention_module.after_decode_attention
    seen = {"given": 0, "ragged": 0, "stages": 0}

    def checking(layer, query, probabilities=None):
        due = layer.physical_length() >= layer.decode_budget.peak_entries
        if probabilities is not None:
            seen["given"] += 1
            seen["ragged"] += not layer.prefix.uniform_length
            expected = _reference(layer, query, scale)
            torch.testing.assert_close(probabilities, expected, rtol=TOLERANCE, atol=TOLERANCE)
        needs_rows = layer.decode_state.statistics.weighting is not None or due
        assert (probabilities is not None) == needs_rows
        seen["stages"] += due
        return original(layer, query, probabilities=probabilities)

    monkeypatch.setattr(attention_module, "after_decode_attention", checking)
    cache = ProbKVCache(
        model.config, parse_method(method), prompt_length=20, max_entries=10, every=3
    )
    ids = torch.randint(0, 200, (1, 50), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(input_ids=ids[:, :20], cache=cache, use_cache=True)
        model(input_ids=ids[:, 20:22], cache=cache, use_cache=True)  # two rows in one forward
        for i in range(22, ids.shape[1]):
            model(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True)
    assert seen["stages"] > 0 and seen["given"] >= seen["stages"]
    if method == RAGGED:
        assert seen["ragged"] > 0


@pytest.mark.parametrize("method", ["prob:h2o-h", "h2o", "tova", "streaming_llm", RAGGED])
def test_reuse_keeps_the_same_entries_as_recomputing(monkeypatch, method):
    """Whole runs, the probabilities reused vs recomputed (the statistics handed the slow
    reference, ``padded_entries`` then ``decode_probabilities``, instead of the attention's
    own softmax): the same kept sets, weights and logits (to rounding)."""
    model = prepare_model(tiny_model("llama", seed=0))

    def recomputed(layer, query, scale):
        return evicted_attention(layer, query, scale), _reference(layer, query, scale)

    ids = torch.randint(0, 200, (1, 60), generator=torch.Generator().manual_seed(5))
    runs = []
    for reuse in (True, False):
        if not reuse:
            monkeypatch.setattr(
                attention_module, "evicted_attention_with_probabilities", recomputed
            )
        cache = ProbKVCache(
            model.config, parse_method(method), prompt_length=20, max_entries=10, every=3
        )
        logits = []
        with torch.no_grad():
            model(input_ids=ids[:, :20], cache=cache, use_cache=True)
            for i in range(20, ids.shape[1]):
                out = model(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True)
                logits.append(out.logits[0, -1])
        kept = [(layer.prefix.lengths, layer.prefix.keys) for layer in _layers(cache)]
        weights = [layer.prefix.log_weights for layer in _layers(cache)]
        runs.append((torch.stack(logits), kept, weights))
    (la, ka, wa), (lb, kb, wb) = runs
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    for (na, keys_a), (nb, keys_b) in zip(ka, kb, strict=True):
        assert na == nb
        torch.testing.assert_close(keys_a, keys_b, rtol=1e-6, atol=1e-6)
    for a, b in zip(wa, wb, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_score_without_column_sums_computes_no_probabilities_between_stages(monkeypatch):
    """StreamingLLM: the attention hands over its probabilities on stage steps only."""
    model = prepare_model(tiny_model("llama", seed=0))
    calls = []
    original = attention_module.evicted_attention_with_probabilities

    def counting(layer, query, scale):
        calls.append(layer.physical_length())
        return original(layer, query, scale)

    monkeypatch.setattr(attention_module, "evicted_attention_with_probabilities", counting)
    cache = ProbKVCache(
        model.config, parse_method("streaming_llm"), prompt_length=20, max_entries=10, every=4
    )
    ids = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        model(input_ids=ids[:, :20], cache=cache, use_cache=True)
        for i in range(20, ids.shape[1]):
            model(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True)
    assert calls and all(n == 14 for n in calls)


def test_statistics_refuse_missing_rows_for_column_sums():
    """A score that reads column sums cannot skip a step's probabilities."""
    from probkv.scores.decode_statistics import DecodeStatistics

    stats = DecodeStatistics.from_prompt(
        "h2o",
        {},
        prompt_log_scores=torch.full((1, 4), 0.25).log(),
        last_query_attention=torch.full((1, 4), 0.25),
        kept=[torch.tensor([0, 2])],
    )
    with pytest.raises(ValueError, match="needs every decode row"):
        stats.observe(None, torch.zeros(1, 1, 4))
