"""probkv's attention function, registered in transformers' ``AttentionInterface`` (SPEC S4).

transformers calls ``cache.update(key, value, layer_idx, kwargs=kwargs)`` and then the
registered attention function with ``**kwargs``; ``EvictingLayer.update`` puts itself into that
dict, so this function receives the layer as ``probkv_layer``. Layers that are not evicting
(Gemma-3's sliding-window layers, or a plain ``DynamicCache``) get transformers' own SDPA path.

For an evicting layer there are three cases:
- prefill (first forward, not yet observed): the layer's output and the policy's statistics come
  from the real post-RoPE tensors, in one pass for the all-rows proposals (S2);
- before eviction otherwise: dense causal attention;
- after eviction: one softmax over the ragged weighted prefix (logits ``+ log w``, S4) and the
  dense tail of tokens added since, which carries no weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from probkv import attention as kernels
from probkv import scores as score_fns
from probkv.policies.base import LayerObservation

ATTN_IMPLEMENTATION = "probkv"


def probkv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    probkv_layer=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``"probkv"`` attention implementation. Returns ``([B, q, Hq, d_v], None)``."""
    if probkv_layer is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("probkv does not support attention logit soft-capping (softcap)")
    layer = probkv_layer
    layer._awaiting_attention = False
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q_len = query.shape[2]
    if layer.reconstruction is not None:  # reconstruction pass (S10.1): probkv.hf.reconstruction
        out = layer.reconstruction.attend(layer, query[0], scale)
    elif layer.is_evicted:
        out = evicted_attention(layer, query[0], scale)
    elif layer.report is None and layer.observation is None and layer.tail_length == q_len:
        out = observe_prefill(layer, query[0], key[0], value[0], scale)
        if layer.policy.layerwise:
            from probkv.hf.cache import apply_selection

            (selection,) = layer.policy.select([layer.observation], num_layers=layer.num_evicting)
            apply_selection(layer, selection, layer.policy)
    else:
        out = dense_attention(query[0], key[0], value[0], scale)
    return out.unsqueeze(0).transpose(1, 2).contiguous(), None


def observe_prefill(layer, query, key, value, scale: float) -> torch.Tensor:
    """Prefill of an evicting layer: its attention output, and the policy's log-scores from the
    same post-RoPE tensors (one chunked pass when the score needs every row, S2)."""
    policy = layer.policy
    t = key.shape[1]
    if score_fns.needs_reconstruction(policy.score):
        # S10.1: the scores come from the reconstruction pass run after every layer's prefill
        # (probkv.hf.reconstruction); keep p_t for the eviction report until then.
        layer.pending_reconstruction = _last_query_attention(query, key, scale)
        return dense_attention(query, key, value, scale)
    weighting = score_fns.column_sums_needed(policy.score)
    column_sums = None
    if weighting is not None:
        row_weights = (
            kernels.uniform_row_weights(t)
            if weighting == "uniform"
            else kernels.harmonic_row_weights(t)
        )
        out, sums = kernels.causal_attention_with_column_sums(
            query, key, value, scale=scale, row_weights=row_weights.unsqueeze(0).to(query.device)
        )
        column_sums = sums[0]
    else:
        out = dense_attention(query, key, value, scale)
    scores = score_fns.compute_scores(
        policy.score, query, key, value, scale=scale, column_sums=column_sums, **policy.score_params
    )
    layer.observation = LayerObservation(
        layer_idx=layer.layer_idx,
        rank=layer.rank,
        log_scores=scores.log_scores,
        forced=scores.forced,
        last_query_attention=_last_query_attention(query, key, scale),
    )
    return out


def _last_query_attention(query, key, scale: float) -> torch.Tensor:
    """``[Hkv, t]``: the last query's attention ``p_t``, averaged over each GQA group (S6)."""
    t = key.shape[1]
    last = kernels.attention_rows(
        query[:, -1:], key, scale=scale, row_positions=torch.tensor([t - 1], device=query.device)
    )[:, 0]  # [Hq, t]
    return last.float().view(key.shape[0], -1, t).mean(1)


