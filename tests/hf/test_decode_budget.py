"""Decode-time eviction held to a budget (probkv.hf.decode_budget, S10.5) on tiny models."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from probkv import sampling
from probkv.hf import ProbKVCache, prepare_model
from probkv.models.testing import tiny_model
from probkv.policies import parse_method
from probkv.policies.probabilistic import ProbabilisticPolicy

METHODS = [
    "streaming_llm",
    "h2o",
    "tova",
    "snapkv",
    "knorm",
    "prob:h2o-h",
    "prob:h2o",
    "prob:tova",
    "prob:min-h",
    "prob:snapkv",
]


@pytest.fixture(scope="module")
def model():
    return prepare_model(tiny_model("llama", seed=0))


def _ids(n: int, seed: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 200, (1, n), generator=gen)


@torch.no_grad()
def _run(model, cache, ids, prompt: int) -> list[torch.Tensor]:
    """Prefill ``prompt`` tokens, then feed the rest one at a time; the logits of each step."""
    out = [model(input_ids=ids[:, :prompt], cache=cache, use_cache=True).logits[0, -1]]
    for i in range(prompt, ids.shape[1]):
        out.append(model(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True).logits[0, -1])
    return out


def _layers(cache):
    return [cache.layers[i] for i in cache.evicting_layers]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("prompt", "budget", "every"), [(30, 12, 4), (8, 12, 1), (20, 10, 16)])
def test_budget_never_exceeded(model, method, prompt, budget, every):
    """From the prompt's eviction on, every head of every layer holds at most B + K entries
    at every one-token step, for any prompt length (above or below B): a top-k stage keeps B,
    a pps stage at most B + K - 1 (its blocks hold at most K entries, S10.3). The layer
    stores at most B + K entries per head too (the dense tail shared by the heads is sized
    for the head holding most), plus one float32 log-weight per kept entry."""
    cache = ProbKVCache(
        model.config, parse_method(method), prompt_length=prompt, max_entries=budget, every=every
    )
    ids = _ids(prompt + 45)
    with torch.no_grad():
        model(input_ids=ids[:, :prompt], cache=cache, use_cache=True)
        for i in range(prompt, ids.shape[1]):
            model(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True)
            for layer in _layers(cache):
                assert layer.physical_length() < budget + every
    for layer in _layers(cache):
        assert layer.decode_state.peak_entries <= budget + every
        assert layer.decode_state.stages >= 2
        h, d = layer.num_heads, layer.prefix.keys.shape[1]
        per_entry = h * (2 * d * 4 + 4)  # keys + values, float32, and a log-weight per head
        assert layer.decode_state.peak_bytes <= (budget + every) * per_entry


def test_large_budget_changes_nothing(model):
    """B >= every token: logits bit-equal to the same cache without eviction (ratio 0)."""
    ids = _ids(50)
    for method in ("h2o", "prob:h2o-h", "snapkv"):
        plain = ProbKVCache(model.config, parse_method(method, ratio=0.0), prompt_length=20)
        reference = _run(model, plain, ids, 20)
        cache = ProbKVCache(
            model.config, parse_method(method), prompt_length=20, max_entries=50, every=1
        )
        logits = _run(model, cache, ids, 20)
        assert all(torch.equal(a, b) for a, b in zip(logits, reference, strict=True))
        assert all(layer.prefix.log_weights is None for layer in _layers(cache))
        assert all(layer.decode_state.stages == 1 for layer in _layers(cache))


def _kept(cache):
    return [(layer.prefix.keys.clone(), layer.prefix.log_weights) for layer in _layers(cache)]


def test_same_seed_same_kept_sets(model):
    ids = _ids(60)
    runs = []
    for seed in (0, 0, 1):
        policy = parse_method(f"prob:h2o-h/seed={seed}")
        cache = ProbKVCache(model.config, policy, prompt_length=20, max_entries=10, every=3)
        _run(model, cache, ids, 20)
        runs.append(_kept(cache))
    for (ka, wa), (kb, wb) in zip(runs[0], runs[1], strict=True):
        assert torch.equal(ka, kb) and torch.equal(wa, wb)
    assert any(
        ka.shape != kc.shape or not torch.equal(ka, kc)
        for (ka, _), (kc, _) in zip(runs[0], runs[2], strict=True)
    )


def test_composed_weights_are_the_product_of_stage_inclusions(model, monkeypatch):
    """S10.5: an entry's final log-weight is -sum over the stages it survived of log P^(s),
    with P^(s) recomputed here from each stage's observation (fixed-size pps, S9), entries
    followed by their positions through every stage."""
    stages: list[tuple[int, torch.Tensor, object]] = []  # (layer, inclusion [H, n], selection)
    original = ProbabilisticPolicy.select

    def recording(self, observations, *, num_layers):
        selections = original(self, observations, num_layers=num_layers)
        for obs, sel in zip(observations, selections, strict=True):
            obs = self._with_forced(obs)
            pi = self.proposal(obs).double()
            forced = (
                obs.forced.sum(-1)
                if obs.forced is not None
                else torch.zeros(obs.num_heads, dtype=torch.int64)
            )
            budget = round((1 - self.ratio) * obs.length)
            p = sampling.pps_inclusion_probabilities(pi, (budget - forced).clamp(min=0))
            if obs.forced is not None:
                p = torch.where(obs.forced, torch.ones_like(p), p)
            stages.append((obs.layer_idx, p, sel))
        return selections

    monkeypatch.setattr(ProbabilisticPolicy, "select", recording)
    policy = parse_method("prob:h2o-h/core=0/block=1/order=position")  # the reference: pure pps
    prompt, budget, every = 16, 8, 4
    cache = ProbKVCache(model.config, policy, prompt_length=prompt, max_entries=budget, every=every)
    _run(model, cache, _ids(40), prompt)
    layer = _layers(cache)[0]
    mine = [(p, sel) for i, p, sel in stages if i == layer.layer_idx]
    assert len(mine) == layer.decode_state.stages >= 3
    # Follow positions: held[h] = positions of head h's entries, weights[h][pos] = -sum log P
    held = [list(range(prompt)) for _ in range(layer.num_heads)]
    weights = [dict.fromkeys(range(prompt), 0.0) for _ in range(layer.num_heads)]
    seen = prompt  # tokens the layer had seen at the last stage
    for stage, (p, sel) in enumerate(mine):
        assert p.shape[0] == layer.num_heads  # equal lengths: one selection per stage
        added = p.shape[1] - len(held[0]) if stage else 0  # the tail since the last stage
        for h in range(layer.num_heads):
            current = held[h] + list(range(seen, seen + added))
            idx, _ = sel.head(h)
            held[h] = [current[i] for i in idx.tolist()]
            for i, pos in zip(idx.tolist(), held[h], strict=True):
                weights[h][pos] = weights[h].get(pos, 0.0) - float(torch.log(p[h, i]))
        seen += added
    for h in range(layer.num_heads):
        _, _, lw = layer.prefix.head(h)
        expected = torch.tensor([weights[h][pos] for pos in held[h]], dtype=torch.float32)
        torch.testing.assert_close(lw, expected, rtol=1e-5, atol=1e-5)


def test_refused_by_name(model):
    for method, word in (
        ("ada_snapkv", "head_budgets"),
        ("pyramidkv", "layer_budgets"),
        ("prob:h2o/scope=global", "scope"),
        ("kvzip", "reconstruction"),
        ("prob:h2o/units=spans", "units='spans'"),
        ("prob:h2o/sampler=with_replacement/weights=inclusion", "with_replacement"),
        ("full", "'full'"),
        ("topk:snapkv/threshold=-3", "threshold=-3.0"),
    ):
        with pytest.raises(ValueError, match=word):
            ProbKVCache(model.config, parse_method(method), max_entries=8)
    with pytest.raises(ValueError, match="max_entries"):
        ProbKVCache(model.config, parse_method("h2o"), max_entries=0)
    with pytest.raises(ValueError, match="every"):
        ProbKVCache(model.config, parse_method("h2o"), max_entries=4, every=0)
    cache = ProbKVCache(model.config, parse_method("h2o"), max_entries=8)
    _run(model, cache, _ids(12), 10)
    with pytest.raises(ValueError, match="decode budget"):
        cache.rewind()


def test_block_designs_are_capped_at_the_block_of_k():
    from probkv.hf.decode_budget import DecodeBudget

    policy = parse_method("prob:h2o-h")  # pps, block 8
    assert DecodeBudget(8, every=4).prompt_policy(policy, 20).block == 4
    assert DecodeBudget(8, every=16).prompt_policy(policy, 20).block == policy.block
    assert dataclasses.replace(policy, ratio=0.6) == DecodeBudget(8, 16).prompt_policy(policy, 20)


def test_generate_holds_the_budget(model):
    """probkv.hf.compress with a decode budget, then generate(): greedy tokens come out and
    no head ever held more than B + K entries, but for the q - 1 = 2 extra entries the 3-token
    input may add at once after the prompt's stage (S10.5); transformers' own generate() too."""
    from probkv.hf import compress, generate

    ids = _ids(30)
    cache = compress(model, ids, parse_method("prob:h2o-h"), max_entries=12, every=4)
    out = generate(model, cache, _ids(3, seed=5), max_new_tokens=25)
    assert out.numel() == 25
    for layer in _layers(cache):
        assert layer.decode_state.peak_entries <= 12 + 4 + (3 - 1)
        assert layer.decode_state.stages >= 5
    cache = ProbKVCache(model.config, parse_method("tova"), max_entries=8, every=1)
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False)
    assert out.shape[1] == 42
    assert all(layer.decode_state.peak_entries <= 9 for layer in _layers(cache))


def test_reports_describe_the_cache_after_a_long_generation():
    """After a budgeted generate of 1,000 tokens, cache.reports() and effective_ratio()
    describe the cache held at the end (the latest decode stage's prefix; the tail holds the
    fewer than K tokens since), not the prompt's eviction: kept counts, tokens seen, bytes."""
    from probkv.hf import compress, generate

    model = prepare_model(tiny_model("llama", seed=0, max_position_embeddings=1100))
    budget, every = 12, 4
    cache = compress(model, _ids(30), parse_method("prob:h2o-h"), max_entries=budget, every=every)
    out = generate(model, cache, _ids(3, seed=5), max_new_tokens=1000, min_new_tokens=1000)
    assert out.numel() == 1000
    reports = cache.reports()
    assert len(reports) == len(cache.evicting_layers)
    tails = 0
    for layer, report in zip(_layers(cache), reports, strict=True):
        assert report.layer_idx == layer.layer_idx
        assert report.stage == layer.decode_state.stages > 200
        assert report.kept_per_head == layer.prefix.lengths
        assert all(k <= budget for k in report.kept_per_head)
        assert report.prefix_length == layer.prefix_length > 1000
        assert report.prefix_length + layer.tail_length == cache.get_seq_length() == 30 + 3 + 999
        assert 0 <= layer.tail_length < every
        assert report.nbytes == layer.prefix.nbytes()
        assert report.target_ratio == pytest.approx(1 - budget / report.prefix_length)
        lw = [layer.prefix.head(h)[2] for h in range(layer.num_heads)]
        ess = [float(w.double().exp().sum() ** 2 / (2 * w.double()).exp().sum()) for w in lw]
        assert report.effective_sample_size == pytest.approx(ess, rel=1e-9)
        tails += layer.nbytes() - layer.prefix.nbytes()
    assert cache.nbytes() == sum(r.nbytes for r in reports) + tails
    kept = [k / r.prefix_length for r in reports for k in r.kept_per_head]
    assert cache.effective_ratio() == pytest.approx(1 - sum(kept) / len(kept))
    assert cache.effective_ratio() > 0.98


def test_answer_leaves_a_budgeted_cache_as_it_was(model):
    """answer() on a cache with a decode budget: its stages evict the prefix too, so it
    answers from a copy; every question starts from the same compressed state."""
    from probkv.hf import answer, compress

    cache = compress(model, _ids(30), parse_method("prob:h2o-h"), max_entries=12, every=4)
    before = _kept(cache)
    one = answer(model, cache, _ids(3, seed=5), max_new_tokens=20)
    assert torch.equal(answer(model, cache, _ids(3, seed=5), max_new_tokens=20), one)
    for (ka, wa), (kb, wb) in zip(before, _kept(cache), strict=True):
        assert torch.equal(ka, kb) and torch.equal(wa, wb)
    assert cache.get_seq_length() == 30 and all(
        layer.decode_state.stages == 1 for layer in _layers(cache)
    )
