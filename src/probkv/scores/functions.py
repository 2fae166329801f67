"""The score functions: classic eviction scores as log-scores per KV head (S2, S5, S6).

Every score is returned in the log domain, ``[Hkv, t]`` float32 and finite, so that a top-k
method (S5) is ``topk(log_scores)`` and the matching proposal (S2) is
``softmax(log_scores / tau)`` (``probkv.scores.proposals.proposal_from_log_scores``).

Attention-derived scores (``h2o``, ``h2o-h``, ``min``, ``min-h``, ``snapkv``) are computed per
query head, normalised into a distribution over the scored entries, mixed within each GQA
group (``probkv.scores.proposals.group_mixture``: uniform ``alpha`` unless given, S2), floored
(``probkv.scores.proposals.with_floor``: every entry at least ``FLOOR / t`` before renormalising)
and logged; at ``tau = 1`` their proposal is exactly that floored mixture. A query head
whose score has no mass at all (e.g. ``min`` with all-zero values) counts as uniform.
(``snapkv(gqa="mean")`` instead averages the raw scores of the group, as SnapKV's
reference implementations do; see ``snapkv``.)

``forced`` marks entries a method keeps outside its budget competition (SnapKV's
observation window, S6): they count against the budget, and in the probabilistic variant
they are a take-all stratum with weight 1 while the proposal covers the other entries.

Each function here is one row of ``probkv.scores.SCORE_TABLE``, which declares what it reads
and its parameters; everything else reaches the functions through ``probkv.scores``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from probkv._checks import check_choice, check_heads, check_odd_int, check_positive_int
from probkv.scores.column_sums import (
    attention_rows,
    causal_attention_with_column_sums,
    harmonic_row_weights,
    uniform_row_weights,
)
from probkv.scores.proposals import FLOOR, group_mixture, with_floor

# How snapkv pools the window's attention and combines a GQA group's query heads (see snapkv).
SNAPKV_POOLING: tuple[str, ...] = ("max", "avg")
SNAPKV_GQA: tuple[str, ...] = ("mixture", "mean")

# Log-score of a forced entry: log 2 exceeds every log-probability (<= 0), so even a plain
# top-k that ignores ``forced`` ranks the forced entries first.
FORCED_LOG_SCORE = math.log(2.0)


@dataclass(frozen=True)
class Scores:
    """Log-scores of one layer (S2, S5).

    ``log_scores``: ``[Hkv, t]`` float32, finite; larger = more important.
    ``forced``: ``[Hkv, t]`` bool mask of entries always kept (counted against the budget,
    weight 1 in the probabilistic variant, S6), or ``None``.
    """

    log_scores: torch.Tensor
    forced: torch.Tensor | None = None

    def __post_init__(self) -> None:
        ls = self.log_scores
        if ls.ndim != 2 or ls.dtype != torch.float32:
            raise ValueError(
                f"log_scores must be float32 [Hkv, t], got {ls.dtype} {tuple(ls.shape)}"
            )
        if not torch.isfinite(ls).all():
            raise ValueError("log_scores must be finite")
        if self.forced is not None and (
            self.forced.dtype != torch.bool or self.forced.shape != ls.shape
        ):
            raise ValueError(
                f"forced must be a bool mask of shape {tuple(ls.shape)}, got "
                f"{self.forced.dtype} {tuple(self.forced.shape)}"
            )


# ----------------------------------------------------------------------------- helpers


def _normalised_rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` non-negative scores -> float64 distributions; massless rows -> uniform."""
    x = x.to(torch.float64)
    total = x.sum(-1, keepdim=True)
    uniform = torch.full_like(x, 1.0 / x.shape[-1])
    return torch.where(total > 0, x / total.clamp_min(torch.finfo(torch.float64).tiny), uniform)


def group_log_scores(
    per_query_head: torch.Tensor, num_kv_heads: int, alpha: torch.Tensor | None
) -> torch.Tensor:
    """S2 GQA: normalise per query head, mix within groups, floor, log -> ``[Hkv, n]`` f32."""
    pi = group_mixture(_normalised_rows(per_query_head), num_kv_heads, alpha)
    return torch.log(with_floor(pi).to(torch.float64)).to(torch.float32)


def check_layer_tensors(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None) -> int:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x is not None and (not isinstance(x, torch.Tensor) or not torch.is_floating_point(x)):
            raise ValueError(
                f"{name} must be a floating-point torch.Tensor, got {type(x).__name__}"
            )
    g = check_heads(query, key, value)
    if query.shape[1] != key.shape[1]:
        raise ValueError(
            f"query length {query.shape[1]} must equal key length {key.shape[1]} (prefill)"
        )
    return g


