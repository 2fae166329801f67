"""probkv.vllm.options: the engine option, the per-request option and every refusal by name
(pure Python on config-shaped objects: runs without vLLM)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from probkv.scores.scorer_lookup import has_scorer
from probkv.scores.surrogate import shipped_scorers
from probkv.vllm import engine_options, request_options
from probkv.vllm.options import (
    DEFAULT_WORKER,
    V2_RUNNER_ENV,
    EngineEviction,
    check_engine,
    check_request,
    check_version,
    evicting_groups,
    frees_nothing,
    kv_group_problems,
    policy_for,
    read_options,
    request_eviction,
)


def config(**changes):
    base = dict(
        additional_config={"probkv": {"method": "prob:snapkv", "ratio": 0.5}},
        cache_config=SimpleNamespace(
            enable_prefix_caching=False, cache_dtype="auto", block_size=32
        ),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, worker_cls=DEFAULT_WORKER),
        scheduler_config=SimpleNamespace(scheduler_cls=None, async_scheduling=False),
        speculative_config=None,
        kv_transfer_config=None,
        model_config=SimpleNamespace(
            hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"], sliding_window=None)
        ),
    )
    base.update(changes)
    return SimpleNamespace(**base)


def test_the_model_wide_policy_takes_the_engines_block_size():
    policy = policy_for("prob:snapkv", 0.5, 32)
    assert policy.scope == "model" and policy.block == 32 and policy.ratio == 0.5
    assert policy_for("snapkv/block=32/scope=model", 0.75, 32).block == 32
    assert policy_for("full", 0.5, 32) is None
    assert policy_for("tova", 0.0, 32) is None


@pytest.mark.parametrize(
    ("method", "match"),
    [
        ("kvzip", "repeat the context"),
        ("prob:kvzip", "repeat the context"),
        ("ada_snapkv", "scope=model"),
        ("prob:snapkv/scope=head", "scope=head"),
        ("snapkv/block=16", "block=16.*hold 32"),
        ("nonsense", "nonsense"),
    ],
)
def test_methods_vllm_cannot_run_are_refused_by_name(method, match):
    with pytest.raises(ValueError, match=match):
        policy_for(method, 0.5, 32)


def smollm2_config(**changes):
    """A config with SmolLM2's identity fields (those its shipped scorer was trained for),
    read by attribute as vLLM's ``hf_config`` is."""
    (scorer,) = [s for s in shipped_scorers() if s.name == "smollm2-135m"]
    fields = {**scorer.model["shapes"], "architectures": ["LlamaForCausalLM"]}
    return SimpleNamespace(**{**fields, "sliding_window": None, **changes})


@pytest.mark.parametrize("method", ["prob:kvzap", "topk:kvzap", "topk:kvzap/scope=model"])
def test_kvzap_gets_the_models_shipped_scorer(method):
    model = smollm2_config()
    assert has_scorer(model)
    policy = policy_for(method, 0.5, 32, model)
    assert policy.scope == "model" and policy.block == 32 and policy.score == "kvzap"
    assert policy.score_params["surrogate"].name == "smollm2-135m"
    assert "surrogate" not in policy_for(method, 0.5, 32).score_params  # no model: name only


@pytest.mark.parametrize("ratio", [0.0, 0.5])
@pytest.mark.parametrize(
    "method", ["topk:kvzap/threshold=-5", "prob:kvzap/threshold=-5", "topk:snapkv/threshold=-6"]
)
def test_a_threshold_runs_model_wide_at_any_ratio(method, ratio):
    """KVzap's threshold mode (S11) in vLLM: the model-wide policy with the threshold, a policy
    at ratio 0 too (the threshold alone sets the ratio: never a silent full cache)."""
    policy = policy_for(method, ratio, 32, smollm2_config())
    assert policy is not None and policy.threshold == (-5.0 if "kvzap" in method else -6.0)
    assert policy.scope == "model" and policy.block == 32 and policy.ratio == ratio
    options = {"method": method, "ratio": ratio}
    check_engine(
        config(
            additional_config={"probkv": {**options, "log_weights": True}},
            model_config=SimpleNamespace(hf_config=smollm2_config()),
        )
    )


