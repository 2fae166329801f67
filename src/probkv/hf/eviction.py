"""Every eviction of an ``EvictingLayer`` goes through here (S3, S4, S6, S10.5).

Two entry points, one path: the policy's selection entry point
(``probkv.policies.select_layers``), then ``apply_selection`` per layer, which evicts and
records the layer's report (``LayerReport``: the cache as it is after this eviction).

- ``evict_layers``: the prompt's eviction of observed layers (at prefill, on
  ``ProbKVCache.evict``). A cache held to a decode budget (``probkv.hf.decode_budget``)
  evicts its prompt down to the budget here (stage 1) and starts the layer's decode
  statistics; in a batch, each sequence's own (``decode_budget.split_batch``).
- ``evict_decode_stage``: one more stage of a decode budget (S10.5), on the observations
  ``probkv.hf.decode_budget.next_stage`` builds from the statistics.

Layers are ``probkv.hf.layers``' kinds (not imported: that module imports this one).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from probkv.budgets import retained_attention_mass
from probkv.estimation import kish_effective_sample_size
from probkv.estimation.selection import RaggedSelection
from probkv.hf import decode_budget
from probkv.hf.report import LayerReport
from probkv.policies.base import EvictionPolicy, select_layers


def evict_layers(policy: EvictionPolicy, layers: Sequence, *, num_layers: int) -> None:
    """Evict observed ``layers`` with ``policy``: its selections (``select_layers``, the one
    entry point the attention-error experiment uses too), applied layer by layer. With a
    decode budget, the policy keeps the budget's entries of the prompt (stage 1). In a batch,
    each sequence is selected on its own, exactly as alone (its observations, its unpadded
    tensors, the policy's own draws; S11 batches: nothing pools across sequences)."""
    budget = layers[0].decode_budget if layers else None
    if budget is not None and layers[0].batch_size > 1:
        # S10.5 in a batch: each sequence's layers evicted exactly as alone, then joined
        split = [decode_budget.split_batch(layer) for layer in layers]
        for b in range(layers[0].batch_size):
            evict_layers(policy, [one[b] for one in split], num_layers=num_layers)
        for layer in layers:
            decode_budget.join_batch(layer)
        return
    if budget is not None:
        policy = budget.prompt_policy(policy, layers[0].observation.length)
    per_sequence = []  # [sequence][layer]
    for b in range(layers[0].batch_size if layers else 0):
        tensors = None
        if policy.calibrates:  # S9: weights fitted on the layers' entries before eviction
            tensors = [layer.unpadded(b) for layer in layers]
        observations = [layer.observations[b] for layer in layers]
        per_sequence.append(
            select_layers(policy, observations, num_layers=num_layers, tensors=tensors)
        )
    for i, layer in enumerate(layers):
        observations = layer.observations
        selections = [chosen[i] for chosen in per_sequence]
        if budget is not None:
            decode_budget.start_decode(layer, observations[0], selections[0])
        attention = [obs.last_query_attention for obs in observations]
        apply_selection(layer, selections, policy.ratio, attention)
        if budget is not None:
            decode_budget.record_peak(layer)


def evict_decode_stage(layer, scale: float) -> None:
    """One decode stage of ``layer`` (S10.5): each group of heads selected by the stage's
    policy through ``select_layers`` (a layerwise policy: one layer, the same draws as
    ``policy.select``), the heads' selections joined, then ``apply_selection``."""
    stage = decode_budget.next_stage(layer, scale)
    parts = [
        select_layers(policy, [obs], num_layers=layer.num_evicting)[0]
        for policy, obs in stage.groups
    ]
    selection = parts[0] if len(parts) == 1 else RaggedSelection.concat(parts)
    apply_selection(layer, [selection], stage.target_ratio, [stage.attention])
    decode_budget.stage_done(layer, selection)


def apply_selection(
    layer, selections: list[RaggedSelection], target_ratio: float, attention: list[torch.Tensor]
) -> None:
    """Evict ``layer`` to ``selections`` (one per sequence of its batch, joined into its
    (sequence, KV head) segments) and record each sequence's report: of the ``t`` tokens the
    sequence has seen (its padding not counted), the entries it keeps per head (S3 effective
    ratio ``1 - kept / t``), their bytes, the retained mass of ``attention`` (the latest
    query's, ``[Hkv, n]`` over the entries held before, S6) and the Kish effective sample
    size of the kept entries' weights (S4: the weights they carry now, composed over every
    stage)."""
    seen = layer.get_seq_length()
    width = max(layer.physical_length(h) for h in range(layer.num_segments))
    joined = selections[0] if len(selections) == 1 else RaggedSelection.concat(selections)
    layer.evict(joined)
    prefix, h = layer.prefix, layer.num_heads
    reports = []
    for b, (selection, att) in enumerate(zip(selections, attention, strict=True)):
        t = seen - layer.pads[b]
        first, last = prefix.offsets[b * h], prefix.offsets[(b + 1) * h]
        mass = retained_attention_mass(att, selection)
        ess = None
        if prefix.log_weights is not None:
            weights = prefix.log_weights[first:last]
            held = RaggedSelection(selection.indices, selection.lengths, weights)
            dense = held.dense_log_weights(width, evicted=0.0)
            ess = kish_effective_sample_size(dense, held.to_mask(width)).tolist()
        kept = [int(n) for n in selection.lengths]
        per_entry = prefix.keys.shape[1] * prefix.keys.element_size()
        per_entry += prefix.values.shape[1] * prefix.values.element_size()
        if prefix.log_weights is not None:
            per_entry += prefix.log_weights.element_size()
        reports.append(
            LayerReport(
                layer_idx=layer.layer_idx,
                prefix_length=t,
                kept_per_head=kept,
                target_ratio=target_ratio,
                effective_ratio_per_head=[1.0 - k / t for k in kept],
                retained_attention_mass=mass.tolist(),
                effective_sample_size=ess,
                stage=layer.decode_state.stages if layer.decode_state is not None else 1,
                nbytes=(last - first) * per_entry,
            )
        )
    layer.record_report(reports)