def _column_sums(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    scale: float,
    weights: Literal["uniform", "harmonic"],
    column_sums: torch.Tensor | None,
    chunk_size: int | None,
) -> torch.Tensor:
    """``[Hq, t]`` column sums of one row weighting (S2), given or computed in row chunks."""
    hq, t = query.shape[0], key.shape[1]
    if column_sums is not None:
        if not isinstance(column_sums, torch.Tensor) or column_sums.shape != (hq, t):
            raise ValueError(
                f"column_sums must be [Hq, t] = [{hq}, {t}] (one {weights}-weighted row of "
                f"causal_attention_with_column_sums' output), got "
                f"{tuple(getattr(column_sums, 'shape', ()))}"
            )
        if not torch.isfinite(column_sums).all() or (column_sums < 0).any():
            raise ValueError("column_sums must be finite and >= 0 (sums of probabilities)")
        return column_sums
    make = uniform_row_weights if weights == "uniform" else harmonic_row_weights
    _, sums = causal_attention_with_column_sums(
        query, key, None, scale=scale, row_weights=make(t)[None], chunk_size=chunk_size
    )
    return sums[0]


def value_norms(value: torch.Tensor, g: int) -> torch.Tensor:
    """``[Hq, t]`` float64 ``||v_i||_2`` of each query head's KV head."""
    norms = torch.linalg.vector_norm(value, dim=-1, dtype=torch.float64)  # no float64 copy of V
    return norms.repeat_interleave(g, 0)


