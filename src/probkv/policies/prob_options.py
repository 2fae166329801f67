"""The parts of a ``prob:`` method, and every default of its options (S2-S4, S9, S10).

A ``ProbabilisticPolicy`` is built from three small frozen parts, each checking itself once at
construction, so that a combination of options that could not change what the method does
cannot be built:

- a sampling design (``DESIGNS``, the option ``sampler``): ``WithReplacement`` (S3: ``m`` draws,
  keep the distinct entries; ``weights`` counts or inclusion) or ``Pps`` (S9, S10: fixed-size
  pps with a deterministic ``core``, units of ``block`` entries or spans, visited in ``order``;
  the weights are always ``1 / P``);
- a ``Weighting`` of the kept entries (S4, S9): ``correct``, ``tau``, ``calibrate``;
- a ``Proposal`` the design draws from (S2, S10): ``proposal_tau``, ``uniform_mix``, ``pool``,
  ``recent``.

``DEFAULTS`` holds every default of a ``prob:`` option, per score and per design where they
differ: the one place they are written (docs/methods.md's table is checked against it).

Adding a sampling design is one class here and one entry in ``DESIGNS`` (plus its defaults in
``DEFAULTS``, if it has options): its ``OPTIONS`` become method-name options of every
``prob:`` method with ``sampler=<NAME>`` and are refused with the other samplers;
docs/architecture.md works an example through.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from probkv import estimation, sampling, scores
from probkv._checks import check_choice
from probkv.estimation import calibration
from probkv.policies.base import check_fraction
from probkv.sampling import sample_size, span_designs
from probkv.scores import proposals

SCOPES = ("head", "global", "model")

# Every default of a prob: option. Keys: "*" (every score, every sampler), a score, a sampler,
# or (sampler, score); the most specific wins (``default``). Measured on SmolLM2's needle tasks
# (docs/evaluation.md): pps with inclusion weights over the paper's with-replacement counts
# (S9). The core ("A deterministic core for every score"): 0.5 for the attention-statistics and
# reconstruction scores, whose top entries are the ones later questions need; 0.9 for tova,
# streaming_llm and uniform, which rank by one query or by position (their top-k is the recent
# window; any thinning of it loses answers); 0 for snapkv and knorm. Units: blocks of 8 in a
# random order, spans of at most 32 for kvzip, drawn globally over entries ranked by
# reconstruction, so a number's digits are kept or dropped together ("Spans for
# `prob:kvzip`"). Defensive proposals ("... for the position-driven scores"): tova's one-query
# proposal gives most entries a tiny P (huge weights), so it is mixed half with the uniform;
# streaming_llm's recency ramp is no estimate of attention, so its weights are tempered (tau
# 2). The reconstruction scores compete globally, as KVzip does (S10.1).
DEFAULTS: dict[str, dict[str | tuple[str, str], object]] = {
    "scope": {
        "*": "head",
        **dict.fromkeys(("kvzip", "kvzip-plus", "h2o-rec", "min-rec", "kvzap"), "global"),
    },
    "aggregate": {"*": "sum"},  # scope="model" only (S11): a block's score over heads
    "sink_blocks": {"*": 1},  # scope="model" only: the sinks' block kept by rule
    "recent_tokens": {"*": 0},  # scope="model" only: the last positions' blocks kept by rule
    "threshold": {"*": None},  # S11: none, the ratio decides (probkv.policies.threshold)
    "seed": {"*": 0},
    "sampler": {"*": "pps"},
    "weights": {"*": "inclusion"},
    "core": {
        "*": 0.0,
        **dict.fromkeys(
            ("h2o", "h2o-h", "min", "min-h", "kvzip", "kvzip-plus", "h2o-rec", "min-rec", "kvzap"),
            0.5,
        ),
        **dict.fromkeys(("tova", "streaming_llm", "uniform"), 0.9),
    },
    "block": {"*": 8, "kvzip": 32, "kvzip-plus": 32, "kvzap": 32},
    "order": {"*": "random"},
    "units": {"*": "blocks", "kvzip": "spans", "kvzip-plus": "spans", "kvzap": "spans"},
    "correct": {"*": True},
    "tau": {"*": 1.0, ("pps", "streaming_llm"): 2.0},
    "calibrate": {"*": math.inf},
    "proposal_tau": {"*": 1.0},
    "uniform_mix": {"*": 1.0, ("pps", "tova"): 0.5},
    "pool": {"*": 1},
    "recent": {"*": 0.0},
}


def default(option: str, score: str, sampler: str) -> object:
    """The default of ``option`` for ``prob:<score>`` with ``sampler`` (``DEFAULTS``)."""
    table = DEFAULTS[option]
    for key in ((sampler, score), score, sampler, "*"):
        if key in table:
            return table[key]
    raise KeyError(option)


def _check_defaults() -> None:
    """A global default scope compares heads on the score's own scale (S9): attention only."""
    for score, scope in DEFAULTS["scope"].items():
        if score != "*" and scope == "global" and not scores.on_attention_scale(score):
            raise ValueError(f"DEFAULTS: scope 'global' for {score!r} needs attention_scale")