def dense_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of the last ``q`` positions over ``n`` dense entries (no eviction).
    query ``[Hq, q, d]``, key/value ``[Hkv, n, d]`` -> ``[Hq, q, d_v]``."""
    q_len, n = query.shape[1], key.shape[1]
    mask = None
    is_causal = False
    if q_len == n:
        is_causal = q_len > 1
    elif q_len > 1:
        mask = _causal_offset_mask(q_len, n, query.device)
    return F.scaled_dot_product_attention(
        query.unsqueeze(0),
        key.unsqueeze(0),
        value.unsqueeze(0),
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=query.shape[0] != key.shape[0],
    )[0]


def _causal_offset_mask(q_len: int, n: int, device) -> torch.Tensor:
    """Bool ``[q, n]``: query ``i`` (at position ``n - q + i``) sees entries ``j <= n - q + i``."""
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (n - q_len)
    return torch.arange(n, device=device).unsqueeze(0) <= rows


def evicted_attention(layer, query: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention after eviction (S4, Algorithm 1 in its fast form): prefix logits get
    ``+ log w`` and share one softmax with the tail, whose newest ``q`` entries are the queries
    themselves (causal among them). query ``[Hq, q, d]`` -> ``[Hq, q, d_v]``."""
    prefix = layer.prefix
    h = layer.num_heads
    hq, q_len, d = query.shape
    g = hq // h
    tail_k = layer.tail_keys[0]  # [H, T, d]
    tail_v = layer.tail_values[0]
    n_tail = tail_k.shape[1]
    qg = query.reshape(h, g * q_len, d)  # rows of KV head h: its g query heads x q positions
    tail_logits = torch.matmul(qg, tail_k.transpose(1, 2)).float().mul_(scale)  # [H, g*q, T]
    if q_len > 1:
        causal = _causal_offset_mask(q_len, n_tail, query.device).repeat(g, 1)  # [g*q, T]
        tail_logits.masked_fill_(~causal, float("-inf"))
    if prefix.uniform_length:
        length = prefix.lengths[0]
        pk = prefix.keys.view(h, length, d)
        pv = prefix.values.view(h, length, -1)
        logits = torch.matmul(qg, pk.transpose(1, 2)).float().mul_(scale)
        if prefix.log_weights is not None:
            logits += prefix.log_weights.view(h, 1, length)
        out = _merge(logits, tail_logits, pv, tail_v)
    else:
        out = torch.stack(
            [
                _merge(
                    _prefix_logits(qg[i], *prefix.head(i), scale),
                    tail_logits[i],
                    prefix.head(i)[1],
                    tail_v[i],
                )
                for i in range(h)
            ]
        )
    return out.reshape(hq, q_len, -1)


def _prefix_logits(q, keys, values, log_weights, scale: float) -> torch.Tensor:
    logits = torch.matmul(q, keys.transpose(0, 1)).float().mul_(scale)
    if log_weights is not None:
        logits += log_weights
    return logits


def _merge(prefix_logits, tail_logits, prefix_values, tail_values) -> torch.Tensor:
    """One softmax over prefix and tail logits, then the expectation of the values."""
    length = prefix_logits.shape[-1]
    probs = torch.softmax(torch.cat([prefix_logits, tail_logits], dim=-1), dim=-1)
    probs = probs.to(prefix_values.dtype)
    return torch.matmul(probs[..., :length], prefix_values) + torch.matmul(
        probs[..., length:], tail_values
    )


def probkv_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """Mask function for the ``"probkv"`` implementation: transformers' SDPA masks (used by
    non-evicting layers), after refusing padded inputs, which eviction does not support."""
    if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
        raise ValueError(
            "probkv does not support padded inputs (the attention_mask has zeros); "
            "run prompts one at a time without padding"
        )
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)
