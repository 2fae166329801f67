"""Speed and memory of probkv's chunked causal attention kernel (S2 chunking).

``probkv.scores.column_sums.causal_attention_with_column_sums`` runs inside the prefill attention of
every layer when a policy needs attention statistics, so it is timed against what the layer
would run anyway: ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)`` on
4-D inputs (the CPU flash kernel; 3-D inputs fall back to the much slower math path), both
with ``enable_gqa=True`` and with repeated keys/values. Shape: SmolLM2-135M's attention
(Hq = 9, Hkv = 3, d = 64), float32, one torch thread.

Prints, per ``t`` and input dtype (``--dtypes``): best-of-N wall times and the ratios
ours / sdpa (GQA, same input dtype) for
  - output only (``row_weights=None``),
  - output + column sums of one row weighting (harmonic: the min-h/h2o-h statistics; this
    is what the integration layer runs during prefill),
  - column sums only (``value=None``, what a proposal alone costs),
  - the other route, ``lse``: torch's fused kernel for the output and each row's
    log-normaliser (``attention_with_log_normalisers``), then the column sums tile by tile
    (``column_sums_from_log_normalisers``); and the fused kernel alone (``sdpa+lse``);
and the peak extra memory (peak RSS growth, fresh subprocess) of the chunked kernel versus a
dense reference that materialises the ``[Hq, t, t]`` attention matrix.

Usage: ``python benchmarks/bench_attention_kernel.py [--t 2048 4096 8192] [--reps 3]
[--chunk-sizes 32 64 128] [--dtypes float32 bfloat16] [--no-memory] [--profile]``. With bfloat16 inputs
the SDPA baseline computes in bfloat16 while probkv's kernels upcast to float32 (its
statistics are float32 by design). Timings on a shared machine are noisy: rounds
are interleaved and the minimum is reported.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from probkv.models.dtypes import dtype_name
from probkv.scores.column_sums import (
    CPU_CHUNK_ROWS,
    attention_with_log_normalisers,
    causal_attention_with_column_sums,
    column_sums_from_log_normalisers,
    default_chunk_size,
    harmonic_row_weights,
)

HQ, HKV, D = 9, 3, 64  # SmolLM2-135M


def _inputs(
    t: int, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(HQ, t, D, generator=gen).to(dtype)
    k = torch.randn(HKV, t, D, generator=gen).to(dtype)
    v = torch.randn(HKV, t, D, generator=gen).to(dtype)
    return q, k, v


def lse_route(q, k, v, scale, w):
    """Output and log-normalisers from torch's fused kernel, then tiled column sums."""
    out, lse = attention_with_log_normalisers(q, k, v, scale=scale)
    return out, column_sums_from_log_normalisers(q, k, lse, scale=scale, row_weights=w)


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def time_one(
    t: int, reps: int, rounds: int, chunk_sizes: list[int | None], dtype: torch.dtype
) -> dict:
    q, k, v = _inputs(t, dtype=dtype)
    scale = D**-0.5
    g = HQ // HKV
    w = harmonic_row_weights(t)[None]
    q4, k4, v4 = q[None], k[None], v[None]
    kr, vr = k4.repeat_interleave(g, 1), v4.repeat_interleave(g, 1)
    cases = {
        "sdpa_gqa": lambda: F.scaled_dot_product_attention(
            q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True
        ),
        "sdpa_rep": lambda: F.scaled_dot_product_attention(q4, kr, vr, is_causal=True, scale=scale),
        "sdpa+lse": lambda: attention_with_log_normalisers(q, k, v, scale=scale),
        "lse": lambda: lse_route(q, k, v, scale, w),
    }
    for c in chunk_sizes:
        cases[f"out/{c}"] = lambda c=c: causal_attention_with_column_sums(
            q, k, v, scale=scale, row_weights=None, chunk_size=c
        )
        cases[f"out+cs/{c}"] = lambda c=c: causal_attention_with_column_sums(
            q, k, v, scale=scale, row_weights=w, chunk_size=c
        )
        cases[f"cs/{c}"] = lambda c=c: causal_attention_with_column_sums(
            q, k, None, scale=scale, row_weights=w, chunk_size=c
        )
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):  # interleave cases so that load from other processes is shared
        for name, fn in cases.items():
            best[name] = min(best[name], _best(fn, reps))
    return best