_check_defaults()


# ------------------------------------------------------------------------------ parts


@dataclass(frozen=True)
class Part:
    """A part of a ``prob:`` method: its ``OPTIONS`` are method-name options."""

    OPTIONS: ClassVar[tuple[str, ...]] = ()

    def values(self) -> dict[str, object]:
        """The part's options as a method name spells them."""
        return {k: getattr(self, k) for k in self.OPTIONS}


@dataclass(frozen=True)
class Weighting(Part):
    """The kept entries' log-weights (S4, S9): ``correct`` (no weights at all when false: the
    uncorrected estimator), ``tau`` (``log w / tau``), ``calibrate`` (S9's ridge of weights
    fitted to the reconstruction queries; ``inf``: the design's weights).

    One spelling per behaviour: ``tau = inf`` is no correction and becomes ``correct=False``;
    a finite ``tau`` or ``calibrate`` with ``correct=False`` could change nothing and is refused.
    Without correction ``tau`` is stored as ``inf`` and is not an option of the name."""

    OPTIONS: ClassVar[tuple[str, ...]] = ("correct", "tau", "calibrate")
    correct: bool
    tau: float
    calibrate: float

    def __post_init__(self) -> None:
        if not isinstance(self.correct, bool):
            raise ValueError(f"correct must be True or False, got {self.correct!r}")
        tau = self.tau
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
            raise ValueError(
                f"tau must be > 0 (the weights' temperature, log w / tau; correct=false "
                f"disables the correction), got {tau!r}"
            )
        if self.correct and math.isinf(tau):  # the second spelling of no correction
            object.__setattr__(self, "correct", False)
        elif not self.correct and not math.isinf(tau):
            raise ValueError(
                f"tau={tau!r} with correct=false: tau tempers the correction's weights, which "
                "correct=false turns off; omit tau"
            )
        object.__setattr__(self, "tau", float(tau))
        object.__setattr__(self, "calibrate", calibration.check_strength(self.calibrate))
        if not self.correct and not math.isinf(self.calibrate):
            raise ValueError(
                f"calibrate={self.calibrate!r} calibrates the correction's weights (S9); it "
                "needs correct=true and a finite tau, got correct=false"
            )

    def values(self) -> dict[str, object]:
        out = super().values()
        if not self.correct:
            del out["tau"]
        return out


