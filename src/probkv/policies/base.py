"""The policy protocol: what a method observes at prefill and what it keeps (S3, S5).

A policy is a small frozen dataclass. During prefill the integration layer computes, for each
evicting layer, the log-scores the policy names (``score`` with ``score_params``, from the real
post-RoPE queries, keys and values; see ``probkv.scores``) and hands the policy one
``LayerObservation`` per layer. ``select`` returns one ``RaggedSelection`` per observation:
which entries each KV head keeps and their log-weights (``None`` = no correction).

Every policy completes its ``score_params`` at construction with the score table's defaults
(``DEFAULT_SCORE_PARAMS``, ``probkv.scores.default_params``), so two policies that compute the
same thing compare equal and have one canonical name (``probkv.policies.registry``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from probkv import scores
from probkv._checks import check_choice, check_ratio
from probkv.estimation.selection import RaggedSelection
from probkv.scores.observation import LayerObservation

# The score parameters a policy uses unless told otherwise: the score table's defaults (S6 SnapKV
# window 32, max-pooling, kernel 7, raw group mean over GQA heads; S5 4 sinks); see
# probkv.scores.SCORE_TABLE and docs/methods.md.
DEFAULT_SCORE_PARAMS: dict[str, dict[str, object]] = {
    name: defaults for name in scores.SCORE_NAMES if (defaults := scores.default_params(name))
}


# what ``calibrated_selections`` takes: one entry per layer
Selections = Sequence[RaggedSelection]
Observations = Sequence[LayerObservation]
LayerTensors = Sequence[tuple[torch.Tensor, torch.Tensor]]  # each layer's (key, value)


@dataclass(frozen=True)
class EvictionPolicy(ABC):
    """Base of every method.

    ``score`` names the log-score in ``probkv.scores`` the policy observes at prefill, with
    ``score_params`` (e.g. SnapKV's window); ``ratio`` is the target compression ratio r in
    [0, 1) (S1: the fraction of prefix entries evicted; r = 0 keeps everything).
    """

    score: str = "h2o"
    ratio: float = 0.5
    score_params: dict = field(default_factory=dict)

    @property
    def layerwise(self) -> bool:
        """True when each layer's selection depends on that layer alone, so a layer can be
        evicted right after its prefill attention (lower peak memory). False for the global
        budget scope (S3), which needs every layer's proposal first, and for scores read from
        a reconstruction pass, which runs after every layer's prefill."""
        return not scores.needs_reconstruction(self.score)

    @abstractmethod
    def select(
        self, observations: Sequence[LayerObservation], *, num_layers: int
    ) -> list[RaggedSelection]:
        """One selection per observation. ``num_layers`` is the number of evicting layers."""

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The options a method name may set on this class (``probkv.policies.registry``):
        its fields but the score, the ratio and the score's parameters."""
        fixed = ("score", "ratio", "score_params")
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in fixed)

    def option_values(self) -> dict[str, object]:
        """The options of this policy, as its method name spells them."""
        return {name: getattr(self, name) for name in self.option_names()}

    @property
    def calibrates(self) -> bool:
        """True when the kept entries' weights are then fitted to reference queries (S9,
        ``probkv.estimation.calibration``), which needs each layer's keys and values."""
        return False

    def calibrated_selections(
        self, selections: Selections, observations: Observations, tensors: LayerTensors
    ) -> list[RaggedSelection]:
        """The selections with calibrated weights (only policies that ``calibrates``)."""
        return list(selections)


