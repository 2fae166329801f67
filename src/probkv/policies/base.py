"""The policy protocol: what a method observes at prefill and what it keeps (SPEC S3, S5).

A policy is a small frozen dataclass. During prefill the integration layer computes, for each
evicting layer, the log-scores the policy names (``score`` with ``score_params``, from the real
post-RoPE queries, keys and values; see ``probkv.scores``) and hands the policy one
``LayerObservation`` per layer. ``select`` returns one ``RaggedSelection`` per observation:
which entries each KV head keeps and their log-weights (``None`` = no correction).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from probkv._checks import check_choice, check_ratio
from probkv.selection import RaggedSelection


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
        budget scope (S3), which needs every layer's proposal first."""
        return True

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
    """Checks every policy runs at construction, so bad input fails before any work (S1, S2)."""
    from probkv import scores

    check_ratio(policy.ratio)
    check_choice(policy.score, scores.SCORE_NAMES, "score")
    scores.validate_params(policy.score, policy.score_params)


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
