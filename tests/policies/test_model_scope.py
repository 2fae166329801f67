"""``scope=model`` (S11): one kept set of whole blocks for every layer and KV head, for the
top-k methods and the ``prob:`` methods; against slow references written with loops, and the
pps version's per-head weighted totals against the truth by Monte Carlo (CLT tolerance)."""

from __future__ import annotations

import math

import pytest
import torch

from probkv.budgets import uniform_budget
from probkv.policies import LayerObservation, ProbabilisticPolicy, TopKPolicy, parse_method
from probkv.policies.base import select_layers
from probkv.policies.registry import method_name
from probkv.scores.functions import streaming_llm

torch.set_num_threads(1)

LAYERS, HEADS, T, WINDOW = 3, 2, 100, 8


def observations(seed: int = 0, t: int = T, window: int = WINDOW) -> list[LayerObservation]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(LAYERS):
        log_scores = 3 * torch.randn(HEADS, t, generator=gen)
        forced = torch.zeros(HEADS, t, dtype=torch.bool)
        if window:
            forced[:, t - window :] = True
        out.append(
            LayerObservation(
                layer_idx=layer,
                rank=layer,
                log_scores=log_scores,
                forced=forced,
                last_query_attention=torch.softmax(log_scores, -1),
            )
        )
    return out


def kept_masks(selections, t: int = T) -> list[torch.Tensor]:
    """bool ``[H, t]`` per layer."""
    out = []
    for sel in selections:
        mask = torch.zeros(HEADS, t, dtype=torch.bool)
        first = 0
        for h, n in enumerate(sel.lengths.tolist()):
            mask[h, sel.indices[first : first + n]] = True
            first += n
        out.append(mask)
    return out


