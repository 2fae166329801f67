"""Tests of probkv.scores.surrogate (S11): features, the ridge fit, the held-out checks, the scorer.

Fast paths are compared with slow, plain references written here: numpy's ``lstsq`` on the
augmented least-squares system for the ridge fit, rank loops for Spearman, Python sets for
the kept-set overlap, an explicit per-pair rotation for RoPE. Synthetic data with a known
linear truth checks that the fit recovers it (noise-free: to float32 rounding; noisy: within
the estimator's standard error).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from probkv.scores import surrogate as sg
from probkv.scores.functions import FORCED_LOG_SCORE


def rope(key: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding, written per pair: pair ``(j, j + d/2)`` rotated by
    ``pos * inv_freq[j]``."""
    out = key.clone().to(torch.float64)
    half = key.shape[-1] // 2
    for ti, pos in enumerate(positions.tolist()):
        for j in range(half):
            a = pos * float(inv_freq[j])
            x, y = key[..., ti, j].double(), key[..., ti, j + half].double()
            out[..., ti, j] = x * math.cos(a) - y * math.sin(a)
            out[..., ti, j + half] = y * math.cos(a) + x * math.sin(a)
    return out.to(torch.float32)


def test_pair_norms_are_rotation_invariant_and_unrotation_inverts_rope():
    g = torch.Generator().manual_seed(0)
    key = torch.randn(2, 5, 8, generator=g)
    positions = torch.tensor([0, 3, 17, 250, 2047])
    inv_freq = 10000.0 ** (-torch.arange(4, dtype=torch.float64) / 4)
    rotated = rope(key, positions, inv_freq)
    torch.testing.assert_close(sg.key_pair_norms(rotated), sg.key_pair_norms(key))
    torch.testing.assert_close(
        sg.unrotate_keys(rotated, positions, inv_freq), key, atol=1e-5, rtol=0
    )


def test_kv_features_layout():
    g = torch.Generator().manual_seed(1)
    key, value = torch.randn(3, 4, 6, generator=g), torch.randn(3, 4, 6, generator=g)
    x = sg.kv_features(key, value)
    assert x.shape == (4, 3 * 9)
    for h in range(3):
        torch.testing.assert_close(x[:, 9 * h : 9 * h + 6], value[h])
        norms = torch.sqrt(key[h, :, :3] ** 2 + key[h, :, 3:] ** 2)
        torch.testing.assert_close(x[:, 9 * h + 6 : 9 * h + 9], norms)
    with pytest.raises(ValueError, match="key and value"):
        sg.kv_features(key, value[:2])
    with pytest.raises(ValueError, match="even"):
        sg.key_pair_norms(torch.ones(2, 3, 5))


def _stats(x: torch.Tensor, y: torch.Tensor, batches: int = 1) -> sg.RidgeStats:
    stats = sg.RidgeStats(x.shape[1], y.shape[1])
    for xs, ys in zip(x.chunk(batches), y.chunk(batches)):
        stats.add(xs, ys)
    return stats


def _reference_ridge(x: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
    """Predictions of ridge in standardised features, by lstsq on the augmented system
    ``[Z; sqrt(alpha n) I] W = [Y - mean; 0]``."""
    n, f = x.shape
    mean, sd = x.mean(0), x.std(0)
    z = (x - mean) / sd
    aug = np.vstack([z, math.sqrt(alpha * n) * np.eye(f)])
    rhs = np.vstack([y - y.mean(0), np.zeros((f, y.shape[1]))])
    w = np.linalg.lstsq(aug, rhs, rcond=None)[0]
    return z @ w + y.mean(0)


@pytest.mark.parametrize("alpha", [0.0, 1e-2, 1.0])
def test_ridge_matches_lstsq_reference(alpha):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200, 6, generator=g) * torch.tensor([1.0, 5.0, 0.1, 2.0, 1.0, 3.0]) + 2.0
    y = torch.randn(200, 3, generator=g) + x[:, :3] @ torch.randn(3, 3, generator=g)
    fit = sg.fit_ridge(_stats(x, y, batches=4), alpha)
    expected = _reference_ridge(x.double().numpy(), y.double().numpy(), alpha)
    np.testing.assert_allclose(fit.predict(x).numpy(), expected, atol=2e-4, rtol=0)


