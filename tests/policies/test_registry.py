"""The method registry: one name per method for the Python API, the CLI and results files
(S5, S9; grammar in probkv.policies.registry and docs/methods.md)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from probkv import scores
from probkv.policies import (
    DEFAULT_SCORE_PARAMS,
    FullCache,
    ProbabilisticPolicy,
    TopKPolicy,
    method_name,
    method_names,
    method_options,
    parse_method,
    top_k_versions,
)
from probkv.policies.prob_options import default
from probkv.scores import SCORE_NAMES, needs_reconstruction, on_attention_scale
from probkv.scores.reconstruction import kvzip_plus

NAMED = [
    "full",
    "streaming_llm",
    "h2o",
    "snapkv",
    "tova",
    "knorm",
    "pyramidkv",
    "ada_snapkv",
    "ada_pyramidkv",
    "kvzip",
    "ada_kvzip",
    "kvzap",
]


def test_method_names_are_the_named_methods_and_both_families():
    names = method_names()
    assert names[: len(NAMED)] == NAMED
    assert set(names[len(NAMED) :]) == {f"{f}:{s}" for f in ("topk", "prob") for s in SCORE_NAMES}


@pytest.mark.parametrize("name", method_names())
def test_every_name_parses_to_its_policy(name):
    policy = parse_method(name, ratio=0.4)
    if name == "full":
        assert policy == FullCache() and policy.ratio == 0.0
        return
    assert policy.ratio == 0.4
    expected = ProbabilisticPolicy if name.startswith("prob:") else TopKPolicy
    assert type(policy) is expected
    assert parse_method(method_name(policy), ratio=0.4) == policy


def test_named_methods_are_what_they_say():
    """Each named method is the top-k policy with the fields of its paper (S5, S6)."""
    assert parse_method("streaming_llm").score_params == {"sinks": 4}
    snap = {"window": 32, "kernel": 7, "pooling": "max", "gqa": "mean"}
    expected = {
        "h2o": ("h2o", "uniform", "uniform", {}),
        "snapkv": ("snapkv", "uniform", "uniform", snap),
        "tova": ("tova", "uniform", "uniform", {}),
        "knorm": ("knorm", "uniform", "uniform", {}),
        "pyramidkv": ("snapkv", "pyramid", "uniform", snap),
        "ada_snapkv": ("snapkv", "uniform", "ada", snap),
        "ada_pyramidkv": ("snapkv", "pyramid", "ada", snap),
    }
    for name, (score, layers, heads, params) in expected.items():
        p = parse_method(name)
        assert (p.score, p.layer_budgets, p.head_budgets, p.score_params) == (
            score,
            layers,
            heads,
            params,
        )
        alpha = 0.2 if heads == "ada" else None  # alpha acts with Ada-KV budgets only
        beta = 20.0 if layers == "pyramid" else None  # beta with pyramid layers only
        assert (p.alpha, p.beta, p.recent) == (alpha, beta, 0.0)


def test_default_score_params_are_the_score_functions_defaults_except_snapkv_gqa():
    """The policies complete score_params with the maths layer's defaults (S6 window 32,
    kernel 7, max; 4 sinks), except SnapKV's GQA form, which follows the reference
    implementations (raw group mean) rather than S2's mixture (docs/methods.md)."""
    functions = {
        "snapkv": scores.snapkv,
        "streaming_llm": scores.streaming_llm,
        "kvzip": scores.kvzip,
        "kvzip-plus": kvzip_plus,
        "h2o-rec": scores.h2o_reconstruction,
        "min-rec": scores.min_reconstruction,
        "kvzap": scores.kvzap,
    }
    for name, params in DEFAULT_SCORE_PARAMS.items():
        signature = inspect.signature(functions[name]).parameters
        for key, value in params.items():
            if (name, key) == ("snapkv", "gqa"):
                assert value == "mean" and signature[key].default == "mixture"
            else:
                assert signature[key].default == value, (name, key)


