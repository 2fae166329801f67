"""Running jobs with a model (S7): prefill, evict, answer, score, measure.

- Question-agnostic by default (S7): the context alone is prefilled and evicted, then the
  question is fed and the answer generated (``probkv.hf.compress`` + ``probkv.hf.answer``).
  Question-aware eviction evicts after context + question instead. In both modes the last
  prompt token is fed after eviction (the first answer token needs a query position), so
  question-aware eviction sees every prompt token but the last (:func:`split_prompt`).
- ``full`` is the plain model (transformers' ``DynamicCache``, SDPA attention): no eviction.
- A unit of several jobs (:mod:`probkv.eval.plan`) is run from one prefill: the observed, not
  yet evicted cache is copied and evicted once per job, exactly as ``compress`` would (each
  layer on its own for per-layer policies, all layers at once for the global scope).
  ``prefill_s`` of such a job is the shared prefill time plus its own eviction time, and
  ``shared_prefill`` says how many jobs shared it.
- Every prefill computes logits for its last position only (``logits_to_keep=1``, as
  ``probkv.hf.compress`` and ``observe`` do), so prefill times compare fairly across methods.
- Context limit: a prompt plus its ``max_new_tokens`` must fit the model's positions
  (``probkv.models.max_positions``). :func:`check_prompts` refuses, before any job runs, an
  example that does not fit; with ``truncate_middle`` its context is cut in the middle
  instead (``probkv.eval.examples.fit_context``, as LongBench's evaluation does), by the
  same function :func:`job_prompt_ids` that every job uses.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from probkv.eval.config import FULL
from probkv.eval.examples import ContextTooLongError, Example, fit_context, score_example
from probkv.eval.plan import Unit
from probkv.eval.prompt import prompt_token_ids
from probkv.eval.store import ROW_FIELDS
from probkv.hf import answer, compress, observe, prepare_model, repeat_prompt
from probkv.models import load_model, max_positions
from probkv.models.dtypes import resolve_dtype
from probkv.policies import parse_method
from probkv.scores import needs_reconstruction


@dataclass(frozen=True)
class JobSettings:
    """What every job of a run shares (picklable, sent to worker processes)."""

    model: str
    question_aware: bool = False
    seed: int = 0
    truncate_middle: bool = False
    dtype: str = "float32"  # the model's, "float32" or "bfloat16" (RunConfig.dtype)


def load_prepared_model(name: str, threads: int, dtype: str = "float32"):
    """``(model, tokenizer)`` of ``name`` (``probkv.models``) in ``dtype`` (``"float32"``,
    ``"bfloat16"`` or ``"auto"``, :mod:`probkv.models.dtypes`), prepared for eviction
    (``probkv.hf.prepare_model``), with ``threads`` torch threads in this process."""
    torch.set_num_threads(threads)
    model, tokenizer = load_model(name, dtype=resolve_dtype(dtype))
    return prepare_model(model), tokenizer


def split_prompt(
    context_ids: Sequence[int], question_ids: Sequence[int], question_aware: bool
) -> tuple[list[int], list[int]]:
    """Token ids prefilled before eviction and fed after it (module docstring): the context
    and the question (question-agnostic), or all but the last prompt token and that token
    (question-aware). The part fed after eviction is never empty."""
    ids = [*context_ids, *question_ids]
    if len(ids) < 2:
        raise ValueError(f"a prompt needs at least 2 tokens (one to prefill, one after), got {ids}")
    # An empty context (question-agnostic): the question's first token is prefilled.
    cut = len(ids) - 1 if question_aware or not question_ids else max(len(context_ids), 1)
    return ids[:cut], ids[cut:]


def job_prompt_ids(
    example: Example, tokenizer: Any, limit: int, *, truncate_middle: bool = False
) -> tuple[list[int], list[int], int]:
    """``(context_ids, question_ids, truncated)`` of ``example`` as every job feeds them: the
    prompt's two parts (``probkv.eval.prompt``), the context cut in the middle to fit
    ``limit`` positions with ``truncate_middle`` (``truncated`` tokens removed); an example
    that does not fit is a :class:`~probkv.eval.examples.ContextTooLongError`."""
    context_ids, question_ids = prompt_token_ids(example, tokenizer)
    fitted = fit_context(
        context_ids,
        question_ids,
        example.max_new_tokens,
        limit,
        example_id=example.id,
        truncate=truncate_middle,
    )
    return fitted, question_ids, len(context_ids) - len(fitted)


def check_prompts(
    examples: Sequence[Example], tokenizer: Any, limit: int, *, truncate_middle: bool = False
) -> None:
    """Refuse, before any job runs, an example whose prompt cannot be built, has fewer than
    2 tokens (one to prefill and evict, one to feed after eviction), or does not fit the
    model's ``limit`` positions with its ``max_new_tokens`` (unless ``truncate_middle``
    can cut its context to fit)."""
    for ex in examples:
        try:
            context_ids, question_ids, _ = job_prompt_ids(
                ex, tokenizer, limit, truncate_middle=truncate_middle
            )
        except ContextTooLongError as err:
            hint = "" if truncate_middle else "; or rerun with --truncate-middle"
            raise ValueError(f"{err}{hint}") from None
        except ValueError as err:
            raise ValueError(f"example {ex.id!r}: {err}") from None
        n = len(context_ids) + len(question_ids)
        if n < 2:
            raise ValueError(
                f"example {ex.id!r}: its prompt has {n} token(s); a job needs at least 2 "
                "(one prefilled and evicted, one fed after eviction)"
            )


def pad_id(tokenizer: Any) -> int | None:
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if pad is not None else getattr(tokenizer, "eos_token_id", None)


def cache_layer_bytes(cache) -> int:
    """Bytes of the key and value tensors of a transformers ``DynamicCache``."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None and hasattr(t, "numel"):
                total += t.numel() * t.element_size()
    return total