def select_layers(
    policy: EvictionPolicy,
    observations: Sequence[LayerObservation],
    *,
    num_layers: int,
    tensors: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> list[RaggedSelection]:
    """What ``policy`` keeps of these observed layers: the one entry point every eviction
    goes through (the integration at prefill and in ``ProbKVCache.evict``, the attention-error
    experiment). A ``layerwise`` policy selects one layer at a time, as during prefill (same
    random draws whether the layers come one by one or together); any other sees them all at
    once (S3 global scope). ``num_layers``: the number of evicting layers of the model.
    ``tensors``: each layer's ``(key, value)`` ``[Hkv, t, d]`` before eviction, needed by a
    policy that ``calibrates`` its weights (S9)."""
    if policy.layerwise:
        selections = [policy.select([obs], num_layers=num_layers)[0] for obs in observations]
    else:
        selections = policy.select(list(observations), num_layers=num_layers)
    if not policy.calibrates:
        return selections
    if tensors is None or len(tensors) != len(observations):
        raise ValueError(
            "this policy calibrates its weights (S9): select_layers needs tensors, one "
            f"(key, value) per observation ({len(observations)}), got "
            f"{'none' if tensors is None else len(tensors)}"
        )
    return policy.calibrated_selections(selections, observations, tensors)


def keep_everything(obs: LayerObservation) -> RaggedSelection:
    """r = 0 keeps all entries with weight exactly 1 (S1), whatever the method."""
    h, t = obs.log_scores.shape
    device = obs.log_scores.device
    indices = torch.arange(t, dtype=torch.int64, device=device).repeat(h)
    lengths = torch.full((h,), t, dtype=torch.int64, device=device)
    return RaggedSelection(indices, lengths, None)


def validate_common(policy: EvictionPolicy) -> None:
    """Checks every policy runs at construction, so bad input fails before any work (S1, S2),
    and completes ``score_params`` with the score table's defaults (frozen dataclass: set once)."""
    object.__setattr__(policy, "ratio", check_ratio(real_number(policy.ratio)))
    check_choice(policy.score, scores.SCORE_TABLE, "score")
    if not isinstance(policy.score_params, dict):
        raise ValueError(
            f"score_params must be a dict of the score's parameters, got {policy.score_params!r}"
        )
    params = {**scores.default_params(policy.score), **policy.score_params}
    scores.validate_params(policy.score, params)
    object.__setattr__(policy, "score_params", params)


def real_number(value):
    """Any real number type (numpy's float32 as Python's float) as a float; other values, bools
    included, pass through for the check that follows to refuse by name."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
        return float(value)  # numpy's bool is no numbers.Real: refused below
    return value


def check_fraction(value: float, name: str, *, what: str) -> float:
    """A number in [0, 1] (``what`` says what it is a fraction of), returned as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number in [0, 1] ({what}), got {value!r}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1] ({what}), got {value!r}")
    return float(value)


def recent_count(recent: float, budget: int) -> int:
    """H2O's recent window (S5): ``floor(recent * budget + 1/2)`` entries of a head's
    ``budget``, at most the budget (``recent = 0.5`` is the H2O paper's equal split)."""
    return min(budget, math.floor(recent * budget + 0.5))


def with_recent(obs: LayerObservation, count: int) -> LayerObservation:
    """``obs`` with its ``count`` most recent entries added to the forced (always kept) ones."""
    if count <= 0:
        return obs
    h, t = obs.log_scores.shape
    forced = torch.zeros(h, t, dtype=torch.bool, device=obs.log_scores.device)
    if obs.forced is not None:
        forced |= obs.forced.to(forced.device)
    forced[:, max(0, t - count) :] = True
    return dataclasses.replace(obs, forced=forced)


def fit_forced(forced: torch.Tensor | None, budgets: torch.Tensor) -> torch.Tensor | None:
    """Forced entries count against the budget (S6). Where a head's budget ``b`` is below its
    forced count (a short prompt at high compression), only its ``b`` most recent forced entries
    stay forced; the others compete like any entry (their high scores usually keep them)."""
    if forced is None:
        return None
    counts = forced.sum(-1)
    if bool((counts <= budgets.to(counts.device)).all()):
        return forced
    rank_from_end = forced.flip(-1).cumsum(-1).flip(-1)  # 1 for the most recent forced entry
    return forced & (rank_from_end <= budgets.to(forced.device).unsqueeze(-1))