def test_python_api_and_names_agree():
    """The same policy built in Python or from a name compares equal and has one name."""
    assert TopKPolicy(score="snapkv") == parse_method("snapkv")
    assert method_name(TopKPolicy(score="snapkv", ratio=0.3)) == "snapkv"
    assert method_name(ProbabilisticPolicy(score="min-h", tau=2)) == "prob:min-h/tau=2"
    assert method_name(FullCache()) == "full"


@pytest.mark.parametrize(
    ("spec", "canonical"),
    [
        ("snapkv/window=32/kernel=7/pooling=max/gqa=mean", "snapkv"),
        ("topk:snapkv", "snapkv"),
        ("topk:h2o", "h2o"),
        ("topk:snapkv/layer_budgets=pyramid", "pyramidkv"),
        ("snapkv/head_budgets=ada/layer_budgets=pyramid", "ada_pyramidkv"),
        ("h2o/layer_budgets=pyramid", "h2o/layer_budgets=pyramid"),
        ("prob:min-h/tau=2.0/scope=global", "prob:min-h/scope=global/tau=2"),
        ("prob:h2o/correct=false", "prob:h2o/correct=false"),
        ("prob:h2o/tau=inf", "prob:h2o/correct=false"),  # one spelling of no correction
        ("prob:h2o/correct=false/tau=inf", "prob:h2o/correct=false"),
        ("prob:streaming_llm/correct=false", "prob:streaming_llm/correct=false"),
        ("prob:snapkv/window=8/gqa=mixture", "prob:snapkv/gqa=mixture/window=8"),
        ("ada_snapkv/alpha=0.20", "ada_snapkv"),
        ("ada_snapkv/alpha=0.5", "ada_snapkv/alpha=0.5"),
        ("h2o/recent=0.5", "h2o/recent=0.5"),
        ("  knorm  ", "knorm"),
        ("prob:snapkv/core=0.50", "prob:snapkv/core=0.5"),
        ("prob:h2o/order=random/block=8", "prob:h2o"),
        ("prob:h2o/order=position/block=1", "prob:h2o/block=1/order=position"),
        ("prob:h2o/core=0.5/block=8/order=random/pool=1", "prob:h2o"),
        ("prob:h2o/core=0/block=8/order=random/pool=1", "prob:h2o/core=0"),
        ("prob:knorm/core=0/block=8/order=random/pool=1", "prob:knorm"),
        ("prob:tova/uniform_mix=0.5/core=0.9", "prob:tova"),  # the score's pps defaults
        ("prob:tova/uniform_mix=1", "prob:tova/uniform_mix=1"),
        ("prob:streaming_llm/tau=2", "prob:streaming_llm"),
        ("prob:streaming_llm/tau=1", "prob:streaming_llm/tau=1"),
        ("prob:h2o/tau=1/uniform_mix=1", "prob:h2o"),
        ("prob:min-h/core=1.0/pool=5", "prob:min-h/core=1/pool=5"),
        ("snapkv/pool=3", "snapkv/pool=3"),
        ("topk:h2o/pool=1", "h2o"),
    ],
)
def test_canonical_names(spec, canonical):
    """Canonical: most specific named method, non-default options only, sorted by key,
    numbers in shortest form; canonical names are fixed points."""
    assert method_name(parse_method(spec)) == canonical
    assert method_name(parse_method(canonical)) == canonical


def test_ratio_is_not_part_of_the_name():
    assert method_name(parse_method("snapkv", ratio=0.9)) == "snapkv"
    assert parse_method("snapkv", ratio=0.9).ratio == 0.9


# ------------------------------------------------------------------- round trip (property)