def test_a_threshold_is_refused_where_it_cannot_apply():
    full = EngineEviction("full", 0.0)
    with pytest.raises(ValueError, match=r"kvzap/threshold=-5.*layer_budgets='global'"):
        policy_for("kvzap/threshold=-5", 0.0, 32, smollm2_config())  # one top-k over heads
    with pytest.raises(ValueError, match="not logs of attention"):
        check_request(request_options("topk:knorm/threshold=-1", 0.0), full, 32)
    with pytest.raises(ValueError, match=r"threshold=-6\.0: its kept count adapts"):
        check_request(
            request_options("topk:snapkv/threshold=-6", 0.5, max_entries=256, every=32), full, 32
        )


def test_kvzap_is_refused_by_name_without_a_scorer_or_kv_heads_that_split_over_the_ranks():
    other = smollm2_config(num_hidden_layers=31, _name_or_path="my/llama")
    with pytest.raises(
        ValueError, match=r"'topk:kvzap' cannot run in vLLM.*no scorer for model 'my/llama'"
    ):
        policy_for("topk:kvzap", 0.5, 32, other)
    # KVzip's recipe (global and Ada-KV budgets) has no model-wide form: the top-k is named
    with pytest.raises(ValueError, match=r"'kvzap'.*use topk:kvzap/scope=model"):
        policy_for("kvzap", 0.5, 32, smollm2_config())
    # SmolLM2's 3 KV heads split over 3 ranks, not over 9 (vLLM would copy them)
    assert policy_for("prob:kvzap", 0.5, 32, smollm2_config(), 3).score == "kvzap"
    with pytest.raises(ValueError, match=r"'prob:kvzap'.*tensor_parallel_size=9: the model's 3 KV"):
        policy_for("prob:kvzap", 0.5, 32, smollm2_config(), 9)
    policy_for("prob:snapkv", 0.5, 32, other, 9)  # other scores: no scorer
    engine = {"additional_config": {"probkv": {"method": "prob:kvzap", "ratio": 0.5}}}
    assert check_engine(config(**engine, model_config=SimpleNamespace(hf_config=smollm2_config())))
    with pytest.raises(ValueError, match="no scorer for model 'my/llama'"):
        check_engine(config(**engine, model_config=SimpleNamespace(hf_config=other)))
    parallel = SimpleNamespace(
        pipeline_parallel_size=1, worker_cls=DEFAULT_WORKER, tensor_parallel_size=9
    )
    with pytest.raises(ValueError, match="tensor_parallel_size=9"):
        check_engine(
            config(
                **engine,
                model_config=SimpleNamespace(hf_config=smollm2_config()),
                parallel_config=parallel,
            )
        )


def test_options_are_checked_by_name():
    assert read_options({"method": "snapkv", "ratio": 0.75}).ratio == 0.75
    for raw, match in [
        ("snapkv", "must be a mapping"),
        ({"ratio": 0.5}, "needs a 'method'"),
        ({"method": "snapkv", "speed": 2}, r"unknown keys \['speed'\]"),
        ({"method": "snapkv", "ratio": 1.5}, "1.5"),
        ({"method": "snapkv", "report": ""}, "report"),
        ({"method": "snapkv", "log_weights": "yes"}, r"log_weights'\] must be true or false"),
    ]:
        with pytest.raises(ValueError, match=match):
            read_options(raw)
    kwargs = engine_options("snapkv", 0.5)
    assert "enable_prefix_caching" not in kwargs  # vLLM's default (on) stays
    assert kwargs["additional_config"]["probkv"]["method"] == "snapkv"


def test_log_weights_are_held_by_prob_engines_or_on_request():
    """Spare key columns (probkv.vllm.weights) cost KV bytes: an engine holds them when its
    method is a prob: one or when asked; a prob: request on an engine without them is refused
    at admission, by name."""
    assert read_options({"method": "prob:snapkv"}).weighted
    assert not read_options({"method": "snapkv"}).weighted
    assert read_options({"method": "full", "ratio": 0, "log_weights": True}).weighted
    assert not read_options({"method": "prob:snapkv", "log_weights": False}).weighted
    plain = EngineEviction("snapkv", 0.5)
    assert check_request(request_options("tova", 0.5), plain, 32).method == "tova"
    with pytest.raises(ValueError, match=r"'prob:tova' needs log-weights.*log_weights=True"):
        check_request(request_options("prob:tova", 0.5), plain, 32)
    raw = engine_options("full", 0.0, log_weights=True)["additional_config"]["probkv"]
    assert read_options(raw).weighted


