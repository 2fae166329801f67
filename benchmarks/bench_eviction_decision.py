"""Cost of probkv's eviction decision for a whole model (S2, S3).

The decision of ``prob:min-h`` with the global budget scope, for SmolLM2-135M's shape (30 layers,
Hq = 9 query heads, Hkv = 3 KV heads, head dim 64), on random float32 tensors, in three stages:

  (a) the ``min-h`` proposal of all 30 layers (S2): harmonic-weighted causal column sums in row
      chunks (``probkv.scores``, via ``probkv.scores.column_sums.causal_attention_with_column_sums``), times
      the value norms, GQA mixture, floor, then ``proposal_from_log_scores``;
  (b) one number of samples ``m`` for all heads of all layers
      (``probkv.sampling.sample_size.samples_for_ratio_global``, S3);
  (c) per layer: the counts (``sample_counts``), the kept set, the importance log-weights
      (``estimation.counts_log_weights`` / ``inclusion_log_weights``, S4/S9) and the flattened ``RaggedSelection`` the cache stores.

(a) is timed once per layer on 30 different layers and summed; every other figure is the best of
``--reps`` calls. Two costs of (a) are reported. Stand-alone: the proposal computed on its own
(an extra attention pass over every layer). Marginal: in the real integration the column sums
come from the same chunked pass that computes the layer's attention output, so what (a) adds to
a prefill is the kernel's extra time over
``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` (measured on one layer,
times 30) plus the O(t) rest (scores from the column sums, proposal, and
the last query's attention that the integration records for its reports, measured on every layer).
The decision's total is compared with SmolLM2's real prefill at the same length, measured in the
same run (``probkv.models.load_model``, sdpa, ``logits_to_keep=1``: the logits of the last
position only, as a serving prefill; best of ``--prefill-reps``). Last, the same tokens go
through probkv's own prefill (``ProbKVCache`` with ``prob:min-h``, global scope) and eviction:
the end-to-end overhead over the plain prefill, which checks the stage-by-stage estimate.

Inputs ("realistically peaked" attention): per KV head, 4 random orthonormal outlier directions
``u``; every key is ``N(0, I)``, and the first 4 keys (sinks) plus a random ``--outlier-frac`` (2%)
of the others get ``+ s u_c`` for a random direction ``c``; every query is ``N(0, I) + s u_c'``
with its own random ``c'``; values ``N(0, I)``; ``s = --strength`` (8). A query's logit against an
outlier key of its direction is about ``s^2 / 8 = 8``, against the others about ``N(0, 2)``, so
a few percent of the entries hold most of each row's mass. The table prints how peaked the
resulting proposals are: the fraction of entries holding 90% of the mass, and ``exp(entropy) / t``.

Peak memory (tracemalloc does not see torch's allocations): the growth of the peak resident set
size (VmHWM) during one call, each measurement in a fresh subprocess whose inputs are built, and
whose stage has run once on 128 entries (one-time costs), before the baseline. The peak is reset
to the current RSS just before the call (``/proc/self/clear_refs``, Linux), after ``malloc_trim``;
the subprocess runs with a fixed glibc mmap threshold of 16 KiB, so every tensor gets its own
pages and returns them when freed: the growth follows the live tensors of the call (an upper
bound, to the page). (a) is measured on one layer (layers run one after another) with a fixed
chunk (``--chunk`` rows); (b) and (c) on all 30 layers, their inputs (the proposals) excluded;
bytes / t per length shows linear growth. The dense reference materialises the ``[Hq, t, t]``
attention matrix (one float32 buffer, softmax in place: the least a dense computation needs)
and is skipped where it would exceed ``--dense-max-gib``.

Lengths above ``--full-layers-max-t`` (8192) time (a) on ``--timed-layers`` layers (2) and scale the
sum to 30 layers (marked ``~``); (b) and (c) then run on 30 layers whose proposals cycle through
the computed ones (their cost depends on t and on how peaked the proposals are, not on which).

Usage: ``python benchmarks/bench_eviction_decision.py [--t 1024 4096 8192 32768] [--reps 3]
[--threads 1] [--no-memory] [--no-prefill]`` (about 12 minutes with the defaults). On a shared
machine timings are noisy: the load average is printed at the start and before the prefill.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from probkv import estimation, sampling, scores
from probkv.estimation.selection import RaggedSelection
from probkv.policies import ProbabilisticPolicy
from probkv.policies.base import LayerObservation
from probkv.sampling import sample_size
from probkv.scores.column_sums import (
    attention_rows,
    causal_attention_with_column_sums,
    harmonic_row_weights,
)
from probkv.scores.proposals import proposal_from_log_scores

LAYERS, HQ, HKV, D = 30, 9, 3, 64  # SmolLM2-135M
SCALE = D**-0.5
MIB = 2**20


# ------------------------------------------------------------------------------ inputs


def layer_inputs(
    t: int, layer: int, *, strength: float, outlier_frac: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Peaked random ``query [Hq, t, D]``, ``key``/``value [Hkv, t, D]`` (module docstring)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    g = HQ // HKV
    directions = torch.linalg.qr(torch.randn(HKV, D, 4, generator=gen)).Q.transpose(1, 2)
    key = torch.randn(HKV, t, D, generator=gen)
    outlier = torch.rand(HKV, t, generator=gen) < outlier_frac
    outlier[:, :4] = True  # attention sinks
    which = torch.randint(0, 4, (HKV, t), generator=gen)
    key += strength * outlier[..., None] * directions.gather(1, which[..., None].expand(-1, -1, D))
    which_q = torch.randint(0, 4, (HQ, t), generator=gen)
    dq = directions.repeat_interleave(g, 0).gather(1, which_q[..., None].expand(-1, -1, D))
    query = torch.randn(HQ, t, D, generator=gen) + strength * dq
    value = torch.randn(HKV, t, D, generator=gen)
    return query, key, value


def peakedness(pi: torch.Tensor) -> tuple[float, float]:
    """Mean over rows of (fraction of entries holding 90% of the mass, exp(entropy) / t)."""
    p = pi.double()
    top = p.sort(-1, descending=True).values.cumsum(-1)
    n90 = (top < 0.9).sum(-1) + 1
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    t = p.shape[-1]
    return (n90 / t).mean().item(), (entropy.exp() / t).mean().item()


# ---------------------------------------------------------------------- the three stages


def min_h_rest(q, k, v, column_sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a) after the column sums: min-h log-scores (S2) and the proposal, ``[Hkv, t]`` each."""
    log_scores = scores.compute_scores("min-h", q, k, v, scale=SCALE, column_sums=column_sums)
    return log_scores.log_scores, proposal_from_log_scores(log_scores.log_scores)


