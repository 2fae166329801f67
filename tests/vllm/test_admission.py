"""probkv.vllm.admission: the engine's admission check, run by vLLM's own per-request validator
of logits processors, and pickled to vLLM's other processes with its engine (no model loaded;
the real server and ``LLM.generate`` are in test_serve.py and test_plugin.py)."""

from __future__ import annotations

import asyncio
import pickle
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs it")

import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import (
    MinPLogitsProcessor,
    validate_logits_processors_parameters,
)

from probkv.vllm import admission, request_options
from probkv.vllm.admission import AdmissionCheck, install
from probkv.vllm.options import EngineEviction

ENGINE = EngineEviction("snapkv", 0.5, log_weights=True)


def config(logits_processors=None, block_size=32):
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block_size),
        model_config=SimpleNamespace(
            hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
            logits_processors=logits_processors,
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


def test_vllms_validator_refuses_a_bad_request_with_the_reason():
    cfg = config()
    install(cfg, ENGINE)
    processors = cfg.model_config.logits_processors
    validate_logits_processors_parameters(processors, SamplingParams())
    good = SamplingParams(extra_args=request_options("prob:snapkv", 0.75))
    validate_logits_processors_parameters(processors, good)
    bad = SamplingParams(extra_args={"probkv_method": "snapkv/block=16"})
    # vLLM turns the ValueError into its client error (HTTP 400), the reason kept
    with pytest.raises(VLLMValidationError, match=r"block=16.*hold 32 positions"):
        validate_logits_processors_parameters(processors, bad)
    validate_logits_processors_parameters(None, bad)  # an engine without the check
    other = config(block_size=16)  # another engine: its own block size
    install(other, ENGINE)
    validate_logits_processors_parameters(other.model_config.logits_processors, bad)
    with pytest.raises(VLLMValidationError, match=r"'probkv'='no-such'.*flat keys"):
        validate_logits_processors_parameters(
            other.model_config.logits_processors, SamplingParams(extra_args={"probkv": "no-such"})
        )


def test_the_check_travels_to_vllms_other_processes_with_its_engine():
    """vLLM pickles the config for its engine core and workers (spawned on the CPU platform):
    the check comes back as the same check, the user's processors are kept, and a second
    install on the same config replaces the first."""
    cfg = config([MinPLogitsProcessor, "my.module:Proc"])
    install(cfg, EngineEviction("tova", 0.5))
    check = install(cfg, ENGINE)
    assert cfg.model_config.logits_processors == [MinPLogitsProcessor, "my.module:Proc", check]
    (_, _, again) = pickle.loads(ForkingPickler.dumps(cfg.model_config.logits_processors))
    assert again is not check and issubclass(again, AdmissionCheck)
    assert again.context == check.context
    with pytest.raises(ValueError, match="kvzip"):
        again.validate_params(SamplingParams(extra_args={"probkv_method": "kvzip"}))
    assert pickle.loads(pickle.dumps(AdmissionCheck)) is AdmissionCheck
    AdmissionCheck.validate_params(SamplingParams(extra_args={"probkv": "x"}))  # no engine


def test_as_a_logits_processor_it_changes_nothing():
    processor = install(config(), ENGINE)(None, torch.device("cpu"), False)
    logits = torch.randn(2, 5)
    assert processor.apply(logits) is logits
    assert processor.is_argmax_invariant()
    processor.update_state(None)


def test_a_resumable_request_is_refused_where_vllm_builds_it_for_evicting_engines_only():
    from vllm.v1.engine.input_processor import InputProcessor

    evicting, plain = config(), config([MinPLogitsProcessor])
    install(evicting, ENGINE)  # wraps InputProcessor.process_inputs (once per process)
    assert admission.evicting(evicting) and not admission.evicting(plain)
    processor = SimpleNamespace(vllm_config=evicting)
    with pytest.raises(VLLMValidationError, match="does not serve streaming-input sessions"):
        InputProcessor.process_inputs(
            processor, "r", {"prompt_token_ids": [1]}, SamplingParams(), (), resumable=True
        )


@pytest.mark.slow
def test_a_streaming_input_session_is_refused_by_name_and_the_engine_serves_on():
    """vLLM 0.32's streaming-input session (``AsyncLLM.generate`` with an input stream) on an
    evicting engine: that session's caller gets the refusal, the engine core lives on and
    answers the next request."""
    from vllm import AsyncEngineArgs
    from vllm.engine.protocol import StreamingInput
    from vllm.v1.engine.async_llm import AsyncLLM

    from probkv.models import resolve_model
    from probkv.vllm import engine_options

    args = AsyncEngineArgs(
        model=str(resolve_model("smollm2-135m").path),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        kv_cache_memory_bytes=16 * 30 * 3 * 64 * 2 * 4 * 32,  # 16 blocks of SmolLM2, f32
        **engine_options("snapkv", 0.5),
    )
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def session():
        yield StreamingInput(prompt={"prompt_token_ids": list(range(100, 180))})

    async def run():
        llm = AsyncLLM.from_engine_args(args)
        try:
            with pytest.raises(VLLMValidationError, match="does not serve streaming-input"):
                async for _ in llm.generate(session(), greedy, request_id="session"):
                    pass
            prompt = {"prompt_token_ids": list(range(100, 180))}
            outs = [o async for o in llm.generate(prompt, greedy, request_id="after")]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
            assert not llm.errored
        finally:
            llm.shutdown()

    asyncio.run(run())
