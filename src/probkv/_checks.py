"""Input checks shared by every layer of probkv.

Each check raises ``ValueError`` naming the argument, the bad value and what is allowed,
so a user never gets a silent wrong answer (see docs/architecture.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch


def check_ratio(ratio: float, name: str = "ratio") -> float:
    """Compression ratio ``r`` (S1): the fraction of prefix entries evicted, in [0, 1)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise ValueError(f"{name} must be a number in [0, 1), got {ratio!r}")
    r = float(ratio)
    if not (0.0 <= r < 1.0) or math.isnan(r):
        raise ValueError(f"{name} must be in [0, 1) (fraction of entries evicted), got {ratio!r}")
    return r


def check_choice(value: str, allowed: Iterable[str], name: str) -> str:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value


def check_positive_int(value: int, name: str, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_tau(tau: float, name: str = "tau") -> float:
    """Temperature of the importance weights (S4): ``tau > 0``; ``inf`` means no correction."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or math.isnan(tau) or tau <= 0:
        raise ValueError(f"{name} must be > 0 (float('inf') disables correction), got {tau!r}")
    return float(tau)


def check_distribution(pi: torch.Tensor, name: str = "pi") -> torch.Tensor:
    """A batch of distributions over the last dimension: finite, non-negative, positive mass."""
    if not isinstance(pi, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(pi).__name__}")
    if pi.ndim == 0 or pi.shape[-1] == 0:
        raise ValueError(
            f"{name} must have a non-empty last dimension (t >= 1), got shape {tuple(pi.shape)}"
        )
    if not torch.is_floating_point(pi):
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {pi.dtype}")
    if not torch.isfinite(pi).all():
        raise ValueError(f"{name} contains NaN or infinite entries; probabilities must be finite")
    if (pi < 0).any():
        raise ValueError(
            f"{name} has negative entries (min {pi.min().item():.3g}); probabilities must be >= 0"
        )
    if (pi.sum(-1) <= 0).any():
        raise ValueError(f"{name} has a row with zero total mass; every row needs positive mass")
    return pi


def check_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None = None) -> int:
    """Shapes of one layer's tensors (docs/architecture.md): query ``[Hq, t, d]``, key/value
    ``[Hkv, t, d]`` with ``Hq`` a multiple of ``Hkv``. Returns the group size ``g = Hq // Hkv``."""
    if query.ndim != 3 or key.ndim != 3:
        raise ValueError(
            f"query must be [Hq, t, d] and key [Hkv, t, d]; got query {tuple(query.shape)}, key {tuple(key.shape)}"
        )
    if key.shape[1] == 0:
        raise ValueError("key has no entries (t = 0); eviction needs t >= 1")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query head dim {query.shape[-1]} != key head dim {key.shape[-1]}")
    if query.shape[0] % key.shape[0] != 0:
        raise ValueError(
            f"query heads ({query.shape[0]}) must be a multiple of KV heads ({key.shape[0]}) for GQA groups"
        )
    if value is not None and (value.ndim != 3 or value.shape[:2] != key.shape[:2]):
        raise ValueError(
            f"value must be [Hkv, t, d_v] matching key {tuple(key.shape)}, got {tuple(value.shape)}"
        )
    return query.shape[0] // key.shape[0]


def check_odd_int(value: int, name: str) -> int:
    """An odd integer >= 1 (a centred pooling kernel keeps the length)."""
    value = check_positive_int(value, name)
    if value % 2 == 0:
        raise ValueError(f"{name} must be odd (centred pooling keeps the length), got {value}")
    return value


def check_token_ids(ids: Sequence[int] | torch.Tensor, name: str) -> torch.Tensor:
    """``[1, n]`` int64 token ids from a list or a ``[n]`` / ``[1, n]`` tensor (``n >= 1``)."""
    tensor = torch.as_tensor(ids, dtype=torch.int64)
    if tensor.ndim == 2 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.ndim != 1 or tensor.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of token ids, got {ids!r}")
    return tensor.unsqueeze(0)
