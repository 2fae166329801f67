"""Proposal distributions over cache entries (S2).

A proposal ``pi`` is a distribution over the ``t`` prefix entries of one KV head, ``[..., t]``
float32, with full support: every entry gets at least ``FLOOR / t`` before renormalising,
so an importance weight ``1 / pi(i)`` is always finite (S2, S4). Proposals come from the
log-scores of ``probkv.scores``: ``pi_tau(i) ∝ exp(log_score(i) / tau)`` (temperature), then
``a * pi + (1 - a) / t`` (uniform mixing, ``a = uniform_mix``).

Entries that a method keeps unconditionally (``forced``, e.g. SnapKV's observation window,
S6) form a take-all stratum with weight 1: the proposal covers only the other entries, so
forced entries get probability exactly 0 and the uniform mixture and the floor are taken
over the ``n`` non-forced entries (``(1 - a) / n``, ``FLOOR / n``).

``max_pool_log_scores`` (S10, option ``pool``) spreads a high score to its neighbours before
the scores become a proposal, as SnapKV pools its scores (S6): a needle's neighbouring tokens
then share its score.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from probkv._checks import check_distribution, check_tau

# Full-support floor (S2): every entry of a proposal gets at least FLOOR / t before the
# distribution is renormalised.
FLOOR = 1e-12


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def with_floor(pi: torch.Tensor) -> torch.Tensor:
    """Full support (S2): ``pi`` normalised, every entry raised to at least ``FLOOR / t``,
    renormalised.

    ``pi``: ``[..., t]`` non-negative, finite, every row with positive mass (need not be
    normalised). Computed in float64; returned as float32 (float64 if ``pi`` is float64).
    Entries end at least ``FLOOR / (t (1 + FLOOR))``, i.e. ``FLOOR / t`` up to the
    renormalisation, which changes the others by a relative ``<= FLOOR``.
    """
    check_distribution(pi, "pi")
    p = pi.to(torch.float64)
    p = p / p.sum(-1, keepdim=True)
    p = p.clamp_min(FLOOR / p.shape[-1])
    return (p / p.sum(-1, keepdim=True)).to(_out_dtype(pi))


def _check_alpha(alpha: torch.Tensor | None, num_kv_heads: int, g: int) -> torch.Tensor | None:
    if alpha is None:
        return None
    if not isinstance(alpha, torch.Tensor):
        alpha = torch.as_tensor(alpha, dtype=torch.float64)
    if alpha.shape not in ((num_kv_heads * g,), (num_kv_heads, g)):
        raise ValueError(
            f"alpha must be [Hq] = [{num_kv_heads * g}] or [Hkv, g] = [{num_kv_heads}, {g}] "
            f"(one weight per query head), got shape {tuple(alpha.shape)}"
        )
    a = alpha.to(torch.float64).reshape(num_kv_heads, g)
    if not torch.isfinite(a).all() or (a < 0).any():
        raise ValueError(f"alpha must be finite and >= 0, got {alpha.tolist()}")
    if (a.sum(-1) <= 0).any():
        raise ValueError(
            f"alpha must give each GQA group positive total weight, got {alpha.tolist()}"
        )
    return a / a.sum(-1, keepdim=True)


def group_mixture(
    per_query_head: torch.Tensor, num_kv_heads: int, alpha: torch.Tensor | None = None
) -> torch.Tensor:
    """GQA (S2): one distribution per KV head, ``pi_G = sum_{h in G} alpha_h pi_h``.

    Args:
        per_query_head: ``[Hq, t]`` distributions (non-negative, finite, positive mass;
            each row is normalised first), query head ``h`` in group ``h // g``.
        num_kv_heads: ``Hkv``; ``Hq`` must be a multiple of it.
        alpha: per-query-head weights ``[Hq]`` or ``[Hkv, g]``, normalised within each
            group; ``None`` = uniform ``1 / g``.

    Returns:
        ``[Hkv, t]`` float32 (float64 if the input is float64), rows summing to 1.
    """
    check_distribution(per_query_head, "per_query_head")
    if per_query_head.ndim != 2:
        raise ValueError(f"per_query_head must be [Hq, t], got shape {tuple(per_query_head.shape)}")
    hq, t = per_query_head.shape
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be an integer >= 1, got {num_kv_heads!r}")
    if hq % num_kv_heads != 0:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of num_kv_heads ({num_kv_heads}) for GQA groups"
        )
    g = hq // num_kv_heads
    a = _check_alpha(alpha, num_kv_heads, g)
    p = per_query_head.to(torch.float64)
    p = (p / p.sum(-1, keepdim=True)).view(num_kv_heads, g, t)
    mixed = p.mean(1) if a is None else (a.to(p.device)[..., None] * p).sum(1)
    return mixed.to(_out_dtype(per_query_head))


def proposal_from_log_scores(
    log_scores: torch.Tensor,
    *,
    tau: float = 1.0,
    uniform_mix: float = 1.0,
    forced: torch.Tensor | None = None,
) -> torch.Tensor:
    """Proposal from log-scores (S2): temperature, uniform mixing, floor; forced entries 0.

    ``pi_tau = softmax(log_scores / tau)`` over the non-forced entries, then
    ``a * pi_tau + (1 - a) / n`` with ``a = uniform_mix`` and ``n`` the number of non-forced
    entries of the row (``n = t`` without ``forced``), then ``with_floor`` on those entries:
    each gets at least ``FLOOR / n`` before renormalising. ``tau = inf`` gives the uniform.

    Args:
        log_scores: ``[..., t]`` finite log-scores (``probkv.scores``).
        tau: temperature, ``> 0`` (``float('inf')`` allowed).
        uniform_mix: ``a`` in ``[0, 1]``: 1 keeps the tempered proposal, 0 is uniform.
        forced: optional bool ``[..., t]``: entries kept outside the sampling (S6), given
            probability 0. A row with every entry forced comes back all zeros.

    Returns:
        ``[..., t]`` float32; rows sum to 1 (0 for fully forced rows), full support on the
        non-forced entries. Computed in float64.
    """
    if not isinstance(log_scores, torch.Tensor) or not torch.is_floating_point(log_scores):
        raise ValueError(
            f"log_scores must be a floating-point tensor, got {type(log_scores).__name__}"
        )
    if log_scores.ndim == 0 or log_scores.shape[-1] == 0:
        raise ValueError(
            f"log_scores must have a non-empty last dimension (t >= 1), got shape {tuple(log_scores.shape)}"
        )
    if not torch.isfinite(log_scores).all():
        raise ValueError("log_scores contains NaN or infinite entries; log-scores must be finite")
    tau = check_tau(tau)
    if (
        isinstance(uniform_mix, bool)
        or not isinstance(uniform_mix, (int, float))
        or not (0.0 <= uniform_mix <= 1.0)
    ):
        raise ValueError(
            f"uniform_mix must be in [0, 1] (weight of the proposal against the uniform), got {uniform_mix!r}"
        )
    _check_forced(forced, log_scores)
    z = log_scores.to(torch.float64)
    free = torch.ones_like(z, dtype=torch.bool) if forced is None else ~forced
    n = free.sum(-1, keepdim=True).to(torch.float64)
    z = z.masked_fill(~free, -math.inf)
    # S2 temperature, softmax over the free entries; the row maximum is subtracted before
    # dividing by tau so that a tiny tau cannot overflow. Fully forced rows end all 0.
    z = z - z.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
    z = z.masked_fill(free, 0.0) if math.isinf(tau) else z / tau  # tau = inf: uniform
    pi = torch.exp(z)
    pi = pi / pi.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    uniform = free.to(torch.float64) / n.clamp_min(1.0)
    pi = uniform_mix * pi + (1.0 - uniform_mix) * uniform  # S2 uniform mixing
    pi = torch.maximum(pi, FLOOR * uniform)  # S2 floor FLOOR / n on the free entries
    pi = pi / pi.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    return pi.masked_fill(~free, 0.0).to(torch.float32)


def log_mass(
    log_scores: torch.Tensor, *, tau: float = 1.0, forced: torch.Tensor | None = None
) -> torch.Tensor:
    """``log sum_i exp(s_i / tau)`` per row over the non-forced entries (S9 global scope).

    For log-scores on the attention scale (``tau = 1``) this is the log of the attention mass a
    head's sampled entries carry: what its proposal weighs against the other heads' when one
    pps scale serves them all. ``tau = inf`` gives ``log n`` (every entry weighs 1, as the
    uniform proposal). Rows with every entry forced give ``-inf``.

    Returns float64 ``log_scores.shape[:-1]``.
    """
    if not isinstance(log_scores, torch.Tensor) or not torch.is_floating_point(log_scores):
        raise ValueError("log_scores must be a floating-point tensor")
    tau = check_tau(tau)
    _check_forced(forced, log_scores)
    z = log_scores.to(torch.float64)
    z = torch.zeros_like(z) if math.isinf(tau) else z / tau
    if forced is not None:
        z = z.masked_fill(forced, -math.inf)
    return torch.logsumexp(z, -1)


def check_pool_kernel(kernel: int, name: str = "pool") -> int:
    """A max-pooling kernel over positions: an odd integer ``>= 1`` (centred; 1 = no pooling)."""
    if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1 or kernel % 2 == 0:
        raise ValueError(
            f"{name} must be an odd integer >= 1 (centred max-pooling kernel over positions; "
            f"1 = no pooling), got {kernel!r}"
        )
    return kernel


def max_pool_log_scores(
    log_scores: torch.Tensor, kernel: int, *, forced: torch.Tensor | None = None
) -> torch.Tensor:
    """Max-pooled log-scores over positions (S10; SnapKV's max-pooling, S6, on any score).

    Entry ``i`` gets ``max {log_scores[j] : |i - j| <= kernel // 2, j not forced}`` (the window
    is clipped at the ends of the row; it always holds ``i`` itself, so the result is finite
    where ``log_scores`` is). Since ``exp`` is increasing this is the log of the max-pooled
    scores. Forced entries keep their own log-score and lend it to no neighbour: their score is
    a placeholder (``probkv.scores.FORCED_LOG_SCORE``), and they are kept anyway.
    ``kernel = 1`` returns ``log_scores`` unchanged.

    Args:
        log_scores: ``[..., t]`` floating-point log-scores.
        kernel: odd integer ``>= 1`` (``check_pool_kernel``).
        forced: optional bool ``[..., t]`` mask of entries kept outside the sampling.

    Returns:
        a tensor of ``log_scores``' shape and dtype.
    """
    kernel = check_pool_kernel(kernel, "kernel")
    if not isinstance(log_scores, torch.Tensor) or not torch.is_floating_point(log_scores):
        raise ValueError(
            f"log_scores must be a floating-point tensor, got {type(log_scores).__name__}"
        )
    if log_scores.ndim == 0 or log_scores.shape[-1] == 0:
        raise ValueError(
            f"log_scores must have a non-empty last dimension, got shape {tuple(log_scores.shape)}"
        )
    _check_forced(forced, log_scores)
    if kernel == 1:
        return log_scores
    lent = log_scores if forced is None else log_scores.masked_fill(forced, -math.inf)
    rows = lent.reshape(-1, 1, log_scores.shape[-1])
    # max_pool1d pads with -inf: the window is clipped at both ends
    pooled = F.max_pool1d(rows, kernel, stride=1, padding=kernel // 2).reshape(log_scores.shape)
    return pooled if forced is None else torch.where(forced, log_scores, pooled)


def _check_forced(forced: torch.Tensor | None, log_scores: torch.Tensor) -> None:
    """``forced``: ``None`` or a bool mask of ``log_scores``' shape (entries kept outside the
    sampling, S2, S6)."""
    if forced is not None and (
        not isinstance(forced, torch.Tensor)
        or forced.dtype != torch.bool
        or forced.shape != log_scores.shape
    ):
        raise ValueError(
            f"forced must be a bool tensor of the log_scores' shape {tuple(log_scores.shape)}, got "
            f"{getattr(forced, 'dtype', type(forced).__name__)} {tuple(getattr(forced, 'shape', ()))}"
        )
