"""KVzip's reconstruction pass inside real transformers models (S10.1).

The oracle: run the model densely (eager attention) over the context followed by one
reconstruction chunk and read its attention probabilities at the chunk's rows; KVzip's score
is their max over rows and GQA group, ``h2o-rec`` their mean. The pass must give the same
scores without ever storing the reconstruction tokens: the cache is bit-identical before and
after it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from probkv.estimation.calibration import calibrated_selection, reference_stride
from probkv.hf import (
    EvictingLayer,
    ProbKVCache,
    RepeatPrompt,
    answer,
    capture_attention,
    compress,
    observe,
    pad_left,
    prepare_model,
    reconstruct,
    repeat_prompt,
)
from probkv.hf.layers import PromptPhase
from probkv.hf.prefill import ObserveOnly
from probkv.hf.reconstruct import REPEAT_FIRST, REPEAT_LATER
from probkv.models.testing import TINY_ARCHITECTURES, tiny_model, tiny_tokenizer
from probkv.policies import parse_method
from probkv.scores.proposals import FLOOR
from probkv.scores.reconstruction import reconstruction_chunks

torch.set_num_threads(1)

# Arbitrary token ids for the prompt parts; the template's opening is the first 3 context ids.
PROMPT = RepeatPrompt(first=(7, 8, 9), later=(10, 11), suffix=(12, 13), template_prefix=(5, 6, 20))


@pytest.fixture(scope="module", params=TINY_ARCHITECTURES)
def tiny(request):
    return prepare_model(tiny_model(request.param, seed=0))


def context_ids(model, t: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(30, model.config.vocab_size, (1, t), generator=g)
    ids[0, :3] = torch.tensor([5, 6, 20])  # starts with PROMPT's template opening
    return ids


def prefilled(model, ids, score="kvzip", **params) -> ProbKVCache:
    cache = ProbKVCache(model.config, ObserveOnly(score=score, ratio=0.0, score_params=params))
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    return cache


def snapshot(cache) -> list[dict]:
    out = []
    for layer in cache.layers:
        if isinstance(layer, EvictingLayer):
            state = {
                "keys": layer.tail_keys.clone(),
                "values": layer.tail_values.clone(),
                "capacity": layer.tail.capacity,
                "lengths": (layer.get_seq_length(), layer.physical_length(), layer.tail_length),
            }
        else:
            state = {
                "keys": layer.keys.clone(),
                "values": layer.values.clone(),
                "lengths": (layer.get_seq_length(), layer.cumulative_length),
            }
        out.append(state)
    return out


def assert_same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            if isinstance(x[key], torch.Tensor):
                assert torch.equal(x[key], y[key]), key
            else:
                assert x[key] == y[key], key


def test_the_pass_leaves_the_cache_bit_identical(tiny):
    model = tiny
    ids = context_ids(model, 37)
    cache = prefilled(model, ids, chunk_tokens=10)
    before = snapshot(cache)
    assert cache.awaiting_reconstruction
    reconstruct(model, cache, ids, PROMPT)
    assert_same(before, snapshot(cache))
    assert cache.get_seq_length() == 37 and not cache.awaiting_reconstruction
    for i in cache.evicting_layers:
        layer = cache.layers[i]
        assert layer.observation is not None and layer.scoring is None
        assert layer.phase is PromptPhase.OBSERVED


def repeat_chunks(ids, prompt, chunk_tokens):
    """The oracles' "repeat the context" chunks of ``ids`` (S10.1)."""
    return reconstruction_chunks(
        ids[0].tolist(),
        first=prompt.first,
        later=prompt.later,
        suffix=prompt.suffix,
        context_start=prompt.context_start(ids[0].tolist()),
        chunk_tokens=chunk_tokens,
    )


def dense_statistics(model, ids, prompt, chunk_tokens):
    """Oracle (S10.1): eager attention over context + each chunk; per evicting layer the max
    over the chunk's rows and GQA group, and the sum over rows, of the first t columns."""
    t = ids.shape[1]
    chunks = repeat_chunks(ids, prompt, chunk_tokens)
    hkv = model.config.num_key_value_heads
    stats = {}
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            for chunk in chunks:
                full = torch.cat([ids, torch.tensor([chunk.input_ids])], dim=1)
                attentions = model(input_ids=full, output_attentions=True).attentions
                for layer_idx, attn in enumerate(attentions):
                    rows = attn[0, :, t:, :t].double()  # [Hq, n, t]
                    mx = rows.amax(1).view(hkv, -1, t).amax(1)
                    old = stats.get(layer_idx, (torch.zeros(hkv, t, dtype=torch.float64), 0, 0))
                    stats[layer_idx] = (
                        torch.maximum(old[0], mx),
                        old[1] + rows.sum(1),
                        old[2] + rows.shape[1],
                    )
    finally:
        prepare_model(model)
    return stats


