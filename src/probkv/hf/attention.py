"""probkv's attention function, registered in transformers' ``AttentionInterface`` (S4).

transformers calls ``cache.update(key, value, layer_idx, kwargs=kwargs)`` and then the
registered attention function with ``**kwargs``; ``EvictingLayer.update`` puts itself into that
dict, so this function receives the layer as ``probkv_layer`` (``probkv.hf.layer_handoff``; older
transformers: a per-thread slot). Layers that are not evicting
(Gemma-3's sliding-window layers, or a plain ``DynamicCache``) get transformers' own SDPA path.

For an evicting layer, its kind and a prompt layer's phase (``probkv.hf.layers``) decide:
- ``PREFILL`` (a prompt forward): ``probkv.hf.prefill.observe_prompt_chunk`` computes the output and the
  policy's statistics from the real post-RoPE tensors (``probkv.scores.observation.observe_layer``
  in one pass for a whole prompt, S2; accumulated over the chunks of a chunked prefill); the
  layer records the observation and evicts right away if the policy is layerwise and the
  prompt has ended;
- ``PREFILL`` of a reconstruction score (S10.1): dense attention; the layer waits for the pass
  (``AWAITING_RECONSTRUCTION``), whose chunks attend in state ``RECONSTRUCTING``
  (``probkv.hf.reconstruct``: over the cache and the chunk, never stored);
- ``OBSERVED`` (prefill seen, eviction pending): dense causal attention;
- ``EvictedLayer``: one softmax over the ragged weighted prefix (logits ``+ log w``, S4) and the
  dense tail of tokens added since, which carries no weight; a ``BudgetedLayer``'s rows
  then feed its statistics and may start a stage (``probkv.hf.decode_budget``, S10.5; in a
  batch, each sequence's own: ``batched_budget_attention``).

A forward may also carry a recorder as ``probkv_capture`` (``probkv.hf.capture``): it receives
every layer's real inputs and output, whichever path computed them.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from probkv.hf import layer_handoff
from probkv.hf.decode_budget import (
    after_decode_attention,
    decode_rows_needed,
    join_batch,
    record_batch_peak,
    sequence_probabilities,
)
from probkv.hf.eviction import evict_decode_stage
from probkv.hf.layers import BudgetedBatchLayer, BudgetedLayer, EvictingLayer, PromptPhase
from probkv.hf.prefill import observe_prompt_chunk, prompt_pads
from probkv.scores import needs_reconstruction
from probkv.scores.observation import (
    causal_offset_mask,
    dense_causal_attention,
    last_query_attention,
)

ATTN_IMPLEMENTATION = "probkv"


def probkv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    probkv_layer: EvictingLayer | None = None,
    probkv_capture=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``"probkv"`` attention implementation. Returns ``([B, q, Hq, d_v], weights)``."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    probkv_layer = layer_handoff.take(module, probkv_layer)
    if probkv_layer is None:
        out, weights = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    else:
        if kwargs.get("softcap") is not None:
            raise ValueError("probkv does not support attention logit soft-capping (softcap)")
        if query.shape[0] == 1:
            layer_out = layer_attention(probkv_layer, query[0], key[0], value[0], scale)
            layer_out = layer_out.unsqueeze(0)
        else:  # a batch (S11 batches): each sequence evicted on its own
            layer_out = batch_attention(probkv_layer, query, key, value, scale, attention_mask)
        out, weights = layer_out.transpose(1, 2).contiguous(), None
    if probkv_capture is not None:
        if query.shape[0] != 1:
            raise ValueError("probkv.hf.capture records one sequence: run a batch of one")
        probkv_capture.record(
            module.layer_idx, query[0], key[0], value[0], out[0].transpose(0, 1), scale
        )
    return out, weights


def layer_attention(
    layer: EvictingLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """An evicting layer's attention in its current state (module docstring): query
    ``[Hq, q, d]``, the layer's dense tail ``key``/``value [Hkv, n, d]`` -> ``[Hq, q, d_v]``."""
    layer.attention_done()
    if layer.is_evicted:
        if not isinstance(layer, BudgetedLayer):
            return evicted_attention(layer, query, scale)
        # S10.5: the statistics read this softmax's probabilities (only if they need them:
        # column sums every step, the latest row at a stage), then a stage if due
        probs = None
        if decode_rows_needed(layer):
            out, probs = evicted_attention_with_probabilities(layer, query, scale)
        else:
            out = evicted_attention(layer, query, scale)
        if after_decode_attention(layer, query, probabilities=probs):
            evict_decode_stage(layer, scale)  # the prompt's eviction path (probkv.hf.eviction)
        return out
    if layer.phase is PromptPhase.RECONSTRUCTING:  # S10.1, probkv.hf.reconstruct
        return layer.scoring.attend(layer, query, scale)
    if layer.phase is PromptPhase.PREFILL and needs_reconstruction(layer.policy.score):
        # S10.1: the scores come from the pass run after every layer's prefill
        layer.awaits_reconstruction(last_query_attention(query, key, scale))
        return dense_causal_attention(query, key, value, scale)
    if layer.phase is PromptPhase.PREFILL:  # a prompt chunk, or the whole prompt
        return observe_prompt_chunk(layer, query[None], key[None], value[None], scale)[0]
    return dense_causal_attention(query, key, value, scale)