def test_an_engine_without_the_option_is_left_alone():
    assert check_engine(config(additional_config={})) is None
    assert check_engine(config()).method == "prob:snapkv"


def test_prefix_caching_is_accepted():
    cache = SimpleNamespace(enable_prefix_caching=True, cache_dtype="auto", block_size=32)
    assert check_engine(config(cache_config=cache)).method == "prob:snapkv"


GEMMA3 = SimpleNamespace(
    hf_config=SimpleNamespace(
        architectures=["Gemma3ForCausalLM"],
        sliding_window=512,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    )
)


def test_gemma3_is_admitted_with_its_sliding_windows():
    """Its global layers are evicted (full-attention KV cache groups), its windowed layers
    left to vLLM: refused only where vLLM keeps both in one group (kv_group_problems)."""
    assert check_engine(config(model_config=GEMMA3)).method == "prob:snapkv"


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"speculative_config": object()}, "speculative decoding"),
        ({"kv_transfer_config": object()}, "KV connectors"),
        ({"parallel_config": SimpleNamespace(pipeline_parallel_size=2,
                                             worker_cls=DEFAULT_WORKER)}, "pipeline_parallel"),
        ({"parallel_config": SimpleNamespace(pipeline_parallel_size=1, worker_cls="my.Worker")},
         "my.Worker"),
        ({"scheduler_config": SimpleNamespace(scheduler_cls="my.Sched", async_scheduling=False)},
         "my.Sched"),
        ({"model_config": SimpleNamespace(hf_config=SimpleNamespace(
            architectures=["Gemma2ForCausalLM"], sliding_window=4096))}, "Gemma2ForCausalLM"),
        ({"model_config": SimpleNamespace(hf_config=SimpleNamespace(
            architectures=["MistralForCausalLM"], sliding_window=4096))},
         r"sliding_window=4096\) is supported only in \['Gemma3ForCausalLM'\]"),
        ({"model_config": SimpleNamespace(hf_config=SimpleNamespace(
            architectures=["Gemma3ForCausalLM"], sliding_window=512,
            layer_types=["sliding_attention"] * 4))}, "no global-attention layer"),
        ({"model_config": GEMMA3, "attention_config": SimpleNamespace(
            backend=SimpleNamespace(name="FLEX_ATTENTION"))}, "FLEX_ATTENTION with sliding"),
    ],
)  # fmt: skip
def test_engine_settings_the_plugin_cannot_serve_are_refused_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        check_engine(config(**changes))


def test_another_vllm_minor_version_is_refused():
    check_version("0.32.0")
    check_version("0.32.1")
    with pytest.raises(ValueError, match=r"0\.33\.0"):
        check_version("0.33.0")


ENGINE = EngineEviction("snapkv", 0.5, report="rows.jsonl", log_weights=True)


def test_a_request_chooses_its_method_and_ratio_with_flat_keys():
    """The one per-request form: flat keys, as vLLM's ``vllm_xargs`` takes them over HTTP and
    as ``request_options`` writes them in Python; either key may be left out."""
    flat = request_options("prob:snapkv", 0.75)
    assert flat == {"probkv_method": "prob:snapkv", "probkv_ratio": 0.75}
    assert request_eviction(flat, ENGINE) == EngineEviction("prob:snapkv", 0.75, "rows.jsonl")
    assert check_request({**flat, "session_id": "s"}, ENGINE, 32).method == "prob:snapkv"
    assert request_eviction({"probkv_ratio": 0.25}, ENGINE) == EngineEviction(
        "snapkv", 0.25, "rows.jsonl"
    )
    assert request_eviction({"probkv_method": "tova"}, ENGINE).ratio == 0.5
    assert request_eviction({"probkv_ratio": 0}, ENGINE).ratio == 0.0  # an int: JSON's 0
    for none in (None, {}, {"kv_transfer_params": {"x": 1}}):  # other keys: not probkv's
        assert request_eviction(none, ENGINE) is ENGINE
        assert check_request(none, ENGINE, 32) is ENGINE
    # options of the method are policy_for's: the engine's block is accepted, another refused
    assert check_request({"probkv_method": "snapkv/block=32"}, ENGINE, 32).method.endswith("32")
    assert request_options("snapkv/block=32", 0.5)["probkv_method"] == "snapkv/block=32"
    with pytest.raises(ValueError, match=r"probkv_ratio=2\.0.*got 2\.0"):
        request_options("snapkv", 2.0)


