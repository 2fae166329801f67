"""Method names, one registry for the Python API, the CLI and results files (S5, S9).

Grammar (docs/methods.md lists every name, option and default)::

    METHOD      := NAME ( "/" KEY "=" VALUE )*
    NAME        := full | streaming_llm | h2o | snapkv | tova | knorm | pyramidkv
                 | ada_snapkv | ada_pyramidkv | kvzip | ada_kvzip | topk:SCORE | prob:SCORE
    SCORE       := a row of probkv.scores.SCORE_TABLE (h2o, h2o-h, min, min-h, snapkv, ...)

Options (``KEY=VALUE``) are the policy's fields (``tau``, ``scope``, ``sampler``, ``weights``,
``correct``, ``seed``, ``proposal_tau``, ``uniform_mix``, ``recent``, ``core``, ``block``,
``order``, ``pool``, ``alpha``, ``beta``, ...) and the score's parameters (``window``,
``kernel``, ``pooling``, ``gqa``, ``sinks``, ``chunk_size``). Values: numbers, ``inf``,
``true``/``false``, or words. Examples: ``snapkv/window=64``, ``prob:min-h/tau=2/scope=global``,
``prob:h2o/correct=false``, ``prob:snapkv/core=0.5``, ``prob:h2o/block=8/order=random``.

``method_name(policy)`` gives the canonical name: the most specific named method the policy is
(``topk:snapkv/layer_budgets=pyramid`` is ``pyramidkv``), then only the options that differ from
that method's defaults, sorted by key, numbers in their shortest form (``tau=2``, not
``tau=2.0``). The compression ratio is never part of a name. ``parse_method`` and
``method_name`` are inverse: ``parse_method(method_name(p), p.ratio) == p``.
"""

from __future__ import annotations

import decimal
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from probkv import scores
from probkv._checks import check_ratio
from probkv.estimation.selection import RaggedSelection
from probkv.policies.base import EvictionPolicy, LayerObservation, keep_everything, real_number
from probkv.policies.probabilistic import ProbabilisticPolicy
from probkv.policies.topk import TopKPolicy


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
    # KVzip (S10.1): its reference evicts by one global top-k over all heads and layers
    "kvzip": (
        TopKPolicy,
        {"score": "kvzip", "layer_budgets": "global", "head_budgets": "ada", "alpha": 0.0},
    ),
    "ada_kvzip": (TopKPolicy, {"score": "kvzip", "head_budgets": "ada"}),
    # its surrogate (S11) evicts as KVzip does: one global top-k on the predicted scale
    "kvzap": (
        TopKPolicy,
        {"score": "kvzap", "layer_budgets": "global", "head_budgets": "ada", "alpha": 0.0},
    ),
}
FAMILIES: dict[str, type[EvictionPolicy]] = {"topk": TopKPolicy, "prob": ProbabilisticPolicy}


def method_names() -> list[str]:
    """Every base name: the named methods, then ``topk:<score>`` and ``prob:<score>`` for
    every score of ``probkv.scores.SCORE_TABLE``."""
    names = list(NAMED_METHODS)
    names += [f"topk:{s}" for s in scores.SCORE_TABLE] + [f"prob:{s}" for s in scores.SCORE_TABLE]
    return names


def top_k_versions(method: str) -> list[str]:
    """Names of the top-k versions of a ``prob:`` method, the ones its defaults are
    measured against (a ``prob:`` default must tie or win within noise): the canonical name
    of ``topk:<score>``, that name as written, and the named method of the score when it is
    another top-k of it (``prob:kvzip/core=0.75`` -> ``topk:kvzip``, ``kvzip``, whose budget
    is global as ``prob:kvzip``'s; ``prob:h2o`` -> ``h2o``, ``topk:h2o``). Empty for other
    methods; an unknown name is a ``ValueError`` as in :func:`parse_method`."""
    policy = parse_method(method)
    if not isinstance(policy, ProbabilisticPolicy):
        return []
    canonical = method_name(TopKPolicy(ratio=policy.ratio, score=policy.score))
    candidates = [canonical, f"topk:{policy.score}"]
    if policy.score in NAMED_METHODS:
        candidates.append(policy.score)
    return list(dict.fromkeys(candidates))


def method_options(name: str) -> list[str]:
    """The option keys base name ``name`` accepts (its policy's fields and score parameters)."""
    cls, fixed = _base(name)
    return sorted(_fields(cls, fixed) | set(_param_names(fixed.get("score", cls.score))))


def _fields(cls: type[EvictionPolicy], fixed: dict) -> set[str]:
    return set(cls.option_names()) - set(fixed)


def _param_names(score: str) -> tuple[str, ...]:
    """The score's parameters a method name may set: all but tensors (Python API only)."""
    tensors = scores.tensor_param_names(score)
    return tuple(p for p in scores.score_param_names(score) if p not in tensors)


def _parse_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("inf", "+inf", "infinity"):
        return math.inf
    if re.fullmatch(r"[+-]?\d+", text):
        # an integer however long (Python refuses str -> int past 4300 digits): the option's
        # own check then says which integers it takes
        return int(decimal.Decimal(text))
    try:
        return float(text)
    except ValueError:
        return text