def test_ridge_statistics_add_up_over_batches():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(90, 4, generator=g), torch.randn(90, 2, generator=g)
    one, many = _stats(x, y), _stats(x, y, batches=3)
    for k in ("sum_x", "sum_y", "sum_xx", "sum_xy"):
        torch.testing.assert_close(getattr(one, k), getattr(many, k), atol=1e-4, rtol=1e-6)
    assert one.n == many.n == 90
    again = sg.RidgeStats.from_state(one.state())
    torch.testing.assert_close(again.sum_xx, one.sum_xx)


def test_ridge_recovers_a_known_linear_truth():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5000, 5, generator=g) * 2 + 1
    w = torch.tensor([[1.0, -2.0], [0.5, 0.0], [0.0, 3.0], [-1.0, 1.0], [2.0, 0.25]])
    b = torch.tensor([0.3, -7.0])
    exact = x @ w + b
    fit = sg.fit_ridge(_stats(x, exact), 0.0)
    torch.testing.assert_close(fit.predict(x), exact, atol=1e-3, rtol=0)
    # noisy targets: the weights in raw units (W / scale) within 5 standard errors
    noise = 0.5
    noisy = exact + noise * torch.randn(5000, 2, generator=g)
    fit = sg.fit_ridge(_stats(x, noisy), 0.0)
    raw = fit.weight / fit.scale.unsqueeze(1)
    se = noise / (math.sqrt(5000) * x.std(0)).unsqueeze(1)
    assert ((raw - w).abs() < 5 * se).all()


def test_ridge_constant_feature_gets_no_weight():
    g = torch.Generator().manual_seed(5)
    x = torch.cat([torch.randn(100, 2, generator=g), torch.full((100, 1), 4.0)], 1)
    y = x[:, :1] * 2
    fit = sg.fit_ridge(_stats(x, y), 0.0)
    assert fit.weight[2].abs().max() == 0
    torch.testing.assert_close(fit.predict(x), y, atol=1e-4, rtol=0)


def test_ridge_bad_input():
    stats = sg.RidgeStats(2, 1)
    with pytest.raises(ValueError, match="at least 2 rows"):
        sg.fit_ridge(stats, 0.1)
    with pytest.raises(ValueError, match="alpha"):
        sg.fit_ridge(stats, -1.0)
    with pytest.raises(ValueError, match="x must be"):
        stats.add(torch.ones(3, 3), torch.ones(3, 1))
    with pytest.raises(ValueError, match="finite"):
        stats.add(torch.tensor([[math.nan, 1.0]]), torch.ones(1, 1))
    with pytest.raises(ValueError, match="num_features"):
        sg.RidgeStats(0, 1)


def _slow_spearman(a: list[float], b: list[float]) -> float:
    def ranks(v):
        out = []
        for x in v:
            less = sum(1 for y in v if y < x)
            equal = sum(1 for y in v if y == x)
            out.append(less + (equal - 1) / 2)
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return num / den if den else 0.0


def test_spearman_matches_a_slow_reference_with_ties():
    g = torch.Generator().manual_seed(6)
    a = torch.randint(0, 5, (3, 30), generator=g).float()  # many ties
    b = a + torch.randn(3, 30, generator=g)
    got = sg.spearman(a, b)
    for row in range(3):
        assert got[row].item() == pytest.approx(_slow_spearman(a[row].tolist(), b[row].tolist()))
    x = torch.randn(50, generator=g)
    assert sg.spearman(x, x.exp()).item() == pytest.approx(1.0)
    assert sg.spearman(x, -x).item() == pytest.approx(-1.0)
    assert sg.spearman(torch.ones(5), x[:5]).item() == 0.0
    with pytest.raises(ValueError, match="one shape"):
        sg.spearman(x, x[:3])


