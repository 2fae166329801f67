"""probkv.vllm.options: the engine option, the per-request option and every refusal by name
(pure Python on config-shaped objects: runs without vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from probkv.scores.scorer_lookup import has_scorer
from probkv.scores.surrogate import shipped_scorers
from probkv.vllm import engine_options, request_options
from probkv.vllm.options import (
    DEFAULT_WORKER,
    check_engine,
    check_version,
    policy_for,
    read_options,
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
    ]:
        with pytest.raises(ValueError, match=match):
            read_options(raw)
    assert request_options("prob:snapkv", 0.5) == {
        "probkv": {"method": "prob:snapkv", "ratio": 0.5}
    }
    with pytest.raises(ValueError, match=r"2\.0"):
        request_options("snapkv", 2.0)
    kwargs = engine_options("snapkv", 0.5)
    assert kwargs["enable_prefix_caching"] is False
    assert kwargs["additional_config"]["probkv"]["method"] == "snapkv"


def test_an_engine_without_the_option_is_left_alone():
    assert check_engine(config(additional_config={})) is None
    assert check_engine(config()).method == "prob:snapkv"


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"cache_config": SimpleNamespace(enable_prefix_caching=True, cache_dtype="auto",
                                          block_size=32)}, "no-enable-prefix-caching"),
        ({"speculative_config": object()}, "speculative decoding"),
        ({"kv_transfer_config": object()}, "KV connectors"),
        ({"parallel_config": SimpleNamespace(pipeline_parallel_size=2,
                                             worker_cls=DEFAULT_WORKER)}, "pipeline_parallel"),
        ({"parallel_config": SimpleNamespace(pipeline_parallel_size=1, worker_cls="my.Worker")},
         "my.Worker"),
        ({"scheduler_config": SimpleNamespace(scheduler_cls="my.Sched", async_scheduling=False)},
         "my.Sched"),
        ({"model_config": SimpleNamespace(hf_config=SimpleNamespace(
            architectures=["Gemma3ForCausalLM"], sliding_window=512))}, "Gemma3ForCausalLM"),
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