VALUES = {
    "tau": ["0.5", "1", "2", "10", "inf"],
    "scope": ["head", "global", "model"],
    "aggregate": ["sum", "max"],
    "sink_blocks": ["0", "1", "2"],
    "recent_tokens": ["0", "64"],
    "sampler": ["with_replacement", "pps"],
    "weights": ["counts", "inclusion"],
    "correct": ["true", "false"],
    "seed": ["0", "1", "17"],
    "proposal_tau": ["0.5", "1", "3.0"],
    "uniform_mix": ["0.25", "0.5", "1"],
    "recent": ["0", "0.25", "0.5"],
    "alpha": ["0", "0.2", "0.5", "1.0"],
    "beta": ["1", "5", "20"],
    "layer_budgets": ["uniform", "pyramid", "global"],
    "head_budgets": ["uniform", "ada"],
    "window": ["1", "8", "32", "64"],
    "kernel": ["1", "3", "5", "7"],
    "pooling": ["max", "avg"],
    "gqa": ["mean", "mixture"],
    "sinks": ["0", "1", "4", "8"],
    "chunk_size": ["16", "64"],
    "chunk_tokens": ["1", "100", "2000"],
    "core": ["0", "0.25", "0.5", "1"],
    "block": ["1", "4", "8"],
    "order": ["position", "random"],
    "units": ["blocks", "spans"],
    "pool": ["1", "3", "7"],
    "calibrate": ["inf", "0.01", "1"],
    "threshold": ["-3.5", "-6", "0"],
}
SPAN_OPTIONS = ("core", "block", "order", "units")  # S10: designs of pps


def does_nothing(name: str, options: list[str]) -> bool:
    """Options that could not change what the method does, refused by name (tests below): pps
    options with the with-replacement sampler, weights with pps, tau with correct=false, alpha
    without Ada-KV head budgets, beta without pyramid layer budgets."""
    keys = {o.split("=")[0]: o.split("=")[1] for o in options}
    with_replacement = keys.get("sampler") == "with_replacement"
    if with_replacement and any(k in keys for k in SPAN_OPTIONS):
        return True
    if name.startswith("prob:") and not with_replacement and "weights" in keys:
        return True
    if keys.get("correct") == "false" and keys.get("tau", "inf") != "inf":
        return True
    ada = name in ("ada_snapkv", "ada_pyramidkv", "ada_kvzip") or keys.get("head_budgets") == "ada"
    pyramid = name in ("pyramidkv", "ada_pyramidkv") or keys.get("layer_budgets") == "pyramid"
    if ("alpha" in keys and not ada) or ("beta" in keys and not pyramid):
        return True
    if "threshold" in keys and not on_attention_scale(parse_method(name).score):
        return True  # S11: a threshold compares attention-scale log-scores
    return model_scope_refused(name, keys)


def model_scope_refused(name: str, keys: dict[str, str]) -> bool:
    """scope=model (S11): block, aggregate, sink_blocks and recent_tokens only there (top-k:
    block is a pps option of prob:), uniform layer and head budgets only, the pps sampler over blocks only; top-k has
    no scope 'global' (its global budget is layer_budgets=global)."""
    prob = name.startswith("prob:")
    model = keys.get("scope") == "model"
    if not prob and keys.get("scope") == "global":
        return True
    if any(k in keys for k in ("aggregate", "sink_blocks", "recent_tokens")) and not model:
        return True
    if not model:
        return not prob and "block" in keys
    if prob:
        return keys.get("sampler") == "with_replacement" or keys.get("units") == "spans"
    fixed_budgets = name in ("kvzip", "pyramidkv", "ada_snapkv", "ada_pyramidkv", "ada_kvzip")
    return (
        fixed_budgets
        or keys.get("layer_budgets", "uniform") != "uniform"
        or (keys.get("head_budgets", "uniform") != "uniform")
    )


def calibrate_refused(name: str, options: list[str]) -> bool:
    """A finite calibrate where the score is not a reconstruction score or there are no
    weights (S9; refused by name, tests/policies/test_probabilistic.py)."""
    if not any(o.startswith("calibrate=") and o != "calibrate=inf" for o in options):
        return False
    uncorrected = "correct=false" in options or "tau=inf" in options
    return not needs_reconstruction(name.split(":")[-1]) or uncorrected


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_parse_and_name_round_trip(data):
    """method_name(parse_method(x)) is canonical(x): parsing it gives the same policy, and
    naming that policy again gives the same name (hypothesis over names and options)."""
    name = data.draw(st.sampled_from([n for n in method_names() if n != "full"]))
    keys = data.draw(st.lists(st.sampled_from(method_options(name)), unique=True, max_size=5))
    options = [f"{k}={data.draw(st.sampled_from(VALUES[k]))}" for k in keys]
    assume(not does_nothing(name, options))  # refused by name (tests below)
    assume(not calibrate_refused(name, options))
    spec = "/".join([name, *options])
    ratio = data.draw(st.sampled_from([0.0, 0.25, 0.5, 0.9]))
    policy = parse_method(spec, ratio=ratio)
    canonical = method_name(policy)
    again = parse_method(canonical, ratio=ratio)
    assert again == policy
    assert method_name(again) == canonical
    option_keys = [part.split("=")[0] for part in canonical.split("/")[1:]]
    assert option_keys == sorted(option_keys)


