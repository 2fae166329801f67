"""Tensor parallelism: every rank observes its own KV heads, the observations are gathered over
the TP group, and every rank applies the same selection: TP 3 (SmolLM2 has 9 query and 3 KV
heads, so 2 does not divide them) gives TP 1's tokens, log-probs and freed blocks in float32,
kvzap included (each rank's share of every head's prediction summed over the group), and so
do requests held to a decode budget (stages at the same steps, the same blocks kept). Each
engine runs in a subprocess (vLLM's workers are spawned processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs it")

pytestmark = pytest.mark.slow

RUN = """
import json, sys
import vllm
from probkv.models import chat_prompt_ids, load_tokenizer, resolve_model
from probkv.vllm import engine_options, request_options

tp, report = int(sys.argv[1]), sys.argv[2]
tokenizer = load_tokenizer("smollm2-135m")
document = ("The lighthouse keeper wrote in the log every night. " * 12
            + "The code of the vault is 4172. "
            + "Gulls circled the rocks while the tide went out and came back. " * 12)
ids = chat_prompt_ids(tokenizer, document + "\\n\\nWhat is the code of the vault?")[0].tolist()
llm = vllm.LLM(model=str(resolve_model("smollm2-135m").path), dtype="float32", enforce_eager=True,
               max_model_len=1024, kv_cache_memory_bytes=128 << 20,
               tensor_parallel_size=tp, seed=0, **engine_options("prob:snapkv", 0.5, report=report))
out = {}
for method in ("prob:snapkv", "tova", "prob:kvzap", "topk:kvzap", "snapkv@64", "tova@64"):
    name, _, budget = method.partition("@")  # @B: a decode budget of B positions, K = 32
    extra = request_options(name, 0.5, **({"max_entries": int(budget), "every": 32} if budget else {}))
    params = vllm.SamplingParams(temperature=0, max_tokens=96 if budget else 6, logprobs=0,
                                 ignore_eos=True, extra_args=extra)
    o = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    out[method] = [list(o.token_ids), [next(iter(s.values())).logprob for s in o.logprobs]]
print("RESULT " + json.dumps(out))
"""


def run(tp: int, tmp_path) -> tuple[dict, list[dict]]:
    report = tmp_path / f"tp{tp}.jsonl"
    env = dict(
        os.environ,
        VLLM_CPU_OMP_THREADS_BIND="|".join(str(r % (os.cpu_count() or 1)) for r in range(tp)),
    )
    done = subprocess.run(
        [sys.executable, "-c", RUN, str(tp), str(report)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    return json.loads(lines[-1][len("RESULT ") :]), rows


def test_three_ranks_decode_and_free_what_one_rank_does(tmp_path):
    one, rows_one = run(1, tmp_path)
    three, rows_three = run(3, tmp_path)
    for method in one:
        assert three[method][0] == one[method][0]
        assert max(abs(a - b) for a, b in zip(three[method][1], one[method][1])) < 1e-4
    keep = ("freed_blocks", "kept_positions", "prompt_length", "num_blocks", "method")
    keep += ("stages", "stage_length", "peak_positions")  # a decode budget's stages (@64)
    assert [{k: r.get(k) for k in keep} for r in rows_three] == [
        {k: r.get(k) for k in keep} for r in rows_one
    ]
    assert all(r["freed_blocks"] > 0 for r in rows_one)
    stages: dict[str, int] = {}  # a budgeted request's report has a row per stage
    for r in rows_one:
        if r.get("stages"):
            stages[r["request_id"]] = max(stages.get(r["request_id"], 0), r["stages"])
    assert len(stages) == 2 and min(stages.values()) >= 3