def slow_block_scores(obs_list, block, aggregate, t=T):
    """Loops: each head's softmax over its non-forced entries, summed per block, then the sum
    or max over (layer, head); the forced blocks."""
    k = math.ceil(t / block)
    per_head, forced = [], [False] * k
    for obs in obs_list:
        for h in range(HEADS):
            free = [i for i in range(t) if not bool(obs.forced[h, i])]
            top = max(float(obs.log_scores[h, i]) for i in free)
            z = sum(math.exp(float(obs.log_scores[h, i]) - top) for i in free)
            masses = [0.0] * k
            for i in range(t):
                if bool(obs.forced[h, i]):
                    forced[i // block] = True
                else:
                    masses[i // block] += math.exp(float(obs.log_scores[h, i]) - top) / z
            per_head.append(masses)
    agg = sum if aggregate == "sum" else max
    return [agg(m[b] for m in per_head) for b in range(k)], forced


def slow_protected(t, block, k, sink_blocks, recent_tokens):
    """Loops: the first blocks, then blocks holding one of the last ``recent_tokens``
    positions from the end, ``k`` at most."""
    n = math.ceil(t / block)
    chosen = list(range(min(sink_blocks, k, n)))
    for b in reversed(range(n)):
        holds_recent = any(
            i >= t - recent_tokens for i in range(b * block, min(t, (b + 1) * block))
        )
        if holds_recent and b not in chosen and len(chosen) < k:
            chosen.append(b)
    return chosen


@pytest.mark.parametrize("aggregate", ["sum", "max"])
@pytest.mark.parametrize("block", [1, 16, 32, 128])
@pytest.mark.parametrize("ratio", [0.5, 0.75, 0.9])
@pytest.mark.parametrize(("sink_blocks", "recent_tokens"), [(0, 0), (1, 0), (2, 20), (0, 37)])
def test_topk_model_scope_matches_slow_reference(
    aggregate, block, ratio, sink_blocks, recent_tokens
):
    obs = observations(seed=block)
    policy = TopKPolicy(
        score="snapkv",
        ratio=ratio,
        scope="model",
        block=block,
        aggregate=aggregate,
        sink_blocks=sink_blocks,
        recent_tokens=recent_tokens,
    )
    masks = kept_masks(select_layers(policy, obs, num_layers=LAYERS))
    scores, forced = slow_block_scores(obs, block, aggregate)
    k = min(len(scores), max(1, math.floor(uniform_budget(T, ratio) / block + 0.5)))
    chosen = [b for b in range(len(scores)) if forced[b]]
    chosen += [b for b in slow_protected(T, block, k, sink_blocks, recent_tokens) if not forced[b]]
    rest = sorted(
        (b for b in range(len(scores)) if b not in chosen), key=lambda b: (-scores[b], -b)
    )
    chosen += rest[: max(0, k - len(chosen))]
    want = torch.zeros(T, dtype=torch.bool)
    for b in chosen:
        want[b * block : (b + 1) * block] = True
    for mask in masks:
        assert torch.equal(mask, want.expand(HEADS, T))


POLICIES = [
    "snapkv/scope=model",
    "snapkv/scope=model/block=32/aggregate=max",
    "topk:kvzip/scope=model/block=128",
    "prob:snapkv/scope=model",
    "prob:snapkv/scope=model/block=32/aggregate=max",
    "prob:kvzip/scope=model/block=128",
    "prob:h2o/scope=model/block=16/order=position/core=0.25",
]


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize(("ratio", "t"), [(0.5, 100), (0.75, 100), (0.5, 257)])
def test_one_kept_set_of_whole_blocks_meeting_the_budget(name, ratio, t):
    policy = parse_method(name, ratio=ratio)
    assert not policy.layerwise  # every layer is observed first
    obs = observations(seed=1, t=t)
    selections = select_layers(policy, obs, num_layers=LAYERS)
    masks = kept_masks(selections, t)
    first = masks[0][0]
    for mask in masks:  # identical across every layer and head
        assert torch.equal(mask, first.expand(HEADS, t))
    b = policy.block
    blocks = [first[i : i + b] for i in range(0, t, b)]
    assert all(bool(x.all()) or not bool(x.any()) for x in blocks)  # whole blocks
    k = min(len(blocks), max(1, math.floor(uniform_budget(t, ratio) / b + 0.5)))
    window_blocks = set(range((t - WINDOW) // b, len(blocks))) | {len(blocks) - 1}
    forced_blocks = len(window_blocks | {0})  # the sinks' block, kept by default
    assert sum(bool(x.any()) for x in blocks) == max(k, min(forced_blocks, len(blocks)))
    # the kept positions are within half a block of the budget, or short by the last block
    kept = int(first.sum())
    short = b - (t - (len(blocks) - 1) * b)
    if k == math.floor(uniform_budget(t, ratio) / b + 0.5) and k >= forced_blocks:  # unclamped
        assert uniform_budget(t, ratio) - b / 2 - short <= kept <= uniform_budget(t, ratio) + b / 2
    for sel in selections:  # one weight per position, shared by every head
        if sel.log_weights is not None:
            w = sel.log_weights.reshape(HEADS, -1)
            assert torch.equal(w[0], w[1])


def test_prob_model_scope_per_head_totals_unbiased():
    """Each head's Horvitz-Thompson total sum_kept w_i x_i (w = exp(log w)) is unbiased for
    sum_i x_i (S9, S11), protected blocks (the sinks', the recent ones) taken with P = 1: the
    Monte Carlo mean over seeds within 4.5 standard errors."""
    obs = observations(seed=5)
    gen = torch.Generator().manual_seed(11)
    x = torch.rand(LAYERS, HEADS, T, generator=gen, dtype=torch.float64)
    truth = x.sum(-1)
    draws = 1500
    totals = torch.zeros(draws, LAYERS, HEADS, dtype=torch.float64)
    for s in range(draws):
        policy = ProbabilisticPolicy(
            score="snapkv", ratio=0.5, scope="model", block=8, recent_tokens=20, seed=s
        )
        for layer, sel in enumerate(select_layers(policy, obs, num_layers=LAYERS)):
            w = sel.log_weights.double().exp()
            first = 0
            for h, n in enumerate(sel.lengths.tolist()):
                idx = sel.indices[first : first + n]
                totals[s, layer, h] = (w[first : first + n] * x[layer, h, idx]).sum()
                first += n
    se = totals.std(0) / math.sqrt(draws)
    assert bool(((totals.mean(0) - truth).abs() <= 4.5 * se).all())
    assert bool((totals.std(0) > 0).all())  # it is random: the check has power


def test_ratio_zero_keeps_everything():
    for name in ("snapkv/scope=model", "prob:snapkv/scope=model"):
        for sel in select_layers(parse_method(name, ratio=0.0), observations(), num_layers=3):
            assert int(sel.lengths.sum()) == HEADS * T and sel.log_weights is None


def test_uncorrected_and_tempered_weights():
    obs = observations(seed=2)
    plain = select_layers(parse_method("prob:snapkv/scope=model/correct=false"), obs, num_layers=3)
    assert all(sel.log_weights is None for sel in plain)
    w1 = select_layers(parse_method("prob:snapkv/scope=model"), obs, num_layers=3)
    w2 = select_layers(parse_method("prob:snapkv/scope=model/tau=2"), obs, num_layers=3)
    torch.testing.assert_close(w2[0].log_weights, w1[0].log_weights / 2)


@pytest.mark.parametrize(
    "name",
    [
        "snapkv/scope=model",
        "snapkv/aggregate=max/block=128/scope=model",
        "topk:kvzip/block=32/scope=model",
        "prob:snapkv/scope=model",
        "prob:kvzip/scope=model",
        "prob:kvzip/block=32/scope=model",
        "prob:snapkv/aggregate=max/scope=model",
        "snapkv/recent_tokens=64/scope=model/sink_blocks=0",
        "prob:snapkv/recent_tokens=128/scope=model/sink_blocks=2",
    ],
)
def test_names_round_trip(name):
    policy = parse_method(name)
    assert method_name(policy) == name
    assert parse_method(method_name(policy)) == policy


@pytest.mark.parametrize("prefix", ["", "prob:"])
def test_streaming_llm_over_blocks_keeps_the_sinks_block(prefix):
    """StreamingLLM's sinks (4 positions) hold less proposal mass than a recent block: over
    blocks, at r = 0.9, only the rule keeps their block; without it (sink_blocks=0) it goes."""
    t, ratio = 2048, 0.9
    obs = [
        LayerObservation(
            layer_idx=layer,
            rank=layer,
            log_scores=streaming_llm(t, HEADS).log_scores,
            forced=None,
            last_query_attention=None,
        )
        for layer in range(LAYERS)
    ]
    kept = kept_masks(
        select_layers(
            parse_method(f"{prefix}streaming_llm/scope=model", ratio=ratio), obs, num_layers=LAYERS
        ),
        t,
    )
    assert all(bool(mask[:, :16].all()) for mask in kept)
    name = f"{prefix}streaming_llm/scope=model/sink_blocks=0"
    dropped = kept_masks(select_layers(parse_method(name, ratio=ratio), obs, num_layers=LAYERS), t)
    assert not any(bool(mask[:, :16].any()) for mask in dropped)


@pytest.mark.parametrize("name", ["snapkv/scope=model", "prob:snapkv/scope=model"])
def test_recent_tokens_keep_the_last_blocks_within_the_budget(name):
    obs = observations(seed=3, t=256, window=0)
    base = parse_method(name, ratio=0.75)
    policy = parse_method(f"{name}/recent_tokens=40", ratio=0.75)
    (mask, *_), (plain, *_) = (
        kept_masks(select_layers(p, obs, num_layers=LAYERS), 256) for p in (policy, base)
    )
    assert bool(mask[:, 256 - 48 :].all()) and bool(mask[:, :16].all())  # 3 recent blocks, sinks
    assert int(mask[0].sum()) == int(plain[0].sum()) == 64  # counted in the same budget


def test_defaults():
    assert parse_method("snapkv/scope=model").sink_blocks == 1
    assert parse_method("prob:snapkv/scope=model").recent_tokens == 0
    assert parse_method("snapkv").sink_blocks is None
    assert parse_method("prob:snapkv").recent_tokens is None
    assert parse_method("snapkv/scope=model").block == 16
    assert parse_method("prob:snapkv/scope=model").block == 16
    assert parse_method("prob:kvzip/scope=model").units == "blocks"
    assert parse_method("prob:snapkv/scope=model").aggregate == "sum"
    assert parse_method("snapkv").block is None and parse_method("prob:snapkv").aggregate is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("snapkv/scope=model/block=0", "block must be an integer >= 1"),
        ("snapkv/scope=model/block=1.5", "block must be an integer >= 1"),
        ("snapkv/scope=model/block=-16", "block must be an integer >= 1"),
        ("prob:snapkv/scope=model/block=0", "block must be an integer >= 1"),
        ("snapkv/block=16", "block=16 is an option of the model-wide scope"),
        ("snapkv/aggregate=max", "aggregate='max' is an option of the model-wide scope"),
        ("prob:snapkv/aggregate=max", "aggregate='max' is an option of the model-wide scope"),
        ("prob:kvzip/aggregate=sum", "aggregate='sum' is an option of the model-wide scope"),
        ("snapkv/scope=model/aggregate=mean", "aggregate must be one of 'sum', 'max'"),
        ("snapkv/scope=model/sink_blocks=-1", "sink_blocks must be >= 0"),
        ("prob:snapkv/scope=model/recent_tokens=1.5", "recent_tokens must be an integer"),
        ("snapkv/sink_blocks=1", "sink_blocks=1 is an option of the model-wide scope"),
        ("prob:snapkv/recent_tokens=64", "recent_tokens=64 is an option of the model-wide scope"),
        ("snapkv/scope=global", "scope must be one of 'head', 'model'"),
        ("kvzip/scope=model", "layer_budgets='global' with scope='model'"),
        ("pyramidkv/scope=model", "layer_budgets='pyramid' with scope='model'"),
        ("ada_snapkv/scope=model", "head_budgets='ada' with scope='model'"),
        (
            "prob:snapkv/scope=model/sampler=with_replacement",
            "scope='model' draws blocks of positions by fixed-size pps",
        ),
        ("prob:kvzip/scope=model/units=spans", "units='spans' with scope='model'"),
    ],
)
def test_bad_options_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_method(spec)


def test_layers_of_different_lengths_refused():
    obs = observations()
    short = observations(t=50)
    with pytest.raises(ValueError, match="same prefix"):
        TopKPolicy(score="snapkv", scope="model").select([obs[0], short[1]], num_layers=2)