# ------------------------------------------------------------------------------- errors


def test_unknown_method_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        parse_method("snapKV")
    message = str(err.value)
    assert "unknown method 'snapKV'" in message
    for name in NAMED:
        assert name in message
    assert "topk:<score>" in message and "prob:<score>" in message
    for score in SCORE_NAMES:
        assert score in message


def test_unknown_score_lists_the_valid_scores():
    with pytest.raises(ValueError, match=r"unknown score 'min_h' in method 'prob:min_h'") as err:
        parse_method("prob:min_h")
    assert all(score in str(err.value) for score in SCORE_NAMES)
    with pytest.raises(ValueError, match="unknown method 'sample:h2o'"):
        parse_method("sample:h2o")


@pytest.mark.parametrize("name", ["snapkv", "prob:min-h", "streaming_llm", "ada_pyramidkv"])
def test_unknown_option_lists_the_valid_options(name):
    with pytest.raises(ValueError) as err:
        parse_method(f"{name}/temperature=2")
    message = str(err.value)
    assert f"unknown option 'temperature' for method {name!r}; valid options: " in message
    assert message.endswith(", ".join(method_options(name)))


def test_method_options_per_family():
    assert "tau" in method_options("prob:h2o") and "alpha" not in method_options("prob:h2o")
    assert {"core", "block", "order", "units", "pool"} <= set(method_options("prob:snapkv"))
    assert "pool" in method_options("snapkv") and "core" not in method_options("snapkv")
    assert "sinks" in method_options("streaming_llm") and "window" not in method_options("h2o")
    assert {"window", "kernel", "pooling", "gqa"} <= set(method_options("prob:snapkv"))
    assert "layer_budgets" not in method_options("pyramidkv")  # fixed by the name
    assert method_options("full") == []


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("pyramidkv/layer_budgets=uniform", "option 'layer_budgets' is fixed for method"),
        ("snapkv/window", "must look like key=value"),
        ("snapkv/=3", "must look like key=value"),
        ("snapkv/window=", "must look like key=value"),
        ("snapkv/window=8/window=16", "option 'window' is given twice"),
        ("full/tau=2", "unknown option 'tau' for method 'full'; valid options: none"),
        ("snapkv/window=0", "window must be >= 1, got 0"),
        ("snapkv/window=8.5", "window must be an integer, got 8.5"),
        ("snapkv/kernel=4", "kernel must be odd"),
        ("snapkv/pooling=mean", "pooling must be one of 'max', 'avg'; got 'mean'"),
        ("snapkv/gqa=sum", "gqa must be one of 'mixture', 'mean'; got 'sum'"),
        ("streaming_llm/sinks=-1", "sinks must be >= 0, got -1"),
        ("ada_snapkv/alpha=1.5", r"alpha must be in \[0, 1\]"),
        ("pyramidkv/beta=0.5", "beta .* must be >= 1"),
        ("h2o/recent=2", r"recent must be in \[0, 1\]"),
        ("prob:h2o/tau=-1", "tau must be > 0"),
        ("prob:h2o/scope=layer", "scope must be one of 'head', 'global', 'model'; got 'layer'"),
        ("prob:h2o/sampler=poisson", "sampler must be one of 'with_replacement', 'pps'"),
        ("prob:h2o/correct=maybe", "correct must be True or False, got 'maybe'"),
        ("prob:h2o/uniform_mix=0", r"uniform_mix must be in \(0, 1\]"),
        ("prob:h2o/chunk_size=0", "chunk_size must be >= 1, got 0"),
        ("prob:h2o/alpha=0.5", "unknown option 'alpha' for method 'prob:h2o'"),
        ("prob:h2o/core=1.5", r"core must be in \[0, 1\] .*got 1.5"),
        ("prob:h2o/core=half", r"core must be a number in \[0, 1\] .*got 'half'"),
        ("prob:h2o/block=0", "block must be an integer >= 1 .*got 0"),
        ("prob:h2o/block=2.5", "block must be an integer >= 1 .*got 2.5"),
        ("prob:h2o/order=reverse", "order must be one of 'position', 'random'; got 'reverse'"),
        ("prob:h2o/units=runs", "units must be one of 'blocks', 'spans'; got 'runs'"),
        ("prob:h2o/pool=4", "pool must be an odd integer >= 1 .*got 4"),
        ("snapkv/pool=0", "pool must be an odd integer >= 1 .*got 0"),
        (
            "prob:h2o/sampler=with_replacement/block=8",
            r"block=8 does nothing with sampler='with_replacement': it is one of the designs "
            r"of sampler='pps' \(S10.2-S10.4\); omit block",
        ),
        ("prob:h2o/sampler=with_replacement/block=1", "block=1 does nothing with sampler="),
        ("prob:h2o/sampler=with_replacement/units=spans", "designs of sampler='pps'"),
        ("prob:h2o/sampler=with_replacement/order=random", "designs of sampler='pps'"),
        ("prob:h2o/sampler=with_replacement/core=0.5", "designs of sampler='pps'"),
    ],
)
def test_bad_options_fail_naming_the_value_and_what_is_allowed(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_method(spec)


@pytest.mark.parametrize("spec", ["", "   ", None, 3])
def test_empty_or_non_string_names_fail(spec):
    with pytest.raises(ValueError, match="method must be a non-empty string"):
        parse_method(spec)


@pytest.mark.parametrize("ratio", [-0.1, 1.0, "0.5", float("nan")])
def test_bad_ratio_fails(ratio):
    with pytest.raises(ValueError, match="ratio must be"):
        parse_method("snapkv", ratio=ratio)


def test_prob_kvzip_budget_is_global_by_default():
    """S9, S10.1: prob:kvzip competes over all heads and layers like KVzip (the score's
    budget_scope); the other scores keep a per-head budget; names round-trip either way."""
    assert parse_method("prob:kvzip").scope == "global"
    assert parse_method("prob:snapkv").scope == "head"
    assert ProbabilisticPolicy(score="kvzip").scope == "global"
    for name in ("prob:kvzip", "prob:kvzip/scope=head", "prob:h2o/scope=global"):
        assert method_name(parse_method(name, 0.5)) == name
    global_scores = [s for s in SCORE_NAMES if default("scope", s, "pps") == "global"]
    # the reconstruction scores and kvzip's surrogate (S11)
    assert global_scores == ["kvzip", "kvzip-plus", "h2o-rec", "min-rec", "kvzap"]


def test_prob_core_defaults_follow_the_score_and_the_sampler():
    """S10.2: each score's pps core by default, as measured in docs/evaluation.md ("A
    deterministic core for every score"; ``uniform``: "Defensive proposals for the
    position-driven scores"); the with-replacement sampler has no core."""
    measured = {
        "h2o": 0.5,
        "h2o-h": 0.5,
        "min": 0.5,
        "min-h": 0.5,
        "snapkv": 0.0,
        "tova": 0.9,
        "knorm": 0.0,
        "streaming_llm": 0.9,
        "uniform": 0.9,
        "kvzip": 0.5,
        "kvzip-plus": 0.5,  # as kvzip's (not measured on its own)
        "h2o-rec": 0.5,
        "min-rec": 0.5,
        "kvzap": 0.5,
    }
    assert {s: default("core", s, "pps") for s in SCORE_NAMES} == measured
    for score, core in measured.items():
        assert parse_method(f"prob:{score}").core == core
        assert "core" not in parse_method(f"prob:{score}/sampler=with_replacement").option_values()
        assert method_name(parse_method(f"prob:{score}/core=0.25")) == f"prob:{score}/core=0.25"
    assert parse_method("prob:snapkv").core == 0.0
    names = ("prob:kvzip/core=0", "prob:kvzip/sampler=with_replacement", "prob:kvzip/core=1")
    for name in names:
        assert method_name(parse_method(name, 0.75)) == name


def test_kvzip_names():
    """kvzip is KVzip's global top-k (S10.1: one budget over all heads and layers, no
    safeguard); ada_kvzip uses Ada-KV within each layer; the S10.1 proposals are scores."""
    kvzip = parse_method("kvzip")
    assert (kvzip.score, kvzip.layer_budgets, kvzip.head_budgets, kvzip.alpha) == (
        "kvzip",
        "global",
        "ada",
        0.0,
    )
    assert kvzip.score_params == {"sinks": 4, "chunk_tokens": 2000}
    ada = parse_method("ada_kvzip")
    assert (ada.layer_budgets, ada.head_budgets, ada.alpha) == ("uniform", "ada", 0.2)
    cases = {
        "topk:kvzip/layer_budgets=global/head_budgets=ada/alpha=0": "kvzip",
        "kvzip/sinks=4/chunk_tokens=2000": "kvzip",
        "topk:kvzip/head_budgets=ada": "ada_kvzip",
        "ada_kvzip/layer_budgets=global": "ada_kvzip/layer_budgets=global",
        "topk:kvzip": "topk:kvzip",
        "prob:kvzip/chunk_tokens=512/sinks=0": "prob:kvzip/chunk_tokens=512/sinks=0",
        "prob:min-rec/scope=global": "prob:min-rec",
        "prob:min-rec/scope=head": "prob:min-rec/scope=head",
        "topk:h2o-rec": "topk:h2o-rec",
        "snapkv/layer_budgets=global": "snapkv/layer_budgets=global",
    }
    for spec, canonical in cases.items():
        assert method_name(parse_method(spec)) == canonical
        assert parse_method(canonical) == parse_method(spec)
    with pytest.raises(ValueError, match="option 'alpha' is fixed for method 'kvzip'"):
        parse_method("kvzip/alpha=0.2")
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1, got 0"):
        parse_method("prob:kvzip/chunk_tokens=0")
    with pytest.raises(
        ValueError, match="layer_budgets must be one of 'uniform', 'pyramid', 'global'"
    ):
        parse_method("snapkv/layer_budgets=all")


def test_top_k_versions_are_the_top_k_policies_of_the_same_score():
    """A prob: method's top-k versions parse to top-k policies of its score; the canonical
    name comes first, the named method of the score (kvzip: global budget) after."""
    assert top_k_versions("prob:kvzip/core=0.75") == ["topk:kvzip", "kvzip"]
    assert top_k_versions("prob:h2o") == ["h2o", "topk:h2o"]
    assert top_k_versions("prob:min-h/seed=2") == ["topk:min-h"]
    for name in ("kvzip", "topk:tova", "full", "pyramidkv"):
        assert top_k_versions(name) == []
    for score in SCORE_NAMES:
        for version in top_k_versions(f"prob:{score}"):
            policy = parse_method(version)
            assert isinstance(policy, TopKPolicy) and policy.score == score
    with pytest.raises(ValueError, match="unknown method 'prob'"):
        top_k_versions("prob")


def test_prob_block_defaults_follow_the_score_and_the_sampler():
    """S10.3: blocks of 8 by default, spans of at most 32 entries for ``kvzip``
    (docs/evaluation.md, "Spans for `prob:kvzip`"); the with-replacement sampler has single
    entries; the canonical name drops the score's own defaults and keeps any other design."""
    blocks = {s: default("block", s, "pps") for s in SCORE_NAMES}
    spans = ("kvzip", "kvzip-plus", "kvzap")  # kvzap mirrors kvzip (S11), kvzip-plus too
    assert blocks == {s: (32 if s in spans else 8) for s in SCORE_NAMES}
    units = {s: default("units", s, "pps") for s in SCORE_NAMES}
    assert units == {s: ("spans" if s in spans else "blocks") for s in SCORE_NAMES}
    kvzip = parse_method("prob:kvzip")
    assert (kvzip.block, kvzip.units) == (32, "spans")
    assert (parse_method("prob:h2o-rec").block, parse_method("prob:h2o-rec").units) == (8, "blocks")
    plain = parse_method("prob:kvzip/sampler=with_replacement")
    assert getattr(plain, "block", 1) == 1 and not hasattr(plain, "units")  # no units
    assert method_name(parse_method("prob:kvzip/block=32/units=spans", 0.5)) == "prob:kvzip"
    assert method_name(parse_method("prob:kvzip/block=1", 0.5)) == "prob:kvzip/block=1"
    assert (
        method_name(parse_method("prob:kvzip/block=8/units=blocks", 0.5))
        == "prob:kvzip/block=8/units=blocks"
    )
    assert method_name(parse_method("prob:knorm/block=1", 0.5)) == "prob:knorm/block=1"


# ------------------------------------------------- options that change nothing, bad values


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("snapkv/alpha=0.5", "`?alpha`? only acts with Ada-KV head budgets"),
        ("topk:kvzip/alpha=0.3", "alpha only acts with Ada-KV head budgets"),
        ("h2o/layer_budgets=global/alpha=0.1", "alpha only acts with Ada-KV head budgets"),
        ("snapkv/beta=5", "beta only acts with pyramid layer budgets"),
        ("ada_snapkv/beta=5", "beta only acts with pyramid layer budgets"),
        ("topk:h2o/head_budgets=ada/beta=2", "beta only acts with pyramid layer budgets"),
        ("prob:snapkv/weights=counts", "pps always weighs a kept entry by 1 / P_i"),
        ("prob:h2o/correct=false/tau=2", "tau tempers the correction's weights"),
    ],
)
def test_options_that_change_nothing_are_refused_with_the_reason(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_method(spec)


def test_alpha_and_beta_where_they_act():
    """alpha with Ada-KV head budgets and beta with pyramid layers are options (defaults 0.2
    and 20, dropped from canonical names); elsewhere they are None."""
    assert parse_method("ada_snapkv/alpha=0.5").alpha == 0.5
    assert method_name(parse_method("topk:h2o/head_budgets=ada/alpha=0.2")) == (
        "h2o/head_budgets=ada"
    )
    assert method_name(parse_method("h2o/layer_budgets=pyramid/beta=20")) == (
        "h2o/layer_budgets=pyramid"
    )
    assert parse_method("pyramidkv/beta=5").beta == 5.0
    plain = parse_method("snapkv")
    assert (plain.alpha, plain.beta) == (None, None)


def test_ratio_of_any_real_number_type():
    """numpy's float32 (no Python float subclass) is a ratio like float64; bools are not."""
    assert parse_method("snapkv", np.float32(0.5)) == parse_method("snapkv", 0.5)
    assert parse_method("prob:h2o", np.float64(0.25)).ratio == 0.25
    assert parse_method("snapkv", np.int64(0)).ratio == 0.0
    assert TopKPolicy(score="h2o", ratio=np.float32(0.75)).ratio == 0.75
    for bad in (True, np.bool_(True), "0.5"):
        with pytest.raises(ValueError, match="ratio must be a number in"):
            parse_method("snapkv", bad)


def test_huge_integers_parse_as_integers():
    """An option of thousands of digits is an integer, refused by its own check (not read
    as the float inf)."""
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, ") as refused:
        parse_method("prob:snapkv/seed=" + "9" * 5000)
    assert "inf" not in str(refused.value)
    with pytest.raises(ValueError, match="seed must be an integer in"):
        parse_method("prob:snapkv/seed=99999999999999999999999")
    with pytest.raises(ValueError, match=r"option 'tau' .* is an integer too large for a"):
        parse_method("prob:h2o/tau=" + "7" * 5000)
    with pytest.raises(ValueError, match=r"option 'beta' .* is an integer too large for a"):
        parse_method("pyramidkv/beta=" + "7" * 400)