def min_h_chunked(q, k, v, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a) stand-alone: harmonic column sums in row chunks (never t x t), then ``min_h_rest``."""
    w = harmonic_row_weights(q.shape[1])[None]
    _, sums = causal_attention_with_column_sums(
        q, k, None, scale=SCALE, row_weights=w, chunk_size=chunk
    )
    return min_h_rest(q, k, v, sums[0])


def min_h_dense(q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """(a) the t x t way: the whole causal attention matrix, then the same column sums."""
    t = q.shape[1]
    g = HQ // HKV
    p = torch.matmul(q * SCALE, k.repeat_interleave(g, 0).transpose(1, 2))  # [Hq, t, t]
    p.masked_fill_(torch.ones(t, t, dtype=torch.bool).triu_(1), -math.inf)
    torch.softmax(p, -1, out=p)
    sums = torch.matmul(harmonic_row_weights(t), p)  # [Hq, t]: sum_j h_j p_j(i)
    del p
    return min_h_rest(q, k, v, sums)


def global_m(pis: list[torch.Tensor], ratio: float) -> int:
    """(b): one m for every head of every layer (S3, Appendix F.1)."""
    return sample_size.samples_for_ratio_global(pis, ratio)


def sample_and_weigh(
    pis: list[torch.Tensor], m: int, weights: str, seed: int
) -> list[RaggedSelection]:
    """(c): counts, kept set, log-weights (S4, S9) and the flattened selection, every layer."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for pi in pis:
        counts = sampling.sample_counts(pi, m, gen)
        kept = counts > 0
        if weights == "counts":
            lw = estimation.counts_log_weights(pi, kept, counts, num_samples=m)
        else:
            lw = estimation.inclusion_log_weights(pi, kept, m, counts=counts)
        out.append(RaggedSelection.from_masks(kept, lw))
    return out


# ------------------------------------------------------------------------------- timing


