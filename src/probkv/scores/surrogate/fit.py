"""Fitting the surrogate (S11) and checking it held out.

- the fit: ridge regression per layer with one output per KV head (the teacher's log-score
  of that head), in standardised features (``RidgeStats`` accumulates the sufficient
  statistics over training contexts in float64; ``fit_ridge`` solves
  ``(C + alpha I) W = c``), so ``alpha`` is relative to unit-variance features; ``fit_mlp``
  fits KVzap's two-layer form by gradient descent, starting from the linear fit.
- held-out checks: ``spearman`` (rank correlation) and ``kept_overlap`` (the share of the
  teacher's kept set a top-k of the prediction keeps at a compression ratio r).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from probkv._checks import check_positive_int, check_ratio
from probkv.scores.surrogate.form import LinearSurrogate, MLPSurrogate

# ----------------------------------------------------------------------------- the fit


@dataclass
class RidgeStats:
    """Sufficient statistics of a least-squares fit of ``y [n, o]`` on ``x [n, f]``, in
    float64, added up over batches of rows (one per training context)."""

    num_features: int
    num_outputs: int
    n: int = 0
    sum_x: torch.Tensor = field(init=False)
    sum_y: torch.Tensor = field(init=False)
    sum_xx: torch.Tensor = field(init=False)
    sum_xy: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        f, o = self.num_features, self.num_outputs
        check_positive_int(f, "num_features")
        check_positive_int(o, "num_outputs")
        self.sum_x = torch.zeros(f, dtype=torch.float64)
        self.sum_y = torch.zeros(o, dtype=torch.float64)
        self.sum_xx = torch.zeros(f, f, dtype=torch.float64)
        self.sum_xy = torch.zeros(f, o, dtype=torch.float64)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add rows ``x [n, f]`` with targets ``y [n, o]`` (finite)."""
        if x.ndim != 2 or y.ndim != 2 or x.shape != (y.shape[0], self.num_features):
            raise ValueError(
                f"x must be [n, {self.num_features}] and y [n, {self.num_outputs}], got "
                f"{tuple(x.shape)} and {tuple(y.shape)}"
            )
        if y.shape[1] != self.num_outputs:
            raise ValueError(f"y must have {self.num_outputs} columns, got {y.shape[1]}")
        if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
            raise ValueError("x and y must be finite")
        # one batch's products in float32 (fast), their running sums in float64
        x = x.to(torch.float32).cpu()
        y = y.to(torch.float32).cpu()
        self.n += x.shape[0]
        self.sum_x += x.sum(0, dtype=torch.float64)
        self.sum_y += y.sum(0, dtype=torch.float64)
        self.sum_xx += (x.T @ x).to(torch.float64)
        self.sum_xy += (x.T @ y).to(torch.float64)

    def state(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in ("n", "sum_x", "sum_y", "sum_xx", "sum_xy")}

    @classmethod
    def from_state(cls, state: dict) -> RidgeStats:
        f, o = state["sum_xy"].shape
        stats = cls(f, o)
        for k in ("n", "sum_x", "sum_y", "sum_xx", "sum_xy"):
            setattr(stats, k, state[k])
        return stats


