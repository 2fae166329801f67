"""probkv on a GPU: prefill + eviction vs plain prefill, decode vs its ideal, the scoring kernels.

Meant for a machine with one CUDA device; there it runs in a few minutes (SmolLM2-135M,
bfloat16, contexts of 8k and 32k tokens). Everything is measured side by side in one run
(variants alternated, best of ``--repeats``), with ``torch.cuda.synchronize()`` around every
timed call. It prints, per context length:

- prefill (+ observation + eviction at r = 0.5) divided by plain prefill (transformers' SDPA
  and ``DynamicCache``), for ``snapkv``, ``h2o``, ``prob:min-h`` and ``prob:h2o``;
- decode milliseconds per token after eviction at r = 0.5 and 0.75 (``prob:min-h``,
  corrected and not), the ideal (a plain cache holding as many entries as the evicted cache
  keeps per head, i.e. a prompt of that length) and ideal / measured;
- one layer's scoring kernels at the model's attention shape: SDPA, probkv's chunked kernel
  (output + harmonic column sums) and the log-normaliser route (torch's fused kernel, then
  tiled column sums), as ratios to SDPA;
- peak GPU memory of each prefill variant.

On a machine without CUDA it refuses ("no CUDA device"). ``--device cpu`` runs the same
measurements on the CPU, for a smoke test: ``--device cpu --lengths 1024`` (add
``--tiny llama`` for a tiny random model instead of SmolLM2; tests/test_bench_gpu.py runs it).

    .venv/bin/python benchmarks/bench_gpu.py [--lengths 8192,32768] [--dtype auto]
        [--model smollm2-135m] [--decode-tokens 32] [--repeats 2] [--device cuda]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from probkv.hf import ProbKVCache, observe, prepare_model
from probkv.models import load_model
from probkv.models.dtypes import DTYPE_CHOICES, MODEL_DTYPES, resolve_dtype_name
from probkv.models.testing import TINY_ARCHITECTURES, tiny_model
from probkv.policies import parse_method
from probkv.scores.column_sums import (
    attention_with_log_normalisers,
    causal_attention_with_column_sums,
    column_sums_from_log_normalisers,
    harmonic_row_weights,
)

PREFILL_METHODS = ["snapkv", "h2o", "prob:min-h", "prob:h2o"]
DECODE_METHODS = ["prob:min-h", "prob:min-h/correct=false"]
RATIOS = (0.5, 0.75)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device):
    """``(seconds, result)`` of one call, the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0


@torch.no_grad()
def prefill(model, ids, method: str | None, ratio: float):
    """One prefill (and eviction): ``(seconds, cache, next token)``."""
    if method is None:
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
    else:
        prepare_model(model)
        cache = ProbKVCache(model.config, parse_method(method, ratio), prompt_length=ids.shape[1])

    def run():
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        if method is not None and cache.eviction_pending:
            cache.evict()
        return out.logits[:, -1:].argmax(-1)

    seconds, token = timed(run, ids.device)
    return seconds, cache, token


@torch.no_grad()
def decode_ms(model, cache, token, steps: int, evicting: bool) -> float:
    """Median milliseconds per greedy decode step over ``steps`` steps."""
    if evicting:
        prepare_model(model)
    else:
        model.set_attn_implementation("sdpa")
    times = []
    for _ in range(steps):
        step = lambda tok=token: model(input_ids=tok, cache=cache, use_cache=True)  # noqa: E731
        seconds, out = timed(step, token.device)
        times.append(seconds)
        token = out.logits[:, -1:].argmax(-1)
    return 1000 * statistics.median(times)


def kept_per_head(cache: ProbKVCache) -> int:
    """Mean entries kept per KV head over the evicted layers (rounded)."""
    lengths = [
        n for layer in cache.layers if layer.prefix is not None for n in layer.prefix.lengths
    ]
    return max(1, round(sum(lengths) / max(1, len(lengths))))


def bench_prefill(model, ids, repeats: int) -> None:
    device = ids.device
    best: dict[str | None, float] = {}
    peaks: dict[str | None, float] = {}
    for _ in range(repeats):
        for method in [None, *PREFILL_METHODS]:
            reset_peak(device)
            seconds, cache, _ = prefill(model, ids, method, 0.5)
            peaks[method] = peak_mib(device)
            best[method] = min(best.get(method, float("inf")), seconds)
            del cache
    plain = best[None]
    print(f"prefill plain (sdpa, full cache): {plain * 1e3:.1f} ms, peak {peaks[None]:.0f} MiB")
    for method in PREFILL_METHODS:
        print(
            f"  {method:14s} prefill+evict {best[method] * 1e3:9.1f} ms  "
            f"ratio {best[method] / plain:.3f}  peak {peaks[method]:.0f} MiB"
        )