@pytest.mark.parametrize("chunk_tokens", [12, 2000])
def test_scores_equal_the_dense_attention_of_the_appended_chunks(tiny, chunk_tokens):
    model = tiny
    ids = context_ids(model, 30)
    expected = dense_statistics(model, ids, PROMPT, chunk_tokens)
    forced = 4  # max(sinks = 4, template opening = 3)
    for score in ("kvzip", "h2o-rec"):
        cache = observe(model, ids, score, {"chunk_tokens": chunk_tokens}, repeat_prompt=PROMPT)
        for i in cache.evicting_layers:
            obs = cache.layers[i].observation
            mx, sums, rows = expected[i]
            assert (obs.forced[:, :forced]).all() and not obs.forced[:, forced:].any()
            got = obs.log_scores[:, forced:].double().exp()
            if score == "kvzip":
                want = mx[:, forced:].clamp_min(FLOOR / (30 - forced))
            else:
                mean = sums[:, forced:] / rows
                want = (mean / mean.sum(-1, keepdim=True)).view(mx.shape[0], -1, 30 - forced)
                want = want.mean(1)
            torch.testing.assert_close(got, want, rtol=2e-4, atol=1e-7)


@pytest.mark.parametrize(
    "method",
    [
        "kvzip",
        "ada_kvzip",
        "prob:kvzip",
        "prob:min-rec/scope=global",
        "prob:kvzip/calibrate=0.01",
    ],
)
def test_observe_then_evict_equals_compress(tiny, method):
    """One pass for many policies (the evaluation's shared prefill): an observed copy evicts
    exactly as compress does."""
    model = tiny
    ids = context_ids(model, 40)
    policy = parse_method(method, ratio=0.5)
    direct = compress(model, ids, policy, repeat_prompt=PROMPT)
    observed = observe(model, ids, policy.score, policy.score_params, repeat_prompt=PROMPT)
    shared = copy.deepcopy(observed)
    shared.evict(policy)
    for i in direct.evicting_layers:
        a, b = direct.layers[i].prefix, shared.layers[i].prefix
        assert a.lengths == b.lengths
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert (a.log_weights is None) == (b.log_weights is None)
        if a.log_weights is not None:
            assert torch.equal(a.log_weights, b.log_weights)
    question = context_ids(model, 4, seed=3)
    assert torch.equal(
        answer(model, direct, question, max_new_tokens=4),
        answer(model, shared, question, max_new_tokens=4),
    )


def test_reference_queries_are_every_kth_row_of_the_pass(tiny):
    """S9: the observation's reference queries are the reconstruction queries at global rows
    0, k, 2k, ... of the pass (k = reference_stride of its rows). Oracle: each chunk's queries
    from a dense forward over context + chunk (the same positions and causal context)."""
    model = tiny
    ids = context_ids(model, 150)  # more rows than DEFAULT_REFERENCE_ROWS
    chunks = reconstruction_chunks(
        ids[0].tolist(),
        first=PROMPT.first,
        later=PROMPT.later,
        suffix=PROMPT.suffix,
        context_start=PROMPT.context_start(ids[0].tolist()),
        chunk_tokens=40,
    )
    rows = {}
    for chunk in chunks:
        full = torch.cat([ids, torch.tensor([chunk.input_ids])], dim=1)
        captures = capture_attention(model, full)
        for i, c in enumerate(captures):
            rows.setdefault(i, []).append(c.query[:, ids.shape[1] :])
    every = reference_stride(sum(len(c.input_ids) for c in chunks))
    assert every > 1  # several rows skipped: the stride is really exercised
    cache = observe(model, ids, "kvzip", {"chunk_tokens": 40}, repeat_prompt=PROMPT)
    for i in cache.evicting_layers:
        obs = cache.layers[i].observation
        want = torch.cat(rows[i], dim=1)[:, ::every]
        assert obs.scale == captures[i].scale
        torch.testing.assert_close(obs.reference_queries, want.float(), rtol=1e-5, atol=1e-5)


