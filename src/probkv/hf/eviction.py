"""Every eviction of an ``EvictingLayer`` goes through here (S3, S4, S6, S10.5).

Two entry points, one path: the policy's selection entry point
(``probkv.policies.select_layers``), then ``apply_selection`` per layer, which evicts and
records the layer's report (``LayerReport``: the cache as it is after this eviction).

- ``evict_layers``: the prompt's eviction of observed layers (at prefill, on
  ``ProbKVCache.evict``). A cache held to a decode budget (``probkv.hf.decode_budget``)
  evicts its prompt down to the budget here (stage 1) and starts the layer's decode
  statistics.
- ``evict_decode_stage``: one more stage of a decode budget (S10.5), on the observations
  ``probkv.hf.decode_budget.next_stage`` builds from the statistics.

Layers are ``probkv.hf.cache``'s ``EvictingLayer`` (not imported: the cache imports this
module).
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
    decode budget, the policy keeps the budget's entries of the prompt (stage 1)."""
    budget = layers[0].decode_budget if layers else None
    if budget is not None:
        policy = budget.prompt_policy(policy, layers[0].observation.length)
    tensors = None
    if policy.calibrates:  # S9: weights fitted on the layers' entries before eviction
        tensors = [(layer.tail_keys[0], layer.tail_values[0]) for layer in layers]
    observations = [layer.observation for layer in layers]
    selections = select_layers(policy, observations, num_layers=num_layers, tensors=tensors)
    for layer, obs, selection in zip(layers, observations, selections, strict=True):
        if budget is not None:
            decode_budget.start_decode(layer, obs, selection)
        apply_selection(layer, selection, policy.ratio, obs.last_query_attention)
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
    apply_selection(layer, selection, stage.target_ratio, stage.attention)
    decode_budget.stage_done(layer, selection)


def apply_selection(
    layer, selection: RaggedSelection, target_ratio: float, attention: torch.Tensor
) -> None:
    """Evict ``layer`` to ``selection`` and record its report: of the ``t`` tokens the layer
    has seen, the entries it keeps per head (S3 effective ratio ``1 - kept / t``), their bytes,
    the retained mass of ``attention`` (the latest query's, ``[Hkv, n]`` over the entries held
    before, S6) and the Kish effective sample size of the kept entries' weights (S4: the
    weights they carry now, composed over every stage)."""
    t = layer.get_seq_length()
    width = max(layer.physical_length(h) for h in range(layer.num_heads))
    layer.evict(selection)
    mass = retained_attention_mass(attention, selection)
    ess = None
    if layer.prefix.log_weights is not None:
        held = RaggedSelection(selection.indices, selection.lengths, layer.prefix.log_weights)
        dense = held.dense_log_weights(width, evicted=0.0)
        ess = kish_effective_sample_size(dense, held.to_mask(width)).tolist()
    kept = [int(n) for n in selection.lengths]
    layer.record_report(
        LayerReport(
            layer_idx=layer.layer_idx,
            prefix_length=t,
            kept_per_head=kept,
            target_ratio=target_ratio,
            effective_ratio_per_head=[1.0 - k / t for k in kept],
            retained_attention_mass=mass.tolist(),
            effective_sample_size=ess,
            stage=layer.decode_state.stages if layer.decode_state is not None else 1,
            nbytes=layer.prefix.nbytes(),
        )
    )
