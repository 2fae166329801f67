"""Every eviction of an ``EvictingLayer`` goes through here (S3, S4, S6, S10.5).

``evict_layers``: the policy's one selection entry point (``probkv.policies.select_layers``)
on observed layers, then ``apply_selection`` per layer, which evicts and records the layer's
report. A cache held to a decode budget (``probkv.hf.decode_budget``) evicts its prompt down
to the budget here (stage 1) and starts the layer's decode statistics; its later stages go
through ``probkv.hf.decode_budget.evict_to_budget``. Layers are ``probkv.hf.cache``'s
``EvictingLayer`` (not imported: the cache imports this module).
"""

from __future__ import annotations

from collections.abc import Sequence

from probkv.budgets import retained_attention_mass
from probkv.estimator import kish_effective_sample_size
from probkv.hf import decode_budget
from probkv.hf.report import LayerReport
from probkv.policies.base import EvictionPolicy, select_layers
from probkv.selection import RaggedSelection


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
    selections = select_layers(
        policy, [layer.observation for layer in layers], num_layers=num_layers, tensors=tensors
    )
    for layer, selection in zip(layers, selections, strict=True):
        apply_selection(layer, selection, policy)


def apply_selection(layer, selection: RaggedSelection, policy: EvictionPolicy) -> None:
    """Evict ``layer`` to ``selection`` and record its diagnostics (S3 effective ratio, S6
    retained attention mass, S4 Kish effective sample size of the new weights)."""
    obs = layer.observation
    if layer.decode_budget is not None:
        decode_budget.start_decode(layer, obs, selection)
    t = layer.get_seq_length()
    layer.evict(selection)
    kept = [int(n) for n in selection.lengths]
    mass = retained_attention_mass(obs.last_query_attention, selection)
    ess = None
    if selection.log_weights is not None:
        dense = selection.dense_log_weights(t, evicted=0.0)
        ess = kish_effective_sample_size(dense, selection.to_mask(t)).tolist()
    layer.report = LayerReport(
        layer_idx=layer.layer_idx,
        prefix_length=t,
        kept_per_head=kept,
        target_ratio=policy.ratio,
        effective_ratio_per_head=[1.0 - k / t for k in kept],
        retained_attention_mass=mass.tolist(),
        effective_sample_size=ess,
    )
    if layer.decode_budget is not None:
        decode_budget.record_peak(layer)
