"""Probabilistic eviction with decode-time correction (SPEC S3, S4, S9).

Sample which entries each KV head keeps from a proposal built from ``score`` (S2), choose the
number of samples for the target ratio per head or globally across all layers (S3), and give
each kept entry an importance log-weight (S4) that the attention adds to its logits at every
later decode step. Entries a score forces (SnapKV's observation window) form a take-all
stratum: always kept, weight 1, and the proposal covers the other entries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from probkv import budgets, estimator, proposals, sampling
from probkv._checks import check_choice, check_tau
from probkv.policies.base import EvictionPolicy, LayerObservation, keep_everything, validate_common
from probkv.selection import RaggedSelection

SCOPES = ("head", "global")
SAMPLERS = ("with_replacement", "pps")
WEIGHTS = ("counts", "inclusion")


@dataclass(frozen=True)
class ProbabilisticPolicy(EvictionPolicy):
    """Importance-sampled eviction from the proposal named by ``score``.

    - ``scope``: ``"head"`` (every KV head keeps 1 - r of its entries in expectation) or
      ``"global"`` (one number of samples / one pps scale for all heads of all layers, S3).
    - ``sampler``: ``"with_replacement"`` (the paper: m draws, keep the distinct ones) or
      ``"pps"`` (S9: fixed size without replacement, exact budget per head).
    - ``weights`` (with-replacement sampler): ``"counts"`` (Eq. 10, the paper) or
      ``"inclusion"`` (Horvitz-Thompson, S9). pps always uses ``1 / P_i``.
    - ``tau``: weight temperature (``log w / tau``); ``inf`` or ``correct=False`` = no
      correction (the uncorrected estimator).
    - ``proposal_tau``, ``uniform_mix``: S2 adjustments of the proposal itself.
    - ``seed``: same seed, same kept set.
    """

    score: str = "min-h"
    scope: str = "head"
    sampler: str = "with_replacement"
    weights: str = "inclusion"
    tau: float = 1.0
    correct: bool = True
    proposal_tau: float = 1.0
    uniform_mix: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        validate_common(self)
        check_choice(self.scope, SCOPES, "scope")
        check_choice(self.sampler, SAMPLERS, "sampler")
        check_choice(self.weights, WEIGHTS, "weights")
        check_tau(self.tau, "tau")
        check_tau(self.proposal_tau, "proposal_tau")
        if not 0.0 < self.uniform_mix <= 1.0:
            raise ValueError(
                f"uniform_mix must be in (0, 1] (weight of the proposal), got {self.uniform_mix}"
            )
        if not isinstance(self.correct, bool):
            raise ValueError(f"correct must be True or False, got {self.correct!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def layerwise(self) -> bool:
        return self.scope == "head" or self.ratio == 0.0

    @property
    def corrected(self) -> bool:
        return self.correct and not math.isinf(self.tau)

    def proposal(self, obs: LayerObservation) -> torch.Tensor:
        """``[Hkv, t]``: zero on forced entries, full support on the others (S2)."""
        return proposals.proposal_from_log_scores(
            obs.log_scores, tau=self.proposal_tau, uniform_mix=self.uniform_mix, forced=obs.forced
        )

    def select(
        self, observations: Sequence[LayerObservation], *, num_layers: int
    ) -> list[RaggedSelection]:
        if self.ratio == 0.0:
            return [keep_everything(obs) for obs in observations]
        # One generator for the whole eviction, seeded per (seed, first layer): per-layer
        # eviction (head scope) and one-shot global eviction are both reproducible.
        generator = torch.Generator().manual_seed(self.seed * 100_003 + observations[0].layer_idx)
        pis = [self.proposal(obs).double() for obs in observations]
        forced = [_forced_counts(obs) for obs in observations]
        if self.sampler == "pps":
            return self._select_pps(observations, pis, forced, generator)
        return self._select_with_replacement(observations, pis, forced, generator)

    def _select_with_replacement(self, observations, pis, forced, generator):
        if self.scope == "global":
            m = sampling.samples_for_ratio(pis, self.ratio, scope="global", always_kept=forced)
            ms = [torch.full((pi.shape[0],), int(m), dtype=torch.int64) for pi in pis]
        else:
            ms = [
                sampling.samples_for_ratio(pi, self.ratio, scope="head", always_kept=f)
                for pi, f in zip(pis, forced)
            ]
        out = []
        for obs, pi, m in zip(observations, pis, ms):
            counts = sampling.sample_counts(pi, m, generator)
            kept = counts > 0
            logw = None
            if self.corrected:
                logw = estimator.log_weights(
                    pi, kept, weights=self.weights, counts=counts, num_samples=m, tau=self.tau
                )
            out.append(_selection(obs, kept, logw))
        return out

    def _select_pps(self, observations, pis, forced, generator):
        if self.scope == "global":
            inclusion = sampling.pps_inclusion_probabilities_global(
                pis, self.ratio, always_kept=forced
            )
        else:
            inclusion = []
            for obs, pi, f in zip(observations, pis, forced):
                k = budgets.uniform_budget(obs.length, self.ratio) - f
                inclusion.append(sampling.pps_inclusion_probabilities(pi, k.clamp(min=0)))
        out = []
        for obs, pi, p in zip(observations, pis, inclusion):
            kept = sampling.systematic_sample(p, generator)
            logw = None
            if self.corrected:
                logw = estimator.log_weights(pi, kept, weights="pps", inclusion=p, tau=self.tau)
            out.append(_selection(obs, kept, logw))
        return out


def _forced_counts(obs: LayerObservation) -> torch.Tensor:
    if obs.forced is None:
        return torch.zeros(obs.num_heads, dtype=torch.int64)
    return obs.forced.sum(-1).to(torch.int64)


def _selection(
    obs: LayerObservation, kept: torch.Tensor, logw: torch.Tensor | None
) -> RaggedSelection:
    """Add the forced (take-all, weight 1) entries and flatten."""
    if obs.forced is not None:
        kept = kept | obs.forced.to(kept.device)
        if logw is not None:
            logw = logw.masked_fill(obs.forced.to(logw.device), 0.0)
    return RaggedSelection.from_masks(kept.cpu(), None if logw is None else logw.cpu())