def test_kept_overlap_matches_sets():
    g = torch.Generator().manual_seed(7)
    teacher = torch.randn(2, 3, 40, generator=g)
    pred = teacher + 0.8 * torch.randn(2, 3, 40, generator=g)
    for r in (0.5, 0.75, 0.9):
        k = sg.keep_count(teacher.numel(), r)
        t_set = set(teacher.reshape(-1).argsort(descending=True)[:k].tolist())
        p_set = set(pred.reshape(-1).argsort(descending=True)[:k].tolist())
        assert sg.kept_overlap(pred, teacher, r) == pytest.approx(len(t_set & p_set) / k)
        assert sg.kept_overlap(teacher.exp(), teacher, r) == 1.0
    assert sg.kept_overlap(pred[:, :, :1], teacher[:, :, :1], 0.9) == 1.0  # keeps none
    with pytest.raises(ValueError, match="ratio"):
        sg.kept_overlap(pred, teacher, 1.0)


def _scorer(hkv=2, d=4, layers=(0, 3), features="kv") -> sg.SurrogateScorer:
    g = torch.Generator().manual_seed(8)
    f = hkv * (d + d // 2)
    fits = {
        i: sg.LinearSurrogate(
            torch.randn(f, generator=g),
            torch.rand(f, generator=g) + 0.5,
            torch.randn(f, hkv, generator=g),
            torch.full((hkv,), -5.0),
        )
        for i in layers
    }
    shapes = {"model_type": "llama", "num_key_value_heads": hkv}
    model = {"name": "toy", "shapes": shapes, "digest": sg.config_digest(shapes)}
    return sg.SurrogateScorer(features, fits, model, {"teacher": "kvzip"}, {"spearman_mean": 0.5})


def test_kvzap_score_is_the_clamped_prediction_with_forced_sinks():
    scorer = _scorer()
    g = torch.Generator().manual_seed(9)
    key, value = torch.randn(2, 10, 4, generator=g), torch.randn(2, 10, 4, generator=g)
    out = sg.kvzap(key, value, layer_idx=3, surrogate=scorer, sinks=2)
    # the fast path (standardisation folded into the weights, no feature matrix) against the
    # plain one: features, then the fit's predict
    expected = scorer.layers[3].predict(sg.kv_features(key, value)).T.clamp(sg.MIN_LOG_SCORE, 0)
    torch.testing.assert_close(out.log_scores[:, 2:], expected[:, 2:], atol=1e-5, rtol=1e-5)
    bf16 = sg.kvzap(key.bfloat16(), value.bfloat16(), layer_idx=3, surrogate=scorer, sinks=0)
    ref = scorer.layers[3].predict(sg.kv_features(key.bfloat16(), value.bfloat16())).T
    torch.testing.assert_close(
        bf16.log_scores, ref.clamp(sg.MIN_LOG_SCORE, 0), atol=1e-5, rtol=1e-5
    )
    assert (out.log_scores[:, :2] == FORCED_LOG_SCORE).all()
    assert out.forced[:, :2].all() and not out.forced[:, 2:].any()
    assert out.log_scores.dtype == torch.float32 and torch.isfinite(out.log_scores).all()
    assert sg.kvzap(key, value, layer_idx=0, surrogate=scorer, sinks=0).forced is None


def test_a_scorer_split_over_ranks_sums_its_shares_to_the_unsplit_prediction():
    """S11 under tensor parallelism: 3 ranks holding one KV head each; each rank's share of
    every head's prediction, summed over the ranks (the all-reduce), then its own head's row,
    is the unsplit kvzap score of that head, forced sinks included."""
    scorer = _scorer(hkv=3)
    g = torch.Generator().manual_seed(10)
    key, value = torch.randn(3, 12, 4, generator=g), torch.randn(3, 12, 4, generator=g)
    whole = sg.kvzap(key, value, layer_idx=3, surrogate=scorer, sinks=2)
    shares = [
        sg.ScorerShard(scorer, r, 1, lambda x: x).partial(3, key[r : r + 1], value[r : r + 1])
        for r in range(3)
    ]
    total = sum(shares)
    for r in range(3):
        shard = sg.ScorerShard(scorer, r, 1, lambda x, mine=shares[r]: x - mine + total)
        out = sg.kvzap(key[r : r + 1], value[r : r + 1], layer_idx=3, surrogate=shard, sinks=2)
        torch.testing.assert_close(out.log_scores, whole.log_scores[r : r + 1], atol=1e-5, rtol=0)
        assert torch.equal(out.forced, whole.forced[r : r + 1])
    with pytest.raises(ValueError, match=r"KV heads 1..1 needs keys \[1, t, d\]"):
        sg.ScorerShard(scorer, 1, 1, lambda x: x).partial(3, key, value)


def test_kvzap_refuses_by_name():
    scorer = _scorer()
    key = torch.randn(2, 6, 4)
    with pytest.raises(ValueError, match="needs a trained scorer"):
        sg.kvzap(key, key, layer_idx=0)
    with pytest.raises(ValueError, match="has no layer 1"):
        sg.kvzap(key, key, layer_idx=1, surrogate=scorer)
    with pytest.raises(ValueError, match="SurrogateScorer"):
        sg.kvzap(key, key, layer_idx=0, surrogate="toy.pt")
    with pytest.raises(ValueError, match="layer index"):
        sg.kvzap(key, key, layer_idx=None, surrogate=scorer)
    with pytest.raises(ValueError, match="features must be"):
        sg.kvzap(key[:1], key[:1], layer_idx=0, surrogate=scorer)
    hidden = _scorer(features="hidden")
    with pytest.raises(ValueError, match="inside the attention function"):
        sg.kvzap(key, key, layer_idx=0, surrogate=hidden)
    with pytest.raises(ValueError, match="trained for another model"):
        scorer.check_model("0" * 16, "gemma3-270m")
    scorer.check_model(scorer.model["digest"], "toy")


def test_scorer_file_round_trip_and_refusals(tmp_path):
    scorer = _scorer()
    path = tmp_path / "toy.pt"
    digest = sg.save_scorer(scorer, path)
    back = sg.load_scorer(path)
    assert back.model == scorer.model and back.recipe == scorer.recipe
    assert back.metrics == scorer.metrics and back.features == "kv"
    for i in scorer.layers:
        torch.testing.assert_close(back.layers[i].weight, scorer.layers[i].weight)
    assert digest == sg.content_digest(sg.scorer_tensors(back))
    blob = torch.load(path, weights_only=True)
    blob["tensors"]["layer0.bias"] = blob["tensors"]["layer0.bias"] + 1
    torch.save(blob, tmp_path / "damaged.pt")
    with pytest.raises(ValueError, match="digest mismatch"):
        sg.load_scorer(tmp_path / "damaged.pt")
    blob = torch.load(path, weights_only=True)
    blob["header"] = blob["header"].replace('"recipe_version": 1', '"recipe_version": 99')
    torch.save(blob, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="recipe version 99"):
        sg.load_scorer(tmp_path / "old.pt")
    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(ValueError, match="not a probkv surrogate file"):
        sg.load_scorer(tmp_path / "text.pt")
    with pytest.raises(ValueError, match="features must be one of"):
        _scorer(features="queries")


def _mlp_scorer(hkv=2, d=4, layers=(0, 3), hidden=5, thresholds=None) -> sg.SurrogateScorer:
    base = _scorer(hkv=hkv, d=d, layers=layers)
    g = torch.Generator().manual_seed(11)
    fits = {
        i: sg.MLPSurrogate(
            fit.mean,
            fit.scale,
            fit.weight,
            fit.bias,
            torch.randn(fit.weight.shape[0], hidden, generator=g),
            torch.randn(hidden, generator=g),
            torch.randn(hidden, hkv, generator=g),
        )
        for i, fit in base.layers.items()
    }
    return sg.SurrogateScorer("kv", fits, base.model, base.recipe, base.metrics, thresholds or {})


def _reference_mlp(fit: sg.MLPSurrogate, x: torch.Tensor) -> torch.Tensor:
    """The two layers written out in float64, GELU as ``x Phi(x)`` with ``math.erf``."""
    z = (x.double() - fit.mean.double()) / fit.scale.double()
    pre = z @ fit.w1.double() + fit.b1.double()
    gelu = pre * 0.5 * (1.0 + torch.special.erf(pre / math.sqrt(2.0)))
    return z @ fit.weight.double() + fit.bias.double() + gelu @ fit.w2.double()


def test_mlp_form_fast_path_equals_the_written_out_two_layers():
    scorer = _mlp_scorer()
    assert scorer.form == "mlp" and _scorer().form == "linear"
    g = torch.Generator().manual_seed(12)
    key, value = torch.randn(2, 9, 4, generator=g), torch.randn(2, 9, 4, generator=g)
    out = sg.kvzap(key, value, layer_idx=3, surrogate=scorer, sinks=0)
    ref = _reference_mlp(scorer.layers[3], sg.kv_features(key, value)).T
    torch.testing.assert_close(
        out.log_scores.double(), ref.clamp(sg.MIN_LOG_SCORE, 0), atol=1e-4, rtol=1e-5
    )
    plain = scorer.layers[3].predict(sg.kv_features(key, value))
    torch.testing.assert_close(
        plain.double(),
        _reference_mlp(scorer.layers[3], sg.kv_features(key, value)),
        atol=1e-4,
        rtol=1e-5,
    )
    # the hidden layer matters here: the linear term alone predicts something else
    linear = sg.LinearSurrogate(*(getattr(scorer.layers[3], k) for k in sg.FORM_TENSORS["linear"]))
    assert (linear.predict(sg.kv_features(key, value)) - plain).abs().max() > 0.1
    # deterministic: the same inputs give the same bits
    again = sg.kvzap(key, value, layer_idx=3, surrogate=scorer, sinks=0)
    assert torch.equal(again.log_scores, out.log_scores)


def test_an_mlp_scorer_split_over_ranks_gives_the_unsplit_prediction():
    scorer = _mlp_scorer(hkv=3)
    g = torch.Generator().manual_seed(13)
    key, value = torch.randn(3, 12, 4, generator=g), torch.randn(3, 12, 4, generator=g)
    whole = sg.kvzap(key, value, layer_idx=3, surrogate=scorer, sinks=2)
    shares = [
        sg.ScorerShard(scorer, r, 1, lambda x: x).partial(3, key[r : r + 1], value[r : r + 1])
        for r in range(3)
    ]
    assert shares[0].shape == (12, 3 + 5)  # the linear terms and the hidden layer's input
    total = sum(shares)
    for r in range(3):
        shard = sg.ScorerShard(scorer, r, 1, lambda x, mine=shares[r]: x - mine + total)
        out = sg.kvzap(key[r : r + 1], value[r : r + 1], layer_idx=3, surrogate=shard, sinks=2)
        torch.testing.assert_close(out.log_scores, whole.log_scores[r : r + 1], atol=1e-4, rtol=0)


def _nonlinear_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features with a target no linear map predicts well: ``|x0| + x1 x2`` and ``-x3^2``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = torch.stack([x[:, 0].abs() + x[:, 1] * x[:, 2], -(x[:, 3] ** 2)], 1)
    return x, y + 0.05 * torch.randn(n, 2, generator=g)


def test_fit_mlp_learns_what_the_ridge_fit_cannot_and_is_deterministic():
    torch.set_num_threads(1)
    x, y = _nonlinear_data(4000, 0)
    vx, vy = _nonlinear_data(1000, 1)
    tx, ty = _nonlinear_data(1000, 2)
    base = sg.fit_ridge(_stats(x, y), 1e-4)
    fit, info = sg.fit_mlp(x, y, vx, vy, base, hidden=32, epochs=30, batch=128, lr=1e-2)
    ridge_mse = float((base.predict(tx) - ty).square().mean())
    mlp_mse = float((fit.predict(tx) - ty).square().mean())
    assert ridge_mse > 0.9  # the target's variance is mostly nonlinear
    assert mlp_mse < 0.25 * ridge_mse, (mlp_mse, ridge_mse)  # held out, not fitted on
    assert info["val_mse"] < info["val_mse_linear"] and 1 <= info["epoch"] <= 30
    again, _ = sg.fit_mlp(x, y, vx, vy, base, hidden=32, epochs=30, batch=128, lr=1e-2)
    assert torch.equal(again.w1, fit.w1) and torch.equal(again.w2, fit.w2)
    # no step (lr 0): the start, which is the ridge fit's prediction
    still, info0 = sg.fit_mlp(x, y, vx, vy, base, hidden=4, epochs=1, lr=0.0)
    assert info0["epoch"] == 0
    torch.testing.assert_close(still.predict(tx), base.predict(tx), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="hidden must be"):
        sg.fit_mlp(x, y, vx, vy, base, hidden=0)
    with pytest.raises(ValueError, match=r"x and y must be \[n, 6\] and \[n, 2\]"):
        sg.fit_mlp(x[:, :5], y, vx, vy, base)
    with pytest.raises(ValueError, match="lr must be a number >= 0, got -1"):
        sg.fit_mlp(x, y, vx, vy, base, lr=-1)


def test_mlp_scorer_file_round_trip_with_its_thresholds(tmp_path):
    scorer = _mlp_scorer(thresholds={"kvzap": -5.25, "prob:kvzap": -4.5})
    path = tmp_path / "mlp.pt"
    sg.save_scorer(scorer, path)
    back = sg.load_scorer(path)
    assert back.form == "mlp" and back.thresholds == {"kvzap": -5.25, "prob:kvzap": -4.5}
    for i, fit in scorer.layers.items():
        for name in sg.FORM_TENSORS["mlp"]:
            assert torch.equal(getattr(back.layers[i], name), getattr(fit, name))
    linear = tmp_path / "linear.pt"
    sg.save_scorer(_scorer(), linear)
    assert sg.load_scorer(linear).form == "linear" and sg.load_scorer(linear).thresholds == {}
    blob = torch.load(path, weights_only=True)
    blob["header"] = blob["header"].replace('"form": "mlp"', '"form": "tree"')
    torch.save(blob, tmp_path / "tree.pt")
    with pytest.raises(ValueError, match="form 'tree'; this probkv reads linear, mlp"):
        sg.load_scorer(tmp_path / "tree.pt")
    with pytest.raises(
        ValueError, match=r"the kvzap threshold must be a log-score in \(-.*, 0\), got nan"
    ):
        _mlp_scorer(thresholds={"kvzap": float("nan")})
    with pytest.raises(
        ValueError, match="a threshold's method must be one of 'kvzap', 'prob:kvzap'; got 'snapkv'"
    ):
        _mlp_scorer(thresholds={"snapkv": -5.0})
    # a file written with one threshold (before one per method) reads it as the top-k's
    old = torch.load(path, weights_only=True)
    header = json.loads(old["header"])
    del header["thresholds"]
    header["threshold"] = -5.0
    old["header"] = json.dumps(header, sort_keys=True)
    torch.save(old, tmp_path / "old.pt")
    assert sg.load_scorer(tmp_path / "old.pt").thresholds == {"kvzap": -5.0}
    mixed = {0: _scorer().layers[0], 3: _mlp_scorer().layers[3]}
    with pytest.raises(ValueError, match="must all be LinearSurrogate or all MLPSurrogate"):
        sg.SurrogateScorer("kv", mixed, scorer.model, scorer.recipe)
