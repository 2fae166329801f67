"""Probabilistic eviction with decode-time correction (S3, S4, S9).

Sample which entries each KV head keeps from a proposal built from ``score`` (S2), choose the
number of samples for the target ratio per head or globally across all layers (S3), and give
each kept entry an importance log-weight (S4) that the attention adds to its logits at every
later decode step. Entries a score forces (SnapKV's observation window) form a take-all
stratum: always kept, weight 1, and the proposal covers the other entries. pps can keep spans
(S10.2-S10.4, ``probkv.designs``): a deterministic core, blocks, a random visiting order; and
any score can be max-pooled over positions first (``pool``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from probkv import (
    budgets,
    calibration,
    designs,
    estimator,
    proposals,
    sample_size,
    sampling,
    scores,
)
from probkv._checks import check_choice, check_tau
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
from probkv.selection import RaggedSelection

SCOPES = ("head", "global")
# Defaults of the pps sampler's design, from probkv's measurements on needle tasks
# (docs/evaluation.md): blocks of 8 entries visited in a seeded random order (S10.3, S10.4).
PPS_BLOCK = scores.DEFAULT_PROB_BLOCK  # the score table's default block (ScoreSpec.prob_block)
PPS_ORDER = "random"
SAMPLERS = ("with_replacement", "pps")
# Options left None take the score's measured pps design (ScoreSpec.prob_<option>, from
# docs/evaluation.md) with sampler="pps", and these fixed values with the paper's sampler.
PLAIN_DEFAULTS = {
    "tau": 1.0,
    "uniform_mix": 1.0,
    "core": 0.0,
    "block": 1,
    "units": "blocks",
}
WEIGHTS = ("counts", "inclusion")


@dataclass(frozen=True)
class ProbabilisticPolicy(EvictionPolicy):
    """Importance-sampled eviction from the proposal named by ``score``.

    - ``scope``: ``"head"`` (every KV head keeps 1 - r of its entries in expectation) or
      ``"global"`` (one number of samples / one pps scale for all heads of all layers, S3, S9);
      default: the score's ``budget_scope`` (``"global"`` for the reconstruction scores
      ``kvzip``, ``h2o-rec``, ``min-rec``; ``"head"`` else).
      With pps, global heads compete on the score's own scale: scores on the attention scale
      weigh each head's proposal by its attention mass ``m_h`` (``P = min(1, lam m_h pi)``, pps
      over the raw scores at ``proposal_tau = 1``) and the global core is the top of the raw
      scores (``core=1`` is then KVzip's global top-k); the others weigh every head the same.
    - ``sampler``: ``"with_replacement"`` (the paper: m draws, keep the distinct ones) or
      ``"pps"`` (S9: fixed size without replacement, exact budget per head).
    - ``weights`` (with-replacement sampler): ``"counts"`` (Eq. 10, the paper) or
      ``"inclusion"`` (Horvitz-Thompson, S9). pps always uses ``1 / P_i``.
    - ``tau``: weight temperature (``log w / tau``); ``inf`` or ``correct=False`` = no
      correction (the uncorrected estimator). Default 1, but 2 for ``streaming_llm`` with pps
      (the score's ``prob_tau``).
    - ``proposal_tau``, ``uniform_mix``: S2 adjustments of the proposal itself
      (``uniform_mix`` = weight of the proposal against the uniform distribution; default 1,
      but 0.5 for ``tova`` with pps, the score's ``prob_uniform_mix``).
    - ``recent``: fraction of each head's budget reserved for the most recent entries, a
      take-all stratum like SnapKV's window (H2O's recent window; default 0, none).
    - ``seed``: same seed, same kept set.
    - ``pool``: max-pool the log-scores over positions with this odd kernel before they become
      the proposal (S10; 1 = none), so a needle's neighbours share its score.
    - Span-preserving pps designs (S10.2-S10.4; ``sampler="pps"`` only; defaults: the
      score's ``prob_block`` and ``prob_units``, blocks of 8 (``kvzip``: spans of at most 32)
      in random order, and the score's ``prob_core``: 0.5 for the attention-statistics and
      reconstruction scores, 0.9 for ``tova``, ``streaming_llm`` and ``uniform``, 0 for
      ``snapkv`` and ``knorm``, from docs/evaluation.md): ``core`` = f in [0, 1], per head the
      ``floor(f b)`` entries of largest proposal
      (``b`` = budget after forced entries; ties by the score, then the later position) are
      kept with weight 1 and the rest of the budget is pps over the other entries (``core=1``
      is the top-k method of ``score``); ``block`` = entries per sampling unit (runs of
      consecutive non-forced entries, every entry of a kept block weighted ``1 / P_block``;
      the kept count is within ``block - 1`` of the budget); ``order`` = ``"position"`` or
      ``"random"``, the visiting order of systematic sampling (a seeded permutation per head);
      ``units`` = ``"blocks"`` (the runs of ``block`` entries above) or ``"spans"`` (runs of
      entries of above-average proposal, at most ``block`` long, are the units, every other
      entry a unit of its own: a needle's tokens are kept or dropped together, the kept count
      is random around the budget; ``designs.spans``).
      Scope "global": the core is the ``floor(f S)`` entries of largest proposal over all heads
      of all layers (``S`` the global sampled budget), then one pps scale for the rest.

    Forced entries (the score's, e.g. SnapKV's window, plus the recent ones) are kept with
    weight 1 and count against the budget; if they exceed a head's budget (a short prompt at
    high compression), only the most recent ``budget`` of them stay forced (``fit_forced``).

    Defaults come from probkv's own evaluation on SmolLM2 (docs/evaluation.md, S9): ``pps``
    sampling with ``tau = 1`` gave the lowest attention error of the sampled estimators,
    compounded over decode steps, on both prompts measured; with the with-replacement sampler,
    ``inclusion`` weights beat the paper's ``counts`` weights, which at ``tau = 1`` were worse
    than no correction. The default proposal is ``snapkv``: the best task scores of the
    proposals measured (``min-h`` has the lowest last-query attention error by design but lost
    most needles on SmolLM2). The paper's estimator is ``sampler="with_replacement",
    weights="counts"`` (``prob:<score>/sampler=with_replacement/weights=counts``).
    """

    score: str = "snapkv"
    scope: str | None = None  # None: the score's budget_scope ("global": reconstruction)
    sampler: str = "pps"
    weights: str = "inclusion"
    tau: float | None = None  # None: the score's prob_tau for sampler="pps", 1 otherwise
    correct: bool = True
    proposal_tau: float = 1.0
    uniform_mix: float | None = None  # None: the score's prob_uniform_mix for pps, 1 otherwise
    recent: float = 0.0
    seed: int = 0
    core: float | None = None  # None: the score's prob_core for sampler="pps", 0 otherwise
    block: int | None = None  # None: the score's prob_block for sampler="pps", 1 otherwise
    order: str | None = None  # None: PPS_ORDER for sampler="pps", "position" otherwise
    units: str | None = None  # None: the score's prob_units for sampler="pps", else "blocks"
    pool: int = 1
    calibrate: float = math.inf  # S9 ridge of calibrated weights; inf = the design's weights

    # Fields whose defaults depend on these (core, block, order, units, tau, uniform_mix on the
    # sampler): method names compare them with the defaults of a policy with the same sampler.
    DEFAULTS_DEPEND_ON: ClassVar[tuple[str, ...]] = ("sampler",)

    def __post_init__(self) -> None:
        validate_common(self)
        if self.scope is None:
            object.__setattr__(self, "scope", scores.budget_scope(self.score))
        check_choice(self.scope, SCOPES, "scope")
        check_choice(self.sampler, SAMPLERS, "sampler")
        check_choice(self.weights, WEIGHTS, "weights")
        self._fill_sampler_defaults()
        object.__setattr__(self, "tau", check_tau(self.tau, "tau"))
        object.__setattr__(self, "proposal_tau", check_tau(self.proposal_tau, "proposal_tau"))
        mix = check_fraction(self.uniform_mix, "uniform_mix", what="weight of the proposal")
        if mix == 0.0:
            raise ValueError("uniform_mix must be in (0, 1] (weight of the proposal), got 0")
        object.__setattr__(self, "uniform_mix", mix)
        recent = check_fraction(self.recent, "recent", what="share of the budget kept recent")
        object.__setattr__(self, "recent", recent)
        if not isinstance(self.correct, bool):
            raise ValueError(f"correct must be True or False, got {self.correct!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        self._check_span_options()
        self._check_calibrate()

    def _check_calibrate(self) -> None:
        """S9 ``calibrate``: weights fitted to the reconstruction queries, so a reconstruction
        score and weights to start from."""
        object.__setattr__(self, "calibrate", calibration.check_strength(self.calibrate))
        if math.isinf(self.calibrate):
            return
        if not scores.needs_reconstruction(self.score):
            raise ValueError(
                f"calibrate={self.calibrate!r} with score={self.score!r}: calibrated weights "
                "fit the reconstruction queries (S10.1), which only the reconstruction scores "
                f"observe ({', '.join(scores.RECONSTRUCTION_SCORES)})"
            )
        if not self.corrected:
            raise ValueError(
                f"calibrate={self.calibrate!r} calibrates the correction's weights (S9); it "
                f"needs correct=True and a finite tau, got correct={self.correct!r}, "
                f"tau={self.tau!r}"
            )

    @property
    def calibrates(self) -> bool:
        return not math.isinf(self.calibrate) and self.ratio > 0.0

    def calibrated_selections(
        self,
        selections: Sequence[RaggedSelection],
        observations: Sequence[LayerObservation],
        tensors: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> list[RaggedSelection]:
        """S9: each layer's weights fitted to its reference queries (``probkv.calibration``);
        the kept entries stay the design's."""
        out = []
        for sel, obs, (key, value) in zip(selections, observations, tensors, strict=True):
            if obs.reference_queries is None or obs.scale is None:
                raise ValueError(
                    f"calibrate={self.calibrate!r}: layer {obs.layer_idx}'s observation has no "
                    "reference queries; the reconstruction pass records them (probkv.hf."
                    "compress or observe)"
                )
            if key.shape[-2] != obs.length:
                raise ValueError(
                    f"layer {obs.layer_idx}: calibration needs the {obs.length} observed "
                    f"entries before eviction, got keys of length {key.shape[-2]}"
                )
            out.append(
                calibration.calibrated_selection(
                    sel,
                    key,
                    value,
                    obs.reference_queries,
                    scale=obs.scale,
                    strength=self.calibrate,
                )
            )
        return out

    def _fill_sampler_defaults(self) -> None:
        """Options left ``None``: the score's pps design, or ``PLAIN_DEFAULTS`` (S9, S10)."""
        pps = self.sampler == "pps"
        spec = scores.score_spec(self.score)
        for name, plain in PLAIN_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(spec, f"prob_{name}") if pps else plain)
        if self.order is None:
            object.__setattr__(self, "order", PPS_ORDER if pps else "position")

    def _check_span_options(self) -> None:
        """S10: ``core``, ``block``, ``order``, ``units`` (pps designs), ``pool``."""
        core = check_fraction(self.core, "core", what="share of the sampled budget taken top-k")
        object.__setattr__(self, "core", core)
        designs.check_block(self.block)
        check_choice(self.order, designs.ORDERS, "order")
        designs.check_units(self.units)
        proposals.check_pool_kernel(self.pool)
        if self.sampler != "pps" and self._span_design:
            raise ValueError(
                f"core={self.core!r}, block={self.block!r}, order={self.order!r}, "
                f"units={self.units!r}: these are designs of sampler='pps' (S10.2-S10.4); "
                f"sampler={self.sampler!r} allows only core=0, block=1, order='position', "
                "units='blocks'"
            )

    @property
    def _span_design(self) -> bool:
        return self.core > 0 or self.block > 1 or self.order != "position" or self.units != "blocks"

    @property
    def layerwise(self) -> bool:
        return super().layerwise and (self.scope == "head" or self.ratio == 0.0)

    @property
    def corrected(self) -> bool:
        return self.correct and not math.isinf(self.tau)

    def pooled_scores(self, obs: LayerObservation) -> torch.Tensor:
        """``[Hkv, t]`` log-scores max-pooled over positions with kernel ``pool`` (S10)."""
        return proposals.max_pool_log_scores(obs.log_scores, self.pool, forced=obs.forced)

    def proposal(self, obs: LayerObservation, pooled: torch.Tensor | None = None) -> torch.Tensor:
        """``[Hkv, t]``: zero on forced entries, full support on the others (S2). ``pooled``:
        ``pooled_scores(obs)`` if already computed."""
        pooled = self.pooled_scores(obs) if pooled is None else pooled
        return proposals.proposal_from_log_scores(
            pooled,
            tau=self.proposal_tau,
            uniform_mix=self.uniform_mix,
            forced=obs.forced,
        )

    def select(
        self, observations: Sequence[LayerObservation], *, num_layers: int
    ) -> list[RaggedSelection]:
        if self.ratio == 0.0:
            return [keep_everything(obs) for obs in observations]
        # One generator for the whole eviction, seeded per (seed, first layer): per-layer
        # eviction (head scope) and one-shot global eviction are both reproducible.
        # The generator lives on the scores' device (on CPU the same stream as before; a CUDA
        # generator draws a different, equally seeded stream).
        device = observations[0].log_scores.device
        generator = torch.Generator(device=device)
        generator.manual_seed(self.seed * 100_003 + observations[0].layer_idx)
        observations = [self._with_forced(obs) for obs in observations]
        pooled = [self.pooled_scores(obs) for obs in observations]
        pis = [self.proposal(obs, p).double() for obs, p in zip(observations, pooled)]
        # A head whose entries are all forced (a prompt no longer than SnapKV's window at a
        # budget of every entry) has nothing to sample: it keeps everything and is left out.
        rows = [pi.sum(-1) > 0 for pi in pis]
        live = [i for i, r in enumerate(rows) if bool(r.any())]
        draw = self._draw_pps if self.sampler == "pps" else self._draw_with_replacement
        # The core ranks by the (pooled) scores; scope "global" compares heads on the score's
        # own scale (S9): raw log-scores where they are attention, per head log-softmax else.
        keys, masses = None, None
        if self._span_design or self.scope == "global":
            if self.scope == "global":
                ranked = [self._global_keys(observations[i], pooled[i]) for i in live]
            else:
                ranked = [pooled[i] for i in live]
            keys = [k[rows[i]].double() for k, i in zip(ranked, live)]
            masses = self._head_masses(keys) if live else None
        if self._span_design:  # S10.2-S10.4
            draw = functools.partial(self._draw_span, keys)
        drawn = []
        if live:
            drawn = draw(
                [pis[i][rows[i]] for i in live],
                [_forced_counts(observations[i])[rows[i]] for i in live],
                [budgets.uniform_budget(observations[i].length, self.ratio) for i in live],
                generator,
                masses=masses,
            )
        kept = [torch.zeros(pi.shape, dtype=torch.bool, device=pi.device) for pi in pis]
        logw = [torch.zeros(pi.shape, dtype=torch.float32, device=pi.device) for pi in pis]
        for i, (kept_i, logw_i) in zip(live, drawn):
            kept[i][rows[i]] = kept_i
            if logw_i is not None:
                logw[i][rows[i]] = logw_i.float()
        return [
            _selection(obs, k, w if self.corrected else None)
            for obs, k, w in zip(observations, kept, logw)
        ]

    def _global_keys(self, obs: LayerObservation, pooled: torch.Tensor) -> torch.Tensor:
        """``[Hkv, t]`` float64 keys comparable across heads (S9 global), from the pooled
        log-scores: as they are for scores on the attention scale (Ada-KV and KVzip compare raw
        attention), each head's log-softmax over its non-forced entries otherwise; ``-inf``
        where forced."""
        keys = pooled.double()
        if obs.forced is not None:
            keys = keys.masked_fill(obs.forced, -math.inf)
        if not scores.on_attention_scale(self.score):
            keys = torch.log_softmax(keys, -1)
        return keys

    def _head_masses(self, keys: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """S9 global: each head's weight ``m_h = sum_i exp(key_hi / proposal_tau)`` against the
        others (relative to the largest, so it cannot overflow); ``None`` (all 1) for head
        scope and for scores not on the attention scale, whose heads weigh the same."""
        if self.scope != "global" or not scores.on_attention_scale(self.score):
            return None
        logm = [proposals.log_mass(k, tau=self.proposal_tau) for k in keys]
        top = torch.cat([x.reshape(-1).cpu() for x in logm]).max()
        return [torch.exp(x - top.to(x.device)) for x in logm]

    def _with_forced(self, obs: LayerObservation) -> LayerObservation:
        """Add the recent window to the forced entries and fit them into the budget (S6)."""
        budget = budgets.uniform_budget(obs.length, self.ratio)
        obs = with_recent(obs, recent_count(self.recent, budget))
        full = torch.full((obs.num_heads,), budget, dtype=torch.int64, device=obs.log_scores.device)
        return dataclasses.replace(obs, forced=fit_forced(obs.forced, full))

    def _draw_with_replacement(self, pis, forced, head_budgets, generator, masses=None):
        """S3: m draws per head (or one m for all, global scope); keep the drawn entries."""
        if self.scope == "global":
            m = sample_size.samples_for_ratio_global(pis, self.ratio, always_kept=forced)
            ms = [torch.full((pi.shape[0],), m, dtype=torch.int64, device=pi.device) for pi in pis]
        else:
            ms = [
                sample_size.samples_for_ratio(pi, self.ratio, always_kept=f)
                for pi, f in zip(pis, forced)
            ]
        out = []
        for pi, m in zip(pis, ms):
            counts = sampling.sample_counts(pi, m, generator)
            kept = counts > 0
            logw = None  # S4 Eq. 10 (counts) or S9 Horvitz-Thompson (inclusion) weights
            if self.corrected and self.weights == "counts":
                logw = estimator.counts_log_weights(pi, kept, counts, num_samples=m, tau=self.tau)
            elif self.corrected:
                logw = estimator.inclusion_log_weights(pi, kept, m, counts=counts, tau=self.tau)
            out.append((kept, logw))
        return out

    def _draw_pps(self, pis, forced, head_budgets, generator, masses=None):
        """S9: exactly the budget per head (one pps scale for all heads, global scope)."""
        if self.scope == "global":
            inclusion = sampling.pps_inclusion_probabilities_global(
                pis, self.ratio, always_kept=forced, row_mass=masses
            )
        else:
            inclusion = [
                sampling.pps_inclusion_probabilities(pi, (b - f).clamp(min=0))
                for pi, f, b in zip(pis, forced, head_budgets)
            ]
        out = []
        for pi, p in zip(pis, inclusion):
            kept = sampling.systematic_sample(p, generator)
            logw = None
            if self.corrected:
                logw = estimator.pps_log_weights(pi, kept, p, tau=self.tau)
            out.append((kept, logw))
        return out

    def _draw_span(self, keys, pis, forced, head_budgets, generator, masses=None):
        """S10.2-S10.4: a deterministic core, then pps over blocks visited in ``order``;
        weights 1 on the core, ``1 / P`` of the entry's block elsewhere."""
        if self.scope == "global":
            total = designs.global_budget(pis, self.ratio, forced)
            eligible = [pi > 0 for pi in pis]
            cores = designs.top_entries_global(keys, designs.core_size(self.core, total), eligible)
            rest = total - sum(int(c.sum()) for c in cores)
            units = designs.block_design_global(
                pis,
                rest,
                self.block,
                outside=cores,
                row_mass=masses,
                units=self.units,
            )
        else:
            cores, units = [], []
            for key, pi, f, b in zip(keys, pis, forced, head_budgets):
                sampled = (b - f).clamp(min=0)
                core = designs.top_entries(key, designs.core_size(self.core, sampled), pi > 0)
                cores.append(core)
                rest = sampled - core.sum(-1)
                units.append(
                    designs.block_design(pi, rest, self.block, outside=core, units=self.units)
                )
        out = []
        for pi, core, design in zip(pis, cores, units):
            kept = designs.sample_design(design, self.order, generator) | core
            logw = None
            if self.corrected:
                inclusion = torch.where(core, 1.0, design.entry_inclusion)
                logw = estimator.pps_log_weights(pi, kept, inclusion, tau=self.tau)
            out.append((kept, logw))
        return out


def _forced_counts(obs: LayerObservation) -> torch.Tensor:
    if obs.forced is None:
        return torch.zeros(obs.num_heads, dtype=torch.int64, device=obs.log_scores.device)
    return obs.forced.sum(-1).to(torch.int64)


def _selection(
    obs: LayerObservation, kept: torch.Tensor, logw: torch.Tensor | None
) -> RaggedSelection:
    """Add the forced (take-all, weight 1) entries and flatten."""
    if obs.forced is not None:
        kept = kept | obs.forced.to(kept.device)
        if logw is not None:
            logw = logw.masked_fill(obs.forced.to(logw.device), 0.0)
    return RaggedSelection.from_masks(kept, logw)  # on the scores' device
