"""The kvzap scorer in the integration (probkv.hf.scorer, S11) on tiny models: the model's
identity, the shipped-scorer lookup (refused by name without one), kvzap by name in
``compress``, and its refusal under a decode budget."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from probkv.hf import ProbKVCache, compress, prepare_model
from probkv.hf import scorer as hs
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