def best_of(fn: Callable[[], object], reps: int) -> tuple[float, object]:
    """Best wall time of ``reps`` calls (seconds) and the last result."""
    best, result = math.inf, None
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def time_length(t: int, args: argparse.Namespace) -> dict:
    """All timings at one length ``t`` (seconds, 30 layers unless stated)."""
    kw = {"strength": args.strength, "outlier_frac": args.outlier_frac, "seed": args.seed}
    computed = LAYERS if t <= args.full_layers_max_t else min(args.timed_layers, LAYERS)
    a_total = rest_total = 0.0
    pis, layer_log_scores, peaks = [], [], []
    for layer in range(computed):
        q, k, v = layer_inputs(t, layer, **kw)
        start = time.perf_counter()
        w = harmonic_row_weights(t)[None]
        _, sums = causal_attention_with_column_sums(
            q, k, None, scale=SCALE, row_weights=w, chunk_size=args.chunk
        )
        middle = time.perf_counter()
        log_scores, pi = min_h_rest(q, k, v, sums[0])
        # the integration also records the last query's attention (reports, S6): marginal cost
        attention_rows(q[:, -1:], k, scale=SCALE, row_positions=[t - 1])
        end = time.perf_counter()
        a_total += end - start
        rest_total += end - middle
        pis.append(pi.double())
        layer_log_scores.append(log_scores)
        peaks.append(peakedness(pi))
    scale_up = LAYERS / computed
    pis = [pis[layer % computed] for layer in range(LAYERS)]
    observations = [
        LayerObservation(
            layer_idx=layer,
            rank=layer,
            log_scores=layer_log_scores[layer % computed],
            forced=None,
            last_query_attention=torch.zeros(HKV, t),
        )
        for layer in range(LAYERS)
    ]

    out = {
        "t": t,
        "pis": pis,
        "computed_layers": computed,
        "a_standalone": a_total * scale_up,
        "a_rest": rest_total * scale_up,
        "frac90": sum(p[0] for p in peaks) / len(peaks),
        "perplexity": sum(p[1] for p in peaks) / len(peaks),
    }
    out["b"], m = best_of(lambda: global_m(pis, args.ratio), args.reps)
    out["m"] = m
    out["c"], selections = best_of(
        lambda: sample_and_weigh(pis, m, args.weights, args.seed), args.reps
    )
    kept = torch.cat([s.lengths.to(torch.float64) for s in selections]) / t
    out["kept_mean"], out["kept_min"], out["kept_max"] = (
        kept.mean().item(),
        kept.min().item(),
        kept.max().item(),
    )
    policy = ProbabilisticPolicy(score="min-h", ratio=args.ratio, scope="global", seed=args.seed)
    out["policy"], _ = best_of(lambda: policy.select(observations, num_layers=LAYERS), args.reps)

    # marginal (a): the kernel's extra time over sdpa on one layer (default chunk, as the
    # integration runs it), times 30; rounds interleaved so that load from other processes
    # falls on all three alike, best of each kept
    if t <= args.marginal_max_t:
        q, k, v = layer_inputs(t, 0, **kw)
        w = harmonic_row_weights(t)[None]
        q4, k4, v4 = q[None], k[None], v[None]
        cases = {
            "sdpa_layer": lambda: F.scaled_dot_product_attention(
                q4, k4, v4, is_causal=True, scale=SCALE, enable_gqa=True
            ),
            "out_layer": lambda: causal_attention_with_column_sums(
                q, k, v, scale=SCALE, row_weights=None
            ),
            "kernel_layer": lambda: causal_attention_with_column_sums(
                q, k, v, scale=SCALE, row_weights=w
            ),
        }
        for name in cases:
            out[name] = math.inf
        for _ in range(args.reps):
            for name, fn in cases.items():
                out[name] = min(out[name], best_of(fn, 1)[0])
        out["a_marginal"] = LAYERS * (out["kernel_layer"] - out["sdpa_layer"]) + out["a_rest"]

    if dense_bytes(t) <= args.dense_max_gib * 2**30:
        q, k, v = layer_inputs(t, 0, **kw)
        out["dense_layer"], (_, pi_dense) = best_of(lambda: min_h_dense(q, k, v), 1)
        out["chunked_layer"], (_, pi_chunked) = best_of(
            lambda: min_h_chunked(q, k, v, args.chunk), 1
        )
        out["dense_rel_err"] = ((pi_dense - pi_chunked).abs().max() / pi_chunked.max()).item()
    return out