def profile_one(
    t: int, dtype: torch.dtype, top: int = 8
) -> dict[str, dict[str, tuple[int, float]]]:
    """Where the chunked kernel's time goes: torch.profiler's self CPU time per aten op for one
    call of output + column sums (default chunk), beside one call of SDPA, as shares of SDPA's
    total. SDPA's fused kernel is one op; the chunked kernel's matmuls, softmax and column sums
    are separate ops, each a pass over a chunk's scores. Prints the ``top`` ops of each call and
    returns ``{call: {op: (calls, self CPU microseconds)}}``."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v = _inputs(t, dtype=dtype)
    scale = D**-0.5
    w = harmonic_row_weights(t)[None]
    calls = {
        "sdpa": lambda: F.scaled_dot_product_attention(
            q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=True
        ),
        "out+cs": lambda: causal_attention_with_column_sums(q, k, v, scale=scale, row_weights=w),
    }
    ops: dict[str, dict[str, tuple[int, float]]] = {}
    for name, fn in calls.items():
        fn()  # warm-up: allocator, first-call dispatch
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        ops[name] = {e.key: (e.count, e.self_cpu_time_total) for e in prof.key_averages()}
    totals = {name: sum(us for _, us in table.values()) for name, table in ops.items()}
    ref = totals["sdpa"]
    print(f"\nprofile, {dtype_name(dtype)}, t = {t}: self CPU time per op, share of SDPA's total")
    for name, table in ops.items():
        print(f"  {name}: total {totals[name] / 1e3:.1f} ms = {totals[name] / ref:.3f} x sdpa")
        for key, (count, us) in sorted(table.items(), key=lambda x: -x[1][1])[:top]:
            print(f"    {key:<48} {count:>6} calls {us / 1e3:>9.1f} ms {us / ref:>7.3f}")
    return ops


def _dense_reference(q, k, v, scale, w):
    """The t x t way: what the chunked kernel avoids (for the memory comparison)."""
    g = q.shape[0] // k.shape[0]
    t = q.shape[1]
    logits = torch.matmul(q, k.repeat_interleave(g, 0).transpose(1, 2)) * scale
    logits.masked_fill_(torch.ones(t, t, dtype=torch.bool).triu_(1), float("-inf"))
    p = torch.softmax(logits, -1)
    return p @ v.repeat_interleave(g, 0), torch.einsum("st,hti->shi", w, p)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(t: int, which: str) -> None:
    """Runs in a fresh process: prints the peak RSS growth (MiB) during one call.

    The peak RSS (VmHWM) is reset to the current RSS just before the call by writing 5 to
    /proc/self/clear_refs (Linux), so the growth counts only what the call itself touched.
    """
    torch.set_num_threads(1)
    q, k, v = _inputs(t)
    w = harmonic_row_weights(t)[None]
    scale = D**-0.5
    fn = {
        "chunked": lambda: causal_attention_with_column_sums(q, k, v, scale=scale, row_weights=w),
        "dense": lambda: _dense_reference(q, k, v, scale, w),
        "sdpa": lambda: F.scaled_dot_product_attention(
            q[None], k[None], v[None], is_causal=True, enable_gqa=True
        ),
    }[which]
    torch.ones(8, 8) @ torch.ones(8, 8)  # load the BLAS before the baseline
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    fn()
    peak = _status_kib("VmHWM")
    print(json.dumps({"mib": (peak - before) / 1024}))


def peak_memory_mib(t: int, which: str) -> float:
    cmd = [sys.executable, __file__, "--memory-child", str(t), which]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])["mib"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--t", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32"],
        choices=["float32", "bfloat16"],
        help="input dtypes (each timed against SDPA in the same dtype)",
    )
    ap.add_argument("--reps", type=int, default=2, help="calls per round (best kept)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds over all cases")
    ap.add_argument(
        "--chunk-sizes", type=int, nargs="*", default=[], help="extra chunk sizes to time"
    )
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also print the per-op breakdown (torch.profiler) of one call per t",
    )
    ap.add_argument("--memory-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        memory_child(int(args.memory_child[0]), args.memory_child[1])
        return
    torch.set_num_threads(1)
    chunks: list[int | None] = [None, *args.chunk_sizes]

    print(f"torch {torch.__version__}, 1 thread, Hq={HQ} Hkv={HKV} d={D}")
    print("times in ms (best of reps x rounds); ratio = ours / sdpa(enable_gqa=True), same dtype")
    header = (
        f"{'dtype':>8} {'t':>6} {'chunk':>6} {'sdpa_gqa':>9} {'sdpa_rep':>9} {'out':>9} "
        f"{'ratio':>6} {'out+cs':>9} {'ratio':>6} {'cs only':>9} {'ratio':>6} "
        f"{'sdpa+lse':>9} {'ratio':>6} {'lse+cs':>9} {'ratio':>6}"
    )
    print(header)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for t in args.t:
            best = time_one(t, args.reps, args.rounds, chunks, dtype)
            ref = best["sdpa_gqa"]
            for c in chunks:
                shown = default_chunk_size(HQ, t, max_rows=CPU_CHUNK_ROWS) if c is None else c
                label = f"{shown}{'*' if c is None else ''}"
                o, ocs, cs = best[f"out/{c}"], best[f"out+cs/{c}"], best[f"cs/{c}"]
                sl, lc = best["sdpa+lse"], best["lse"]
                print(
                    f"{name:>8} {t:>6} {label:>6} {ref * 1e3:>9.1f} {best['sdpa_rep'] * 1e3:>9.1f} "
                    f"{o * 1e3:>9.1f} {o / ref:>6.3f} {ocs * 1e3:>9.1f} {ocs / ref:>6.3f} "
                    f"{cs * 1e3:>9.1f} {cs / ref:>6.3f} {sl * 1e3:>9.1f} {sl / ref:>6.3f} "
                    f"{lc * 1e3:>9.1f} {lc / ref:>6.3f}",
                    flush=True,
                )
    print("* = default chunk size")
    if args.profile:
        for name in args.dtypes:
            for t in args.t:
                profile_one(t, getattr(torch, name))

    if args.no_memory:
        return
    print("\npeak extra memory (MiB): peak RSS growth during one call, fresh process each")
    print(f"{'t':>6} {'chunked':>9} {'dense':>9} {'dense/chunked':>14} {'sdpa':>9}")
    for t in args.t:
        ch, de, sd = (peak_memory_mib(t, x) for x in ("chunked", "dense", "sdpa"))
        print(f"{t:>6} {ch:>9.1f} {de:>9.1f} {de / max(ch, 1e-9):>14.1f} {sd:>9.1f}", flush=True)


if __name__ == "__main__":
    main()
