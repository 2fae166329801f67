"""Which kvzap scorer fits a model (probkv.scores.scorer_lookup, S11), from its config alone:
the identity fields and digest, the shipped-scorer lookup (refused by name without one), and a
kvzap policy completed with it (other scores left alone). The integrations' use of it:
tests/hf/test_kvzap.py and tests/vllm."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from probkv.policies import parse_method
from probkv.scores import scorer_lookup as lookup
from probkv.scores import surrogate as sg


def _config(**overrides) -> LlamaConfig:
    fields = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
    )
    return LlamaConfig(**{**fields, **overrides})


def _scorer_for(config) -> sg.SurrogateScorer:
    shapes = lookup.model_shapes(config)
    hkv, d = shapes["num_key_value_heads"], shapes["head_dim"]
    f = hkv * (d + d // 2)
    fit = sg.LinearSurrogate(torch.zeros(f), torch.ones(f), torch.zeros(f, hkv), torch.zeros(hkv))
    layers = dict.fromkeys(range(shapes["num_hidden_layers"]), fit)
    return sg.SurrogateScorer("kv", layers, lookup.model_identity(config, "tiny"), {})


def test_identity_names_the_shapes_and_tells_models_apart():
    config = _config()
    shapes = lookup.model_shapes(config)
    assert set(shapes) == set(lookup.IDENTITY_FIELDS)
    assert shapes["head_dim"] == 16 and shapes["num_hidden_layers"] == 2
    other = _config(num_hidden_layers=3)
    assert (
        lookup.model_identity(other, "x")["digest"] != lookup.model_identity(config, "x")["digest"]
    )


def test_any_object_with_the_fields_has_the_same_identity():
    """vLLM hands the plugin its own copy of the config: only the attributes count."""
    config = _config()
    plain = SimpleNamespace(**lookup.model_shapes(config))
    assert lookup.model_shapes(plain) == lookup.model_shapes(config)


def test_lookup_finds_the_scorer_by_digest_or_refuses_by_name(monkeypatch):
    config = _config(name_or_path="my/tiny-model")
    with pytest.raises(ValueError, match=r"no scorer for model 'my/tiny-model'.*shipped scorer"):
        lookup.scorer_for_config(config)
    assert not lookup.has_scorer(config)
    scorer = _scorer_for(config)
    monkeypatch.setattr(
        lookup, "shipped_scorers", lambda: (_scorer_for(_config(vocab_size=9)), scorer)
    )
    assert lookup.has_scorer(config)
    assert lookup.scorer_for_config(config) is scorer


def test_with_scorer_completes_kvzap_policies_and_checks_a_given_scorer(monkeypatch):
    config = _config()
    scorer = _scorer_for(config)
    monkeypatch.setattr(lookup, "shipped_scorers", lambda: (scorer,))
    other = parse_method("snapkv", 0.5)
    assert lookup.with_scorer(other, config) is other
    for method in ("kvzap", "prob:kvzap", "topk:kvzap/scope=model/block=8"):
        policy = lookup.with_scorer(parse_method(method, 0.5), config)
        assert policy.score_params["surrogate"] is scorer
    foreign = _scorer_for(_config(num_hidden_layers=1))
    policy = parse_method("kvzap", 0.5)
    policy = dataclasses.replace(policy, score_params={**policy.score_params, "surrogate": foreign})
    with pytest.raises(ValueError, match="'tiny' was trained for another model"):
        lookup.with_scorer(policy, config)


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
        scorer = lookup.scorer_for_config(config)
        assert scorer.name == name and scorer.recipe["teacher"] == "kvzip"
        text = config.get_text_config(decoder=True)
        types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        assert sorted(scorer.layers) == [i for i, t in enumerate(types) if t == "full_attention"]
        assert scorer.metrics["kept_overlap"]["0.5"] > 0.7  # measured held out at training
    with pytest.raises(ValueError, match=r"no scorer for model .*smollm2-135m"):
        lookup.scorer_for_config(tiny_model("llama").config)