def _base(name: str) -> tuple[type[EvictionPolicy], dict]:
    names = tuple(scores.SCORE_TABLE)
    if name in NAMED_METHODS:
        cls, fixed = NAMED_METHODS[name]
        return cls, dict(fixed)
    family, sep, score = name.partition(":")
    if sep and family in FAMILIES:
        if score not in names:
            raise ValueError(
                f"unknown score {score!r} in method {name!r}; valid scores: {', '.join(names)}"
            )
        return FAMILIES[family], {"score": score}
    raise ValueError(
        f"unknown method {name!r}; valid methods: {', '.join(NAMED_METHODS)}, "
        f"topk:<score>, prob:<score> (scores: {', '.join(names)})"
    )


def parse_method(spec: str, ratio: float = 0.5) -> EvictionPolicy:
    """The policy for a method name such as ``"prob:min-h/tau=2"`` at compression ``ratio``.

    Unknown names, unknown option keys and bad values raise ``ValueError`` listing what is
    valid. ``full`` is always ``FullCache()`` (ratio 0) and takes no options.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"method must be a non-empty string, got {spec!r}")
    ratio = check_ratio(real_number(ratio))
    name, *options = spec.strip().split("/")
    cls, fixed = _base(name)
    fields = _fields(cls, fixed)
    param_names = _param_names(fixed.get("score", cls.score))
    kwargs: dict = {}
    score_params: dict = {}
    for option in options:
        key, sep, raw = option.partition("=")
        if not sep or not key or not raw:
            raise ValueError(f"option {option!r} in method {spec!r} must look like key=value")
        if key in fixed:
            raise ValueError(f"option {key!r} is fixed for method {name!r} (it is {fixed[key]!r})")
        if key in kwargs or key in score_params:
            raise ValueError(f"option {key!r} is given twice in method {spec!r}")
        value = _parse_value(raw)
        if key in fields:
            kwargs[key] = value
        elif key in param_names:
            score_params[key] = value
        elif key in getattr(cls, "WHY_NOT", {}):
            raise ValueError(f"option {key!r} of method {name!r}: {cls.WHY_NOT[key]}")
        else:
            allowed = sorted(fields | set(param_names))
            listed = ", ".join(allowed) if allowed else "none"
            raise ValueError(f"unknown option {key!r} for method {name!r}; valid options: {listed}")
    if cls is FullCache:
        return FullCache()
    try:
        return cls(ratio=ratio, score_params=score_params, **fixed, **kwargs)
    except OverflowError:  # an integer too large for a float, given to a number option
        huge = [k for k, v in {**kwargs, **score_params}.items() if _huge(v)]
        raise ValueError(
            f"option {huge[0] if huge else '?'!r} in method {spec!r} is an integer too large "
            "for a number (beyond float64's range)"
        ) from None


def _huge(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**1023


def method_name(policy: EvictionPolicy) -> str:
    """Canonical name of ``policy`` (inverse of ``parse_method``, ratio aside)."""
    if isinstance(policy, FullCache):
        return "full"
    # The most specific named method whose fixed fields the policy has (pyramidkv before snapkv).
    matches = [
        (len(fixed), name, fixed)
        for name, (cls, fixed) in NAMED_METHODS.items()
        if type(policy) is cls and all(getattr(policy, k) == v for k, v in fixed.items())
    ]
    if matches:
        _, name, fixed = max(matches, key=lambda m: m[0])
    else:
        family = next((f for f, c in FAMILIES.items() if type(policy) is c), None)
        if family is None:
            raise ValueError(f"{type(policy).__name__} is not a registered method class")
        name, fixed = f"{family}:{policy.score}", {"score": policy.score}
    plain = type(policy)(ratio=policy.ratio, **fixed).option_values()
    # options whose defaults follow other options (ProbabilisticPolicy: core, block, tau, ...
    # follow the sampler; TopKPolicy: alpha and beta follow the budgets) are compared with the
    # defaults of a policy that has those options' values
    values = policy.option_values()
    depends = {k: values[k] for k in getattr(policy, "DEFAULTS_DEPEND_ON", ())}
    defaults = type(policy)(ratio=policy.ratio, **{**depends, **fixed})
    default_values = defaults.option_values()
    options = {}
    for key, value in values.items():
        if key in fixed:
            continue
        reference = plain if key in depends else default_values
        if key not in reference or value != reference[key]:
            options[key] = value
    tensors = scores.tensor_param_names(policy.score)
    for key, value in policy.score_params.items():
        if key in tensors:
            raise ValueError(
                f"a policy with the tensor score parameter {key!r} has no method name "
                "(tensor parameters are for the Python API only)"
            )
        if key not in defaults.score_params or value != defaults.score_params[key]:
            options[key] = value
    return name + "".join(f"/{k}={_format(v)}" for k, v in sorted(options.items()))


def _format(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value.is_integer():
            return str(int(value))  # parses back to the same number
        return repr(value)
    return str(value)
