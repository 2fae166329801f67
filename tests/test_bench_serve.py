"""benchmarks/bench_serve.py: its ratio lines and cap arithmetic on made-up rows (anywhere), and
a tiny run end to end through vLLM's OpenAI-compatible server and vLLM's serving benchmark:
2 prompts of 128 tokens, 4 new tokens, plain vLLM under C and C / (1 - r) and snapkv r = 0.5
(no timing is checked: speed is read from the benchmark's own output)."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest


def test_ratio_lines_and_the_cap_check(load_benchmark, capsys):
    bench = load_benchmark("bench_serve")
    args = bench.parse_args(
        ["--shape", "long", "--methods", "snapkv,prob:snapkv", "--ratios", "0.5"]
    )
    per_request = 72  # (2048 + 256) / 32
    configs = bench.configurations(args, per_request)
    assert [c.name for c in configs] == [
        "plain C", "plain C/(1-0.5)", "snapkv r=0.5", "prob:snapkv r=0.5"
    ]  # fmt: skip
    assert [c.blocks for c in configs] == [288, 576, 288, 288]
    speeds = {
        "plain C": 1.0,
        "plain C/(1-0.5)": 1.2,
        "snapkv r=0.5": 1.1,
        "prob:snapkv r=0.5": 0.99,
    }
    rows = []
    for cfg in configs:
        row = bench.Row(cfg, cap_bytes=(cfg.blocks + 1) * 32 * 46080, num_gpu_blocks=cfg.blocks + 1)
        row.duration_s, row.req_s, row.output_tok_s = 10 / speeds[cfg.name], speeds[cfg.name], 256
        row.median_ttft_ms, row.median_tpot_ms, row.peak_running = 100.0, 50.0, 4
        rows.append(row)
    ratios = bench.report_rows(args, rows, per_request)
    out = capsys.readouterr().out
    assert (
        "289 blocks in vLLM (288 + its null block): 4 full requests of 72 blocks, exactly n" in out
    )
    assert "plain C/(1-0.5) / plain C: 1.20x req/s" in out
    assert "snapkv r=0.5 / plain C: 1.10x req/s" in out
    assert "snapkv r=0.5 / plain C/(1-0.5): 0.92x req/s" in out
    assert "prob:snapkv r=0.5 / snapkv r=0.5: 0.90x req/s" in out
    assert len(ratios) == 1 + 2 + 3


def test_the_hybrid_shape_evicts_gemma3_under_two_full_requests(load_benchmark, capsys):
    """Issue 54's shape: Gemma-3 270M, 8 x 8,192 / 128, C = 2 full requests over every layer,
    plain under C and 2 C, snapkv and topk:kvzap at r = 0.5; the groups and layers freed in are
    printed from the report's rows."""
    bench = load_benchmark("bench_serve")
    args = bench.parse_args(["--shape", "hybrid"])
    assert (args.input_len, args.output_len, args.num_prompts) == (8192, 128, 8)
    assert args.model == "gemma3-270m" and args.full_requests == 2
    per_request = 260  # (8192 + 128) / 32
    configs = bench.configurations(args, per_request)
    assert [c.name for c in configs] == [
        "plain C", "plain C/(1-0.5)", "snapkv r=0.5", "topk:kvzap r=0.5"
    ]  # fmt: skip
    assert [c.blocks for c in configs] == [520, 1040, 520, 520]
    rows = []
    for cfg, speed in zip(configs, (1.0, 1.02, 1.05, 1.04)):
        row = bench.Row(cfg, cap_bytes=1, num_gpu_blocks=3121)
        row.duration_s, row.req_s, row.output_tok_s = 10 / speed, speed, 128
        row.median_ttft_ms, row.median_tpot_ms, row.peak_running = 100.0, 50.0, 8
        if cfg.method:
            row.evicted_groups, row.evicted_layers = [2], [5, 11, 17]
        rows.append(row)
    bench.report_rows(args, rows, per_request)
    out = capsys.readouterr().out
    assert "| plain C | 520 (3121) | - |" in out  # vLLM's blocks are per group of layers
    assert "snapkv r=0.5: freed in KV cache groups [2], observed layers [5, 11, 17]" in out
    assert "made 3121 blocks in vLLM, each a block of one layer per KV cache group" in out
    assert "snapkv r=0.5 / plain C/(1-0.5): 1.03x req/s" in out


def test_the_long_output_shape_runs_a_budget_against_c_and_memory_for_all(
    load_benchmark, capsys, tmp_path
):
    bench = load_benchmark("bench_serve")
    args = bench.parse_args(["--shape", "long-output", "--methods", "snapkv,tova"])
    assert (args.input_len, args.output_len, args.num_prompts) == (512, 1024, 16)
    per_request = 48  # (512 + 1024) / 32
    configs = bench.configurations(args, per_request)
    assert [c.name for c in configs] == [
        "plain C", "plain, memory for all", "snapkv B=256 K=32", "tova B=256 K=32"
    ]  # fmt: skip
    assert [c.blocks for c in configs] == [192, 768, 192, 192]
    config = {"num_attention_heads": 9, "hidden_size": 576, "num_hidden_layers": 30}
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 3}))
    command = bench.server_command(args, tmp_path, 1, configs[2], tmp_path / "r.jsonl")
    option = json.loads(command[command.index("--additional-config") + 1])["probkv"]
    assert (option["method"], option["max_entries"], option["every"]) == ("snapkv", 256, 32)
    rows = []
    for cfg, speed in zip(configs, (1.0, 1.5, 1.45, 1.4)):
        row = bench.Row(cfg, cap_bytes=0, num_gpu_blocks=cfg.blocks + 1)
        row.duration_s, row.req_s, row.output_tok_s = 10 / speed, speed, 1024
        row.median_ttft_ms, row.median_tpot_ms, row.peak_running = 100.0, 50.0, 4
        row.peak_positions = 288 if cfg.max_entries else None
        rows.append(row)
    ratios = bench.report_rows(args, rows, per_request)
    out = capsys.readouterr().out
    assert "budget B = 256, K = 32" in out
    assert "snapkv B=256 K=32 / plain C: 1.45x req/s" in out
    assert "snapkv B=256 K=32 / plain, memory for all: 0.97x req/s" in out
    assert "| 288 |" in out
    assert len(ratios) == 1 + 2 + 2
    with pytest.raises(ValueError, match="--max-entries must be >= 32"):
        bench.parse_args(["--shape", "long-output", "--max-entries", "16"])