@dataclass(frozen=True)
class Proposal(Part):
    """What the design draws from (S2, S10): ``softmax(pooled log-scores / proposal_tau)``
    mixed with the uniform distribution (weight ``uniform_mix`` on the proposal), the scores
    max-pooled over ``pool`` positions first; ``recent``: the share of each head's budget kept
    from its most recent entries (a take-all stratum, as SnapKV's window)."""

    OPTIONS: ClassVar[tuple[str, ...]] = ("proposal_tau", "uniform_mix", "pool", "recent")
    proposal_tau: float
    uniform_mix: float
    pool: int
    recent: float

    def __post_init__(self) -> None:
        t = self.proposal_tau
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(
                f"proposal_tau must be > 0 (the proposal's temperature, pi ~ exp(score / "
                f"proposal_tau); inf gives the uniform proposal), got {t!r}"
            )
        object.__setattr__(self, "proposal_tau", float(t))
        mix = check_fraction(self.uniform_mix, "uniform_mix", what="weight of the proposal")
        if mix == 0.0:
            raise ValueError("uniform_mix must be in (0, 1] (weight of the proposal), got 0")
        object.__setattr__(self, "uniform_mix", mix)
        proposals.check_pool_kernel(self.pool)
        recent = check_fraction(self.recent, "recent", what="share of the budget kept recent")
        object.__setattr__(self, "recent", recent)


@dataclass
class Stratum:
    """What a design draws from: the live heads of the layers of one eviction (S3, S9).

    ``pis``: float64 ``[H, t]`` proposals per layer, zero at forced entries; ``forced``: int64
    ``[H]`` forced entries per head; ``budgets``: each layer's entries per head (forced
    included); ``rank()`` gives the ranking keys of a core (float64 ``[H, t]``, comparable
    across heads for the global scope) and the heads' masses against each other (global scope
    on the attention scale, else ``None``), computed when a design asks for them."""

    pis: list[torch.Tensor]
    forced: list[torch.Tensor]
    budgets: list[int]
    ratio: float
    scope: str
    rank: Callable[[], tuple[list[torch.Tensor], list[torch.Tensor] | None]]

    @functools.cached_property
    def ranking(self) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        return self.rank()