def test_calibrated_eviction_keeps_the_designs_entries_with_fitted_weights(tiny):
    """S9: calibrate changes the weights only; they are calibrated_selection of the design's
    selection on the layer's entries before eviction."""
    model = tiny
    ids = context_ids(model, 40)
    observed = observe(model, ids, "kvzip", {"chunk_tokens": 12}, repeat_prompt=PROMPT)
    plain, fitted = observed.copy(), observed.copy()
    # the policies observe what the cache observed (chunk_tokens=12): else evict refuses
    policy = parse_method("prob:kvzip/chunk_tokens=12/calibrate=0.05", ratio=0.5)
    layers = [observed.layers[i] for i in observed.evicting_layers]
    design = parse_method("prob:kvzip/chunk_tokens=12", ratio=0.5).select(
        [layer.observation for layer in layers], num_layers=len(layers)
    )
    plain.evict(parse_method("prob:kvzip/chunk_tokens=12", ratio=0.5))
    fitted.evict(policy)
    for layer, sel, i in zip(layers, design, observed.evicting_layers):
        a, b = plain.layers[i].prefix, fitted.layers[i].prefix
        assert a.lengths == b.lengths and torch.equal(a.keys, b.keys)
        want = calibrated_selection(
            sel,
            layer.tail_keys[0],
            layer.tail_values[0],
            layer.observation.reference_queries,
            scale=layer.observation.scale,
            strength=0.05,
        )
        torch.testing.assert_close(b.log_weights, want.log_weights, rtol=0, atol=0)
        assert not torch.equal(a.log_weights, b.log_weights)


def test_kvzip_evicts_with_one_global_budget(tiny):
    model = tiny
    ids = context_ids(model, 48)
    cache = compress(model, ids, parse_method("kvzip", ratio=0.5), repeat_prompt=PROMPT)
    kept = [n for r in cache.reports() for n in r.kept_per_head]
    assert sum(kept) == 24 * len(kept)  # the pooled budget is exact
    assert abs(cache.effective_ratio() - 0.5) < 1e-9


def test_a_raw_generate_is_refused_naming_compress_and_observe(tiny):
    model = tiny
    ids = context_ids(model, 20)
    cache = ProbKVCache(model.config, parse_method("kvzip", ratio=0.5))
    with pytest.raises(ValueError, match=r"probkv\.hf\.compress.*probkv\.hf\.observe"):
        model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    with pytest.raises(ValueError, match="reconstruction pass"):
        cache.evict()


def test_without_a_repeat_prompt_the_context_is_fed_alone_with_a_warning(tiny):
    model = tiny
    ids = context_ids(model, 20)
    with pytest.warns(UserWarning, match=r"repeat_prompt=probkv\.hf\.repeat_prompt\(tokenizer\)"):
        cache = compress(model, ids, parse_method("prob:h2o-rec/block=1/order=position", ratio=0.5))
    assert cache.effective_ratio() > 0.4
    with pytest.raises(ValueError, match="needs a cache whose prefill observed"):
        reconstruct(model, cache, ids, PROMPT)


def test_repeat_prompt_from_a_chat_template():
    tokenizer = tiny_tokenizer()
    prompt = repeat_prompt(tokenizer)
    encode = lambda s: tuple(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    assert prompt.first == encode(REPEAT_FIRST) and prompt.later == encode(REPEAT_LATER)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello there"}], tokenize=False, add_generation_prompt=True
    )
    opening, closing = rendered.split("hello there")
    assert prompt.template_prefix == encode(opening) and prompt.suffix == encode(closing)
    ids = list(encode(rendered))
    assert prompt.context_start(ids) == len(prompt.template_prefix)
    assert prompt.context_start(prompt.template_prefix) == len(prompt.template_prefix) - 1
    assert RepeatPrompt().context_start([4, 5]) == 0
    with pytest.raises(ValueError, match="first must be a sequence of token ids"):
        RepeatPrompt(first="Repeat")


def test_no_chat_template_closes_with_a_newline():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    prompt = repeat_prompt(tokenizer)
    assert prompt.suffix == tuple(tokenizer.encode("\n", add_special_tokens=False))
    assert prompt.template_prefix == ()


# ---------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_smollm2_kvzip_keeps_the_needle_before_the_question(smollm2):
    """Question-agnostic (the question is fed after eviction) at r = 0.5: KVzip keeps what a
    later question needs, on a short RULER-style needle prompt the full cache answers."""
    from probkv.eval.prompt import prompt_token_ids
    from probkv.eval.tasks import generate_examples

    model, tokenizer = smollm2
    prepare_model(model)
    try:
        prompt = repeat_prompt(tokenizer)
        for example in generate_examples(
            "niah_single_1", tokenizer=tokenizer, length=500, num_examples=2, seed=0
        ):
            context, question = prompt_token_ids(example, tokenizer)
            context_t, question_t = torch.tensor([context]), torch.tensor([question])
            policy = parse_method("kvzip", ratio=0.5)
            cache = compress(model, context_t, policy, repeat_prompt=prompt)
            assert abs(cache.effective_ratio() - 0.5) < 0.01
            full = compress(model, context_t, parse_method("full"))
            for c in (full, cache):
                new = answer(model, c, question_t, max_new_tokens=12)
                text = tokenizer.decode(new, skip_special_tokens=True)
                assert example.answers[0] in text, (example.id, text)
    finally:
        model.set_attn_implementation("sdpa")


