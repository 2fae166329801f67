"""Method names, one registry for the Python API, the CLI and results files (SPEC S5, S9).

Grammar::

    METHOD      := NAME ( "/" KEY "=" VALUE )*
    NAME        := full | streaming_llm | h2o | snapkv | tova | knorm | pyramidkv
                 | ada_snapkv | ada_pyramidkv | topk:SCORE | prob:SCORE
    SCORE       := a name in probkv.scores.SCORE_NAMES (h2o, h2o-h, min, min-h, snapkv, ...)

Options (``KEY=VALUE``) are the policy's fields (``tau``, ``scope``, ``sampler``, ``weights``,
``correct``, ``seed``, ``proposal_tau``, ``uniform_mix``, ``alpha``, ``beta``, ...) and the
score's parameters (``window``, ``kernel``, ``pooling``, ``sinks``). Values: numbers, ``inf``,
``true``/``false``, or words. Examples: ``snapkv/window=64``, ``prob:min-h/tau=2/scope=global``,
``prob:h2o/correct=false``. ``method_name(policy)`` gives the canonical name: only options that
differ from the method's defaults, sorted by key; the compression ratio is never part of it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from probkv._checks import check_ratio
from probkv.policies.base import EvictionPolicy, LayerObservation, keep_everything
from probkv.policies.probabilistic import ProbabilisticPolicy
from probkv.policies.topk import TopKPolicy
from probkv.selection import RaggedSelection


@dataclass(frozen=True)
class FullCache(EvictionPolicy):
    """No eviction: every entry kept with weight 1 (the reference every method is compared to)."""

    score: str = "uniform"
    ratio: float = 0.0

    def select(
        self, observations: Sequence[LayerObservation], *, num_layers: int
    ) -> list[RaggedSelection]:
        return [keep_everything(obs) for obs in observations]


# name -> (policy class, fixed fields). Fixed fields cannot be overridden by options.
NAMED_METHODS: dict[str, tuple[type[EvictionPolicy], dict]] = {
    "full": (FullCache, {}),
    "streaming_llm": (TopKPolicy, {"score": "streaming_llm"}),
    "h2o": (TopKPolicy, {"score": "h2o"}),
    "snapkv": (TopKPolicy, {"score": "snapkv"}),
    "tova": (TopKPolicy, {"score": "tova"}),
    "knorm": (TopKPolicy, {"score": "knorm"}),
    "pyramidkv": (TopKPolicy, {"score": "snapkv", "layer_budgets": "pyramid"}),
    "ada_snapkv": (TopKPolicy, {"score": "snapkv", "head_budgets": "ada"}),
    "ada_pyramidkv": (
        TopKPolicy,
        {"score": "snapkv", "layer_budgets": "pyramid", "head_budgets": "ada"},
    ),
}
FAMILIES: dict[str, type[EvictionPolicy]] = {"topk": TopKPolicy, "prob": ProbabilisticPolicy}


def method_names() -> list[str]:
    from probkv.scores import SCORE_NAMES

    names = list(NAMED_METHODS)
    names += [f"topk:{s}" for s in SCORE_NAMES] + [f"prob:{s}" for s in SCORE_NAMES]
    return names


def _parse_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("inf", "+inf", "infinity"):
        return math.inf
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _base(name: str) -> tuple[type[EvictionPolicy], dict]:
    from probkv.scores import SCORE_NAMES

    if name in NAMED_METHODS:
        cls, fixed = NAMED_METHODS[name]
        return cls, dict(fixed)
    family, sep, score = name.partition(":")
    if sep and family in FAMILIES:
        if score not in SCORE_NAMES:
            raise ValueError(
                f"unknown score {score!r} in method {name!r}; valid scores: {', '.join(SCORE_NAMES)}"
            )
        return FAMILIES[family], {"score": score}
    raise ValueError(
        f"unknown method {name!r}; valid methods: {', '.join(NAMED_METHODS)}, "
        f"topk:<score>, prob:<score> (scores: {', '.join(SCORE_NAMES)})"
    )


def parse_method(spec: str, ratio: float = 0.5) -> EvictionPolicy:
    """The policy for a method name such as ``"prob:min-h/tau=2"`` at compression ``ratio``."""
    from probkv.scores import score_param_names

    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"method must be a non-empty string, got {spec!r}")
    ratio = check_ratio(ratio)
    name, *options = spec.strip().split("/")
    cls, fixed = _base(name)
    fields = {f.name for f in dataclasses.fields(cls)} - {"score_params", "ratio", "score"}
    kwargs: dict = {}
    score_params: dict = {}
    param_names = score_param_names(fixed.get("score", "uniform"))
    for option in options:
        key, sep, raw = option.partition("=")
        if not sep or not key:
            raise ValueError(f"option {option!r} in method {spec!r} must look like key=value")
        if key in fixed:
            raise ValueError(f"option {key!r} is fixed for method {name!r} (it is {fixed[key]!r})")
        value = _parse_value(raw)
        if key in fields:
            kwargs[key] = value
        elif key in param_names:
            score_params[key] = value
        else:
            allowed = sorted(fields | set(param_names))
            raise ValueError(
                f"unknown option {key!r} for method {name!r}; valid options: {', '.join(allowed)}"
            )
    if cls is FullCache:
        return FullCache()
    return cls(ratio=ratio, score_params=score_params, **fixed, **kwargs)


def method_name(policy: EvictionPolicy) -> str:
    """Canonical name of ``policy`` (inverse of ``parse_method``, ratio aside)."""
    if isinstance(policy, FullCache):
        return "full"
    base = None
    for name, (cls, fixed) in NAMED_METHODS.items():
        if type(policy) is cls and all(getattr(policy, k) == v for k, v in fixed.items()):
            base = (name, fixed)
            break
    if base is None:
        family = next(f for f, c in FAMILIES.items() if type(policy) is c)
        base = (f"{family}:{policy.score}", {"score": policy.score})
    name, fixed = base
    defaults = type(policy)(ratio=policy.ratio, **fixed)
    options = {}
    for f in dataclasses.fields(policy):
        if f.name in ("ratio", "score_params") or f.name in fixed:
            continue
        value = getattr(policy, f.name)
        if value != getattr(defaults, f.name):
            options[f.name] = value
    options.update(policy.score_params)
    return name + "".join(f"/{k}={_format(v)}" for k, v in sorted(options.items()))


def _format(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return str(value)