def bench_decode(model, ids, steps: int) -> None:
    _, full_cache, token = prefill(model, ids, None, 0.0)
    full_ms = decode_ms(model, full_cache, token, steps, False)
    del full_cache
    print(f"decode full cache ({ids.shape[1]} entries): {full_ms:.2f} ms/token")
    prepare_model(model)
    observed = observe(model, ids, "min-h")
    for ratio in RATIOS:
        per = {}
        kept = None
        for method in DECODE_METHODS:
            cache = copy.deepcopy(observed)
            cache.evict(parse_method(method, ratio))
            kept = kept_per_head(cache)
            per[method] = decode_ms(model, cache, token, steps, True)
            del cache
        # the ideal: a plain cache of the same number of entries per head
        _, ideal_cache, _ = prefill(model, ids[:, :kept], None, 0.0)
        ideal = decode_ms(model, ideal_cache, token, steps, False)
        del ideal_cache
        for method in DECODE_METHODS:
            print(
                f"  r={ratio} {method:26s} {per[method]:7.2f} ms/token  ideal ({kept} entries) "
                f"{ideal:7.2f}  ideal/measured {ideal / per[method]:.3f}"
            )
        corr, unc = per[DECODE_METHODS[0]], per[DECODE_METHODS[1]]
        print(f"  r={ratio} correction cost: {100 * (corr - unc) / unc:+.1f}% of a step")
    del observed


def bench_kernels(model, t: int, device: torch.device, dtype: torch.dtype, repeats: int) -> None:
    """One layer's scoring kernels at the model's attention shape, random inputs."""
    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(hq, t, d, generator=gen, device=device).to(dtype)
    k = torch.randn(hkv, t, d, generator=gen, device=device).to(dtype)
    v = torch.randn(hkv, t, d, generator=gen, device=device).to(dtype)
    w = harmonic_row_weights(t).to(device)[None]
    scale = d**-0.5

    def lse_route():
        out, lse = attention_with_log_normalisers(q, k, v, scale=scale)
        return out, column_sums_from_log_normalisers(q, k, lse, scale=scale, row_weights=w)

    cases = {
        "sdpa": lambda: F.scaled_dot_product_attention(
            q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=hq != hkv
        ),
        "chunked out+cs": lambda: causal_attention_with_column_sums(
            q, k, v, scale=scale, row_weights=w
        ),
        "sdpa+lse": lambda: attention_with_log_normalisers(q, k, v, scale=scale),
        "lse route out+cs": lse_route,
    }
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(repeats):
        for name, fn in cases.items():
            best[name] = min(best[name], timed(fn, device)[0])
    ref = best["sdpa"]
    print(f"one layer's kernels (Hq={hq}, Hkv={hkv}, d={d}, {dtype}):")
    for name, seconds in best.items():
        print(f"  {name:18s} {seconds * 1e3:9.2f} ms  ratio to sdpa {seconds / ref:.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="model dtype (default auto: bfloat16 on a CUDA device that supports it)",
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tiny", choices=TINY_ARCHITECTURES, help="a tiny random model instead")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    if args.device not in ("cuda", "cpu") and not args.device.startswith("cuda:"):
        raise ValueError(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "no CUDA device: this benchmark is for a GPU machine; "
            "use --device cpu --lengths 1024 for a smoke test",
            file=sys.stderr,
        )
        return 2
    lengths = [int(x) for x in args.lengths.split(",")]
    if any(t < 2 for t in lengths):
        raise ValueError(f"--lengths must be integers >= 2, got {args.lengths!r}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype_name = resolve_dtype_name(args.dtype, device)
    dtype = MODEL_DTYPES[dtype_name]
    if args.tiny:
        model = tiny_model(args.tiny, dtype=dtype, max_position_embeddings=max(lengths) + 64)
        name = f"tiny {args.tiny}"
    else:
        model, _ = load_model(args.model, dtype=dtype)
        name = args.model
    model = model.to(device)
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"model {name}, {dtype_name}, device {label}, torch {torch.__version__}, batch 1")
    gen = torch.Generator().manual_seed(0)
    for t in lengths:
        ids = torch.randint(100, model.config.vocab_size - 100, (1, t), generator=gen)
        ids = ids.to(device)
        print(f"\n== context {t} tokens ==", flush=True)
        bench_prefill(model, ids, args.repeats)
        bench_decode(model, ids, args.decode_tokens)
        bench_kernels(model, t, device, dtype, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
