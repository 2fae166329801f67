"""Which engine runs an evaluation's jobs (``probkv eval --engine hf|vllm``).

- ``hf`` (default): transformers through ``probkv.hf``, one job after another
  (:mod:`probkv.eval.job`, :mod:`probkv.eval.workers`).
- ``vllm``: ONE vLLM engine with probkv's plugin for the whole run
  (``probkv.vllm.engine.VllmRunner``, imported only here and only then). The jobs of each
  (method, ratio) go to the engine as one batch of requests with the same token ids the HF
  engine feeds (:func:`probkv.eval.job.job_prompt_ids`), greedy, and come back as the same
  results rows, plus ``freed_bytes`` (KV bytes vLLM's block pool got back). vLLM evicts after
  the whole prompt's prefill, so it runs question-aware evaluations only; its first answer
  token comes from that prefill, before eviction (the HF engine feeds the last prompt token
  after eviction). ``compressed_tokens`` is therefore the whole prompt.

:func:`check_engine_run` refuses, by name and before any model or engine loads, what an
engine cannot run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from probkv.eval.config import FULL, RunConfig
from probkv.eval.job import JobSettings, common_fields, job_prompt_ids, job_row
from probkv.eval.plan import Unit
from probkv.models import load_model_config, resolve_model


def check_engine_run(
    config: RunConfig,
    *,
    workers: int = 1,
    threads: int = 1,
    reuse_prefill: bool = True,
    tensor_parallel_size: int | None = None,
    spelled: Sequence[str] = (),
    batch_size: int = 1,
) -> None:
    """Refuse (ValueError naming the option) a run its engine cannot do: tensor parallelism
    with ``hf``; with ``vllm``, question-agnostic eviction, worker processes, torch threads,
    ``--no-prefill-reuse`` and the methods the plugin refuses (``probkv.vllm.engine``), also
    as ``spelled`` by the user (a canonical name drops options equal to the defaults, such as
    ``scope=head``, which vLLM cannot run)."""
    if config.engine == "hf":
        if tensor_parallel_size is not None:
            raise ValueError(
                f"--tensor-parallel-size {tensor_parallel_size} applies to --engine vllm only; "
                "the hf engine runs on one device (use --workers for processes)"
            )
        return
    if tensor_parallel_size is not None and (
        isinstance(tensor_parallel_size, bool)
        or not isinstance(tensor_parallel_size, int)
        or tensor_parallel_size < 1
    ):
        raise ValueError(
            f"--tensor-parallel-size must be an integer >= 1, got {tensor_parallel_size!r}"
        )
    if not config.question_aware:
        raise ValueError(
            "--engine vllm evicts after the whole prompt's prefill (the question included): "
            "it runs question-aware evaluations only; add --question-aware"
        )
    if workers != 1:
        raise ValueError(
            f"--workers {workers}: --engine vllm runs one engine that batches the requests; "
            "omit --workers (use --tensor-parallel-size to split the model)"
        )
    if batch_size != 1:
        raise ValueError(
            f"--batch-size {batch_size}: --engine vllm batches every request of a method and "
            "ratio itself; omit --batch-size"
        )
    if threads != 1:
        raise ValueError(
            f"--threads {threads}: vLLM binds its own CPU threads (VLLM_CPU_OMP_THREADS_BIND); "
            "omit --threads with --engine vllm"
        )
    if not reuse_prefill:
        raise ValueError(
            "--no-prefill-reuse applies to the hf engine; vLLM prefills every request itself"
        )
    from probkv.vllm.engine import check_methods  # pure: imports nothing of vLLM

    check_methods(
        [m for m in (*spelled, *config.methods) if m != FULL],
        config.ratios,
        tensor_parallel_size=tensor_parallel_size or 1,
    )


def check_engine_model(config: RunConfig, *, tensor_parallel_size: int | None = None) -> None:
    """With ``vllm``, refuse a model the plugin cannot run, or whose heads do not divide over
    the ranks, from its ``config.json`` (``probkv.vllm.engine.check_model``), or that a kvzap
    method has no shipped scorer for (its config's identity) or whose KV heads do not split
    over the ranks; nothing with ``hf``."""
    if config.engine != "vllm":
        return
    from probkv.vllm.engine import check_methods, check_model, scorer_methods  # pure

    path, ranks = str(resolve_model(config.model).path), tensor_parallel_size or 1
    check_model(path, ranks)
    methods = scorer_methods([m for m in config.methods if m != FULL], config.ratios)
    if methods:
        model = load_model_config(path)
        check_methods(methods, config.ratios, model=model, tensor_parallel_size=ranks)


def vllm_rows(
    config: RunConfig,
    units: Sequence[Unit],
    tokenizer: Any,
    limit: int,
    *,
    tensor_parallel_size: int | None = None,
) -> Iterator[dict[str, Any]]:
    """Results rows of the pending ``units``' jobs through one vLLM engine (module docstring):
    one batch per (method, ratio), in the order of the run's jobs."""
    from probkv.vllm.engine import Request, VllmRunner

    settings = JobSettings(
        config.model, config.question_aware, config.seed, config.truncate_middle, config.dtype
    )
    prompts = {}
    for unit in units:
        ex = unit.example
        if ex.id not in prompts:
            context_ids, question_ids, truncated = job_prompt_ids(
                ex, tokenizer, limit, truncate_middle=config.truncate_middle
            )
            ids = [*context_ids, *question_ids]
            common = common_fields(
                settings, context_ids, question_ids, truncated, compressed=len(ids), engine="vllm"
            )
            prompts[ex.id] = (ex, tuple(ids), common)
    batches: dict[tuple[str, float], list[str]] = {}
    for unit in units:
        for job in unit.jobs:
            batches.setdefault(job, []).append(unit.example.id)
    if not batches:
        return
    longest = max(len(ids) + ex.max_new_tokens for ex, ids, _ in prompts.values())
    runner = VllmRunner(
        str(resolve_model(config.model).path),
        dtype=config.dtype,
        tensor_parallel_size=tensor_parallel_size or 1,
        max_model_len=min(longest, limit),
        seed=config.seed,
    )
    try:
        for (method, ratio), ids in batches.items():
            requests = [
                Request(prompts[i][1], method, ratio, prompts[i][0].max_new_tokens) for i in ids
            ]
            for i, result in zip(ids, runner.run(requests), strict=True):
                ex, _, common = prompts[i]
                measured = {
                    "effective_ratio": result.effective_ratio,
                    "cache_bytes": result.cache_bytes,
                    "freed_bytes": result.freed_bytes,
                    "prefill_s": result.prefill_s,
                    "decode_s": result.decode_s,
                    "shared_prefill": 1,
                }
                yield job_row(ex, tokenizer, method, ratio, result.token_ids, measured, common)
    finally:
        runner.close()
