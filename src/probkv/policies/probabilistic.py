"""Probabilistic eviction with decode-time correction (S3, S4, S9).

Sample which entries each KV head keeps from a proposal built from ``score`` (S2), choose the
number of samples for the target ratio per head or globally across all layers (S3), and give
each kept entry an importance log-weight (S4) that the attention adds to its logits at every
later decode step. Entries a score forces (SnapKV's observation window) form a take-all
stratum: always kept, weight 1, and the proposal covers the other entries.

A policy is made of parts that check themselves (``probkv.policies.prob_options``): the
sampling design (``sampler``: with replacement, or pps with its span-preserving options), the
weighting and the proposal. Method names spell them as flat options (``prob:h2o/tau=2/core=0``);
``ProbabilisticPolicy(score=..., tau=2, core=0)`` takes the same options, and reads them back
as attributes (``policy.tau``, ``policy.core``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from probkv import budgets, scores
from probkv._checks import check_choice
from probkv.estimation import calibration
from probkv.estimation.selection import RaggedSelection
from probkv.policies import model_scope, prob_options
from probkv.policies.base import (
    EvictionPolicy,
    LayerObservation,
    LayerTensors,
    Observations,
    Selections,
    fit_forced,
    keep_everything,
    recent_count,
    validate_common,
    with_recent,
)
from probkv.policies.prob_options import DESIGNS, SCOPES, Design, Proposal, Stratum, Weighting
from probkv.policies.threshold import check_threshold, threshold_ratio
from probkv.sampling import model_blocks
from probkv.scores import proposals

# Every draw's generator is seeded with seed * SEED_STRIDE + the first layer's index: torch
# generators take 64-bit seeds, so seeds are limited to SEEDS (room for 2^16 layers).
SEED_STRIDE = 100_003
SEEDS = (0, (2**64 - 2**16) // SEED_STRIDE)
PART_OPTIONS = (Weighting.OPTIONS, Proposal.OPTIONS)
SAMPLERS = tuple(DESIGNS)  # the values of the option sampler
_PROTECTED = ("sink_blocks", "recent_tokens")  # scope="model": blocks kept by rule


def _check_seed(seed) -> int:
    lo, hi = SEEDS
    if isinstance(seed, bool) or not isinstance(seed, int) or not lo <= seed <= hi:
        too_long = isinstance(seed, int) and abs(seed) >= 10**40  # not printed in full
        shown = f"an integer of {seed.bit_length()} bits" if too_long else repr(seed)
        raise ValueError(
            f"seed must be an integer in [{lo}, {hi}] (torch seeds are 64-bit; each layer's draw "
            f"is seeded with seed * {SEED_STRIDE} + its index), got {shown}"
        )
    return seed


@dataclass(frozen=True, init=False)
class ProbabilisticPolicy(EvictionPolicy):
    """Importance-sampled eviction from the proposal named by ``score``.

    Fields: ``score``, ``ratio``, ``score_params`` (``EvictionPolicy``); ``scope``: ``"head"``
    (every KV head keeps 1 - r of its entries in expectation) or ``"global"`` (one number of
    samples / one pps scale for all heads of all layers, S3, S9; with pps, scores on the
    attention scale weigh each head's proposal by its attention mass, the others every head the
    same); ``seed`` (same seed, same kept set); ``threshold`` (S11, KVzap's threshold mode:
    the prompt's ratio is ``max(ratio, r(threshold))``, the share of entries scoring at or
    below it, and the design draws at that ratio; ``probkv.policies.threshold``); and the parts ``design`` (``sampler``),
    ``weighting``, ``proposal_options`` (``probkv.policies.prob_options``: what each option
    means). ``ProbabilisticPolicy(score=..., ratio=..., **options)`` builds the parts from the
    options of a method name; options not given take ``prob_options.DEFAULTS`` for the score and
    the sampler; the options of another sampler, and options that could change nothing, are
    refused by name. ``dataclasses.replace(policy, tau=2)`` changes one option.

    Forced entries (the score's, e.g. SnapKV's window, plus the recent ones) are kept with
    weight 1 and count against the budget; if they exceed a head's budget (a short prompt at
    high compression), only the most recent ``budget`` of them stay forced (``fit_forced``).
    The paper's estimator is ``prob:<score>/sampler=with_replacement/weights=counts``.
    With ``scope="model"``, ``aggregate``, ``sink_blocks`` and ``recent_tokens`` are
    ``probkv.policies.model_scope``'s options (protected blocks: kept with ``P = 1``, counted in
    the budget); ``None`` with any other scope.
    """

    score: str = "snapkv"
    ratio: float = 0.5
    score_params: dict = field(default_factory=dict)
    scope: str | None = None
    seed: int = 0
    design: Design | None = None
    weighting: Weighting | None = None
    proposal_options: Proposal | None = None
    aggregate: str | None = None  # scope="model" only (S11): "sum" (default) or "max"
    sink_blocks: int | None = None  # scope="model" only: first blocks kept by rule
    recent_tokens: int | None = None  # scope="model" only: last positions kept by rule
    threshold: float | None = None  # S11: the ratio adapts per prompt (probkv.policies.threshold)

    # Option whose value decides other options' defaults: method names compare those options
    # with the defaults of a policy with the same sampler.
    DEFAULTS_DEPEND_ON = ("sampler", "scope")
    # Options of other policies that this one refuses, and why (the registry says it too).
    WHY_NOT: ClassVar[Mapping[str, str]] = {}

    def __init__(
        self,
        score: str = "snapkv",
        ratio: float = 0.5,
        score_params: dict | None = None,
        scope: str | None = None,
        seed: int = 0,
        design: Design | None = None,
        weighting: Weighting | None = None,
        proposal_options: Proposal | None = None,
        aggregate: str | None = None,
        threshold: float | None = None,
        sink_blocks: int | None = None,
        recent_tokens: int | None = None,
        **options,
    ) -> None:
        put = _setter(self)
        put(score=score, ratio=ratio, score_params={} if score_params is None else score_params)
        validate_common(self)
        put(threshold=check_threshold(threshold, score))
        for key in set(options) & set(self.WHY_NOT):
            raise ValueError(f"option {key!r} of a prob: method: {self.WHY_NOT[key]}")
        unknown = sorted(set(options) - set(self.option_names()))
        if unknown:
            raise ValueError(
                f"unknown option {unknown[0]!r} of ProbabilisticPolicy; valid options: "
                f"{', '.join(self.option_names())}"
            )
        if scope is None:
            scope = prob_options.default("scope", score, options.get("sampler") or "pps")
        check_choice(scope, SCOPES, "scope")
        if scope == model_scope.SCOPE and design is None and options.get("sampler", "pps") == "pps":
            # model-wide units are blocks of positions, vLLM's 16 unless told (S11)
            options.setdefault("units", "blocks")
            options.setdefault("block", model_scope.DEFAULT_BLOCK)
        design = self._design(design, options)
        weighting = self._part(Weighting, weighting, options, design.NAME)
        shape = self._part(Proposal, proposal_options, options, design.NAME)
        if scope == model_scope.SCOPE:  # model-scope options: prob: keeps its own defaults
            given = {"aggregate": aggregate, "sink_blocks": sink_blocks}
            given["recent_tokens"] = recent_tokens
            aggregate, sink_blocks, recent_tokens = (
                prob_options.default(k, score, design.NAME) if v is None else v
                for k, v in given.items()
            )
        model = model_scope.check_options(
            scope,
            where="prob:",
            aggregate=aggregate,
            sink_blocks=sink_blocks,
            recent_tokens=recent_tokens,
        )
        put(scope=scope, seed=_check_seed(seed), design=design, weighting=weighting)
        put(proposal_options=shape, **{k: model[k] for k in ("aggregate", *_PROTECTED)})
        self._check_model_scope()
        self._check_calibrate()

    def _check_model_scope(self) -> None:
        """``scope="model"`` draws whole blocks of ``block`` positions by fixed-size pps (S11)."""
        if self.scope != model_scope.SCOPE:
            return
        if self.design.NAME != "pps":
            raise ValueError(
                f"scope='model' draws blocks of positions by fixed-size pps (S11), got "
                f"sampler={self.design.NAME!r}; use sampler=pps"
            )
        if self.design.units != "blocks":
            raise ValueError(
                f"units={self.design.units!r} with scope='model': model-wide units are blocks "
                "of consecutive positions shared by every layer and head (S11); use units=blocks"
            )

    def _design(self, design: Design | None, options: dict) -> Design:
        """The sampling design from ``design`` and the options (S9, S10)."""
        sampler = options.pop("sampler", None)
        if sampler is not None:
            check_choice(sampler, DESIGNS, "sampler")
        if design is not None and sampler not in (None, design.NAME):
            design = None  # another sampler: its options start from its defaults
        name = design.NAME if design is not None else sampler or self._default("sampler", "")
        cls = DESIGNS[name]
        given = {k: options.pop(k) for k in cls.OPTIONS if k in options}
        foreign = {k: options.pop(k) for k in prob_options.design_options() if k in options}
        if foreign:
            key, value = next(iter(foreign.items()))
            owners = [n for n, c in DESIGNS.items() if key in c.OPTIONS]
            why = cls.WHY_NOT.get(key, f"it is an option of sampler={' or '.join(owners)}")
            raise ValueError(
                f"{key}={value!r} does nothing with sampler={name!r}: {why}; omit {key}"
            )
        return cls.build(self.score, prob_options.merged(design, given))

    def _part(self, cls, part, options: dict, sampler: str):
        given = {k: options.pop(k) for k in cls.OPTIONS if k in options}
        values = prob_options.merged(part, given)
        if cls is Weighting and values.get("correct") is False and "tau" not in values:
            values["tau"] = math.inf  # no correction: no temperature
        filled = {
            k: self._default(k, sampler) if values.get(k) is None else values[k]
            for k in cls.OPTIONS
        }
        return cls(**filled)

    def _default(self, option: str, sampler: str):
        return prob_options.default(option, self.score, sampler)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        designs = tuple(prob_options.design_options())
        parts = tuple(k for options in PART_OPTIONS for k in options)
        names = ("scope", "seed", "sampler", "aggregate", "threshold", *_PROTECTED)
        names = (*names, *designs, *parts)
        return tuple(sorted(names))

    def option_values(self) -> dict[str, object]:
        return {
            "scope": self.scope,
            "aggregate": self.aggregate,
            **{key: getattr(self, key) for key in _PROTECTED},
            "threshold": self.threshold,
            "seed": self.seed,
            "sampler": self.design.NAME,
            **self.design.values(),
            **self.weighting.values(),
            **self.proposal_options.values(),
        }

    def __getattr__(self, name: str):
        # the parts' options read as the policy's own (policy.tau, policy.core, ...)
        if name in ("design", "weighting", "proposal_options") or name.startswith("__"):
            raise AttributeError(name)
        if name == "sampler":
            return self.design.NAME
        for part in (self.design, self.weighting, self.proposal_options):
            if name in type(part).OPTIONS:
                return getattr(part, name)
        raise AttributeError(f"{type(self).__name__} has no option {name!r}")

    def _check_calibrate(self) -> None:
        """S9 ``calibrate``: weights fitted to the reconstruction queries, so a reconstruction
        score (the weighting checks it has weights to start from)."""
        strength = self.weighting.calibrate
        if not math.isinf(strength) and not scores.needs_reconstruction(self.score):
            raise ValueError(
                f"calibrate={strength!r} with score={self.score!r}: calibrated weights "
                "fit the reconstruction queries (S10.1), which only the reconstruction scores "
                f"observe ({', '.join(scores.RECONSTRUCTION_SCORES)})"
            )

    @property
    def calibrates(self) -> bool:
        evicts = self.ratio > 0.0 or self.threshold is not None
        return not math.isinf(self.weighting.calibrate) and evicts

    def calibrated_selections(
        self, selections: Selections, observations: Observations, tensors: LayerTensors
    ) -> list[RaggedSelection]:
        """S9: each layer's weights fitted to its reference queries (``probkv.estimation.calibration``);
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

    @property
    def layerwise(self) -> bool:
        if self.threshold is not None:  # every layer is counted first
            return False
        return super().layerwise and (self.scope == "head" or self.ratio == 0.0)

    @property
    def corrected(self) -> bool:
        return self.weighting.correct

    def pooled_scores(self, obs: LayerObservation) -> torch.Tensor:
        """``[Hkv, t]`` log-scores max-pooled over positions with kernel ``pool`` (S10)."""
        return proposals.max_pool_log_scores(obs.log_scores, self.pool, forced=obs.forced)

    def proposal(self, obs: LayerObservation, pooled: torch.Tensor | None = None) -> torch.Tensor:
        """``[Hkv, t]``: zero on forced entries, full support on the others (S2). ``pooled``:
        ``pooled_scores(obs)`` if already computed."""
        pooled = self.pooled_scores(obs) if pooled is None else pooled
        return proposals.proposal_from_log_scores(
            pooled, tau=self.proposal_tau, uniform_mix=self.uniform_mix, forced=obs.forced
        )

    def select(
        self, observations: Sequence[LayerObservation], *, num_layers: int
    ) -> list[RaggedSelection]:
        if self.threshold is not None:  # the prompt's ratio, then the design at that ratio
            ratio = max(self.ratio, threshold_ratio(observations, self.threshold))
            policy = dataclasses.replace(self, ratio=ratio, threshold=None)
            return policy.select(observations, num_layers=num_layers)
        if self.ratio == 0.0:
            return [keep_everything(obs) for obs in observations]
        # One generator for the whole eviction, seeded per (seed, first layer): per-layer
        # eviction (head scope) and one-shot global eviction are both reproducible.
        # The generator lives on the scores' device (on CPU the same stream as before; a CUDA
        # generator draws a different, equally seeded stream).
        device = observations[0].log_scores.device
        generator = torch.Generator(device=device)
        generator.manual_seed(self.seed * SEED_STRIDE + observations[0].layer_idx)
        observations = [self._with_forced(obs) for obs in observations]
        pooled = [self.pooled_scores(obs) for obs in observations]
        pis = [self.proposal(obs, p).double() for obs, p in zip(observations, pooled)]
        if self.scope == model_scope.SCOPE:
            return self._select_model(observations, pis)
        # A head whose entries are all forced (a prompt no longer than SnapKV's window at a
        # budget of every entry) has nothing to sample: it keeps everything and is left out.
        rows = [pi.sum(-1) > 0 for pi in pis]
        live = [i for i, r in enumerate(rows) if bool(r.any())]

        def rank():
            # The core ranks by the (pooled) scores; scope "global" compares heads on the
            # score's own scale (S9): raw log-scores where they are attention, else per head
            # log-softmax.
            if self.scope == "global":
                ranked = [self._global_keys(observations[i], pooled[i]) for i in live]
            else:
                ranked = [pooled[i] for i in live]
            keys = [k[rows[i]].double() for k, i in zip(ranked, live)]
            return keys, self._head_masses(keys)

        drawn = []
        if live:
            stratum = Stratum(
                pis=[pis[i][rows[i]] for i in live],
                forced=[_forced_counts(observations[i])[rows[i]] for i in live],
                budgets=[budgets.uniform_budget(observations[i].length, self.ratio) for i in live],
                ratio=self.ratio,
                scope=self.scope,
                rank=rank,
            )
            drawn = self.design.draw(stratum, self.weighting, generator)
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

    def _select_model(
        self, observations: list[LayerObservation], pis: list[torch.Tensor]
    ) -> list[RaggedSelection]:
        """S11: one block pps for every layer and head, weights ``-log P_b / tau``. The draw
        runs on a CPU generator seeded as the head scope's (the blocks are few)."""
        generator = torch.Generator()
        generator.manual_seed(self.seed * SEED_STRIDE + observations[0].layer_idx)

        def choose(mass, forced, k):
            kept, inclusion = model_blocks.pps_blocks(
                mass, forced, k, core=self.core, order=self.order, generator=generator
            )
            return kept, inclusion if self.corrected else None

        tau = self.tau if self.corrected else 1.0
        return model_scope.select(observations, pis, self, choose=choose, tau=tau)

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
        if self.scope != "global" or not scores.on_attention_scale(self.score) or not keys:
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


def _setter(obj):
    """Set fields of a frozen dataclass during its construction."""

    def put(**values):
        for k, v in values.items():
            object.__setattr__(obj, k, v)

    return put


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
