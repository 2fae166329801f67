"""The surrogate's form (S11): the features it reads and the two fitted maps of them.

- features (``FEATURE_KINDS``): ``"kv"``, each KV head's value and the norms of its key's
  RoPE pairs (a rotation by position leaves them unchanged, so post-RoPE keys give exactly
  the pre-RoPE pair norms), concatenated over the layer's KV heads: ``Hkv * 3d / 2``
  features, all of them in what the attention function receives; ``"kv-unrot"``, values and
  the keys rotated back to position 0 (needs the positions); ``"hidden"``, the layer's
  normalised input hidden state (what the key and value projections read; not handed to the
  attention function).
- forms (``FORMS``): ``LinearSurrogate`` (a linear map of standardised features) and
  ``MLPSurrogate`` (KVzap's two layers: a GELU hidden layer beside the linear term).
- ``predict_kv``: a fit's prediction straight from keys and values, the standardisation
  folded into the weights (``folded_map``, ``finish``), per KV head or for some heads only
  (a tensor-parallel rank's share).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from probkv.scores.proposals import FLOOR

FEATURE_KINDS: tuple[str, ...] = ("kv", "kv-unrot", "hidden")
# The scorer's forms: a linear map of the features, or KVzap's two layers (MLPSurrogate).
FORMS: tuple[str, ...] = ("linear", "mlp")
# Features the attention function can compute from its own inputs, at prefill and at decode.
ATTENTION_FEATURE_KINDS: tuple[str, ...] = ("kv",)
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


# ----------------------------------------------------------------------------- forms


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


# ----------------------------------------------------------------------------- prediction


def folded_map(fit: LinearSurrogate | MLPSurrogate) -> tuple[torch.Tensor, torch.Tensor]:
    """The maps of raw features that a fit starts with, standardisation folded in:
    ``(W / scale, b - mean (W / scale))``, ``[f, m]`` and ``[m]``, with ``W`` the linear
    weight (``m = o``) or, for the MLP form, the linear weight and ``w1`` side by side
    (``m = o + h``, biases ``bias`` and ``b1``)."""
    weight, bias = fit.weight, fit.bias
    if isinstance(fit, MLPSurrogate):
        weight, bias = torch.cat([weight, fit.w1], 1), torch.cat([bias, fit.b1])
    w = weight / fit.scale.unsqueeze(1)
    return w, bias - fit.mean @ w


def finish(fit: LinearSurrogate | MLPSurrogate, pre: torch.Tensor) -> torch.Tensor:
    """``[t, m]`` (``folded_map``'s map of the features) -> the prediction ``[t, o]``: the same
    for the linear form; the linear part plus ``gelu(hidden input) @ w2`` for the MLP."""
    if not isinstance(fit, MLPSurrogate):
        return pre
    o = fit.weight.shape[1]
    hidden = torch.nn.functional.gelu(pre[:, o:])
    return pre[:, :o] + hidden @ fit.w2.to(pre.device)


def predict_kv(
    fit: LinearSurrogate | MLPSurrogate,
    key: torch.Tensor,
    value: torch.Tensor,
    heads: slice | None = None,
) -> torch.Tensor:
    """``fit.predict(kv_features(key, value))`` without building the features: the
    standardisation folded into the weights (``folded_map``), then one batched product per kind
    of feature, summed over heads, then the MLP's hidden layer (``finish``). ``[t, o]``
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
    w, intercept = folded_map(fit)
    w = w.to(key.device).view(total, per, w.shape[1])
    if heads is not None:
        w = w[heads]
    out = torch.bmm(value.to(torch.float32), w[:, :dv]).sum(0)
    out += torch.bmm(key_pair_norms(key), w[:, dv:]).sum(0)
    if heads is not None:
        return out
    return finish(fit, out.add_(intercept.to(key.device)))