Drawn = list[tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class Design(Part, ABC):
    """A sampling design: what the option ``sampler=NAME`` selects. ``WHY_NOT`` says why an
    option of another design does nothing here (the refusal's reason)."""

    NAME: ClassVar[str] = ""
    WHY_NOT: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def build(cls, score: str, given: Mapping[str, object]) -> Design:
        """The design of ``prob:<score>`` with the options ``given``, the rest ``DEFAULTS``."""
        return cls(
            **{k: given[k] if k in given else default(k, score, cls.NAME) for k in cls.OPTIONS}
        )

    @abstractmethod
    def draw(self, stratum: Stratum, weighting: Weighting, generator: torch.Generator) -> Drawn:
        """Per layer: the kept entries (bool ``[H, t]``) and their log-weights (float
        ``[H, t]``, or ``None`` without correction)."""


@dataclass(frozen=True)
class WithReplacement(Design):
    """The paper's sampler (S3): ``m`` draws per head (one ``m`` for all heads, global scope),
    keep the drawn entries; ``weights``: ``counts`` (Eq. 10) or ``inclusion`` (Horvitz-Thompson,
    S9). The kept count is random, the target in expectation."""

    NAME: ClassVar[str] = "with_replacement"
    OPTIONS: ClassVar[tuple[str, ...]] = ("weights",)
    WHY_NOT: ClassVar[Mapping[str, str]] = {
        k: "it is one of the designs of sampler='pps' (S10.2-S10.4)"
        for k in ("core", "block", "order", "units")
    }
    weights: str

    def __post_init__(self) -> None:
        check_choice(self.weights, ("counts", "inclusion"), "weights")

    def draw(self, stratum: Stratum, weighting: Weighting, generator: torch.Generator) -> Drawn:
        pis, ratio = stratum.pis, stratum.ratio
        if stratum.scope == "global":
            m = sample_size.samples_for_ratio_global(pis, ratio, always_kept=stratum.forced)
            ms = [torch.full((pi.shape[0],), m, dtype=torch.int64, device=pi.device) for pi in pis]
        else:
            ms = [
                sample_size.samples_for_ratio(pi, ratio, always_kept=f)
                for pi, f in zip(pis, stratum.forced)
            ]
        out = []
        for pi, m in zip(pis, ms):
            counts = sampling.sample_counts(pi, m, generator)
            kept = counts > 0
            logw = None
            if weighting.correct and self.weights == "counts":
                logw = estimation.counts_log_weights(
                    pi, kept, counts, num_samples=m, tau=weighting.tau
                )
            elif weighting.correct:
                logw = estimation.inclusion_log_weights(
                    pi, kept, m, counts=counts, tau=weighting.tau
                )
            out.append((kept, logw))
        return out


@dataclass(frozen=True)
class Pps(Design):
    """Fixed-size pps without replacement (S9) with span-preserving designs (S10.2-S10.4,
    ``probkv.sampling.span_designs``): per head the ``floor(core b)`` entries of largest key are kept with
    weight 1 (``b``: the budget after forced entries), the rest of the budget is pps over units
    (``units="blocks"``: runs of ``block`` entries; ``"spans"``: runs of above-average proposal
    of at most ``block`` entries) visited in ``order`` by systematic sampling; every entry of a
    kept unit is weighted ``1 / P`` of its unit. ``core=0, block=1, order="position"`` is S9's
    pps over the entries. Scope "global": the core is the top ``floor(core S)`` over all heads
    of all layers, then one pps scale, heads weighed by their masses."""

    NAME: ClassVar[str] = "pps"
    OPTIONS: ClassVar[tuple[str, ...]] = ("core", "block", "order", "units")
    WHY_NOT: ClassVar[Mapping[str, str]] = {
        "weights": "pps always weighs a kept entry by 1 / P_i (S9)",
    }
    core: float
    block: int
    order: str
    units: str

    def __post_init__(self) -> None:
        what = "share of the sampled budget taken top-k"
        object.__setattr__(self, "core", check_fraction(self.core, "core", what=what))
        span_designs.check_block(self.block)
        check_choice(self.order, span_designs.ORDERS, "order")
        span_designs.check_units(self.units)

    def _units(self, stratum: Stratum):
        """Per layer: the core (bool ``[H, t]``) and the unit design of the rest."""
        keys, masses = stratum.ranking
        pis = stratum.pis
        if stratum.scope == "global":
            total = span_designs.global_budget(pis, stratum.ratio, stratum.forced)
            eligible = [pi > 0 for pi in pis]
            cores = span_designs.top_entries_global(
                keys, span_designs.core_size(self.core, total), eligible
            )
            rest = total - sum(int(c.sum()) for c in cores)
            units = span_designs.block_design_global(
                pis, rest, self.block, outside=cores, row_mass=masses, units=self.units
            )
            return cores, units
        cores, units = [], []
        for key, pi, f, b in zip(keys, pis, stratum.forced, stratum.budgets):
            sampled = (b - f).clamp(min=0)
            core = span_designs.top_entries(key, span_designs.core_size(self.core, sampled), pi > 0)
            cores.append(core)
            rest = sampled - core.sum(-1)
            units.append(
                span_designs.block_design(pi, rest, self.block, outside=core, units=self.units)
            )
        return cores, units

    def draw(self, stratum: Stratum, weighting: Weighting, generator: torch.Generator) -> Drawn:
        out = []
        for pi, core, design in zip(stratum.pis, *self._units(stratum)):
            kept = span_designs.sample_design(design, self.order, generator) | core
            logw = None
            if weighting.correct:
                inclusion = torch.where(core, 1.0, design.entry_inclusion)
                logw = estimation.pps_log_weights(pi, kept, inclusion, tau=weighting.tau)
            out.append((kept, logw))
        return out


DESIGNS: dict[str, type[Design]] = {"with_replacement": WithReplacement, "pps": Pps}
"""The samplers, by the name the option ``sampler`` gives them."""


def design_options() -> dict[str, tuple[str, ...]]:
    """Each design option and the samplers that have it."""
    owners: dict[str, tuple[str, ...]] = {}
    for name, cls in DESIGNS.items():
        for option in cls.OPTIONS:
            owners[option] = (*owners.get(option, ()), name)
    return owners


def merged(part: Part | None, given: Mapping[str, object]) -> dict[str, object]:
    """The options of ``part`` (none if ``None``) updated with those ``given``."""
    return {**(part.values() if part is not None else {}), **given}
