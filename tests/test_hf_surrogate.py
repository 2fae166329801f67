"""The kvzap scorer in the integration (probkv.hf.surrogate, S11) on tiny models: the model's
identity, the shipped-scorer lookup (refused by name without one), kvzap by name in
``compress``, and kvzap under a decode budget (it scores the generated tokens too)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from probkv import surrogate as sg
from probkv.hf import ProbKVCache, compress, prepare_model
from probkv.hf import surrogate as hs
from probkv.policies import parse_method
from probkv.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return prepare_model(tiny_model("llama", seed=0))


def _scorer_for(model) -> sg.SurrogateScorer:
    c = model.config
    hkv, d = c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    d = getattr(c, "head_dim", None) or d
    f = hkv * (d + d // 2)
    gen = torch.Generator().manual_seed(0)
    fit = sg.LinearSurrogate(
        torch.zeros(f),
        torch.ones(f),
        0.3 * torch.randn(f, hkv, generator=gen),
        torch.full((hkv,), -4.0),
    )
    layers = dict.fromkeys(range(c.num_hidden_layers), fit)
    return sg.SurrogateScorer("kv", layers, hs.model_identity(c, "tiny-llama"), {})


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, 200, (1, n), generator=torch.Generator().manual_seed(3))


def test_identity_names_the_shapes_and_tells_models_apart(model):
    shapes = hs.model_shapes(model.config)
    assert set(shapes) == set(hs.IDENTITY_FIELDS)
    assert shapes["num_hidden_layers"] == model.config.num_hidden_layers
    other = tiny_model("llama", num_hidden_layers=model.config.num_hidden_layers + 1)
    assert (
        hs.model_identity(other.config, "x")["digest"]
        != hs.model_identity(model.config, "x")["digest"]
    )


def test_kvzap_by_name_uses_the_shipped_scorer_or_is_refused_by_name(model, monkeypatch):
    other = parse_method("snapkv", 0.5)
    assert hs.with_scorer(other, model.config) is other
    with pytest.raises(ValueError, match=r"no scorer for model .*models with a shipped scorer"):
        compress(model, _ids(40), parse_method("kvzap", 0.5))
    scorer = _scorer_for(model)
    monkeypatch.setattr(hs, "shipped_scorers", lambda: (scorer,))
    for method in ("kvzap", "prob:kvzap", "topk:kvzap"):
        cache = compress(model, _ids(40), parse_method(method, 0.5))
        assert cache.policy.score_params["surrogate"] is scorer
        assert 0.4 < cache.effective_ratio() < 0.6


def test_an_explicit_scorer_of_another_model_is_refused_by_name(model):
    scorer = _scorer_for(tiny_model("llama", num_hidden_layers=1))
    policy = parse_method("topk:kvzap", 0.5)
    policy = dataclasses.replace(policy, score_params={**policy.score_params, "surrogate": scorer})
    with pytest.raises(ValueError, match="'tiny-llama' was trained for another model"):
        compress(model, _ids(30), policy)


def test_kvzap_scores_generated_tokens_under_a_decode_budget(model, monkeypatch):
    """S10.5: the per-head top-k and pps forms of kvzap hold B + K entries per head while
    decoding; every stage scores the held entries, generated ones included, from their keys
    and values. The global forms are refused by name, as for every score."""
    monkeypatch.setattr(hs, "shipped_scorers", lambda: (_scorer_for(model),))
    budget, every, prompt = 12, 4, 30
    for method in ("topk:kvzap", "prob:kvzap/scope=head/units=blocks/block=4"):
        cache = ProbKVCache(
            model.config,
            parse_method(method),
            prompt_length=prompt,
            max_entries=budget,
            every=every,
        )
        ids = _ids(prompt + 30)
        with torch.no_grad():
            model(input_ids=ids[:, :prompt], cache=cache, use_cache=True)
            for i in range(prompt, ids.shape[1]):
                model(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True)
        for i in cache.evicting_layers:
            state = cache.layers[i].decode_state
            assert state.stages >= 2 and state.peak_entries <= budget + every
    for method in ("kvzap", "prob:kvzap"):
        with pytest.raises(ValueError, match="cannot be held at decode"):
            ProbKVCache(model.config, parse_method(method), max_entries=budget)


@pytest.mark.slow
def test_shipped_smollm2_scorer_matches_its_model_and_refuses_gemma():
    """The package ships the SmolLM2 scorer (pyproject package-data); it is found for
    SmolLM2's config and refused by name for Gemma-3, which has none."""
    from transformers import AutoConfig

    from probkv.models import resolve_model

    assert "smollm2-135m" in sg.scorer_names()
    smol = AutoConfig.from_pretrained(resolve_model("smollm2-135m").path)
    scorer = hs.scorer_for_config(smol)
    assert scorer.name == "smollm2-135m" and scorer.recipe["teacher"] == "kvzip"
    assert sorted(scorer.layers) == list(range(smol.num_hidden_layers))
    assert scorer.metrics["kept_overlap"]["0.5"] > 0.7  # measured held out at training
    gemma = AutoConfig.from_pretrained(resolve_model("gemma3-270m").path)
    with pytest.raises(ValueError, match=r"no scorer for model .*smollm2-135m"):
        hs.scorer_for_config(gemma)