def kvzip_plus_oracle(model, ids, prompt, chunk_tokens, layers):
    """Oracle of KVzip+ (S11, kvpress's ``kvzip_plus_normalization``): eager attention over
    context + each chunk, each row's probabilities divided by the norm of its attention input
    (the layer's normalised hidden state) and multiplied by ``||W_o^q v_i||``; the max over
    rows and GQA group of the first t columns, per evicting layer."""
    t = ids.shape[1]
    chunks = repeat_chunks(ids, prompt, chunk_tokens)
    c = model.config
    hkv, hq = c.num_key_value_heads, c.num_attention_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // hq
    stats = {i: torch.zeros(hkv, t, dtype=torch.float64) for i in layers}
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            for chunk in chunks:
                full = torch.cat([ids, torch.tensor([chunk.input_ids])], dim=1)
                out = model(input_ids=full, output_attentions=True, output_hidden_states=True)
                for i in layers:
                    block = model.model.layers[i]
                    h = block.input_layernorm(out.hidden_states[i][0]).double()
                    v = block.self_attn.v_proj(h[:t].float())
                    v = v.double().view(t, hkv, d).transpose(0, 1)
                    wo = block.self_attn.o_proj.weight.double()
                    cols = torch.stack(
                        [
                            (v[q // (hq // hkv)] @ wo[:, q * d : (q + 1) * d].T).norm(dim=-1)
                            for q in range(hq)
                        ]
                    )  # [Hq, t]
                    rows = out.attentions[i][0, :, t:, :t].double()  # [Hq, n, t]
                    w = rows / h[t:].norm(dim=-1).view(1, -1, 1) * cols.unsqueeze(1)
                    stats[i] = torch.maximum(stats[i], w.amax(1).view(hkv, -1, t).amax(1))
    finally:
        prepare_model(model)
    return stats


def test_kvzip_plus_equals_its_dense_oracle(tiny):
    """S11: the reconstruction pass weighted by ||W_o^q v_i|| / ||h_u|| (a pre-hook reads the
    rows' attention input, the output projection the entries' contribution) gives the oracle's
    scores; the forced prefix is KVzip's."""
    model = tiny
    ids = context_ids(model, 30)
    cache = observe(model, ids, "kvzip-plus", {"chunk_tokens": 12}, repeat_prompt=PROMPT)
    expected = kvzip_plus_oracle(model, ids, PROMPT, 12, cache.evicting_layers)
    forced = 4
    for i in cache.evicting_layers:
        obs = cache.layers[i].observation
        assert (obs.forced[:, :forced]).all() and not obs.forced[:, forced:].any()
        got = obs.log_scores[:, forced:].double().exp()
        want = expected[i][:, forced:].clamp_min(FLOOR / (30 - forced))
        torch.testing.assert_close(got, want, rtol=2e-4, atol=1e-7)


# -- batches (S11 batches; each sequence as alone: tests/hf/test_batch.py) ---------------
def test_a_batch_pass_leaves_the_cache_bit_identical(tiny):
    ids, mask = pad_left([context_ids(tiny, n, seed=n)[0] for n in (37, 19)])
    cache = prefilled_batch(tiny, ids, mask, chunk_tokens=10)
    before = snapshot(cache)
    reconstruct(tiny, cache, ids, PROMPT)
    assert_same(before, snapshot(cache))
    assert not cache.awaiting_reconstruction
    with pytest.raises(ValueError, match=r"shape \(1, 37\).*2 sequence\(s\) of 37"):
        reconstruct(tiny, prefilled_batch(tiny, ids, mask), ids[:1], PROMPT)


def prefilled_batch(model, ids, mask, **params) -> ProbKVCache:
    """A left-padded batch prefilled for kvzip's pass (positions from each sequence's start)."""
    cache = ProbKVCache(model.config, ObserveOnly(score="kvzip", ratio=0.0, score_params=params))
    with torch.no_grad():
        model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
            cache=cache,
            use_cache=True,
        )
    return cache