@pytest.mark.parametrize(
    ("extra_args", "match"),
    [
        ({"probkv": "no-such-method"}, r"'probkv'='no-such-method'.*flat keys.*probkv_method"),
        ({"probkv": {"method": "snapkv", "ratio": 0.5}}, r"'probkv'=\{'method'.*flat keys"),
        ({"probkv_rato": 0.5}, r"unknown.*\['probkv_rato'\]; allowed: \['probkv_method', "),
        ({"probkv_report": "x.jsonl"}, r"\['probkv_report'\]"),
        ({"probkv_method": "no-such-method"}, r"unknown method 'no-such-method'; valid methods"),
        ({"probkv_method": "prob:nope"}, r"unknown score 'nope'.*valid scores"),
        ({"probkv_method": ["snapkv"]}, r"probkv_method must be a probkv method name.*\['snapkv'\]"),
        ({"probkv_method": " "}, r"probkv_method must be"),
        ({"probkv_ratio": "half"}, r"probkv_ratio must be a number in \[0, 1\).*'half'"),
        ({"probkv_ratio": "0.5"}, r"probkv_ratio must be a number.*'0\.5'"),
        ({"probkv_ratio": True}, r"probkv_ratio must be a number.*True"),
        ({"probkv_ratio": 1.5}, r"ratio must be in \[0, 1\).*1\.5"),
        ({"probkv_method": "kvzip"}, r"probkv_method='kvzip'.*cannot run in vLLM.*repeat the"),
        ({"probkv_method": "ada_snapkv"}, r"probkv_method='ada_snapkv'.*scope=model"),
        ({"probkv_method": "snapkv/block=16"}, r"block=16.*hold 32 positions"),
        ({"probkv_method": "snapkv/scope=head"}, r"scope=head"),
        ({"probkv_method": "snapkv/speed=2"}, r"unknown option 'speed'"),
        ("probkv_method=snapkv", r"extra_args must be a mapping"),
    ],
)  # fmt: skip
def test_a_bad_request_option_is_refused_with_the_value_and_what_is_allowed(extra_args, match):
    with pytest.raises(ValueError, match=match):
        check_request(extra_args, ENGINE, 32)


def test_model_wide_options_are_read_at_ratio_zero_and_under_a_budget():
    """A request that evicts nothing now (ratio 0, or a decode budget, whose stages set their
    own ratio) names options of the model-wide scope the engine reads (``aggregate``): they
    are checked at that scope, not refused as options of the per-head one."""
    full = EngineEviction("full", 0.0)
    budget = request_options("tova/aggregate=max", 0.5, max_entries=256, every=32)
    assert check_request(budget, full, 32).method == "tova/aggregate=max"
    assert check_request(request_options("tova/aggregate=max", 0.0), full, 32).ratio == 0.0
    with pytest.raises(ValueError, match=r"aggregate.*'mean'"):
        check_request(request_options("tova/aggregate=mean", 0.0), full, 32)


def test_a_window_the_budget_cannot_hold_is_refused_by_name():
    """A stage keeps the positions of the score's last query rows (SnapKV's window) and the
    last, partial block: a budget below both could never get back to B."""
    full = EngineEviction("full", 0.0)
    wide = request_options("snapkv/window=128", 0.5, max_entries=128, every=32)
    with pytest.raises(ValueError, match=r"last 128 query rows.*probkv_max_entries >= 160"):
        check_request(wide, full, 32)
    fits = request_options("snapkv/window=128", 0.5, max_entries=160, every=32)
    assert check_request(fits, full, 32).max_entries == 160