def layer_rows(cache, sequence: int | None = None) -> list[dict[str, Any]]:
    """Per evicted layer: its effective ratio (S3) and the last query's attention mass on the
    kept entries, mean over KV heads (S6 diagnostic), from ``cache.reports()`` (of one
    ``sequence`` of a batch)."""
    return [
        {
            "layer": r.layer_idx,
            "effective_ratio": r.effective_ratio,
            "retained_attention_mass": sum(r.retained_attention_mass)
            / max(len(r.retained_attention_mass), 1),
        }
        for r in cache.reports(sequence)
    ]


def common_fields(
    settings: JobSettings,
    context_ids: Sequence[int],
    question_ids: Sequence[int],
    truncated: int,
    *,
    compressed: int,
    engine: str,
) -> dict[str, Any]:
    """The fields every job of one example shares, in any engine (``compressed``: prompt
    tokens in the cache when it was evicted)."""
    return {
        "context_tokens": len(context_ids),
        "truncated_tokens": truncated,
        "question_tokens": len(question_ids),
        "compressed_tokens": compressed,
        "question_aware": settings.question_aware,
        "seed": settings.seed,
        "model": settings.model,
        "dtype": settings.dtype,
        "engine": engine,
    }


def job_row(
    ex: Example,
    tokenizer: Any,
    method: str,
    ratio: float,
    new_ids: Sequence[int],
    measured: dict[str, Any],
    common: dict[str, Any],
) -> dict[str, Any]:
    """A results row (:data:`probkv.eval.store.ROW_FIELDS`, in that order): the answer
    ``new_ids`` decoded and scored, with the engine's ``measured`` fields and ``common``."""
    prediction = tokenizer.decode(new_ids, skip_special_tokens=True).strip()
    out = {
        "id": ex.id,
        "task": ex.task,
        "method": method,
        "ratio": float(ratio),
        "prediction": prediction,
        "answers": list(ex.answers),
        "score": score_example(ex, prediction),
        **measured,
        "generated_tokens": len(new_ids),
        **common,
    }
    return {k: out[k] for k in ROW_FIELDS if k in out}


