"""Deterministic top-k eviction (S5, S6): keep the k highest log-scores per KV head, no
correction (``log w = 0``). Layer budgets: uniform or PyramidKV; head budgets within a layer:
uniform or Ada-KV's adaptive allocation. StreamingLLM, H2O, SnapKV, TOVA, K-norm, PyramidKV,
Ada-SnapKV, Ada-PyramidKV and the top-k of any proposal (S9) are all this one class with
different fields (see ``probkv.policies.registry`` and docs/methods.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from probkv import budgets, scores
from probkv._checks import check_choice
from probkv.estimation.selection import RaggedSelection
from probkv.policies import model_scope
from probkv.policies.base import (
    EvictionPolicy,
    LayerObservation,
    check_fraction,
    fit_forced,
    keep_everything,
    recent_count,
    validate_common,
    with_recent,
)
from probkv.policies.threshold import check_threshold, threshold_count, threshold_ratio
from probkv.sampling import model_blocks
from probkv.scores import proposals

LAYER_BUDGETS = ("uniform", "pyramid", "global")
HEAD_BUDGETS = ("uniform", "ada")
SCOPES = ("head", model_scope.SCOPE)
ADA_ALPHA = 0.2  # Ada-KV's safeguard, as its reference code
PYRAMID_BETA = 20.0  # PyramidKV's ratio of the first layer's budget to the last's


@dataclass(frozen=True)
class TopKPolicy(EvictionPolicy):
    """Top-k of ``score`` per KV head.

    - ``layer_budgets="pyramid"``: PyramidKV's linearly decreasing layer budgets with ratio
      ``beta`` (S5; the observation window sits outside the pyramid, as in its reference code;
      default ``PYRAMID_BETA``).
    - ``layer_budgets="global"``: the layers pool their budgets; with ``head_budgets="ada"``
      every KV head of every layer competes for the pooled budget (Ada-KV's allocation over
      all heads of all layers, safeguard ``alpha``; ``alpha = 0`` is KVzip's one global top-k
      of its scores, S10.1). With ``head_budgets="uniform"`` every head keeps its share, as
      with uniform layers. Not layerwise: every layer is observed first.
    - ``head_budgets="ada"``: Ada-KV's head-wise allocation of each layer's budget with the
      safeguard ``alpha`` (S6, the floor fraction of the uniform share; default
      ``ADA_ALPHA``); heads then hold different numbers of entries, stored ragged.
    - ``alpha`` only acts with Ada-KV head budgets and ``beta`` only with pyramid layer
      budgets: given elsewhere they could change nothing, and are refused by name (``None``
      there).
    - ``recent``: fraction of each head's budget reserved for the most recent entries (H2O's
      recent window; 0.5 is the H2O paper's equal split of heavy hitters and recent tokens).
      0 (default) keeps the H2O of S5, pure accumulated attention (S5).
    - ``pool``: max-pool the log-scores over positions with this odd kernel first (S10; 1 =
      none, the default), as ``prob:<score>/pool=k`` does: the matched top-k baseline.
    - ``scope="model"`` (S11): one kept set of whole blocks of ``block`` positions (default
      16) for every layer and head, the top ``k`` blocks by ``aggregate`` (``"sum"``, default,
      or ``"max"``) of each head's softmax mass of its (pooled) log-scores in the block
      (``probkv.sampling.model_blocks``); uniform layer and head budgets only. Not layerwise.
      The first ``sink_blocks`` blocks and the blocks of the last ``recent_tokens`` positions
      are kept by rule, counted in the budget (``model_blocks.protected_blocks``; defaults
      ``model_scope.DEFAULTS``). ``block``, ``aggregate``, ``sink_blocks`` and
      ``recent_tokens`` are ``None`` with ``scope="head"``.
    - ``threshold`` (S11, KVzap's threshold mode): keep what scores above ``threshold`` instead
      of a fixed share, so the compression adapts per prompt. The observed layers' entries
      scoring above it (and the forced ones) give the prompt's ratio
      ``r(threshold) = 1 - kept / entries`` over every KV head of every layer
      (``threshold_ratio``); the policy then runs at ``max(ratio, r(threshold))``: ``ratio`` is
      the least compression (0: the threshold alone). With ``layer_budgets="global"`` and
      ``head_budgets="ada"``, ``alpha = 0`` (``kvzap``, ``kvzip``: one top-k over every head),
      keeps exactly the entries above the threshold (its count is the pooled budget); with
      uniform budgets the threshold sets the ratio and each head keeps its top share; with
      ``scope="model"`` it sets the ratio and the top blocks are kept (what vLLM can free).
      Scores on the attention scale only (a threshold compares log-scores across heads); not
      layerwise (every layer is counted first; ``probkv.policies.threshold``). The effective
      ratio is in the cache's reports (S3).
    """

    layer_budgets: str = "uniform"
    head_budgets: str = "uniform"
    alpha: float | None = None  # None: ADA_ALPHA with head_budgets="ada"
    beta: float | None = None  # None: PYRAMID_BETA with layer_budgets="pyramid"
    recent: float = 0.0
    pool: int = 1
    scope: str = "head"
    block: int | None = None  # None: model_scope.DEFAULT_BLOCK with scope="model"
    aggregate: str | None = None  # None: model_scope.DEFAULT_AGGREGATE with scope="model"
    sink_blocks: int | None = None  # None: model_scope.DEFAULTS with scope="model"
    recent_tokens: int | None = None  # None: model_scope.DEFAULTS with scope="model"
    threshold: float | None = None  # keep log-scores above it: the ratio adapts per prompt

    def __post_init__(self) -> None:
        validate_common(self)
        self._check_threshold()
        check_choice(self.layer_budgets, LAYER_BUDGETS, "layer_budgets")
        check_choice(self.head_budgets, HEAD_BUDGETS, "head_budgets")
        check_choice(self.scope, SCOPES, "scope")
        given = {key: getattr(self, key) for key in model_scope.OPTIONS}
        for key, value in model_scope.check_options(self.scope, where="top-k", **given).items():
            object.__setattr__(self, key, value)
        if self.scope == model_scope.SCOPE:
            for key in ("layer_budgets", "head_budgets"):
                if getattr(self, key) != "uniform":
                    raise ValueError(
                        f"{key}={getattr(self, key)!r} with scope='model': one set of blocks "
                        "for every layer and head has no layer or head budgets (uniform only; "
                        f"for these scores use topk:{self.score}/scope=model)"
                    )
        self._check_alpha_beta()
        recent = check_fraction(self.recent, "recent", what="share of the budget kept recent")
        object.__setattr__(self, "recent", recent)
        proposals.check_pool_kernel(self.pool)

    # alpha's and beta's defaults follow the budgets: method names compare them with a policy
    # of the same budgets
    DEFAULTS_DEPEND_ON = ("layer_budgets", "head_budgets", "scope")

    def _check_alpha_beta(self) -> None:
        """``alpha`` with Ada-KV head budgets only, ``beta`` with pyramid layers only."""
        if self.head_budgets != "ada":
            if self.alpha is not None:
                raise ValueError(
                    f"alpha={self.alpha!r}: alpha only acts with Ada-KV head budgets "
                    f"(head_budgets='ada'), got head_budgets={self.head_budgets!r}; omit alpha"
                )
        else:
            alpha = ADA_ALPHA if self.alpha is None else self.alpha
            alpha = check_fraction(alpha, "alpha", what="Ada-KV safeguard fraction")
            object.__setattr__(self, "alpha", alpha)
        if self.layer_budgets != "pyramid":
            if self.beta is not None:
                raise ValueError(
                    f"beta={self.beta!r}: beta only acts with pyramid layer budgets "
                    f"(layer_budgets='pyramid'), got layer_budgets={self.layer_budgets!r}; "
                    "omit beta"
                )
            return
        beta = PYRAMID_BETA if self.beta is None else self.beta
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta):
            raise ValueError(f"beta (PyramidKV) must be a finite number >= 1, got {beta!r}")
        if beta < 1:
            raise ValueError(f"beta (PyramidKV) must be >= 1 (1 = uniform layers), got {beta!r}")
        object.__setattr__(self, "beta", float(beta))

    def _check_threshold(self) -> None:
        """``threshold``: a finite number, on an attention-scale score (``probkv.policies.threshold``)."""
        object.__setattr__(self, "threshold", check_threshold(self.threshold, self.score))

    @property
    def layerwise(self) -> bool:
        return (
            self.layer_budgets != "global"
            and self.scope == "head"
            and self.threshold is None
            and super().layerwise
        )

    def layer_budget(self, obs: LayerObservation, num_layers: int) -> int:
        """Kept entries per head of this layer (before the head allocation)."""
        t = obs.length
        mean = budgets.uniform_budget(t, self.ratio)
        if self.layer_budgets != "pyramid":
            return mean
        # PyramidKV's reference code shapes only the budget beyond the observation window.
        window = 0 if obs.forced is None else min(int(obs.forced.sum(-1).max()), mean)
        return budgets.pyramid_budgets(num_layers, mean, beta=self.beta, window=window, t=t)[
            obs.rank
        ]

    @property
    def _one_competition(self) -> bool:
        """Every head of every layer competes for one pooled budget (``_select_global``)."""
        return self.layer_budgets == "global" and self.head_budgets == "ada"

    def select(
        self, observations: Sequence[LayerObservation], *, num_layers: int
    ) -> list[RaggedSelection]:
        if self.threshold is not None:  # the prompt's ratio, then the policy at that ratio
            ratio = threshold_ratio(observations, self.threshold)
            policy = dataclasses.replace(self, ratio=max(self.ratio, ratio), threshold=None)
            kept, entries = threshold_count(observations, self.threshold)
            exact = ratio == 1.0 - kept / entries  # not capped at one entry per head
            if ratio > self.ratio and exact and policy._one_competition:
                # exactly the entries above the threshold: their count is the pooled budget
                return policy._select_global(observations, total=kept)
            return policy.select(observations, num_layers=num_layers)
        if self.layer_budgets == "global" and self.head_budgets == "ada" and self.ratio > 0:
            return self._select_global(observations)
        if self.scope == model_scope.SCOPE and self.ratio > 0:
            return self._select_model(observations)
        out = []
        for obs in observations:
            if self.ratio == 0.0:
                out.append(keep_everything(obs))
                continue
            per_head = self.layer_budget(obs, num_layers)
            obs = with_recent(obs, recent_count(self.recent, per_head))
            h = obs.num_heads
            uniform = torch.full((h,), per_head, dtype=torch.int64, device=obs.log_scores.device)
            forced = fit_forced(obs.forced, uniform)
            log_scores = proposals.max_pool_log_scores(obs.log_scores, self.pool, forced=forced)
            if self.head_budgets == "ada":
                head_budgets = budgets.adakv_allocation(
                    log_scores,
                    per_head * h,
                    alpha=self.alpha,
                    forced=forced,
                    # Logs of attention probabilities (S2) are compared across heads as they
                    # are, like Ada-KV's reference code compares raw attention; the others (key
                    # norms, synthetic recency, uniform) are made distributions per head first.
                    normalize=not scores.on_attention_scale(self.score),
                )
            else:
                head_budgets = uniform
            out.append(budgets.topk_per_head(log_scores, head_budgets, forced=forced))
        return out

    def _select_global(
        self, observations: Sequence[LayerObservation], total: int | None = None
    ) -> list[RaggedSelection]:
        """One budget for every KV head of every layer (``layer_budgets="global"``): Ada-KV's
        allocation over the stacked heads (ties: lower layer, lower head, later position),
        then each head's top-``B_h`` (S6; KVzip's global top-k at ``alpha = 0``, S10.1).
        ``total``: the pooled budget (a threshold's count), else the ratio's per-head budget
        times the heads."""
        lengths = {obs.length for obs in observations}
        if len(lengths) != 1:
            raise ValueError(
                f"layer_budgets='global' needs every layer observed over the same prefix, got "
                f"lengths {sorted(lengths)}"
            )
        per_head = budgets.uniform_budget(lengths.pop(), self.ratio)
        log_scores, forced = [], []
        for obs in observations:
            obs = with_recent(obs, recent_count(self.recent, per_head))
            full = torch.full(
                (obs.num_heads,), per_head, dtype=torch.int64, device=obs.log_scores.device
            )
            f = fit_forced(obs.forced, full)
            log_scores.append(proposals.max_pool_log_scores(obs.log_scores, self.pool, forced=f))
            forced.append(
                f if f is not None else torch.zeros_like(obs.log_scores, dtype=torch.bool)
            )
        stacked = torch.cat(log_scores)
        head_budgets = budgets.adakv_allocation(
            stacked,
            per_head * stacked.shape[0] if total is None else total,
            alpha=self.alpha,
            forced=torch.cat([f.to(stacked.device) for f in forced]),
            normalize=not scores.on_attention_scale(self.score),
        )
        out, first = [], 0
        for ls, f in zip(log_scores, forced):
            h = ls.shape[0]
            out.append(budgets.topk_per_head(ls, head_budgets[first : first + h], forced=f))
            first += h
        return out

    def _select_model(self, observations: Sequence[LayerObservation]) -> list[RaggedSelection]:
        """S11: the top blocks by the aggregate of every head's softmax mass of its (pooled)
        log-scores, the same blocks for every layer and head; forced entries' blocks kept."""
        t = model_scope.common_length(observations)
        per_head = budgets.uniform_budget(t, self.ratio)
        observations = [
            with_recent(obs, recent_count(self.recent, per_head)) for obs in observations
        ]
        pis = []
        for obs in observations:
            pooled = proposals.max_pool_log_scores(obs.log_scores, self.pool, forced=obs.forced)
            pis.append(proposals.proposal_from_log_scores(pooled, forced=obs.forced))

        def choose(mass, forced, k):
            return model_blocks.top_blocks(mass, forced, k), None

        return model_scope.select(observations, pis, self, choose=choose)
