"""probkv.hf.prefill: a prompt read in several forwards is evicted at its end, exactly as if it
had been read in one (issue 11, chunked prefill; S2). The reference is always the same
prompt in one forward; the kept entries and the generated tokens must be the same."""

from __future__ import annotations

import pytest
import torch

from probkv.hf import ProbKVCache, PromptPhase, compress, prepare_model
from probkv.models.testing import tiny_model
from probkv.policies import parse_method

torch.set_num_threads(1)

T = 70  # prompt tokens


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request):
    return prepare_model(tiny_model(request.param, seed=0))


def ids_of(model, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (1, n), generator=g)


def kept(cache) -> list:
    """Per evicting layer: the prompt length it evicted, kept counts, kept keys, weights."""
    out = []
    for i in cache.evicting_layers:
        layer = cache.layers[i]
        prefix = layer.prefix
        weights = None if prefix.log_weights is None else prefix.log_weights.tolist()
        out.append((layer.prefix_length, prefix.lengths, prefix.keys, weights))
    return out


def assert_same_kept(a, b) -> None:
    assert len(a) == len(b)
    for (ta, la, ka, wa), (tb, lb, kb, wb) in zip(a, b):
        assert (ta, la) == (tb, lb)
        torch.testing.assert_close(ka, kb, rtol=1e-5, atol=1e-5)
        assert (wa is None) == (wb is None)
        if wa is not None:
            torch.testing.assert_close(torch.tensor(wa), torch.tensor(wb), rtol=1e-4, atol=1e-4)


def generate(model, ids, cache, **kw):
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        max_new_tokens=4,
        do_sample=False,
        **kw,
    )


CHUNKED_METHODS = [
    "snapkv/window=8",
    "prob:snapkv/window=40",  # the window spans three chunks
    "h2o",
    "prob:h2o/scope=global",
    "prob:tova/sampler=with_replacement",
    "ada_snapkv/window=8",
    "knorm",
    "streaming_llm",
]


@pytest.mark.parametrize("prompt_length", [None, T])
@pytest.mark.parametrize("method", CHUNKED_METHODS)
def test_generate_with_prefill_chunks_equals_one_prefill(tiny, method, prompt_length):
    if method == "knorm" and tiny.config.model_type.startswith("gemma3"):
        pytest.skip("QK-norm gives every key the same norm: knorm's order is all ties")
    ids = ids_of(tiny, T, seed=1)
    policy = parse_method(method, ratio=0.5)
    one = ProbKVCache(tiny.config, policy, prompt_length=prompt_length)
    expected = generate(tiny, ids, one)
    chunked = ProbKVCache(tiny.config, policy, prompt_length=prompt_length)
    got = generate(tiny, ids, chunked, prefill_chunk_size=16)
    assert torch.equal(got, expected)
    assert_same_kept(kept(chunked), kept(one))
    assert all(t == T for t, *_ in kept(chunked))


@pytest.mark.parametrize("method", ["prob:min-h", "topk:h2o-h"])
def test_harmonic_scores_accumulate_exactly_with_the_prompt_length(tiny, method):
    ids = ids_of(tiny, T, seed=2)
    policy = parse_method(method, ratio=0.5)
    expected = generate(tiny, ids, ProbKVCache(tiny.config, policy))
    chunked = ProbKVCache(tiny.config, policy, prompt_length=T)
    assert torch.equal(generate(tiny, ids, chunked, prefill_chunk_size=16), expected)
    assert_same_kept(kept(chunked), kept(compress(tiny, ids, policy)))


def test_with_the_prompt_length_layers_evict_during_their_last_chunk(tiny):
    """Layerwise policies still evict layer by layer inside the last chunk's forward; a
    global one waits for the next forward."""
    ids = ids_of(tiny, 30, seed=3)
    layerwise = ProbKVCache(tiny.config, parse_method("snapkv/window=4", 0.5), prompt_length=30)
    global_ = ProbKVCache(tiny.config, parse_method("prob:h2o/scope=global", 0.5), prompt_length=30)
    with torch.no_grad():
        for cache in (layerwise, global_):
            tiny(input_ids=ids[:, :12], cache=cache)
            assert all(cache.layers[i].phase is PromptPhase.PREFILL for i in cache.evicting_layers)
            tiny(input_ids=ids[:, 12:29], cache=cache)
            tiny(input_ids=ids[:, 29:], cache=cache)  # a last chunk of one token: still prompt
    assert all(layerwise.layers[i].is_evicted for i in layerwise.evicting_layers)
    assert global_.eviction_pending
    assert_same_kept(
        kept(layerwise), kept(compress(tiny, ids, parse_method("snapkv/window=4", 0.5)))
    )


def test_without_the_prompt_length_the_first_single_token_ends_the_prompt(tiny):
    """Chunks of several tokens are prompt; the first forward of one token is the first
    decode step: eviction happens before it, over everything read so far."""
    ids = ids_of(tiny, 41, seed=4)
    policy = parse_method("prob:snapkv/window=8", 0.5)
    cache = ProbKVCache(tiny.config, policy)
    with torch.no_grad():
        tiny(input_ids=ids[:, :20], cache=cache)
        assert cache.prefill_open and cache.eviction_pending  # provisional observation
        tiny(input_ids=ids[:, 20:40], cache=cache)
        assert not any(cache.layers[i].is_evicted for i in cache.evicting_layers)
        tiny(input_ids=ids[:, 40:], cache=cache)
    assert all(cache.layers[i].is_evicted for i in cache.evicting_layers)
    assert_same_kept(kept(cache), kept(compress(tiny, ids[:, :40], policy)))
    assert cache.get_seq_length() == 41


def test_end_prefill_evicts_before_a_question(tiny):
    """A forward loop that feeds a context and then a question ends the prompt in between,
    as compress + answer do: the question's logits are those after compress."""
    context, question = ids_of(tiny, 40, seed=5), ids_of(tiny, 6, seed=6)
    policy = parse_method("prob:h2o", 0.5)
    cache = ProbKVCache(tiny.config, policy)
    with torch.no_grad():
        tiny(input_ids=context, cache=cache)
        cache.end_prefill()
        got = tiny(input_ids=question, cache=cache).logits
        reference = compress(tiny, context, policy)
        expected = tiny(input_ids=question, cache=reference).logits
    torch.testing.assert_close(got, expected)
    assert_same_kept(kept(cache), kept(reference))


def test_where_the_prompt_cannot_end(tiny):
    ids = ids_of(tiny, 20, seed=7)
    cache = ProbKVCache(tiny.config, parse_method("snapkv", 0.5), prompt_length=20)
    with pytest.raises(ValueError, match="cannot end after 0 tokens of prompt_length=20"):
        cache.end_prefill()
    with torch.no_grad():
        tiny(input_ids=ids[:, :10], cache=cache)
        with pytest.raises(ValueError, match="cannot end after 10 tokens of prompt_length=20"):
            cache.end_prefill()
        with pytest.raises(ValueError, match="the prompt has 25 tokens, beyond prompt_length=20"):
            tiny(input_ids=torch.cat([ids, ids[:, :5]], 1)[:, 10:], cache=cache)
    with pytest.raises(ValueError, match="prompt_length must be >= 1, got 0"):
        ProbKVCache(tiny.config, parse_method("snapkv", 0.5), prompt_length=0)
