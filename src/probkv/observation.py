"""What one layer's prefill shows an eviction policy, from its real tensors (S2, S6).

``observe_layer`` is the one place where a layer's post-RoPE prefill ``query``, ``key`` and
``value`` become its attention output and a ``LayerObservation``: the policy's log-scores
and forced entries (``probkv.scores``) and the last query's attention (for diagnostics).
The integration calls it inside its attention function during prefill; the attention-error
experiment calls it on captured tensors; so both observe exactly the same numbers, and the
policies (``probkv.policies.select_layers``) turn them into the same kept sets.

Tensors follow docs/architecture.md: one layer, batch dropped; ``query [Hq, t, d]``,
``key``/``value [Hkv, t, d]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from probkv import attention as kernels
from probkv import scores


@dataclass(frozen=True)
class LayerObservation:
    """What the prefill of one evicting layer showed the policy."""

    layer_idx: int  # index in the model
    rank: int  # position among the evicting layers (0 = lowest), for layer budgets (PyramidKV)
    log_scores: torch.Tensor  # [Hkv, t] float32 (probkv.scores)
    forced: torch.Tensor | None  # [Hkv, t] bool: always kept, counted in the budget (SnapKV window)
    last_query_attention: torch.Tensor  # [Hkv, t] group-averaged p_t, for diagnostics (S6)

    @property
    def num_heads(self) -> int:
        return self.log_scores.shape[0]

    @property
    def length(self) -> int:
        return self.log_scores.shape[1]


def dense_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of the last ``q`` positions over ``n`` dense entries (no eviction),
    torch's SDPA. query ``[Hq, q, d]``, key/value ``[Hkv, n, d]`` -> ``[Hq, q, d_v]``."""
    q_len, n = query.shape[1], key.shape[1]
    mask = None
    is_causal = False
    if q_len == n:
        is_causal = q_len > 1
    elif q_len > 1:
        mask = causal_offset_mask(q_len, n, query.device)
    return F.scaled_dot_product_attention(
        query.unsqueeze(0),
        key.unsqueeze(0),
        value.unsqueeze(0),
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=query.shape[0] != key.shape[0],
    )[0]


def causal_offset_mask(q_len: int, n: int, device) -> torch.Tensor:
    """Bool ``[q, n]``: query ``i`` (at position ``n - q + i``) sees entries ``j <= n - q + i``."""
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (n - q_len)
    return torch.arange(n, device=device).unsqueeze(0) <= rows


def observe_layer(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    score: str,
    score_params: dict | None = None,
    layer_idx: int = 0,
    rank: int = 0,
) -> tuple[torch.Tensor, LayerObservation]:
    """A layer's prefill: its causal attention output ``[Hq, t, d_v]`` and the observation of
    ``score`` with ``score_params`` (S2). Scores built on all-rows column sums get them from
    the same chunked pass that computes the output (``chunk_size`` rows at a time if given);
    the others read the tensors directly and the output is torch's SDPA."""
    params = dict(score_params or {})
    t = key.shape[1]
    weighting = scores.column_sums_needed(score)
    column_sums = None
    if weighting is not None:
        weights = (
            kernels.uniform_row_weights if weighting == "uniform" else kernels.harmonic_row_weights
        )
        out, sums = kernels.causal_attention_with_column_sums(
            query,
            key,
            value,
            scale=scale,
            row_weights=weights(t).unsqueeze(0).to(query.device),
            chunk_size=params.get("chunk_size"),
        )
        column_sums = sums[0]
    else:
        out = dense_causal_attention(query, key, value, scale)
    result = scores.compute_scores(
        score, query, key, value, scale=scale, column_sums=column_sums, **params
    )
    observation = LayerObservation(
        layer_idx=layer_idx,
        rank=rank,
        log_scores=result.log_scores,
        forced=result.forced,
        last_query_attention=last_query_attention(query, key, scale),
    )
    return out, observation


def last_query_attention(query: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
    """``[Hkv, t]``: the last prefill query's attention ``p_t``, averaged over each GQA group
    (the retained-mass diagnostic of the eviction report, S6)."""
    t = key.shape[1]
    last = kernels.attention_rows(
        query[:, -1:], key, scale=scale, row_positions=torch.tensor([t - 1], device=query.device)
    )[:, 0]  # [Hq, t]
    return last.float().view(key.shape[0], -1, t).mean(1)