def dense_bytes(t: int) -> int:
    """The dense reference's ``[Hq, t, t]`` float32 buffer plus the ``[t, t]`` causal mask."""
    return HQ * t * t * 4 + t * t


# ------------------------------------------------------------------------------- memory


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(spec: dict) -> None:
    """In a fresh process: peak RSS growth (bytes) of one stage; inputs built before the baseline.

    The stage first runs once on 128-entry inputs, so that one-time costs (lazily loaded kernels,
    thread pools) are paid before the baseline and the growth is what the length ``t`` costs.
    """
    torch.set_num_threads(spec["threads"])
    stage = spec["stage"]

    def make_call(t: int) -> Callable[[], object]:
        if stage in ("a_chunked", "a_dense"):
            kw = {k: spec[k] for k in ("strength", "outlier_frac", "seed")}
            q, k, v = layer_inputs(t, 0, **kw)
            if stage == "a_chunked":
                return lambda: min_h_chunked(q, k, v, spec["chunk"])
            return lambda: min_h_dense(q, k, v)
        pis = torch.load(spec["pis"])
        if t < pis[0].shape[-1]:
            pis = [p[:, :t] / p[:, :t].sum(-1, keepdim=True) for p in pis]
        if stage == "b":
            return lambda: global_m(pis, spec["ratio"])
        return lambda: sample_and_weigh(pis, spec["m"], spec["weights"], spec["seed"])

    make_call(128)()  # warm-up
    call = make_call(spec["t"])
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # return freed heap pages: reuse would hide them
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = _status_kib("VmRSS")
    result = call()
    peak = _status_kib("VmHWM")
    del result
    print(json.dumps({"bytes": (peak - before) * 1024}))


def peak_bytes(spec: dict) -> int:
    cmd = [sys.executable, __file__, "--memory-child", json.dumps(spec)]
    # a fixed glibc mmap threshold: every buffer above 16 KiB gets its own pages, returned when
    # freed, so the RSS peak follows live tensors rather than heap reuse and fragmentation
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "16384"}
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(res.stdout.strip().splitlines()[-1])["bytes"]


def memory_length(t: int, args: argparse.Namespace, pis_path: Path, m: int) -> dict:
    base = {
        "t": t,
        "threads": args.threads,
        "chunk": args.chunk,
        "strength": args.strength,
        "outlier_frac": args.outlier_frac,
        "seed": args.seed,
        "ratio": args.ratio,
        "weights": args.weights,
        "pis": str(pis_path),
        "m": m,
    }
    out = {stage: peak_bytes({**base, "stage": stage}) for stage in ("a_chunked", "b", "c")}
    if dense_bytes(t) <= args.dense_max_gib * 2**30:
        out["a_dense"] = peak_bytes({**base, "stage": "a_dense"})
    return out


# ------------------------------------------------------------------------------ prefill


def prefill_comparison(t: int, args: argparse.Namespace) -> dict:
    """SmolLM2 at ``t`` random tokens: plain prefill (sdpa) against probkv's prefill with the same
    policy (``prob:min-h``, global scope: statistics from the chunked kernel) and its eviction.

    Both use ``logits_to_keep=1``; rounds alternate between the two so that load from other
    processes falls on both alike; best of ``args.prefill_reps`` each (seconds).
    """
    from probkv.hf import ProbKVCache, prepare_model
    from probkv.models import load_model
    from probkv.models.dtypes import resolve_dtype

    model, _ = load_model(
        "smollm2-135m", dtype=resolve_dtype(args.dtype), attn_implementation="sdpa"
    )
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, model.config.vocab_size, (1, t), generator=gen)
    policy = ProbabilisticPolicy(score="min-h", ratio=args.ratio, scope="global", seed=args.seed)
    out = {"plain": math.inf, "probkv_prefill": math.inf, "probkv_evict": math.inf}
    with torch.inference_mode():
        model(input_ids=ids[:, :256], use_cache=True, logits_to_keep=1)  # warm-up
        for _ in range(args.prefill_reps):
            model.set_attn_implementation("sdpa")
            plain = best_of(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), 1)
            out["plain"] = min(out["plain"], plain[0])
            prepare_model(model)
            cache = ProbKVCache(model.config, policy, prompt_length=t)
            start = time.perf_counter()
            model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            middle = time.perf_counter()
            cache.evict()  # the global scope evicts once every layer has been observed
            end = time.perf_counter()
            out["probkv_prefill"] = min(out["probkv_prefill"], middle - start)
            out["probkv_evict"] = min(out["probkv_evict"], end - middle)
            out["effective_ratio"] = cache.effective_ratio()
    return out


