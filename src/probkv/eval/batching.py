"""Running several examples' units together (``probkv eval --batch-size N``, S11 batches).

Units (:mod:`probkv.eval.plan`) of different examples with the same jobs and the same
generation budget form a batch of up to ``N``: their prompts are prefilled in one left-padded
forward (``probkv.hf.compress`` / ``observe`` on a list of contexts), each evicted on its own
exactly as alone, and their answers decoded together (``probkv.hf.answer``). The rows are the
rows of batch size 1 (same predictions under greedy decoding, same kept counts, bytes and
ratios per example); ``prefill_s`` and ``decode_s`` are the batch's times divided by its size.

Methods whose score reads a reconstruction pass (``kvzip``, S10.1) run it for the batch, one
forward per round of chunks (``probkv.hf.reconstruct``). With a model that has sliding-window
layers (Gemma-3), only examples whose questions have the same length are batched (their
padding would fall inside the window: ``probkv.hf.guards.check_padding``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import DynamicCache

from probkv.eval.config import FULL
from probkv.eval.job import (
    JobSettings,
    job_row,
    layer_rows,
    pad_id,
    prompt_parts,
    run_unit,
)
from probkv.eval.plan import Unit
from probkv.hf import answer, compress, observe, pad_left, repeat_prompt
from probkv.policies import parse_method
from probkv.scores import needs_reconstruction


def plan_batches(units: Sequence[Unit], batch_size: int, question_length=None) -> list[list[Unit]]:
    """Units grouped into batches of at most ``batch_size`` (module docstring), in the order
    of each batch's first unit. ``question_length(unit)``: the length of the part fed after
    eviction, when batches must share it (sliding-window layers), else ``None``."""
    batches: list[list[Unit]] = []
    open_batches: dict[Any, list[Unit]] = {}
    for unit in units:
        if batch_size == 1:
            batches.append([unit])
            continue
        length = None if question_length is None else question_length(unit)
        key = (unit.jobs, unit.example.max_new_tokens, length)
        batch = open_batches.get(key)
        if batch is None or len(batch) == batch_size:
            batch = open_batches[key] = []
            batches.append(batch)
        batch.append(unit)
    return batches


def run_batch(
    model, tokenizer, units: Sequence[Unit], settings: JobSettings
) -> Iterator[dict[str, Any]]:
    """Run a batch of units with the same jobs (``plan_batches``); yield their rows, job by
    job, example after example."""
    if len(units) == 1:
        yield from run_unit(model, tokenizer, units[0], settings)
        return
    parts = [prompt_parts(model, tokenizer, u.example, settings) for u in units]
    befores = [torch.tensor(p[0], dtype=torch.long) for p in parts]
    afters = [torch.tensor(p[1], dtype=torch.long) for p in parts]
    gen_kw = {"max_new_tokens": units[0].example.max_new_tokens, "pad_token_id": pad_id(tokenizer)}
    jobs = units[0].jobs
    size = len(units)

    def rows(method, ratio, outputs, measured):
        for b, (unit, part) in enumerate(zip(units, parts)):
            new_ids = _until_end(model, outputs[b])
            yield job_row(unit.example, tokenizer, method, ratio, new_ids, measured[b], part[2])

    if jobs[0][0] == FULL:
        yield from rows(FULL, jobs[0][1], *_run_full(model, befores, afters, gen_kw))
        return
    policies = [parse_method(method, ratio) for method, ratio in jobs]  # parsed once
    first = policies[0]
    rec = {"repeat_prompt": repeat_prompt(tokenizer)} if needs_reconstruction(first.score) else {}
    if len(jobs) == 1:
        start = time.perf_counter()
        cache = compress(model, befores, first, **rec)
        prefill_s = (time.perf_counter() - start) / size
        yield from rows(*jobs[0], *_decode(model, cache, afters, gen_kw, prefill_s, 1))
        return
    start = time.perf_counter()
    observed = observe(model, befores, first.score, first.score_params, **rec)
    shared_s = (time.perf_counter() - start) / size
    for i, ((method, ratio), policy) in enumerate(zip(jobs, policies, strict=True)):
        start = time.perf_counter()
        cache = observed if i == len(jobs) - 1 else copy.deepcopy(observed)
        with torch.no_grad():
            cache.evict(policy)
        prefill_s = shared_s + (time.perf_counter() - start) / size
        yield from rows(method, ratio, *_decode(model, cache, afters, gen_kw, prefill_s, len(jobs)))


def _until_end(model, tokens: torch.Tensor) -> torch.Tensor:
    """A sequence's generated ids up to its first end-of-text id (included), as ``generate``
    returns them for one sequence (a batch pads the finished ones)."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    for i, t in enumerate(tokens.tolist()):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def _decode(model, cache, afters, gen_kw, prefill_s: float, shared: int):
    """Each sequence's measurements of the evicted batch cache, then the batch's answers."""
    measured = [
        {
            "effective_ratio": cache.effective_ratio(sequence=b),
            "cache_bytes": cache.nbytes(sequence=b),
            "prefill_s": prefill_s,
            "shared_prefill": shared,
            "layers": layer_rows(cache, b),
        }
        for b in range(len(afters))
    ]
    start = time.perf_counter()
    outputs = answer(model, cache, afters, **gen_kw)
    decode_s = (time.perf_counter() - start) / len(afters)
    for m in measured:
        m["decode_s"] = decode_s
    return outputs, measured


def _run_full(model, befores, afters, gen_kw):
    """The plain model on the batch (transformers' DynamicCache, SDPA, left padding); each
    sequence's bytes are its unpadded share, as alone."""
    ids, mask = pad_left(befores)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        start = time.perf_counter()
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        prefill_s = (time.perf_counter() - start) / len(befores)
        held = [_held_bytes(cache, len(before)) for before in befores]
        new, new_mask = pad_left(afters)
        full = torch.cat([ids, new], dim=1)
        start = time.perf_counter()
        out = model.generate(
            input_ids=full,
            attention_mask=torch.cat([mask, new_mask], dim=1),
            cache=cache,
            do_sample=False,
            **gen_kw,
        )
        decode_s = (time.perf_counter() - start) / len(befores)
    measured = [
        {
            "effective_ratio": 0.0,
            "cache_bytes": nbytes,
            "prefill_s": prefill_s,
            "shared_prefill": 1,
            "decode_s": decode_s,
        }
        for nbytes in held
    ]
    return out[:, full.shape[1] :], measured


def _held_bytes(cache, tokens: int) -> int:
    """The bytes a DynamicCache holds for a sequence of ``tokens`` prompt tokens of a padded
    batch: each layer's unpadded share (a sliding-window layer holds at most its window)."""
    total = 0
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or not hasattr(keys, "numel") or keys.numel() == 0:
            continue
        batch, _, length, _ = keys.shape
        per_position = (keys.numel() * keys.element_size()) // (batch * length)
        per_position += (values.numel() * values.element_size()) // (batch * length)
        total += per_position * min(length, tokens)
    return total
