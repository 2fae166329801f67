"""Cost of verifying a converted model against its digests, as a ratio to loading it (issue 11).

Every load of a converted model (probkv.models) re-hashes its folder against the manifest
(probkv.models.files, sha256). This prints, measured side by side in one run (alternating,
best of ``--repeats``, the page cache warm for both):

- ``verify``: hashing every file of the converted folder (the per-process memo cleared);
- ``load``: ``from_pretrained`` of model and tokenizer from that folder (what a cached load
  cost before digests);
- ``source``: hashing the source GGUF (a registry model's check, done before digests too);
- the ratio verify / load, and the whole ``load_model`` (resolve + verify + load) / load.

The model is converted first if needed (in ``$PROBKV_CACHE_DIR`` or the normal cache). Also a
comparison of hash functions on the weights file, to justify sha256.

    .venv/bin/python benchmarks/bench_model_cache.py [--model smollm2-135m] [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from probkv.models import files as model_files
from probkv.models import loading as models
from probkv.models.dtypes import DTYPE_CHOICES, resolve_dtype


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _hash_rate(path, name: str) -> float:
    """MB/s of hashlib's ``name`` over ``path`` (1 MiB blocks)."""
    digest = hashlib.new(name)
    start = time.perf_counter()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return path.stat().st_size / 1e6 / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--dtype", choices=DTYPE_CHOICES, default="auto", help="model dtype (probkv.models.dtypes)"
    )
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype)
    torch.set_num_threads(args.threads)

    resolved = models.resolve_model(args.model)  # converts once if needed
    folder = resolved.path
    key = folder.name
    sizes = sorted((p.stat().st_size, p.name) for p in folder.iterdir() if p.is_file())
    total_mb = sum(s for s, _ in sizes) / 1e6
    parts = models.gguf_parts(models.REGISTRY[args.model]) if args.model in models.REGISTRY else []
    print(
        f"model {args.model}: {folder} ({resolved.origin}), {total_mb:.0f} MB in {len(sizes)} files"
    )

    def verify() -> None:
        model_files._VERIFIED.clear()
        assert model_files.folder_problem(folder, key) is None

    def load() -> None:
        AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
        AutoTokenizer.from_pretrained(folder, local_files_only=True)

    def source() -> None:
        models._SHA_MEMO.clear()
        models.sha256_of_parts(parts)

    def load_model() -> None:
        model_files._VERIFIED.clear()
        models._SHA_MEMO.clear()
        models.load_model(args.model, dtype=dtype)

    variants = {"verify": verify, "load": load, "load_model": load_model}
    if parts:
        variants["source"] = source
    for fn in variants.values():  # warm the page cache and imports
        fn()
    best = {name: float("inf") for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            best[name] = min(best[name], _timed(fn))
    for name, seconds in best.items():
        print(f"{name:>10}: {seconds:7.3f} s")
    print(f"verify / load            = {best['verify'] / best['load']:.2f}")
    print(f"load_model / load        = {best['load_model'] / best['load']:.2f}")
    if parts:
        print(f"source / load            = {best['source'] / best['load']:.2f}")

    weights = folder / "model.safetensors"
    rates = {name: _hash_rate(weights, name) for name in ("sha256", "blake2b", "sha1", "md5")}
    print(
        "hash rates on model.safetensors (MB/s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in rates.items())
    )


if __name__ == "__main__":
    main()