def batch_attention(
    layer: EvictingLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """``layer_attention`` for a batch: query ``[B, Hq, q, d]``, the dense tail ``key``/
    ``value [B, Hkv, n, d]``, the forward's 4D ``mask`` (left padding; ``None``: none) ->
    ``[B, Hq, q, d_v]``. A prompt forward observes each sequence on its unpadded rows
    (``probkv.hf.prefill``), and a reconstruction score's pass scores each sequence on its own
    rows (``probkv.hf.reconstruct``); after eviction every (sequence, KV head) segment of the
    layer attends in one call (``batched_evicted_attention``; with a decode budget,
    ``batched_budget_attention``)."""
    layer.attention_done()
    if isinstance(layer, BudgetedBatchLayer):
        return batched_budget_attention(layer, query, scale, mask)
    if layer.is_evicted:
        return batched_evicted_attention(layer, query, scale, mask)
    if layer.phase is PromptPhase.RECONSTRUCTING:  # S10.1, probkv.hf.reconstruct.BatchScoring
        return layer.scoring.attend(layer, query, scale)
    if layer.phase is PromptPhase.PREFILL and needs_reconstruction(layer.policy.score):
        return await_reconstruction(layer, query, key, value, scale, mask)
    if layer.phase is PromptPhase.PREFILL:
        return observe_prompt_chunk(layer, query, key, value, scale, mask)
    if layer.phase is not PromptPhase.OBSERVED:
        raise ValueError(f"layer {layer.layer_idx}: a batch cannot attend in phase {layer.phase}")
    outs = []  # prefill seen, eviction pending: each sequence's dense attention, unpadded
    q_len, t = query.shape[2], key.shape[2]
    for b, pad in enumerate(layer.pads):
        start = max(0, pad - (t - q_len))
        out = dense_causal_attention(query[b, :, start:], key[b, :, pad:], value[b, :, pad:], scale)
        outs.append(torch.cat([out.new_zeros(out.shape[0], start, out.shape[2]), out], dim=1))
    return torch.stack(outs)


def await_reconstruction(layer, query, key, value, scale: float, mask) -> torch.Tensor:
    """The prefill of a reconstruction score in a batch (S10.1, S11 batches): each sequence's
    dense causal attention on its rows without padding (zero on padding rows), and its ``p_t``
    kept for the report until the pass has run, as alone."""
    batch, _, q_len, _ = query.shape
    t = key.shape[2]
    layer.prompt.pads = pads = prompt_pads(mask, batch, t)
    if q_len != t:
        raise ValueError(
            f"score {layer.policy.score!r} in a batch reads its prompt in one forward ({q_len} "
            f"of {t} tokens given): compress the batch with probkv.hf.compress, which does"
        )
    outs, last = [], []
    for b, pad in enumerate(pads):
        q, k, v = query[b, :, pad:], key[b, :, pad:], value[b, :, pad:]
        last.append(last_query_attention(q, k, scale))
        out = dense_causal_attention(q, k, v, scale)
        outs.append(torch.cat([out.new_zeros(out.shape[0], pad, out.shape[2]), out], dim=1))
    layer.awaits_reconstruction(last)
    return torch.stack(outs)


def batched_evicted_attention(
    layer, query: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    """Decode attention of a batch after eviction (S4, S11 batches): query ``[B, Hq, q, d]``
    -> ``[B, Hq, q, d_v]``. The prefix holds ``B * Hkv`` segments (sequence after sequence),
    the tail ``[B, Hkv, T, d]``: the segments are the heads of ``evicted_attention``'s
    layout, one batched softmax per segment over its prefix (``+ log w``) and its tail. Tail
    slots that are padding (a later input padded on the left: ``mask``'s last ``T``
    columns, aligned by ``EvictingLayer.get_mask_sizes``) get no attention; each query row
    always sees itself, so a padding row stays finite."""
    batch, hq, q_len, d = query.shape
    h = layer.num_heads
    segments = batch * h
    tail_k = layer.tail_keys.reshape(segments, -1, d)
    tail_v = layer.tail_values.reshape(segments, -1, layer.tail_values.shape[-1])
    n_tail = tail_k.shape[1]
    visible = causal_offset_mask(q_len, n_tail, query.device).expand(batch, q_len, n_tail)
    if mask is not None:
        seen = mask[:, 0, -q_len:, -n_tail:]
        seen = seen if seen.dtype == torch.bool else seen == 0
        own = torch.arange(q_len, device=query.device) + (n_tail - q_len)
        visible = visible & seen
        visible[:, torch.arange(q_len, device=query.device), own] = True
    visible = visible.unsqueeze(1).expand(batch, hq, q_len, n_tail)
    visible = visible.reshape(segments, (hq // h) * q_len, n_tail)
    qg = query.reshape(segments, (hq // h) * q_len, d)
    out, _ = _segment_attention(layer.prefix, qg, tail_k, tail_v, visible, scale, False)
    return out.reshape(batch, hq, q_len, -1)


def batched_budget_attention(
    layer, query: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    """Decode attention of a batch held to a decode budget (S10.5, S11 batches): query
    ``[B, Hq, q, d]`` -> ``[B, Hq, q, d_v]``. Each sequence holds its own prefix (a slice of
    the layer's joined prefix) and its own dense tail (``probkv.hf.decode_budget``): the tails,
    of each sequence's length, are stacked into ``[B Hkv, T, d]`` (a copy of at most ``K + q``
    slots per segment, right-padded, the padding never seen) and every (sequence, KV head)
    segment attends in one call, as in ``batched_evicted_attention``. Then each sequence's
    statistics read its rows of the probabilities, and a sequence whose head holds ``B + K``
    entries runs its own stage (its seeds, its statistics), exactly as alone; the joined
    prefix follows. New tokens that are padding are refused (``decode_budget.check_budget_padding``)."""
    batch, hq, q_len, d = query.shape
    h = layer.num_heads
    sequences = layer.sequence_layers
    if mask is not None and q_len > 1:
        own = mask[:, 0, torch.arange(q_len), mask.shape[-1] - q_len + torch.arange(q_len)]
        if not bool((own if own.dtype == torch.bool else own == 0).all()):
            raise ValueError(
                f"layer {layer.layer_idx}: a batch held to a decode budget takes new tokens "
                "without padding (a padding token would be an entry of its stages); give "
                "every sequence new tokens of the same length"
            )
    lengths = [one.tail.length for one in sequences]
    width = max(lengths)
    tail_k = query.new_zeros(batch, h, width, d)
    tail_v = query.new_zeros(batch, h, width, sequences[0].tail_values.shape[-1])
    for b, one in enumerate(sequences):
        tail_k[b, :, : lengths[b]] = one.tail_keys[0]
        tail_v[b, :, : lengths[b]] = one.tail_values[0]
    # row r of sequence b sees its tail slots j < T_b - q + 1 + r (itself, causal)
    slots = torch.arange(width, device=query.device).view(1, 1, width)
    last = torch.tensor(lengths, device=query.device).view(batch, 1, 1) - q_len
    visible = slots <= last + torch.arange(q_len, device=query.device).view(1, q_len, 1)
    visible = visible.unsqueeze(1).expand(batch, hq, q_len, width)
    visible = visible.reshape(batch * h, (hq // h) * q_len, width)
    qg = query.reshape(batch * h, (hq // h) * q_len, d)
    needed = [decode_rows_needed(one) for one in sequences]
    out, probs = _segment_attention(
        layer.prefix,
        qg,
        tail_k.view(batch * h, width, d),
        tail_v.view(batch * h, width, -1),
        visible,
        scale,
        any(needed),
    )
    due = [
        after_decode_attention(
            one,
            query[b],
            probabilities=sequence_probabilities(layer, probs, b, q_len) if needed[b] else None,
        )
        for b, one in enumerate(sequences)
    ]
    record_batch_peak(layer)  # before any stage: what the batch holds at its largest
    for one in (one for one, stage in zip(sequences, due) if stage):
        evict_decode_stage(one, scale)
    if any(due):
        join_batch(layer)
    return out.reshape(batch, hq, q_len, -1)


def evicted_attention(layer, query: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention after eviction (S4, Algorithm 1 in its fast form): prefix logits get
    ``+ log w`` and share one softmax with the tail, whose newest ``q`` entries are the queries
    themselves (causal among them). query ``[Hq, q, d]`` -> ``[Hq, q, d_v]``. Every path here
    (uniform, ragged batched or per head, a batch's segments) is tested against the slow
    reference over the same layout, ``probkv.estimation.ragged_corrected_attention``."""
    return _evicted_attention(layer, query, scale, False)[0]


def evicted_attention_with_probabilities(
    layer, query: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``evicted_attention`` and the probabilities its softmax computed, for a decode
    budget's statistics (S10.5): ``[Hkv, g, q, n]`` float32 over each head's entries (its
    prefix, then the tail) padded to the longest head with zeros, the layout of
    ``probkv.scores.decode_statistics.decode_probabilities``, which recomputes them (the slow
    reference). A uniform prefix hands over the softmax itself, no copy."""
    out, probs = _evicted_attention(layer, query, scale, True)
    h = layer.num_heads
    hq, q_len, _ = query.shape
    return out, probs.view(h, hq // h, q_len, probs.shape[-1])


def _evicted_attention(layer, query: torch.Tensor, scale: float, keep_probs: bool):
    """``(out, probs [Hkv, g q, n] or None)``: both forms of ``evicted_attention``."""
    h = layer.num_heads
    hq, q_len, d = query.shape
    g = hq // h
    tail_k = layer.tail_keys[0]  # [H, T, d]
    tail_v = layer.tail_values[0]
    qg = query.reshape(h, g * q_len, d)  # rows of KV head h: its g query heads x q positions
    visible = None
    if q_len > 1:
        visible = causal_offset_mask(q_len, tail_k.shape[1], query.device).repeat(g, 1)
    out, probs = _segment_attention(layer.prefix, qg, tail_k, tail_v, visible, scale, keep_probs)
    return out.reshape(hq, q_len, -1), probs


def _segment_attention(prefix, qg, tail_k, tail_v, visible, scale: float, keep_probs: bool):
    """One softmax per head (or (sequence, head) segment) over its prefix and its tail:
    ``qg [H, R, d]``, ``tail_k``/``tail_v [H, T, d]``, ``visible`` (``[R, T]`` or ``[H, R,
    T]`` bool, ``None``: all) the tail entries each row sees -> ``([H, R, d_v], probs)``."""
    h, _, d = qg.shape
    tail_logits = torch.matmul(qg, tail_k.transpose(1, 2)).float().mul_(scale)  # [H, R, T]
    if visible is not None:
        tail_logits.masked_fill_(~visible, float("-inf"))
    if prefix.uniform_length:
        length = prefix.lengths[0]
        # Explicit sizes: a prefix may be empty in every head (S4: an empty kept set is a
        # possible draw; the tail alone then carries the softmax).
        pk = prefix.keys.view(h, length, d)
        pv = prefix.values.view(h, length, prefix.values.shape[-1])
        logits = torch.matmul(qg, pk.transpose(1, 2)).float().mul_(scale)
        if prefix.log_weights is not None:
            logits += prefix.log_weights.view(h, 1, length)
        out, probs = _merge_with_probabilities(logits, tail_logits, pv, tail_v)
    else:
        batched = qg.device.type != "cpu" or RAGGED_BATCHED_ON_CPU
        merge = _ragged_batched if batched else _ragged_per_head
        out, probs = merge(prefix, qg, tail_logits, tail_v, scale, keep_probs)
    return out, probs


# Scratch size of the ragged decode: the ``[H, rows, N]`` block-diagonal logits of one row block.
RAGGED_BLOCK_BYTES = 64 * 2**20
# Ragged heads on CPU take the per-head loop: benchmarks/bench_ragged_decode.py measured it
# 1.4-2.6x faster there than the batched op (which computes H times the logits); on other
# devices the batched op avoids launching a few kernels per head (not yet measured on a GPU).
RAGGED_BATCHED_ON_CPU = False


def _ragged_batched(prefix, qg, tail_logits, tail_v, scale: float, keep_probs: bool):
    """Decode attention for every head of a ragged prefix in batched ops, no loop over heads
    (S4); with ``keep_probs`` also its probabilities, padded per head (``[H, R, max length +
    T]``, ``evicted_attention_with_probabilities``).

    Entry ``n`` of the flattened prefix belongs to head ``prefix.head_index[n]``. One matmul of
    every query row with every entry gives ``[H, rows, N]``; each entry keeps its own head's
    row (a gather along heads), then a segment softmax: per-(head, row) maxima and sums by
    ``scatter_reduce``/``index_add`` over ``head_index``, joined with the tail's, as varlen
    attention kernels do. The probabilities go back into a block-diagonal ``[H, rows, N]``
    (zero off each head's segment) for one matmul with the values. This computes ``H`` times
    the logits a per-head loop does, but launches a fixed number of ops and never reads the
    per-head lengths on the host; row blocks bound the scratch to ``RAGGED_BLOCK_BYTES``.
    ``qg [H, R, d]`` (R = g * q), ``tail_logits [H, R, T]`` float32 -> ``[H, R, d_v]``.
    """
    h, rows, d = qg.shape
    n = prefix.keys.shape[0]
    head = prefix.head_index  # [N]
    step = max(1, RAGGED_BLOCK_BYTES // max(1, 4 * h * n))
    padded = _padded_probabilities(prefix, tail_logits) if keep_probs else None
    out = []
    for a in range(0, rows, step):
        b = min(a + step, rows)
        r = b - a
        full = torch.matmul(qg[:, a:b].reshape(h * r, d), prefix.keys.T).float().mul_(scale)
        gather_ix = head.view(1, 1, n).expand(1, r, n)
        logits = full.view(h, r, n).gather(0, gather_ix)[0]  # [r, N]: own head's rows
        if prefix.log_weights is not None:
            logits += prefix.log_weights
        tail = tail_logits[:, a:b]  # [H, r, T]
        seg_max = tail.amax(-1)  # [H, r]; the tail holds the queries: finite
        seg_max = seg_max.scatter_reduce(0, gather_ix[0].T, logits.T, "amax")
        exps = (logits - seg_max.T[:, head]).exp_()  # [r, N]
        tail_exps = (tail - seg_max.unsqueeze(-1)).exp_()
        seg_sum = tail_exps.sum(-1).index_add_(0, head, exps.T)  # [H, r]
        probs = exps.div_(seg_sum.T[:, head])
        tail_probs = tail_exps.div_(seg_sum.unsqueeze(-1))
        if padded is not None:
            padded[0][head, a:b, padded[1]] = probs.T  # [N, r]: entry n at its head's place
            padded[0][:, a:b].scatter_(2, padded[2].expand(h, r, -1), tail_probs)
        block = torch.zeros(h, r, n, dtype=probs.dtype, device=probs.device)
        block.scatter_(0, gather_ix, probs.unsqueeze(0))
        pv = prefix.values
        part = torch.matmul(block.view(h * r, n).to(pv.dtype), pv).view(h, r, -1)
        out.append(part + torch.matmul(tail_probs.to(tail_v.dtype), tail_v))
    out = out[0] if len(out) == 1 else torch.cat(out, dim=1)
    return out, None if padded is None else padded[0]


def _padded_probabilities(prefix, tail_logits):
    """Zeros ``[H, R, max length + T]`` for ``_ragged_batched``'s probabilities, each prefix
    entry's place in its head (``[N]``) and each head's tail places (``[H, 1, T]``)."""
    h, rows, t = tail_logits.shape
    device = tail_logits.device
    lengths = torch.tensor(prefix.lengths, device=device)
    offsets = torch.tensor(prefix.offsets[:-1], device=device)
    place = torch.arange(prefix.keys.shape[0], device=device) - offsets[prefix.head_index]
    tail_place = (lengths.view(h, 1, 1) + torch.arange(t, device=device)).view(h, 1, t)
    zeros = torch.zeros(h, rows, max(prefix.lengths) + t, device=device)
    return zeros, place, tail_place


def _ragged_per_head(prefix, qg, tail_logits, tail_v, scale: float, keep_probs: bool):
    """The ragged decode as a Python loop over heads, one softmax over prefix and tail each
    (the CPU path, ``RAGGED_BATCHED_ON_CPU``); with ``keep_probs`` also each head's
    probabilities, padded (``[H, R, max length + T]``,
    ``evicted_attention_with_probabilities``)."""
    outs, probs = [], []
    for i in range(len(prefix.lengths)):
        keys, values, log_weights = prefix.head(i)
        logits = _prefix_logits(qg[i], keys, values, log_weights, scale)
        out, p = _merge_with_probabilities(logits, tail_logits[i], values, tail_v[i])
        outs.append(out)
        probs.append(p)
    if not keep_probs:
        return torch.stack(outs), None
    width = max(p.shape[-1] for p in probs)
    padded = probs[0].new_zeros(len(probs), probs[0].shape[0], width)
    for i, p in enumerate(probs):
        padded[i, :, : p.shape[-1]] = p
    return torch.stack(outs), padded


def _prefix_logits(q, keys, values, log_weights, scale: float) -> torch.Tensor:
    logits = torch.matmul(q, keys.transpose(0, 1)).float().mul_(scale)
    if log_weights is not None:
        logits += log_weights
    return logits


def _merge_with_probabilities(prefix_logits, tail_logits, prefix_values, tail_values):
    """One softmax over prefix and tail logits, the expectation of the values under it, and
    its float32 probabilities ``[..., prefix + tail]``."""
    length = prefix_logits.shape[-1]
    probs = torch.softmax(torch.cat([prefix_logits, tail_logits], dim=-1), dim=-1)
    weights = probs.to(prefix_values.dtype)
    out = torch.matmul(weights[..., :length], prefix_values) + torch.matmul(
        weights[..., length:], tail_values
    )
    return out, probs


def probkv_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """Mask function for the ``"probkv"`` implementation: transformers' SDPA masks (for
    non-evicting layers, and the padding of a batch's sequences, ``batch_attention``), after
    refusing a padded input of one sequence (a prompt alone is never padded)."""
    if (
        attention_mask is not None
        and attention_mask.ndim == 2
        and attention_mask.shape[0] == 1
        and not bool(attention_mask.all())
    ):
        raise ValueError(
            "probkv does not support padded inputs of one sequence (the attention_mask has "
            "zeros); run the prompt without padding, or pad a batch of several on the left"
        )
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)