def fit_ridge(stats: RidgeStats, alpha: float) -> LinearSurrogate:
    """Ridge regression from ``stats``: features standardised by their mean and standard
    deviation (a constant feature gets scale 1 and weight 0), then
    ``W = (C + alpha I)^{-1} c`` with ``C`` the features' correlation matrix and ``c`` their
    covariance with the centred targets; the intercept is the targets' mean. ``alpha >= 0``
    (0: least squares, needs ``C`` invertible)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha >= 0:
        raise ValueError(f"alpha must be a number >= 0, got {alpha!r}")
    if stats.n < 2:
        raise ValueError(f"a fit needs at least 2 rows, got {stats.n}")
    n = stats.n
    mean = stats.sum_x / n
    mean_y = stats.sum_y / n
    cov = stats.sum_xx / n - torch.outer(mean, mean)
    cross = stats.sum_xy / n - torch.outer(mean, mean_y)
    var = cov.diagonal().clamp_min(0.0)
    constant = var <= 1e-12 * (1.0 + mean.abs() ** 2)
    scale = torch.where(constant, torch.ones_like(var), var.sqrt())
    corr = cov / torch.outer(scale, scale)
    corr[constant, :] = 0.0
    corr[:, constant] = 0.0
    corr.diagonal()[constant] = 1.0
    rhs = cross / scale.unsqueeze(1)
    rhs[constant] = 0.0
    system = corr + alpha * torch.eye(len(var), dtype=torch.float64)
    weight = torch.linalg.solve(system, rhs)
    return LinearSurrogate(
        mean.to(torch.float32),
        scale.to(torch.float32),
        weight.to(torch.float32),
        mean_y.to(torch.float32),
    )


def _mse(fit: MLPSurrogate, z: torch.Tensor, y: torch.Tensor, batch: int) -> float:
    """Mean squared error of ``fit`` on standardised features ``z`` (no gradients)."""
    total = 0.0
    with torch.no_grad():
        for start in range(0, z.shape[0], batch):
            zb, yb = z[start : start + batch], y[start : start + batch]
            hidden = torch.nn.functional.gelu(zb @ fit.w1 + fit.b1)
            pred = zb @ fit.weight + fit.bias + hidden @ fit.w2
            total += float((pred - yb).square().sum())
    return total / max(1, y.numel())


def fit_mlp(
    x: torch.Tensor,
    y: torch.Tensor,
    val_x: torch.Tensor,
    val_y: torch.Tensor,
    base: LinearSurrogate,
    *,
    hidden: int = 64,
    epochs: int = 12,
    batch: int = 1024,
    lr: float = 2e-3,
    weight_decay: float = 1e-4,
    seed: int = 0,
) -> tuple[MLPSurrogate, dict[str, float]]:
    """KVzap's two-layer form fitted to ``y [n, o]`` from features ``x [n, f]``: ``base``'s
    standardisation, its linear term as the starting point (``w2 = 0``: the start predicts
    what ``base`` predicts), ``hidden`` GELU units, Adam(W) on the mean squared error in
    mini-batches of ``batch`` rows for ``epochs`` passes (shuffled by ``seed``: the same
    inputs give the same fit on one thread). The epoch with the lowest squared error on
    ``val_x``/``val_y`` (rows not fitted on) is returned, with ``{"val_mse_linear",
    "val_mse", "epoch"}`` (epoch 0: no pass improved on ``base``)."""
    for value, label in ((hidden, "hidden"), (epochs, "epochs"), (batch, "batch")):
        check_positive_int(value, label)
    for value, label in ((lr, "lr"), (weight_decay, "weight_decay")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{label} must be a number >= 0, got {value!r}")
    f, o = base.weight.shape
    for a, b, label in ((x, y, "x and y"), (val_x, val_y, "val_x and val_y")):
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != f or b.shape[1] != o or len(a) != len(b):
            raise ValueError(
                f"{label} must be [n, {f}] and [n, {o}] for this base fit, got "
                f"{tuple(a.shape)} and {tuple(b.shape)}"
            )
        if len(a) == 0 or not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"{label} must be non-empty and finite")
    gen = torch.Generator().manual_seed(seed)
    mean, scale = base.mean.to(torch.float32), base.scale.to(torch.float32)
    z = (x.to(torch.float32) - mean) / scale
    val_z = (val_x.to(torch.float32) - mean) / scale
    y, val_y = y.to(torch.float32), val_y.to(torch.float32)
    params = {
        "weight": base.weight.to(torch.float32).clone(),
        "bias": base.bias.to(torch.float32).clone(),
        "w1": torch.randn(f, hidden, generator=gen) / math.sqrt(f),
        "b1": torch.zeros(hidden),
        "w2": torch.zeros(hidden, o),
    }
    for t in params.values():
        t.requires_grad_(True)

    def snapshot() -> MLPSurrogate:
        p = {k: v.detach().clone() for k, v in params.items()}
        return MLPSurrogate(mean, scale, p["weight"], p["bias"], p["w1"], p["b1"], p["w2"])

    best = snapshot()
    linear_mse = best_mse = _mse(best, val_z, val_y, 8192)
    best_epoch = 0
    opt = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=weight_decay)
    for epoch in range(1, epochs + 1):
        order = torch.randperm(len(z), generator=gen)
        for start in range(0, len(z), batch):
            idx = order[start : start + batch]
            zb, yb = z[idx], y[idx]
            h = torch.nn.functional.gelu(zb @ params["w1"] + params["b1"])
            pred = zb @ params["weight"] + params["bias"] + h @ params["w2"]
            loss = (pred - yb).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        current = snapshot()
        mse = _mse(current, val_z, val_y, 8192)
        if mse < best_mse:
            best, best_mse, best_epoch = current, mse, epoch
    return best, {"val_mse_linear": linear_mse, "val_mse": best_mse, "epoch": best_epoch}


# ----------------------------------------------------------------------------- checks


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks ``0..n-1`` along the last dimension, ties given their mean rank."""
    x = x.to(torch.float64)
    order = x.argsort(dim=-1, stable=True)
    ranks = torch.empty_like(x)
    ranks.scatter_(-1, order, torch.arange(x.shape[-1], dtype=x.dtype).expand_as(x).clone())
    sorted_x = x.gather(-1, order)
    if (sorted_x[..., 1:] == sorted_x[..., :-1]).any():  # average tied ranks (rare)
        flat_x, flat_r = x.reshape(-1, x.shape[-1]), ranks.reshape(-1, x.shape[-1])
        for row in range(flat_x.shape[0]):
            values, inverse = torch.unique(flat_x[row], return_inverse=True)
            sums = torch.zeros(len(values), dtype=x.dtype).index_add_(0, inverse, flat_r[row])
            counts = torch.zeros(len(values), dtype=x.dtype).index_add_(
                0, inverse, torch.ones_like(flat_r[row])
            )
            flat_r[row] = (sums / counts)[inverse]
        ranks = flat_r.view_as(x)
    return ranks


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Spearman's rank correlation of ``a`` and ``b`` along the last dimension (``[..., n]``,
    ``n >= 2``): Pearson's correlation of their ranks (ties: mean ranks). A constant row
    gives 0."""
    if a.shape != b.shape or a.ndim == 0 or a.shape[-1] < 2:
        raise ValueError(f"a and b must have one shape [..., n >= 2], got {a.shape}, {b.shape}")
    ra, rb = _ranks(a), _ranks(b)
    ra = ra - ra.mean(-1, keepdim=True)
    rb = rb - rb.mean(-1, keepdim=True)
    den = (ra.square().sum(-1) * rb.square().sum(-1)).sqrt()
    num = (ra * rb).sum(-1)
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))


def keep_count(n: int, ratio: float) -> int:
    """Entries a top-k keeps of ``n`` at compression ratio ``ratio`` (S1): ``round((1-r) n)``."""
    return round((1.0 - check_ratio(ratio)) * n)


def kept_overlap(predicted: torch.Tensor, teacher: torch.Tensor, ratio: float) -> float:
    """The share of the teacher's kept set (top ``(1 - ratio)`` of ``teacher``'s entries,
    flattened) that a top-k of ``predicted`` at the same ratio also keeps (1.0 if nothing
    is kept)."""
    if predicted.shape != teacher.shape:
        raise ValueError(f"shapes differ: {tuple(predicted.shape)} vs {tuple(teacher.shape)}")
    p, t = predicted.reshape(-1), teacher.reshape(-1)
    k = keep_count(p.numel(), ratio)
    if k == 0:
        return 1.0
    mask = torch.zeros(p.numel(), dtype=torch.bool)
    mask[p.topk(k).indices.cpu()] = True
    return float(mask[t.topk(k).indices.cpu()].float().mean())
