"""The policy protocol: what a method observes at prefill and what it keeps (SPEC S3, S5).

A policy is a small frozen dataclass. During prefill the integration layer computes, for each
evicting layer, the log-scores the policy names (``score`` with ``score_params``, from the real
post-RoPE queries, keys and values; see ``probkv.scores``) and hands the policy one
``LayerObservation`` per layer. ``select`` returns one ``RaggedSelection`` per observation:
which entries each KV head keeps and their log-weights (``None`` = no correction).

Every policy completes its ``score_params`` at construction with ``DEFAULT_SCORE_PARAMS``, so
two policies that compute the same thing compare equal and have one canonical name
(``probkv.policies.registry``).
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from probkv._checks import check_choice, check_ratio
from probkv.scores import needs_reconstruction
from probkv.selection import RaggedSelection

# The score parameters a policy uses unless told otherwise: the defaults of the score functions
# in probkv.scores (S6: SnapKV window 32, max-pooling, kernel 7; S5: 4 sinks), except SnapKV's
# GQA combination. The methods follow SnapKV's GQA form in kvpress and Ada-KV's reference code
# (raw group mean, which keeps each KV head's attention mass for Ada-KV's comparison across
# heads) where the maths layer's default is S2's group mixture. See docs/methods.md.
DEFAULT_SCORE_PARAMS: dict[str, dict[str, object]] = {
    "snapkv": {"window": 32, "kernel": 7, "pooling": "max", "gqa": "mean"},
    "streaming_llm": {"sinks": 4},
    # reconstruction scores (S10.1): kvpress's 4 sinks, KVzip's 2000-token chunks
    "kvzip": {"sinks": 4, "chunk_tokens": 2000},
    "h2o-rec": {"sinks": 4, "chunk_tokens": 2000},
    "min-rec": {"sinks": 4, "chunk_tokens": 2000},
}


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
        the reconstruction pass (S10.1), which runs after every layer's prefill."""
        return not needs_reconstruction(self.score)

    @abstractmethod
    def select(
        self, observations: Sequence[LayerObservation], *, num_layers: int
    ) -> list[RaggedSelection]:
        """One selection per observation. ``num_layers`` is the number of evicting layers."""


def keep_everything(obs: LayerObservation) -> RaggedSelection:
    """r = 0 keeps all entries with weight exactly 1 (S1), whatever the method."""
    h, t = obs.log_scores.shape
    indices = torch.arange(t, dtype=torch.int64).repeat(h)
    lengths = torch.full((h,), t, dtype=torch.int64)
    return RaggedSelection(indices, lengths, None)


def validate_common(policy: EvictionPolicy) -> None:
    """Checks every policy runs at construction, so bad input fails before any work (S1, S2),
    and completes ``score_params`` with ``DEFAULT_SCORE_PARAMS`` (frozen dataclass: set once)."""
    from probkv import scores

    object.__setattr__(policy, "ratio", check_ratio(policy.ratio))
    check_choice(policy.score, scores.SCORE_NAMES, "score")
    if not isinstance(policy.score_params, dict):
        raise ValueError(
            f"score_params must be a dict of the score's parameters, got {policy.score_params!r}"
        )
    params = {**DEFAULT_SCORE_PARAMS.get(policy.score, {}), **policy.score_params}
    scores.validate_params(policy.score, params)
    object.__setattr__(policy, "score_params", params)


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
