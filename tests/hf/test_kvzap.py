"""kvzap in the transformers integration (S11) on tiny models: by name in ``compress`` with
the model's scorer (``probkv.scores.scorer_lookup``; refused by name without one), one
observation for every kvzap policy, and under a decode budget (each entry scored once, when it
enters). The lookup itself: tests/scores/test_scorer_lookup.py."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from probkv import scores
from probkv.hf import ProbKVCache, compress, decode_budget, observe, prepare_model
from probkv.hf.decode_budget import DecodeBudget
from probkv.hf.layers import EvictingLayer
from probkv.models.testing import tiny_model
from probkv.policies import parse_method
from probkv.policies.threshold import threshold_count
from probkv.scores import scorer_lookup as lookup
from probkv.scores import surrogate as sg
from probkv.scores.scorer_lookup import with_scorer


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
    return sg.SurrogateScorer("kv", layers, lookup.model_identity(c, "tiny-llama"), {})


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, 200, (1, n), generator=torch.Generator().manual_seed(3))


def test_kvzap_by_name_uses_the_shipped_scorer_or_is_refused_by_name(model, monkeypatch):
    other = parse_method("snapkv", 0.5)
    assert lookup.with_scorer(other, model.config) is other
    with pytest.raises(ValueError, match=r"no scorer for model .*models with a shipped scorer"):
        compress(model, _ids(40), parse_method("kvzap", 0.5))
    scorer = _scorer_for(model)
    monkeypatch.setattr(lookup, "shipped_scorers", lambda: (scorer,))
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
    monkeypatch.setattr(lookup, "shipped_scorers", lambda: (_scorer_for(model),))
    policy = parse_method("kvzap", 0.5)
    cache = observe(model, _ids(30), "kvzap", with_scorer(policy, model.config).score_params)
    for method in ("kvzap", "prob:kvzap", "topk:kvzap"):
        copy.deepcopy(cache).evict(parse_method(method, 0.5))
    other = dataclasses.replace(_scorer_for(model), recipe={"teacher": "another"})
    monkeypatch.setattr(lookup, "shipped_scorers", lambda: (other,))
    with pytest.raises(ValueError, match="observed"):
        copy.deepcopy(cache).evict(parse_method("kvzap", 0.5))


def _recording_updates(monkeypatch) -> dict[int, list[torch.Tensor]]:
    """Every key and value entering each evicting layer, as ``EvictingLayer.update`` gets them."""
    seen: dict[int, list] = {}
    original = EvictingLayer.update

    def update(self, key_states, value_states, *args, **kwargs):
        seen.setdefault(self.layer_idx, []).append((key_states[0], value_states[0]))
        return original(self, key_states, value_states, *args, **kwargs)

    monkeypatch.setattr(EvictingLayer, "update", update)
    return seen


@pytest.mark.parametrize("method", ["topk:kvzap", "prob:kvzap/scope=head/units=blocks"])
def test_kvzap_under_a_decode_budget_scores_each_entry_as_the_whole_sequence_would(
    model, monkeypatch, method
):
    """S10.5, S11: an entry's kvzap score reads every KV head's key and value at its position
    and nothing later (``ScoreSpec.fixed``), so a decode budget scores it once, when it enters
    (the prompt's at prefill, the tail's at the stage) and keeps it: at every stage, every
    head's entries carry exactly the scores (and the 4 sinks' forced flags) that the whole
    sequence's keys and values give them, and the budget holds."""
    scorer = _scorer_for(model)
    monkeypatch.setattr(lookup, "shipped_scorers", lambda: (scorer,))
    seen = _recording_updates(monkeypatch)
    original = decode_budget.next_stage
    checked = []

    def next_stage(layer, scale):
        held = [decode_budget._head_entries(layer, h)[0] for h in range(layer.num_heads)]
        stage = original(layer, scale)
        keys = torch.cat([k for k, _ in seen[layer.layer_idx]], 1)
        values = torch.cat([v for _, v in seen[layer.layer_idx]], 1)
        whole = sg.kvzap(keys, values, layer_idx=layer.layer_idx, surrogate=scorer, sinks=4)
        for i, (_, obs) in enumerate(stage.groups):
            heads = range(layer.num_heads) if len(stage.groups) == 1 else [i]
            for j, h in enumerate(heads):
                match = (held[h].unsqueeze(1) == keys[h].unsqueeze(0)).all(-1)
                assert (match.sum(1) == 1).all()
                positions = match.float().argmax(1)
                torch.testing.assert_close(
                    obs.log_scores[j], whole.log_scores[h, positions], atol=1e-5, rtol=1e-5
                )
                forced = torch.zeros_like(positions, dtype=torch.bool)
                if obs.forced is not None:
                    forced = obs.forced[j]
                assert torch.equal(forced, positions < 4)
        checked.append(layer.layer_idx)
        return stage

    monkeypatch.setattr(decode_budget, "next_stage", next_stage)
    cache = ProbKVCache(
        model.config, parse_method(method), prompt_length=24, max_entries=12, every=4
    )
    ids = _ids(60)
    with torch.no_grad():
        model(input_ids=ids[:, :24], cache=cache, use_cache=True)
        for i in range(24, 60):
            model(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True)
            for idx in cache.evicting_layers:
                assert cache.layers[idx].physical_length() < 12 + 4
    assert len(checked) >= 2 * len(cache.evicting_layers)
    assert cache.policy.score_params["surrogate"] is scorer


def test_a_cross_head_score_not_fixed_per_entry_is_refused_under_a_decode_budget(
    model, monkeypatch
):
    """A score that reads every KV head at a position and later rows too could not be held
    after a stage (each head holds its own entries): refused by name."""
    row = dataclasses.replace(scores.SCORE_TABLE["knorm"], cross_head=True)
    monkeypatch.setitem(scores.SCORE_TABLE, "crossnorm", row)
    with pytest.raises(ValueError, match="'crossnorm' under a decode budget"):
        DecodeBudget(12).check_policy(parse_method("topk:knorm", 0.5).__class__(score="crossnorm"))
    monkeypatch.setattr(lookup, "shipped_scorers", lambda: (_scorer_for(model),))
    DecodeBudget(12).check_policy(parse_method("topk:kvzap"))  # fixed per entry: accepted


def test_kvzap_threshold_mode_reports_each_prompts_effective_ratio(model, monkeypatch):
    """S11 threshold mode through the cache: ``kvzap/threshold=x`` keeps the entries scoring
    above x (and the sinks), so the compression differs per prompt, and the cache reports it."""
    monkeypatch.setattr(lookup, "shipped_scorers", lambda: (_scorer_for(model),))
    policy = with_scorer(parse_method("kvzap/threshold=-4", 0.0), model.config)
    ratios = []
    for n in (30, 50):
        cache = observe(model, _ids(n), "kvzap", policy.score_params)
        observations = [cache.layers[i].observation for i in cache.evicting_layers]
        kept, entries = threshold_count(observations, -4.0)
        cache.evict(policy)
        assert cache.effective_ratio() == pytest.approx(1 - kept / entries)
        ratios.append(cache.effective_ratio())
    assert 0 < ratios[0] < 1 and ratios[0] != ratios[1]