def _last_row(query: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
    """``[Hq, t]``: ``p_t``, the last query's causal attention (S1)."""
    t = key.shape[1]
    return attention_rows(query[:, -1:], key, scale=scale, row_positions=[t - 1])[:, 0]


# ------------------------------------------------------------------------------ scores


def _accumulated_attention(weights: Literal["uniform", "harmonic"], name: str, doc: str):
    """An H2O score of one row weighting (S2): the log of each entry's weighted column sums,
    per query head normalised, GQA group mixture with ``alpha``, floored. Computed in row
    chunks (never ``t x t``) unless the ``column_sums [Hq, t]`` of that weighting, from
    ``causal_attention_with_column_sums``, are given."""

    def score(
        query: torch.Tensor,
        key: torch.Tensor,
        *,
        scale: float,
        chunk_size: int | None = None,
        column_sums: torch.Tensor | None = None,
        alpha: torch.Tensor | None = None,
    ) -> Scores:
        check_layer_tensors(query, key, None)
        sums = _column_sums(
            query, key, scale=scale, weights=weights, column_sums=column_sums, chunk_size=chunk_size
        )
        return Scores(group_log_scores(sums, key.shape[0], alpha))

    score.__name__ = score.__qualname__ = name
    score.__doc__ = doc
    return score


h2o = _accumulated_attention(
    "uniform",
    "h2o",
    """H2O (S2, S5): ``log sum_j p_j(i)``, column sums over every causal row (uniform
    weights); ``column_sums``: the uniform ``[Hq, t]`` sums if already computed.""",
)
h2o_harmonic = _accumulated_attention(
    "harmonic",
    "h2o_harmonic",
    """H2O with the harmonic prior (S2 ``h2o-h``): ``log sum_j h_j p_j(i)``,
    ``h_j = 1 / ((t - j + 1) H_t)`` (recent rows weigh most). ``column_sums``: the
    harmonic-weighted ``[Hq, t]`` sums if already computed.""",
)


def min_variance(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    alpha: torch.Tensor | None = None,
) -> Scores:
    """Minimum-variance proposal for the last query (S2 ``min``): ``log p_t(i) ||v_i||_2``."""
    if value is None:
        raise ValueError("value is required for the 'min' score (pi ∝ p_t(i) * ||v_i||)")
    g = check_layer_tensors(query, key, value)
    per_head = _last_row(query, key, scale).to(torch.float64) * value_norms(value, g)
    return Scores(group_log_scores(per_head, key.shape[0], alpha))


def min_variance_harmonic(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    chunk_size: int | None = None,
    column_sums: torch.Tensor | None = None,
    alpha: torch.Tensor | None = None,
) -> Scores:
    """S2 ``min-h``: ``log sum_j h_j p_j(i) ||v_i||_2`` (harmonic column sums times value
    norms); ``column_sums``: the harmonic-weighted ``[Hq, t]`` sums if already computed."""
    if value is None:
        raise ValueError("value is required for the 'min-h' score (pi ∝ sum_j h_j p_j(i) ||v_i||)")
    g = check_layer_tensors(query, key, value)
    sums = _column_sums(
        query, key, scale=scale, weights="harmonic", column_sums=column_sums, chunk_size=chunk_size
    )
    per_head = sums.to(torch.float64) * value_norms(value, g)
    return Scores(group_log_scores(per_head, key.shape[0], alpha))


def _group_mean(
    per_query_head: torch.Tensor, num_kv_heads: int, alpha: torch.Tensor | None
) -> torch.Tensor:
    """``[Hkv, n]`` float64: the ``alpha``-weighted mean of the *raw* per-query-head scores of
    each GQA group (no per-head normalisation; uniform weights ``1 / g`` by default)."""
    hq, n = per_query_head.shape
    g = hq // num_kv_heads
    x = per_query_head.to(torch.float64).view(num_kv_heads, g, n)
    if alpha is None:
        return x.mean(1)
    # group_mixture of one-hot rows returns the group weights [Hkv, g], validated and
    # normalised within each group exactly as for the mixture.
    one_hot = torch.eye(g, dtype=torch.float64, device=x.device).repeat(num_kv_heads, 1)
    weights = group_mixture(one_hot, num_kv_heads, alpha).to(torch.float64)
    return (weights.unsqueeze(-1) * x).sum(1)


def snapkv(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    scale: float,
    window: int = 32,
    kernel: int = 7,
    pooling: Literal["max", "avg"] = "max",
    gqa: Literal["mixture", "mean"] = "mixture",
    alpha: torch.Tensor | None = None,
) -> Scores:
    """SnapKV (S6): pooled attention of the observation window to the prefix; window forced.

    With ``w = min(window, t)``, the last ``w`` queries (rows ``t-w..t-1``) are the
    observation window. For each query head: their causal attention (softmax over all
    ``j + 1`` visible keys, window keys included) restricted to the prefix columns
    ``0..t-w-1`` and averaged over the window rows; then a 1-D pooling of size ``kernel``
    (odd), stride 1, ``kernel // 2`` padding on each side (max: padding never wins; avg:
    zero padding counted in the mean, as ``avg_pool1d``). The query heads of a GQA group
    are then combined (weights ``alpha``, uniform by default) in one of two ways:

    - ``gqa="mixture"`` (S2's group mixture): each query head's pooled scores are first
      normalised into a distribution over the prefix; the KV head's log-scores are the log of
      the floored mixture, a distribution over the prefix.
    - ``gqa="mean"`` (SnapKV's GQA form in kvpress and in Ada-KV's reference code): the
      *raw* pooled scores are averaged, with no normalisation, so every KV head keeps its
      window's attention mass on the prefix. This is the scale on which Ada-KV compares heads
      (the retained attention mass of its bound, S6): a head whose window attends mostly to
      itself has little prefix mass and competes with low scores. Entries are floored at
      ``FLOOR / (t - w)`` (attention that underflowed) before the log.

    The window's own ``w`` entries are ``forced`` (kept always, counted against the budget)
    with log-score ``FORCED_LOG_SCORE``; if ``t <= window`` every entry is forced. With
    ``g = 1`` both ``gqa`` forms rank a head's entries identically.

    Where the references differ (probkv's choice last; docs/methods.md has the full table):
      - The SnapKV reference code sums over the window, Ada-KV and kvpress average: same
        ranking, and for ``gqa="mean"`` the same cross-head comparison up to a common factor.
      - Window columns: the paper's code, Ada-KV's and kvpress all score only the prefix,
        softmax over the full causal row, no renormalisation; so do we.
      - Defaults: the SnapKV reference code uses avg-pooling, kernel 5, window 32; kvpress
        avg, kernel 5, window 64; Ada-KV max-pooling, kernel 7, window 32. probkv follows
        S6: max, kernel 7, window 32.
      - GQA: the SnapKV reference code scores every query head on its own (repeated keys, no
        GQA support); kvpress and Ada-KV average the raw pooled scores of the group
        (``"mean"``, what probkv's SnapKV policies use). ``"mixture"`` (this function's
        default, the S2 contract of every attention score) differs only in how query heads
        whose window looks mostly at itself are weighted.
    """
    check_layer_tensors(query, key, None)
    check_positive_int(window, "window")
    check_odd_int(kernel, "kernel")
    check_choice(pooling, SNAPKV_POOLING, "pooling")
    check_choice(gqa, SNAPKV_GQA, "gqa")
    hkv, t = key.shape[:2]
    w = min(window, t)
    prefix = t - w
    forced = torch.zeros(hkv, t, dtype=torch.bool, device=key.device)
    forced[:, prefix:] = True
    log_scores = torch.full((hkv, t), FORCED_LOG_SCORE, dtype=torch.float32, device=key.device)
    if prefix == 0:
        return Scores(log_scores, forced)
    rows = attention_rows(
        query[:, prefix:], key, scale=scale, row_positions=torch.arange(prefix, t)
    )  # [Hq, w, t]
    observed = rows[..., :prefix].mean(1, dtype=torch.float64)  # [Hq, prefix]
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    pooled = pool(observed[:, None, :], kernel_size=kernel, stride=1, padding=kernel // 2)[:, 0]
    if gqa == "mixture":
        log_scores[:, :prefix] = group_log_scores(pooled, hkv, alpha)
    else:
        mean = _group_mean(pooled, hkv, alpha).clamp_min(FLOOR / prefix)
        log_scores[:, :prefix] = torch.log(mean).to(torch.float32)
    return Scores(log_scores, forced)


def tova(query: torch.Tensor, key: torch.Tensor, *, scale: float) -> Scores:
    """TOVA (S2, S5): ``log`` of the last query's attention averaged over all query heads of
    the layer; every KV head gets the same score. Floored."""
    check_layer_tensors(query, key, None)
    mean = _normalised_rows(_last_row(query, key, scale)).mean(0)  # [t]
    log_scores = torch.log(with_floor(mean).to(torch.float64)).to(torch.float32)
    return Scores(log_scores.expand(key.shape[0], -1).contiguous())


def knorm(key: torch.Tensor) -> Scores:
    """K-norm (S2, S5): score ``-||k_i||_2`` (a low key norm marks an important entry, as in
    Devoto et al. 2024; the paper's text says ``||v||``, the cited method uses keys)."""
    if not isinstance(key, torch.Tensor) or not torch.is_floating_point(key) or key.ndim != 3:
        raise ValueError(
            f"key must be a floating-point [Hkv, t, d] tensor, got {getattr(key, 'shape', type(key).__name__)}"
        )
    if key.shape[1] == 0:
        raise ValueError("key has no entries (t = 0); eviction needs t >= 1")
    norms = torch.linalg.vector_norm(key.to(torch.float64), dim=-1)
    if not torch.isfinite(norms).all():
        raise ValueError("key contains NaN or infinite entries")
    return Scores((-norms).to(torch.float32))


def streaming_llm(
    t: int, num_kv_heads: int, *, sinks: int = 4, device: torch.device | str | None = None
) -> Scores:
    """StreamingLLM (S2, S5): attention sinks plus recency, as log-scores.

    With ``s = min(sinks, t)`` sinks and ``n = t - s`` other entries, the log-scores are
    ``log 2`` for the sinks and ``log((i - s + 1) / n)`` for entry ``i = s..t-1``
    (0-based), i.e. each sink is twice as likely as the newest entry. Hence:
      - top-k for any ``k >= s``: exactly the ``s`` sinks plus the ``k - s`` most recent
        entries (sinks score above every other entry, the rest strictly increase with
        position; distinct in float32 for ``t`` up to about 2e7);
      - ``softmax`` (tau = 1) is the mixture ``lam * Uniform(sinks) + (1 - lam) * r`` with
        the linear recency distribution ``r(i) = 2 (i - s + 1) / (n (n + 1))`` (increasing)
        and sink weight ``lam = 4 s / (4 s + n + 1)`` (``lam = 1`` when ``t <= sinks``).
    """
    check_positive_int(t, "t")
    check_positive_int(num_kv_heads, "num_kv_heads")
    check_positive_int(sinks, "sinks", allow_zero=True)
    s = min(sinks, t)
    n = t - s
    scores = torch.full((t,), FORCED_LOG_SCORE, dtype=torch.float64)
    if n:
        scores[s:] = torch.log(torch.arange(1, n + 1, dtype=torch.float64) / n)
    return Scores(scores.to(torch.float32).expand(num_kv_heads, t).contiguous().to(device))


def uniform(t: int, num_kv_heads: int, *, device: torch.device | str | None = None) -> Scores:
    """Uniform (S2): all log-scores 0; its proposal is the uniform distribution."""
    check_positive_int(t, "t")
    check_positive_int(num_kv_heads, "num_kv_heads")
    return Scores(torch.zeros(num_kv_heads, t, dtype=torch.float32, device=device))