def test_the_attention_backend_reaches_every_server_and_is_read_back(load_benchmark, tmp_path):
    bench = load_benchmark("bench_serve")
    config = {"num_attention_heads": 9, "hidden_size": 576, "num_hidden_layers": 30}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for backend in (None, "FLEX_ATTENTION"):
        argv = ["--shape", "long", "--methods", "snapkv", "--ratios", "0.5"]
        args = bench.parse_args(argv + (["--attention-backend", backend] if backend else []))
        for cfg in bench.configurations(args, 72):  # plain ones too: the same server flags
            command = bench.server_command(args, tmp_path, 1, cfg, tmp_path / "r.jsonl")
            assert "--no-async-scheduling" in command  # probkv refuses vLLM's GPU default
            if backend is None:
                assert "--attention-backend" not in command
            else:
                assert command[command.index("--attention-backend") + 1] == backend
    assert bench.backend_ran("", [{"attention_backend": "FLEX_ATTENTION"}]) == "FLEX_ATTENTION"
    cpu_log = "INFO [cpu.py:178] Cannot use AttentionBackendEnum.FLEX_ATTENTION backend on CPU.\n"
    assert bench.backend_ran(cpu_log, []) == "CPU_ATTN"  # the CPU platform's silent fallback
    chosen = "INFO [cuda.py:446] Using AttentionBackendEnum.FLEX_ATTENTION backend.\n"
    assert bench.backend_ran(chosen, []) == "FLEX_ATTENTION"  # vLLM's CUDA platform, chosen
    automatic = "INFO Using FLASH_ATTN attention backend out of potential backends: [...].\n"
    assert bench.backend_ran(automatic, []) == "FLASH_ATTN"
    assert bench.backend_ran("INFO nothing said\n", []) is None
    with pytest.raises(ValueError, match=r"--attention-backend takes .* got 'flex'"):
        bench.parse_args(["--attention-backend", "flex"])


def test_bad_configs_are_refused(load_benchmark):
    with pytest.raises(ValueError, match=r"--configs takes plain, ideal, evict; got \['x'\]"):
        load_benchmark("bench_serve").parse_args(["--configs", "plain,x"])


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed here: run it in .venv-vllm",
)
def test_tiny_run_through_vllms_server_and_client(load_benchmark, tmp_path, capsys):
    # 128 prompt tokens: 4 blocks, of which the sinks' block and the prompt's last are kept by
    # rule (issue 55), so r = 0.5 has blocks to free (64 tokens had none: 2 blocks, both kept)
    argv = ["--shape", "short", "--input-len", "128", "--output-len", "4", "--num-prompts", "2"]
    argv += ["--methods", "snapkv", "--ratios", "0.5", "--out", str(tmp_path / "serve.json")]
    assert load_benchmark("bench_serve").main(argv) == 0
    out = capsys.readouterr().out
    assert "4 full requests of 5 blocks, exactly n" in out  # C = 4 x ceil(132 / 32) blocks
    for pair in ("plain C/(1-0.5) / plain C", "snapkv r=0.5 / plain C",
                 "snapkv r=0.5 / plain C/(1-0.5)"):  # fmt: skip
        assert re.search(
            rf"^{re.escape(pair)}: \d+\.\d\dx req/s, \d+\.\d\dx output tok/s", out, re.M
        )
    data = json.loads((tmp_path / "serve.json").read_text())
    rows = {r["config"]["name"]: r for r in data["configs"]}
    assert list(rows) == ["plain C", "plain C/(1-0.5)", "snapkv r=0.5"]
    for row in rows.values():
        assert row["error"] is None and row["completed"] == 2 and row["failed"] == 0
        assert row["req_s"] > 0 and row["median_ttft_ms"] > 0 and row["median_tpot_ms"] > 0
        assert row["mean_prompt_tokens"] == 128
    assert [rows[n]["num_gpu_blocks"] for n in rows] == [21, 41, 21]
    assert rows["snapkv r=0.5"]["evicted_requests"] == 2  # one row per request in the report
    assert rows["snapkv r=0.5"]["attention_backend"] == "CPU_ATTN"  # the report's rows say
    assert rows["snapkv r=0.5"]["mean_freed_blocks"] > 0
    assert rows["plain C"]["evicted_requests"] == 0
    assert len(data["ratios"]) == 3


def test_a_refusal_is_read_from_the_server_log(load_benchmark, tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        'INFO starting\nTraceback (most recent call last):\n  File "x.py", line 1\n'
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
        "  Value error, probkv eviction in vLLM: prefix caching shares blocks "
        "[type=value_error, input_value=ArgsKwargs(())]\n"
        "    For further information visit the docs\n"
    )
    reason = load_benchmark("bench_serve").failure_reason(log)
    assert reason.endswith("Value error, probkv eviction in vLLM: prefix caching shares blocks")
