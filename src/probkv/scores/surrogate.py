"""Surrogate scores (S11): a cheap per-position function fitted to a teacher's log-scores.

A reconstruction score (KVzip, S10.1) needs a second pass over the context. A surrogate
``s_hat_l(x_i)`` predicts it from what layer ``l`` already holds for position ``i`` during
its own prefill, so it costs one small matrix product per layer, needs no second pass, and
applies to generated tokens as they arrive. Two forms (``FORMS``): ``"linear"``, fitted in
closed form, and ``"mlp"``, KVzap's two-layer form (a GELU hidden layer beside the linear
term, ``MLPSurrogate``), fitted by gradient descent from the linear fit (``fit_mlp``):

- features (``FEATURE_KINDS``): ``"kv"``, each KV head's value and the norms of its key's
  RoPE pairs (a rotation by position leaves them unchanged, so post-RoPE keys give exactly
  the pre-RoPE pair norms), concatenated over the layer's KV heads: ``Hkv * 3d / 2``
  features, all of them in what the attention function receives; ``"kv-unrot"``, values and
  the keys rotated back to position 0 (needs the positions); ``"hidden"``, the layer's
  normalised input hidden state (what the key and value projections read; not handed to the
  attention function).
- the fit: ridge regression per layer with one output per KV head (the teacher's log-score
  of that head), in standardised features (``RidgeStats`` accumulates the sufficient
  statistics over training contexts in float64; ``fit_ridge`` solves
  ``(C + alpha I) W = c``), so ``alpha`` is relative to unit-variance features.
- held-out checks: ``spearman`` (rank correlation) and ``kept_overlap`` (the share of the
  teacher's kept set a top-k of the prediction keeps at a compression ratio r).

``SurrogateScorer`` is one model's fitted layers with the model's identity (a digest of its
config's shapes), the feature kind, the recipe's version and, where one was measured, its
default ``threshold`` (S11's threshold mode, chosen on training contexts); ``kvzap`` is the score function
(a row of ``probkv.scores.SCORE_TABLE``). File I/O (``save_scorer``, ``load_scorer``) is a
torch file of tensors with a JSON header and a content digest.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from probkv._checks import check_choice, check_positive_int, check_ratio
from probkv.scores.functions import FORCED_LOG_SCORE, Scores
from probkv.scores.proposals import FLOOR

FEATURE_KINDS: tuple[str, ...] = ("kv", "kv-unrot", "hidden")
# The scorer's forms: a linear map of the features, or KVzap's two layers (MLPSurrogate).
FORMS: tuple[str, ...] = ("linear", "mlp")
# Features the attention function can compute from its own inputs, at prefill and at decode.
ATTENTION_FEATURE_KINDS: tuple[str, ...] = ("kv",)
# Bumped when the features, targets or fit change: a file of another version is refused.
RECIPE_VERSION = 1
FILE_FORMAT = "probkv-surrogate"
# Where the package ships the scorers of its registry models: ``<model name>.pt``.
SCORER_DIR = Path(__file__).resolve().parent / "scorers"
# The lowest log-score a prediction may take: the floor of the teacher's own scores (S2).
MIN_LOG_SCORE = math.log(FLOOR)


# ----------------------------------------------------------------------------- features


def key_pair_norms(key: torch.Tensor) -> torch.Tensor:
    """``[..., d] -> [..., d/2]``: the norm of each RoPE pair ``(j, j + d/2)`` (transformers'
    ``rotate_half`` pairing). A rotary embedding rotates each pair by an angle, so these are
    the same before and after RoPE."""
    d = key.shape[-1]
    if d % 2:
        raise ValueError(f"key's head dimension must be even (RoPE pairs), got {d}")
    k = key.to(torch.float32)
    return torch.sqrt(k[..., : d // 2] ** 2 + k[..., d // 2 :] ** 2)


def unrotate_keys(key: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """Keys ``[Hkv, t, d]`` at ``positions [t]`` rotated back to position 0: the inverse of
    transformers' ``k cos + rotate_half(k) sin`` with angles ``positions * inv_freq [d/2]``."""
    d = key.shape[-1]
    if inv_freq.shape != (d // 2,):
        raise ValueError(f"inv_freq must have shape [{d // 2}], got {tuple(inv_freq.shape)}")
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(torch.float64)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(torch.float32)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(torch.float32)
    k = key.to(torch.float32)
    half = torch.cat([-k[..., d // 2 :], k[..., : d // 2]], -1)
    return k * cos - half * sin


def kv_features(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``"kv"`` features ``[t, Hkv * (d_v + d/2)]`` float32 of one layer's ``key``/``value
    [Hkv, t, d]`` (post-RoPE keys are fine: only their pair norms are read)."""
    if key.ndim != 3 or value.ndim != 3 or key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"key and value must be [Hkv, t, d] of equal Hkv and t, got {tuple(key.shape)} "
            f"and {tuple(value.shape)}"
        )
    per_head = torch.cat([value.to(torch.float32), key_pair_norms(key)], dim=-1)
    return per_head.transpose(0, 1).reshape(key.shape[1], -1)


def unrotated_features(key, value, positions, inv_freq) -> torch.Tensor:
    """``"kv-unrot"`` features ``[t, Hkv * (d_v + d)]``: values and position-0 keys."""
    per_head = torch.cat([value.to(torch.float32), unrotate_keys(key, positions, inv_freq)], -1)
    return per_head.transpose(0, 1).reshape(key.shape[1], -1)


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


@dataclass(frozen=True)
class LinearSurrogate:
    """One layer's fit: ``y_hat = ((x - mean) / scale) @ weight + bias``; ``mean``/``scale``
    ``[f]``, ``weight [f, o]``, ``bias [o]`` (float32)."""

    mean: torch.Tensor
    scale: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """``x [n, f]`` -> ``[n, o]`` float32."""
        if x.ndim != 2 or x.shape[1] != self.weight.shape[0]:
            raise ValueError(
                f"features must be [n, {self.weight.shape[0]}] for this surrogate, got "
                f"{tuple(x.shape)}"
            )
        w = self.weight.to(x.device)
        z = (x.to(torch.float32) - self.mean.to(x.device)) / self.scale.to(x.device)
        return z @ w + self.bias.to(x.device)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.{k}": getattr(self, k) for k in ("mean", "scale", "weight", "bias")}


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


@dataclass(frozen=True)
class MLPSurrogate:
    """One layer's two-layer fit (KVzap's MLP form, with the linear term beside it):
    ``z = (x - mean) / scale``, ``y_hat = z @ weight + bias + gelu(z @ w1 + b1) @ w2``;
    ``mean``/``scale [f]``, ``weight [f, o]``, ``bias [o]``, ``w1 [f, h]``, ``b1 [h]``,
    ``w2 [h, o]`` (float32; GELU's exact, erf form). With ``w2 = 0`` it is the linear fit."""

    mean: torch.Tensor
    scale: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """``x [n, f]`` -> ``[n, o]`` float32."""
        if x.ndim != 2 or x.shape[1] != self.weight.shape[0]:
            raise ValueError(
                f"features must be [n, {self.weight.shape[0]}] for this surrogate, got "
                f"{tuple(x.shape)}"
            )
        dev = x.device
        z = (x.to(torch.float32) - self.mean.to(dev)) / self.scale.to(dev)
        hidden = torch.nn.functional.gelu(z @ self.w1.to(dev) + self.b1.to(dev))
        return z @ self.weight.to(dev) + self.bias.to(dev) + hidden @ self.w2.to(dev)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        names = ("mean", "scale", "weight", "bias", "w1", "b1", "w2")
        return {f"{prefix}.{k}": getattr(self, k) for k in names}


# The tensors of each form's layer, in its constructor's order (the file's names).
FORM_TENSORS: dict[str, tuple[str, ...]] = {
    "linear": ("mean", "scale", "weight", "bias"),
    "mlp": ("mean", "scale", "weight", "bias", "w1", "b1", "w2"),
}
FORM_CLASSES = {"linear": LinearSurrogate, "mlp": MLPSurrogate}


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


# ----------------------------------------------------------------------------- the scorer


def config_digest(shapes: dict[str, object]) -> str:
    """A short digest of a model's identity fields (``shapes``: JSON-able)."""
    text = json.dumps(shapes, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class SurrogateScorer:
    """One model's fitted surrogate: ``layers[layer_idx]`` per evicting layer, its ``features``
    kind, the ``model`` identity (``name``, ``shapes`` and their ``digest``) it was trained
    for, the ``recipe`` (version, teacher, training contexts, ridge alpha, form) and
    ``metrics`` measured held out; ``threshold``: the default log-score threshold measured for
    it (``kvzap/threshold=...``, S11), or ``None``. Every layer has one form (``form``)."""

    features: str
    layers: dict[int, LinearSurrogate | MLPSurrogate]
    model: dict[str, object]
    recipe: dict[str, object]
    metrics: dict[str, object] = field(default_factory=dict)
    threshold: float | None = None

    def __post_init__(self) -> None:
        check_choice(self.features, FEATURE_KINDS, "features")
        for key in ("name", "shapes", "digest"):
            if key not in self.model:
                raise ValueError(f"a scorer's model identity needs {key!r}; got {self.model}")
        kinds = {type(fit) for fit in self.layers.values()}
        if not kinds <= {LinearSurrogate, MLPSurrogate} or len(kinds) > 1:
            raise ValueError(
                "a scorer's layers must all be LinearSurrogate or all MLPSurrogate, got "
                f"{sorted(k.__name__ for k in kinds)}"
            )
        t = self.threshold
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)
        ):
            raise ValueError(f"threshold must be a finite log-score or None, got {t!r}")

    @property
    def form(self) -> str:
        """``"mlp"`` if the layers are ``MLPSurrogate``, else ``"linear"``."""
        mlp = any(isinstance(fit, MLPSurrogate) for fit in self.layers.values())
        return "mlp" if mlp else "linear"

    @property
    def name(self) -> str:
        return str(self.model["name"])

    def check_model(self, digest: str, name: str) -> None:
        """Refuse a model other than the one this scorer was trained for, by name."""
        if digest != self.model["digest"]:
            raise ValueError(
                f"the kvzap scorer {self.name!r} was trained for another model (config digest "
                f"{self.model['digest']}, shapes {self.model['shapes']}); model {name!r} has "
                f"digest {digest}: train one for it with `probkv train-scorer --model ...`"
            )

    def predict(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Layer ``layer_idx``'s predicted teacher log-scores ``[Hkv, t]`` float32 from its
        ``key``/``value [Hkv, t, d]`` (``"kv"`` features only)."""
        out = _predict_kv(self.check_layer(layer_idx), key, value)  # [t, Hkv]
        if out.shape[1] != key.shape[0]:
            raise ValueError(
                f"the kvzap scorer {self.name!r} predicts {out.shape[1]} KV heads; the layer "
                f"has {key.shape[0]} (kvzap scores every KV head of a layer together)"
            )
        return out.T.clamp(MIN_LOG_SCORE, 0.0).contiguous()

    def check_layer(self, layer_idx: int) -> LinearSurrogate | MLPSurrogate:
        """Layer ``layer_idx``'s fit, refused by name when the scorer cannot score it."""
        if self.features not in ATTENTION_FEATURE_KINDS:
            raise ValueError(
                f"a scorer with features {self.features!r} cannot score inside the attention "
                f"function; it needs one of {', '.join(ATTENTION_FEATURE_KINDS)}"
            )
        if layer_idx not in self.layers:
            raise ValueError(
                f"the kvzap scorer {self.name!r} has no layer {layer_idx} (it has "
                f"{sorted(self.layers)})"
            )
        return self.layers[layer_idx]


@dataclass(frozen=True)
class ScorerShard:
    """A ``SurrogateScorer`` on one tensor-parallel rank, which holds KV heads
    ``[first, first + count)`` of every layer while each head's prediction reads every KV head
    (S11). The linear term (and, in the MLP form, the hidden layer's input) is a sum over the
    heads' features, so the rank computes its heads' share of it (``partial``, ``[t, Hkv]``, or
    ``[t, Hkv + h]`` for ``h`` hidden units), ``all_reduce`` sums the ranks' shares (over the
    TP group: ``Hkv`` (+ ``h``) floats per position and layer, not the features), every rank
    applies the rest (the GELU layer), and keeps its own heads' rows: the unsplit prediction,
    up to the order of the sum."""

    scorer: SurrogateScorer
    first: int
    count: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor]

    @property
    def name(self) -> str:
        return self.scorer.name

    def partial(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``[t, Hkv]`` (MLP form: ``[t, Hkv + h]``) float32: this rank's heads'
        (``key``/``value [count, t, d]``) terms of every head's linear prediction (and of the
        hidden layer's input), without the intercepts."""
        fit = self.scorer.check_layer(layer_idx)
        if key.ndim != 3 or key.shape[0] != self.count:
            raise ValueError(
                f"a rank holding KV heads {self.first}..{self.first + self.count - 1} needs "
                f"keys [{self.count}, t, d], got {tuple(key.shape)}"
            )
        return _predict_kv(fit, key, value, heads=slice(self.first, self.first + self.count))

    def predict(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """This rank's heads' predicted log-scores ``[count, t]`` (``SurrogateScorer.predict``
        of the unsplit layer, these heads' rows)."""
        fit = self.scorer.check_layer(layer_idx)
        total = self.all_reduce(self.partial(layer_idx, key, value))
        out = _finish(fit, total + _folded(fit)[1].to(total.device))
        own = out[:, self.first : self.first + self.count]
        return own.T.clamp(MIN_LOG_SCORE, 0.0).contiguous()


def _folded(fit: LinearSurrogate | MLPSurrogate) -> tuple[torch.Tensor, torch.Tensor]:
    """The maps of raw features that a fit starts with, standardisation folded in:
    ``(W / scale, b - mean (W / scale))``, ``[f, m]`` and ``[m]``, with ``W`` the linear
    weight (``m = o``) or, for the MLP form, the linear weight and ``w1`` side by side
    (``m = o + h``, biases ``bias`` and ``b1``)."""
    weight, bias = fit.weight, fit.bias
    if isinstance(fit, MLPSurrogate):
        weight, bias = torch.cat([weight, fit.w1], 1), torch.cat([bias, fit.b1])
    w = weight / fit.scale.unsqueeze(1)
    return w, bias - fit.mean @ w


def _finish(fit: LinearSurrogate | MLPSurrogate, pre: torch.Tensor) -> torch.Tensor:
    """``[t, m]`` (``_folded``'s map of the features) -> the prediction ``[t, o]``: the same
    for the linear form; the linear part plus ``gelu(hidden input) @ w2`` for the MLP."""
    if not isinstance(fit, MLPSurrogate):
        return pre
    o = fit.weight.shape[1]
    hidden = torch.nn.functional.gelu(pre[:, o:])
    return pre[:, :o] + hidden @ fit.w2.to(pre.device)


def _predict_kv(
    fit: LinearSurrogate | MLPSurrogate,
    key: torch.Tensor,
    value: torch.Tensor,
    heads: slice | None = None,
) -> torch.Tensor:
    """``fit.predict(kv_features(key, value))`` without building the features: the
    standardisation folded into the weights (``_folded``), then one batched product per kind
    of feature, summed over heads, then the MLP's hidden layer (``_finish``). ``[t, o]``
    float32. With ``heads`` (the KV heads ``key``/``value`` hold, of the layer's), only those
    heads' terms of the folded map ``[t, m]``, without the intercepts
    (``ScorerShard.partial``)."""
    if key.ndim != 3 or value.ndim != 3 or key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"key and value must be [Hkv, t, d] of equal Hkv and t, got {tuple(key.shape)} "
            f"and {tuple(value.shape)}"
        )
    hkv, t, d = key.shape
    dv = value.shape[-1]
    per = dv + d // 2
    f = fit.weight.shape[0]
    total = hkv if heads is None else f // per
    if f != total * per or (heads is not None and len(range(total)[heads]) != hkv):
        raise ValueError(f"features must be [n, {f}] for this surrogate, got [{t}, {hkv * per}]")
    w, intercept = _folded(fit)
    w = w.to(key.device).view(total, per, w.shape[1])
    if heads is not None:
        w = w[heads]
    out = torch.bmm(value.to(torch.float32), w[:, :dv]).sum(0)
    out += torch.bmm(key_pair_norms(key), w[:, dv:]).sum(0)
    if heads is not None:
        return out
    return _finish(fit, out.add_(intercept.to(key.device)))


def check_scorer(value: object, name: str) -> SurrogateScorer | ScorerShard:
    if not isinstance(value, (SurrogateScorer, ScorerShard)):
        raise ValueError(
            f"{name} must be a probkv.scores.surrogate.SurrogateScorer (load_scorer(path)), got "
            f"{type(value).__name__}"
        )
    return value


def kvzap(
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    layer_idx: int | None,
    surrogate: SurrogateScorer | ScorerShard | None = None,
    sinks: int = 4,
) -> Scores:
    """The surrogate of KVzip's score (S11): ``surrogate``'s prediction of layer
    ``layer_idx``'s log max reconstruction attention from its keys and values, on KVzip's
    scale (clamped to ``[log FLOOR, 0]``); the first ``sinks`` entries are forced, as KVzip's."""
    if surrogate is None:
        raise ValueError(
            "score 'kvzap' needs a trained scorer: probkv.hf and probkv.vllm load the one "
            "shipped for the model, or pass "
            "score_params={'surrogate': probkv.scores.surrogate.load_scorer(path)}"
        )
    check_scorer(surrogate, "surrogate")
    if layer_idx is None:
        raise ValueError("score 'kvzap' needs the layer index (layer_idx)")
    check_positive_int(sinks, "sinks", allow_zero=True)
    log_scores = surrogate.predict(layer_idx, key, value)
    hkv, t = log_scores.shape
    f = min(sinks, t)
    if f == 0:
        return Scores(log_scores)
    log_scores[:, :f] = FORCED_LOG_SCORE
    forced = torch.zeros(hkv, t, dtype=torch.bool, device=log_scores.device)
    forced[:, :f] = True
    return Scores(log_scores, forced)


# ----------------------------------------------------------------------------- files


def _tensors(scorer: SurrogateScorer) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, layer in sorted(scorer.layers.items()):
        out.update({k: v.contiguous().cpu() for k, v in layer.tensors(f"layer{i}").items()})
    return out


def content_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names, shapes and float32 bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].to(torch.float32).contiguous()
        h.update(f"{name}:{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def save_scorer(scorer: SurrogateScorer, path: str | Path) -> str:
    """Write ``scorer`` to ``path`` (a torch file: a JSON header and the tensors); returns
    the content digest stored in the header."""
    tensors = _tensors(scorer)
    header = {
        "format": FILE_FORMAT,
        "recipe_version": RECIPE_VERSION,
        "features": scorer.features,
        "form": scorer.form,
        "threshold": scorer.threshold,
        "layers": sorted(scorer.layers),
        "model": scorer.model,
        "recipe": scorer.recipe,
        "metrics": scorer.metrics,
        "digest": content_digest(tensors),
    }
    torch.save({"header": json.dumps(header, sort_keys=True), "tensors": tensors}, Path(path))
    return header["digest"]


def load_scorer(path: str | Path) -> SurrogateScorer:
    """Read a file written by ``save_scorer``, checking its format, recipe version and
    content digest (``ValueError`` naming the file and what is wrong)."""
    path = Path(path)
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        header = json.loads(blob["header"])
        tensors = blob["tensors"]
    except (OSError, KeyError, TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{path}: not a probkv surrogate file ({err})") from err
    if header.get("format") != FILE_FORMAT:
        raise ValueError(f"{path}: format {header.get('format')!r}, expected {FILE_FORMAT!r}")
    if header.get("recipe_version") != RECIPE_VERSION:
        raise ValueError(
            f"{path}: recipe version {header.get('recipe_version')!r}; this probkv reads "
            f"version {RECIPE_VERSION}: train the scorer again (probkv train-scorer)"
        )
    if content_digest(tensors) != header.get("digest"):
        raise ValueError(f"{path}: content digest mismatch (the file is damaged)")
    form = header.get("form", "linear")  # files written before the MLP form are linear
    if form not in FORMS:
        raise ValueError(f"{path}: form {form!r}; this probkv reads {', '.join(FORMS)}")
    cls, names = FORM_CLASSES[form], FORM_TENSORS[form]
    layers = {i: cls(*(tensors[f"layer{i}.{k}"] for k in names)) for i in header["layers"]}
    return SurrogateScorer(
        header["features"],
        layers,
        header["model"],
        header["recipe"],
        header["metrics"],
        header.get("threshold"),
    )


@functools.cache
def shipped_scorers() -> tuple[SurrogateScorer, ...]:
    """Every scorer file shipped in the package (``SCORER_DIR``), read once."""
    return tuple(load_scorer(p) for p in sorted(SCORER_DIR.glob("*.pt")))


def scorer_names() -> tuple[str, ...]:
    """The registry models a scorer is shipped for (the files' names, none read)."""
    return tuple(p.stem for p in sorted(SCORER_DIR.glob("*.pt")))
