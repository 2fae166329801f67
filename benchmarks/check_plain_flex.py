"""Can a plain vLLM engine (no probkv option) run ``FLEX_ATTENTION`` on vLLM's CPU platform?
Engines one after the other in one process (SmolLM2, float32, ``enforce_eager``, 40 blocks of
32), each asked for a backend; printed per engine: the attention implementation its layers run
and its 12 greedy tokens on one prompt (run in the vLLM environment, under the bench lock):

    .venv-vllm/bin/python benchmarks/check_plain_flex.py          # the four engines below
    .venv-vllm/bin/python benchmarks/check_plain_flex.py --from 1 # probkv's engine first

1. plain, ``FLEX_ATTENTION`` asked (stock vLLM); 2. probkv's engine through ``FLEX_ATTENTION``,
the request ``full`` (no eviction); 3. plain, ``FLEX_ATTENTION`` asked, after probkv's engine
(does the plugin's switch leak to a plain engine?); 4. plain, ``CPU_ATTN``. Results:
docs/measurements/vllm.md ("A plain engine and FLEX_ATTENTION on the CPU")."""

import argparse
import gc
import os
import time

ENGINES = (  # label, backend asked, probkv's option
    ("plain FLEX_ATTENTION asked", "FLEX_ATTENTION", False),
    ("probkv FLEX_ATTENTION, request full", "FLEX_ATTENTION", True),
    ("plain FLEX_ATTENTION asked, after probkv's", "FLEX_ATTENTION", False),
    ("plain CPU_ATTN", "CPU_ATTN", False),
)
BLOCK_BYTES = 32 * 30 * 2 * 3 * 64 * 4  # SmolLM2: 30 layers, K and V, 3 heads of 64, fp32


def run(label: str, backend: str, evicting: bool, ids: list[int]) -> None:
    import vllm

    from probkv.models import resolve_model
    from probkv.vllm import engine_options, request_options

    start = time.monotonic()
    llm = vllm.LLM(
        model=str(resolve_model("smollm2-135m").path),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        max_num_batched_tokens=128,
        kv_cache_memory_bytes=40 * BLOCK_BYTES,
        seed=0,
        attention_backend=backend,
        **(engine_options("snapkv", 0.5) if evicting else {}),
    )
    core = llm.llm_engine.engine_core.engine_core
    model = core.model_executor.driver_worker.worker.model_runner.model
    impls = sorted({type(m.impl).__qualname__ for m in model.modules() if hasattr(m, "impl")})
    params = vllm.SamplingParams(
        temperature=0,
        max_tokens=12,
        ignore_eos=True,
        extra_args=request_options("full", 0.5) if evicting else None,
    )
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    took = time.monotonic() - start
    print(f"{label}: layers run {impls}; tokens {list(out.token_ids)} ({took:.0f} s)", flush=True)
    del llm
    gc.collect()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from", dest="first", type=int, default=0, choices=range(len(ENGINES)))
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # every engine in this process
    from probkv.models import load_tokenizer

    text = "The lighthouse keeper wrote in the log every night. " * 10 + "The code is 4172."
    ids = load_tokenizer("smollm2-135m")(text).input_ids
    for label, backend, evicting in ENGINES[args.first :]:
        run(label, backend, evicting, ids)


if __name__ == "__main__":
    main()
