"""benchmarks/soak_serve.py: its schedule and metric reading (anywhere), and a CI-sized soak of
vLLM's OpenAI-compatible server with probkv (every kind of request, a KV cap that preempts),
whose exact post-checks must all pass: the script's exit status is the verdict."""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "soak_serve.py"


def test_the_schedule_sends_every_kind_in_turn(load_benchmark):
    soak = load_benchmark("soak_serve")
    kinds = soak.schedule(soak.parse_args(["--requests", "30"]))
    assert len(kinds) == 30
    counts = collections.Counter(kinds[: len(soak.KINDS)])
    assert set(counts) == set(soak.KINDS) and set(counts.values()) == {1}


def test_a_metric_is_the_sum_of_its_samples(load_benchmark):
    soak = load_benchmark("soak_serve")
    text = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_running_extra{engine="0"} 5.0\n'
        "vllm:kv_cache_usage_perc 0.0\n"
    )
    assert soak.metric(text, "vllm:num_requests_running") == 2.0
    assert soak.metric(text, "vllm:kv_cache_usage_perc") == 0.0
    assert soak.metric(text, "vllm:num_preemptions_total") is None


def test_the_backends_are_read_from_the_report_rows(load_benchmark, tmp_path):
    soak = load_benchmark("soak_serve")
    report = tmp_path / "r.jsonl"
    assert soak.reported_backends(report) == []  # no eviction reported: a failure to the check
    report.write_text(
        '{"attention_backend": "FLEX_ATTENTION"}\n\n{"attention_backend": "CPU_ATTN"}\n{}\n'
    )
    assert soak.reported_backends(report) == ["CPU_ATTN", "FLEX_ATTENTION", "None"]


@pytest.mark.slow
def test_a_ci_sized_soak_passes_every_post_check():
    pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs it")
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--requests", "24", "--duration", "150", "--threads", "4",
         "--max-tokens", "8", "--seeded-prompts", "1"],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "PASS" in run.stdout