def test_the_admission_check_reads_the_engines_model_and_ranks():
    """kvzap per request: the model's shipped scorer and the tensor-parallel split are checked
    as for the engine's own option."""
    flat = request_options("prob:kvzap", 0.5)
    assert check_request(flat, ENGINE, 32, smollm2_config(), 3).method == "prob:kvzap"
    other = smollm2_config(num_hidden_layers=31, _name_or_path="my/llama")
    with pytest.raises(ValueError, match=r"'prob:kvzap'.*no scorer for model 'my/llama'"):
        check_request(flat, ENGINE, 32, other)
    with pytest.raises(ValueError, match="tensor_parallel_size=9"):
        check_request(flat, ENGINE, 32, smollm2_config(), 9)


@pytest.mark.parametrize("value", ["1", "true", "True"])
def test_vllms_v2_model_runner_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(V2_RUNNER_ENV, value)
    with pytest.raises(ValueError, match=f"{V2_RUNNER_ENV}={value}: vLLM's V2 model runner"):
        check_engine(config())
    monkeypatch.setenv(V2_RUNNER_ENV, "0")
    assert check_engine(config()) is not None


def test_a_pooling_runner_is_refused_by_name_on_a_listed_architecture():
    hf = SimpleNamespace(architectures=["LlamaForCausalLM"], sliding_window=None)
    model = SimpleNamespace(hf_config=hf, runner_type="pooling")
    with pytest.raises(ValueError, match="runner 'pooling'"):
        check_engine(config(model_config=model))
    assert check_engine(config(model_config=SimpleNamespace(hf_config=hf, runner_type="generate")))


class FullAttentionSpec(SimpleNamespace):
    """Stands for vLLM's spec of that name (read by its class name)."""


class SlidingWindowSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


def groups(*specs):
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])


def test_hybrid_kv_caches_evict_their_full_attention_groups_only():
    full, window = FullAttentionSpec(sliding_window=None), SlidingWindowSpec(sliding_window=512)
    one = groups(full)
    assert not list(kv_group_problems(one)) and evicting_groups(one) == (0,)
    gemma = groups(window, window, full, window, window, window)  # Gemma-3 270M's six groups
    assert not list(kv_group_problems(gemma)) and evicting_groups(gemma) == (2,)
    assert evicting_groups(groups(full, window, full)) == (0, 2)


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        # --disable-hybrid-kv-cache-manager: windowed layers promoted into the full group
        ((FullAttentionSpec(sliding_window=512),), "one block list .*sliding_window=512"),
        ((SlidingWindowSpec(sliding_window=4096),), "no full-attention KV cache group"),
        ((FullAttentionSpec(sliding_window=None), MambaSpec()), "group 1 is a MambaSpec"),
    ],
)
def test_kv_cache_layouts_probkv_cannot_evict_in_are_refused_by_name(layout, match):
    [problem] = kv_group_problems(groups(*layout))
    assert re.search(match, problem), problem


@pytest.mark.parametrize(
    ("t", "max_tokens", "budget", "skipped"),
    [
        (32, 16, False, True),  # one block: always kept
        (33, 16, False, False),  # block 0 can be freed (tova, knorm, streaming_llm)
        (33, 16, True, False),
        (32, 16, True, False),  # a budget's stages evict what the request generates
        (900, 1, False, True),  # the one token comes from the prefill
        (900, 1, True, True),
        (900, 0, False, True),
        (900, None, False, False),
    ],
)
def test_an_observation_is_skipped_only_where_eviction_changes_nothing(
    t, max_tokens, budget, skipped
):
    assert frees_nothing(t, max_tokens, 32, budget) is skipped


def test_prompt_embeds_are_refused_by_name():
    hf = SimpleNamespace(architectures=["LlamaForCausalLM"], sliding_window=None)
    model = SimpleNamespace(hf_config=hf, enable_prompt_embeds=True)
    with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
        check_engine(config(model_config=model))
