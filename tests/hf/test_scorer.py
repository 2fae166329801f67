"""The kvzap scorer in the integration (probkv.hf.scorer, S11) on tiny models: the model's
identity, the shipped-scorer lookup (refused by name without one), kvzap by name in
``compress``, and its refusal under a decode budget."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from probkv.hf import ProbKVCache, compress, observe, prepare_model
from probkv.hf import scorer as hs
from probkv.hf.scorer import with_scorer
from probkv.models.testing import tiny_model
from probkv.policies import parse_method
from probkv.scores import surrogate as sg


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


def test_one_kvzap_observation_serves_every_kvzap_policy(model, monkeypatch):
    """probkv eval observes once and evicts a copy per policy: a copied cache holds a copy of
    the scorer (a dataclass of tensors), which must count as the same parameter."""
    monkeypatch.setattr(hs, "shipped_scorers", lambda: (_scorer_for(model),))
    policy = parse_method("kvzap", 0.5)
    cache = observe(model, _ids(30), "kvzap", with_scorer(policy, model.config).score_params)
    for method in ("kvzap", "prob:kvzap", "topk:kvzap"):
        copy.deepcopy(cache).evict(parse_method(method, 0.5))
    other = dataclasses.replace(_scorer_for(model), recipe={"teacher": "another"})
    monkeypatch.setattr(hs, "shipped_scorers", lambda: (other,))
    with pytest.raises(ValueError, match="observed"):
        copy.deepcopy(cache).evict(parse_method("kvzap", 0.5))


def test_kvzap_is_refused_by_name_under_a_decode_budget(model, monkeypatch):
    """S10.5, S11: after a stage the heads hold different positions, and the scorer reads every
    head's features at one position, so a decode budget refuses kvzap in every form."""
    monkeypatch.setattr(hs, "shipped_scorers", lambda: (_scorer_for(model),))
    for method in ("kvzap", "prob:kvzap", "topk:kvzap", "prob:kvzap/scope=head/units=blocks"):
        with pytest.raises(ValueError, match="'kvzap' under a decode budget"):
            ProbKVCache(model.config, parse_method(method), max_entries=12)
    cache = ProbKVCache(model.config, parse_method("tova"), prompt_length=20, max_entries=12)
    with pytest.raises(ValueError, match="'kvzap' under a decode budget"):
        cache.evict(parse_method("topk:kvzap"))


@pytest.mark.slow
def test_shipped_scorers_match_their_models_and_refuse_others():
    """The package ships the SmolLM2 and Gemma-3 scorers (pyproject package-data); each is
    found for its own model's config, fits that model's evicting layers, and a model of other
    shapes is refused by name."""
    from transformers import AutoConfig

    from probkv.models import resolve_model
    from probkv.models.testing import tiny_model

    assert {"smollm2-135m", "gemma3-270m"} <= set(sg.scorer_names())
    for name in ("smollm2-135m", "gemma3-270m"):
        config = AutoConfig.from_pretrained(resolve_model(name).path)
        scorer = hs.scorer_for_config(config)
        assert scorer.name == name and scorer.recipe["teacher"] == "kvzip"
        text = config.get_text_config(decoder=True)
        types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        assert sorted(scorer.layers) == [i for i, t in enumerate(types) if t == "full_attention"]
        assert scorer.metrics["kept_overlap"]["0.5"] > 0.7  # measured held out at training
    with pytest.raises(ValueError, match=r"no scorer for model .*smollm2-135m"):
        hs.scorer_for_config(tiny_model("llama").config)