def prompt_parts(model, tokenizer, ex: Example, settings: JobSettings):
    """``(before, after, common)``: the ids prefilled before eviction and fed after it
    (:func:`split_prompt`), and the row fields every job of ``ex`` shares."""
    context_ids, question_ids, truncated = job_prompt_ids(
        ex, tokenizer, max_positions(model.config), truncate_middle=settings.truncate_middle
    )
    before, after = split_prompt(context_ids, question_ids, settings.question_aware)
    common = common_fields(
        settings, context_ids, question_ids, truncated, compressed=len(before), engine="hf"
    )
    return before, after, common


def run_unit(model, tokenizer, unit: Unit, settings: JobSettings) -> Iterator[dict[str, Any]]:
    """Run one unit's jobs; yield one results row per job as it finishes (see
    :data:`probkv.eval.store.ROW_FIELDS`).

    ``model`` must be prepared (``probkv.hf.prepare_model``)."""
    ex = unit.example
    before, after, common = prompt_parts(model, tokenizer, ex, settings)
    before_t = torch.tensor([before], dtype=torch.long)
    after_t = torch.tensor([after], dtype=torch.long)
    gen_kw = {"max_new_tokens": ex.max_new_tokens, "pad_token_id": pad_id(tokenizer)}

    def row(method: str, ratio: float, new_ids, measured: dict[str, Any]) -> dict[str, Any]:
        return job_row(ex, tokenizer, method, ratio, new_ids, measured, common)

    if unit.jobs[0][0] == FULL:
        if len(unit.jobs) != 1:
            raise ValueError(f"the full-cache job runs alone, got the unit {unit.jobs}")
        yield row(FULL, unit.jobs[0][1], *_run_full(model, before_t, after_t, gen_kw))
        return

    policies = [parse_method(method, ratio) for method, ratio in unit.jobs]  # parsed once
    # KVzip-style scores (S10.1) reconstruct the context with the tokenizer's repeat prompt.
    first = policies[0]
    rec = {"repeat_prompt": repeat_prompt(tokenizer)} if needs_reconstruction(first.score) else {}
    if len(unit.jobs) == 1:
        method, ratio = unit.jobs[0]
        start = time.perf_counter()
        cache = compress(model, before_t, first, **rec)
        prefill_s = time.perf_counter() - start
        yield row(method, ratio, *_decode(model, cache, after_t, gen_kw, prefill_s, 1))
        return

    # Shared prefill: observe once, copy the observed cache and evict it once per job.
    start = time.perf_counter()
    observed = observe(model, before_t, first.score, first.score_params, **rec)
    shared_s = time.perf_counter() - start
    for i, ((method, ratio), policy) in enumerate(zip(unit.jobs, policies, strict=True)):
        start = time.perf_counter()
        cache = observed if i == len(unit.jobs) - 1 else copy.deepcopy(observed)
        with torch.no_grad():
            cache.evict(policy)
        prefill_s = shared_s + time.perf_counter() - start
        yield row(method, ratio, *_decode(model, cache, after_t, gen_kw, prefill_s, len(unit.jobs)))


def _decode(model, cache, after_t, gen_kw, prefill_s: float, shared: int):
    """Measure the evicted cache, then answer from it: ``(generated ids, measurements)``."""
    measured = {
        "effective_ratio": cache.effective_ratio(),
        "cache_bytes": cache.nbytes(),
        "prefill_s": prefill_s,
        "shared_prefill": shared,
        "layers": layer_rows(cache),
    }
    start = time.perf_counter()
    new_ids = answer(model, cache, after_t, **gen_kw)
    measured["decode_s"] = time.perf_counter() - start
    return new_ids, measured


def _run_full(model, before_t, after_t, gen_kw):
    """The plain model: transformers' DynamicCache and SDPA (a prepared model sends plain
    caches to SDPA), no eviction: ``(generated ids, measurements)``."""
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        start = time.perf_counter()
        model(input_ids=before_t, cache=cache, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - start
        measured = {
            "effective_ratio": 0.0,
            "cache_bytes": cache_layer_bytes(cache),
            "prefill_s": prefill_s,
            "shared_prefill": 1,
        }
        ids = torch.cat([before_t, after_t], dim=1)
        start = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            do_sample=False,
            **gen_kw,
        )
        measured["decode_s"] = time.perf_counter() - start
    return out[0, ids.shape[1] :], measured
