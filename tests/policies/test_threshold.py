"""KVzap's threshold mode (S11, ``probkv.policies.threshold``): the ratio a threshold gives a
prompt, and every policy that takes one running at that ratio: a ``prob:`` design at every
scope (the same draw, seed for seed, as the design at that ratio), the model-wide top-k, the
ratio as the least compression, refusals by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from probkv.policies import LayerObservation, ProbabilisticPolicy, method_name, parse_method
from probkv.policies.threshold import check_threshold, threshold_count, threshold_ratio


def observations(num_layers=3, hkv=2, t=64, seed=0, shift=0.0, forced_prefix=4):
    """Log-scores on the attention scale (log-softmax per head), a forced prefix."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num_layers):
        logits = 3.0 * torch.randn(hkv, t, generator=gen)
        log_scores = torch.log_softmax(logits, -1) + shift
        forced = torch.zeros(hkv, t, dtype=torch.bool)
        forced[:, :forced_prefix] = True
        out.append(LayerObservation(i, i, log_scores, forced, log_scores.exp()))
    return out


def kept_and_weights(selections):
    out = []
    for sel in selections:
        for h in range(sel.num_heads):
            positions, logw = sel.head(h)
            weights = None if logw is None else logw.tolist()
            out.append((positions.tolist(), weights))
    return out


def test_threshold_ratio_counts_every_head_of_every_layer_and_the_forced_entries():
    obs = observations()
    x = -4.5
    above = sum(int(((o.log_scores > x) | o.forced).sum()) for o in obs)
    entries = sum(o.log_scores.numel() for o in obs)
    assert threshold_count(obs, x) == (above, entries)
    assert threshold_ratio(obs, x) == pytest.approx(1 - above / entries)
    # above every score: only the forced entries stay; below every score: nothing is evicted
    assert threshold_ratio(obs, 1.0) == pytest.approx(1 - 4 / 64)
    assert threshold_ratio(obs, -1e9) == 0.0
    # at most 1 - 1/t: every head keeps one entry
    unforced = observations(forced_prefix=0)
    assert threshold_ratio(unforced, 1.0) == pytest.approx(1 - 1 / 64)


@pytest.mark.parametrize(
    "method",
    [
        "prob:kvzap",  # scope global, pps with spans (kvzap's defaults)
        "prob:kvzap/scope=head",
        "prob:snapkv/scope=global",
        "prob:kvzap/scope=model/block=8",
        "prob:h2o/sampler=with_replacement",
    ],
)
@pytest.mark.parametrize("seed", [0, 3])
def test_a_prob_threshold_draws_what_the_design_draws_at_the_thresholds_ratio(method, seed):
    """``prob:<score>/threshold=x`` at ratio 0 keeps and weighs exactly what the same design
    keeps at ``r(x)``, seed for seed: the threshold only sets the sample's size (S11), the
    Horvitz-Thompson weights are the design's (S4)."""
    obs = observations(seed=seed)
    x = -4.5
    r = threshold_ratio(obs, x)
    assert 0.3 < r < 0.9  # a threshold that evicts some, not all
    with_threshold = parse_method(f"{method}/seed={seed}/threshold={x}", 0.0)
    at_r = parse_method(f"{method}/seed={seed}", r)
    assert not with_threshold.layerwise
    got = kept_and_weights(with_threshold.select(obs, num_layers=3))
    want = kept_and_weights(at_r.select(obs, num_layers=3))
    assert got == want
    kept = sum(len(p) for p, _ in got)
    assert kept < sum(o.log_scores.numel() for o in obs)  # it evicted
    assert parse_method(method_name(with_threshold), 0.0) == with_threshold


def test_the_ratio_is_the_least_compression_and_the_threshold_adapts_per_prompt():
    """Two prompts, one threshold: the one with lower scores is compressed more; a given ratio
    above the threshold's is the one that runs."""
    x = -4.5
    easy, hard = observations(seed=1), observations(seed=1, shift=-1.0)
    assert threshold_ratio(hard, x) > threshold_ratio(easy, x)
    policy = parse_method(f"prob:kvzap/threshold={x}", 0.0)
    kept = [
        sum(len(p) for p, _ in kept_and_weights(policy.select(o, num_layers=3)))
        for o in (easy, hard)
    ]
    assert kept[1] < kept[0]
    capped = dataclasses.replace(policy, ratio=0.95)
    plain = parse_method("prob:kvzap", 0.95)
    assert kept_and_weights(capped.select(easy, num_layers=3)) == kept_and_weights(
        plain.select(easy, num_layers=3)
    )


def test_a_model_wide_top_k_threshold_keeps_the_top_blocks_at_the_thresholds_ratio():
    """``topk:<score>/scope=model/threshold=x``: what a paged engine (vLLM) can run: the top
    blocks at ``r(x)``."""
    obs = observations()
    x = -4.5
    policy = parse_method(f"topk:kvzap/scope=model/block=8/threshold={x}", 0.0)
    at_r = parse_method("topk:kvzap/scope=model/block=8", threshold_ratio(obs, x))
    assert not policy.layerwise
    got = kept_and_weights(policy.select(obs, num_layers=3))
    assert got == kept_and_weights(at_r.select(obs, num_layers=3))
    assert all(p == got[0][0] for p, _ in got)  # one kept set for every layer and head


def test_a_prob_threshold_is_calibrated_like_the_design_at_its_ratio():
    policy = ProbabilisticPolicy(score="kvzip", ratio=0.0, threshold=-5.0, calibrate=1.0)
    assert policy.calibrates  # ratio 0, but the threshold evicts
    assert not ProbabilisticPolicy(score="kvzip", ratio=0.0, calibrate=1.0).calibrates


def test_threshold_refused_by_name_where_it_cannot_apply():
    for method, word in (
        ("topk:knorm/threshold=-1", "not logs of attention"),
        ("prob:knorm/threshold=-1", "not logs of attention"),
        ("topk:snapkv/threshold=nan", "finite log-score"),
        ("topk:snapkv/threshold=inf", "finite log-score"),
        ("prob:kvzap/threshold=inf", "finite log-score"),
        ("prob:kvzap/threshold=true", "finite log-score"),
    ):
        with pytest.raises(ValueError, match=word):
            parse_method(method)
    assert check_threshold(None, "knorm") is None
    assert check_threshold(-3, "kvzap") == -3.0
