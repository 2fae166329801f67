"""Deterministic top-k eviction (SPEC S5, S6): keep the k highest log-scores per KV head, no
correction (``log w = 0``). Layer budgets: uniform or PyramidKV; head budgets within a layer:
uniform or Ada-KV's adaptive allocation. StreamingLLM, H2O, SnapKV, TOVA, K-norm, PyramidKV,
Ada-SnapKV, Ada-PyramidKV and the top-k of any proposal (S9) are all this one class with
different fields (see ``probkv.policies.registry``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from probkv import budgets
from probkv._checks import check_choice
from probkv.policies.base import (
    EvictionPolicy,
    LayerObservation,
    fit_forced,
    keep_everything,
    validate_common,
)
from probkv.selection import RaggedSelection

LAYER_BUDGETS = ("uniform", "pyramid")
HEAD_BUDGETS = ("uniform", "ada")


@dataclass(frozen=True)
class TopKPolicy(EvictionPolicy):
    """Top-k of ``score`` per KV head.

    ``layer_budgets="pyramid"``: PyramidKV's linearly decreasing layer budgets (``beta``, S5).
    ``head_budgets="ada"``: Ada-KV's head-wise allocation of each layer's budget with the
    safeguard ``alpha`` (S6); heads then hold different numbers of entries, stored ragged.
    """

    layer_budgets: str = "uniform"
    head_budgets: str = "uniform"
    alpha: float = 0.2
    beta: float = 20.0

    def __post_init__(self) -> None:
        validate_common(self)
        check_choice(self.layer_budgets, LAYER_BUDGETS, "layer_budgets")
        check_choice(self.head_budgets, HEAD_BUDGETS, "head_budgets")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(
                f"alpha (Ada-KV safeguard fraction) must be in [0, 1], got {self.alpha}"
            )
        if self.beta <= 1:
            raise ValueError(f"beta (PyramidKV) must be > 1, got {self.beta}")

    def layer_budget(self, obs: LayerObservation, num_layers: int) -> int:
        """Kept entries per head of this layer (before the head allocation)."""
        t = obs.length
        mean = budgets.uniform_budget(t, self.ratio)
        if self.layer_budgets == "uniform":
            return mean
        # PyramidKV's reference code shapes only the budget beyond the observation window.
        window = 0 if obs.forced is None else min(int(obs.forced.sum(-1).max()), mean)
        return budgets.pyramid_budgets(num_layers, mean, beta=self.beta, window=window, t=t)[
            obs.rank
        ]

    def select(
        self, observations: Sequence[LayerObservation], *, num_layers: int
    ) -> list[RaggedSelection]:
        out = []
        for obs in observations:
            if self.ratio == 0.0:
                out.append(keep_everything(obs))
                continue
            per_head = self.layer_budget(obs, num_layers)
            h = obs.num_heads
            uniform = torch.full((h,), per_head, dtype=torch.int64)
            forced = fit_forced(obs.forced, uniform)
            if self.head_budgets == "ada":
                head_budgets = budgets.adakv_allocation(
                    obs.log_scores, per_head * h, alpha=self.alpha, forced=forced
                )
            else:
                head_budgets = uniform
            out.append(budgets.topk_per_head(obs.log_scores, head_budgets, forced=forced))
        return out
