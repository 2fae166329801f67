"""KVzap's threshold mode (S11): keep what scores above a log-score, so the ratio adapts per prompt.

A threshold ``x`` gives a prompt its compression ratio ``r(x) = 1 - kept / entries``: the share
of entries, over every KV head of every observed layer, whose log-score is at most ``x`` and
that no score forces (``threshold_ratio``). The policy then runs at ``max(ratio, r(x))``, so a
given ``ratio`` is the least compression (0: the threshold alone). What runs at that ratio is
the policy's own selection: ``kvzap``'s one top-k over every head keeps exactly the entries
above ``x`` (``TopKPolicy``); uniform budgets keep each head's top share; ``scope="model"``
keeps the top blocks; a ``prob:`` design draws its sample at that ratio and weighs it by
``1 / P`` (``ProbabilisticPolicy``). Every layer is counted before any is evicted, so a policy
with a threshold is not layerwise. One threshold compares log-scores across heads and layers,
so only scores on the attention scale (S6) take one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from probkv import scores
from probkv.policies.base import LayerObservation, real_number

NAME = "threshold"


def check_threshold(value, score: str) -> float | None:
    """``value`` as a float (``None``: no threshold), refused by name unless it is a finite
    number and ``score`` is on the attention scale."""
    if value is None:
        return None
    value = real_number(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"threshold must be a finite log-score (e.g. -6.5), got {value!r}")
    if not scores.on_attention_scale(score):
        raise ValueError(
            f"threshold with score {score!r}: its log-scores are not logs of attention "
            "probabilities (S6), so one threshold means nothing across heads; use a score on "
            "the attention scale (kvzap, kvzip, h2o, snapkv, tova, ...)"
        )
    return float(value)


def threshold_count(observations: Sequence[LayerObservation], threshold: float) -> tuple[int, int]:
    """``(kept, entries)``: the entries whose log-score is above ``threshold`` or forced, and
    all entries, over every KV head of every layer."""
    kept = 0
    entries = 0
    for obs in observations:
        above = obs.log_scores > threshold
        if obs.forced is not None:
            above |= obs.forced.to(above.device)
        kept += int(above.sum())
        entries += above.numel()
    return kept, entries


def threshold_ratio(observations: Sequence[LayerObservation], threshold: float) -> float:
    """The compression ratio a threshold gives these layers (S1, S11): ``1 - kept / entries``
    (``threshold_count``), at most ``1 - 1 / t`` (every head keeps at least one entry)."""
    kept, entries = threshold_count(observations, threshold)
    if entries == 0:
        return 0.0
    longest = max(obs.length for obs in observations)
    return min(1.0 - kept / entries, 1.0 - 1.0 / longest)