# --------------------------------------------------------------------------------- main


def _ms(x: float | None, approx: bool = False) -> str:
    return "-" if x is None else f"{'~' if approx else ''}{x * 1e3:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--t", type=int, nargs="+", default=[1024, 4096, 8192, 32768])
    ap.add_argument("--reps", type=int, default=3, help="calls per timing (best kept)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (set explicitly)")
    ap.add_argument("--ratio", type=float, default=0.5, help="compression ratio r (S1)")
    ap.add_argument(
        "--weights", default="inclusion", choices=("counts", "inclusion"), help="log-weights of (c)"
    )
    ap.add_argument("--chunk", type=int, default=64, help="rows per chunk of (a)")
    ap.add_argument("--strength", type=float, default=8.0, help="outlier strength s")
    ap.add_argument("--outlier-frac", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--full-layers-max-t", type=int, default=8192)
    ap.add_argument("--timed-layers", type=int, default=2)
    ap.add_argument("--marginal-max-t", type=int, default=8192)
    ap.add_argument("--dense-max-gib", type=float, default=6.0)
    ap.add_argument("--prefill-t", type=int, default=8192)
    ap.add_argument("--prefill-reps", type=int, default=2)
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="SmolLM2's dtype in the prefill comparison (probkv.models.dtypes)",
    )
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        memory_child(json.loads(args.memory_child))
        return
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, torch.set_num_threads({args.threads}) -> "
        f"{torch.get_num_threads()} thread(s); float32 inputs; {LAYERS} layers x Hq={HQ} "
        f"Hkv={HKV} d={D}; ratio r={args.ratio}, weights={args.weights!r}, chunk={args.chunk}; "
        f"outliers s={args.strength}, frac={args.outlier_frac}; best of {args.reps}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )

    results = []
    tmp = tempfile.TemporaryDirectory(prefix="probkv-bench-")
    for t in args.t:
        res = time_length(t, args)
        pis = res.pop("pis")
        if not args.no_memory:
            path = Path(tmp.name) / f"pis-{t}.pt"
            torch.save(pis, path)
            res["memory"] = memory_length(t, args, path, res["m"])
        results.append(res)
        print(f"  measured t={t}", flush=True)

    print("\n(1) time of the eviction decision, ms for 30 layers (~ = scaled from fewer layers)")
    print(
        f"{'t':>6} {'(a)alone':>9} {'(a)rest':>8} {'(a)marg':>8} {'(b)m':>6} {'(c)samp':>8} "
        f"{'policy':>7} {'alone':>8} {'marginal':>9} {'m':>10} {'kept/t min..max':>16} "
        f"{'90%mass':>8} {'ppl/t':>6}"
    )
    for r in results:
        approx = r["computed_layers"] < LAYERS
        alone = r["a_standalone"] + r["b"] + r["c"]
        marginal = None if "a_marginal" not in r else r["a_marginal"] + r["b"] + r["c"]
        print(
            f"{r['t']:>6} {_ms(r['a_standalone'], approx):>9} {_ms(r['a_rest'], approx):>8} "
            f"{_ms(r.get('a_marginal'), approx):>8} {_ms(r['b']):>6} {_ms(r['c']):>8} "
            f"{_ms(r['policy']):>7} {_ms(alone, approx):>8} {_ms(marginal, approx):>9} "
            f"{r['m']:>10} {r['kept_min']:>7.3f}..{r['kept_max']:<7.3f} "
            f"{r['frac90']:>8.4f} {r['perplexity']:>6.4f}"
        )
    print(
        "(a)alone: min-h proposal on its own (chunked column sums + rest); (a)rest: the O(t)\n"
        "part after the column sums (scores, proposal, last-query attention); (a)marg: 30 x\n"
        "(kernel out+sums - sdpa) + rest; (b): global m; (c): counts, log-weights, selection;\n"
        "policy: ProbabilisticPolicy(min-h, global).select on the same log-scores (= proposal\n"
        "+ (b) + (c)); alone/marginal: (a) + (b) + (c). kept/t: per-head kept fraction under\n"
        "the one global m; 90%mass: fraction of entries holding 90% of a proposal's mass."
    )

    print("\n(2) attention kernel vs sdpa, one layer, ms (marginal cost of the min-h statistics)")
    print(f"{'t':>6} {'sdpa':>8} {'out only':>9} {'out+sums':>9} {'extra':>8} {'extra/sdpa':>11}")
    for r in results:
        if "sdpa_layer" in r:
            s, o = r["sdpa_layer"], r["kernel_layer"]
            print(
                f"{r['t']:>6} {_ms(s):>8} {_ms(r['out_layer']):>9} {_ms(o):>9} {_ms(o - s):>8} "
                f"{(o - s) / s:>11.3f}"
            )
    print(
        "out only / out+sums: probkv's chunked kernel without / with the harmonic column sums;\n"
        "extra = out+sums - sdpa (negative: the chunked kernel is the faster one at that length)"
    )

    print("\n(3) chunked vs dense (a), one layer")
    print(f"{'t':>6} {'chunked ms':>11} {'dense ms':>9} {'max|dpi|/max pi':>16}")
    for r in results:
        if "dense_layer" in r:
            print(
                f"{r['t']:>6} {_ms(r['chunked_layer']):>11} {_ms(r['dense_layer']):>9} "
                f"{r['dense_rel_err']:>16.2e}"
            )
        else:
            gib = dense_bytes(r["t"]) / 2**30
            print(f"{r['t']:>6}  dense skipped: {gib:.1f} GiB > --dense-max-gib")

    if not args.no_memory:
        print(
            "\n(4) peak memory (peak-RSS growth during one call, fresh process each): MiB and "
            "bytes per t\n    (a) one layer, chunk fixed; (b), (c) all 30 layers"
        )
        print(
            f"{'t':>6} {'(a)chunked':>11} {'B/t':>7} {'(a)dense':>9} {'B/t':>8} "
            f"{'dense/chunk':>12} {'(b)':>7} {'B/t':>6} {'(c)':>7} {'B/t':>6}"
        )
        for r in results:
            mem, t = r["memory"], r["t"]
            dense = mem.get("a_dense")
            dense_cols = (
                f"{dense / MIB:>9.1f} {dense / t:>8.0f} {dense / max(mem['a_chunked'], 1):>12.1f}"
                if dense is not None
                else f"{'skipped':>9} {'-':>8} {'-':>12}"
            )
            print(
                f"{t:>6} {mem['a_chunked'] / MIB:>11.1f} {mem['a_chunked'] / t:>7.0f} "
                f"{dense_cols} {mem['b'] / MIB:>7.1f} {mem['b'] / t:>6.0f} "
                f"{mem['c'] / MIB:>7.1f} {mem['c'] / t:>6.0f}"
            )

    print(f"\nload average now {os.getloadavg()[0]:.1f} (other processes inflate every figure)")
    if args.no_prefill:
        return
    pre = prefill_comparison(args.prefill_t, args)
    prefill = pre["plain"]
    print(
        f"\n(5) SmolLM2-135M plain prefill of {args.prefill_t} random tokens (sdpa, "
        f"logits_to_keep=1, {args.threads} thread(s), --dtype {args.dtype}, best of "
        f"{args.prefill_reps}): {prefill:.2f} s"
    )
    for r in results:
        if r["t"] != args.prefill_t:
            continue
        alone = r["a_standalone"] + r["b"] + r["c"]
        print(
            f"    decision with (a) stand-alone: {alone:.2f} s = {alone / prefill:.1%} of prefill"
        )
        if "a_marginal" in r:
            marginal = r["a_marginal"] + r["b"] + r["c"]
            print(
                f"    decision with (a) marginal:    {marginal:.2f} s = {marginal / prefill:.1%} "
                "of prefill (target < 10%)"
            )
            proper = r["a_rest"] + r["b"] + r["c"]
            print(
                f"    the decision after the attention pass (rest + (b) + (c)): {proper:.2f} s = "
                f"{proper / prefill:.1%}"
            )
    extra = pre["probkv_prefill"] + pre["probkv_evict"] - prefill
    print(
        f"(6) end to end, same model and tokens: probkv prefill (ProbKVCache, prob:min-h global) "
        f"{pre['probkv_prefill']:.2f} s + eviction {pre['probkv_evict']:.2f} s (effective ratio "
        f"{pre['effective_ratio']:.3f})\n    = plain + {extra:.2f} s = {extra / prefill:+.1%} of "
        "plain prefill"
    )


if __name__ == "__main__":
    main()
