"""probkv through vLLM's FlexAttention backend on the CPU platform (``attention_backend=
"FLEX_ATTENTION"``, which the plugin keeps there for an evicting engine): greedy tokens equal to
probkv's transformers integration under the same selection (the CPU backend is held to the same
reference in test_plugin.py), blocks freed, report rows naming the backend vLLM ran, and no
recompilation of the compiled flex_attention from one decode step to the next. One engine,
SmolLM2 in float32, few tokens; the vLLM environment only."""

from __future__ import annotations

import json
import os

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs it")

from probkv.hf import ProbKVCache, prepare_model  # noqa: E402
from probkv.models import chat_prompt_ids, load_model, resolve_model  # noqa: E402
from probkv.policies import parse_method  # noqa: E402
from probkv.vllm import engine_options, request_options  # noqa: E402

pytestmark = pytest.mark.slow
NEW_TOKENS = 8
BLOCK = 32
MAX_LEN = 2048
BLOCK_BYTES = BLOCK * 30 * 2 * 3 * 64 * 4  # SmolLM2: 30 layers, K and V, 3 heads of 64, fp32
DOCUMENT = (
    "The lighthouse keeper wrote in the log every night. " * 12
    + "The code of the vault is 4172. "
    + "Gulls circled the rocks while the tide went out and came back. " * 12
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process
    report = tmp_path_factory.mktemp("flex") / "evictions.jsonl"
    llm = vllm.LLM(
        model=str(resolve_model("smollm2-135m").path),
        dtype="float32",
        enforce_eager=True,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=128,
        kv_cache_memory_bytes=2 * MAX_LEN // BLOCK * BLOCK_BYTES,  # more than one sequence
        seed=0,
        attention_backend="FLEX_ATTENTION",
        enable_prefix_caching=False,  # a request run twice has the same shapes twice
        **engine_options("prob:snapkv", 0.5, report=str(report)),
    )
    return llm, report


@pytest.fixture(scope="module")
def prompt():
    _, tokenizer = load_model("smollm2-135m")
    return chat_prompt_ids(tokenizer, DOCUMENT + "\n\nWhat is the code of the vault?")[0].tolist()


def hf_greedy(ids, method, ratio):
    """probkv's transformers integration, a model-wide selection of blocks of ``BLOCK``
    positions (what the vLLM plugin selects); ``method`` None: no eviction."""
    model, _ = load_model("smollm2-135m", dtype=torch.float32)
    kwargs = {}
    if method is not None:
        prepare_model(model)
        policy = parse_method(f"{method}/scope=model/block={BLOCK}", ratio)
        kwargs["cache"] = ProbKVCache(model.config, policy, prompt_length=len(ids))
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    return out[0, len(ids) :].tolist()


def greedy(llm, ids, method, ratio):
    params = vllm.SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, extra_args=request_options(method, ratio)
    )
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids)


def test_the_engine_runs_vllms_flex_backend_with_probkvs_subclass(engine):
    from probkv.vllm.flex_backend import ProbKVFlexAttentionImpl

    llm, _ = engine
    state = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.eviction
    assert state.backend == "FLEX_ATTENTION"
    runner = state.runner
    impls = {type(layer.impl) for layer in runner.model.modules() if hasattr(layer, "impl")}
    assert impls == {ProbKVFlexAttentionImpl}


@pytest.mark.parametrize(("method", "ratio"), [("snapkv", 0.5), ("prob:snapkv", 0.5)])
def test_greedy_tokens_equal_the_transformers_integration(engine, prompt, method, ratio):
    llm, report = engine
    tokens = greedy(llm, prompt, method, ratio)
    assert tokens == hf_greedy(prompt, method, ratio)
    row = [json.loads(line) for line in report.read_text().splitlines()][-1]
    assert row["method"].split("/")[0] == method and row["attention_backend"] == "FLEX_ATTENTION"
    assert row["freed_blocks"] >= max(1, 0.45 * row["num_blocks"] - 1)  # r = 0.5, whole blocks


def test_no_eviction_gives_the_tokens_of_the_full_model(engine, prompt):
    llm, _ = engine
    assert greedy(llm, prompt, "full", 0.5) == hf_greedy(prompt, None, 0.0)


def test_no_recompilation_from_step_to_step(engine, prompt):
    """The first request compiles flex_attention for its shapes (prefill chunks, decode);
    the same request again (prefix caching is off: the same shapes, step after step) compiles
    nothing more: the score_mod is one function over fixed tensors (dynamo's cache entries of
    flex_attention's code)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.nn.attention.flex_attention import flex_attention

    llm, _ = engine
    greedy(llm, prompt[:-40], "prob:snapkv", 0.5)  # compiled for these shapes, if new
    first = len(_debug_get_cache_entry_list(flex_attention.__code__))
    greedy(llm, prompt[:-40], "prob:snapkv", 0.5)
    assert first > 0  # compiled in this process
    assert len(_debug_get_cache_entry_list(flex_attention.__code__)) == first
