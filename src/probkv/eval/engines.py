"""The engines that run an evaluation's jobs (``probkv eval --engine NAME``), behind one
interface: :class:`Engine`, one subclass per engine, in :data:`ENGINES` by name.

- ``hf`` (default, :class:`HfEngine`): transformers through ``probkv.hf``, one unit (or one
  batch of units) after another in this process or in ``workers`` processes
  (:mod:`probkv.eval.job`, :mod:`probkv.eval.batching`, :mod:`probkv.eval.workers`).
- ``vllm`` (:class:`VllmEngine`): ONE vLLM engine with probkv's plugin for the whole run
  (``probkv.vllm.engine.VllmRunner``, imported only here and only then). The jobs of each
  (method, ratio) go to the engine as one batch of requests with the same token ids the HF
  engine feeds (:func:`probkv.eval.job.job_prompt_ids`), greedy, and come back as the same
  results rows, plus ``freed_bytes`` (KV bytes vLLM's block pool got back). vLLM evicts after
  the whole prompt's prefill, so it runs question-aware evaluations only; its first answer
  token comes from that prefill, before eviction (the HF engine feeds the last prompt token
  after eviction). ``compressed_tokens`` is therefore the whole prompt.

The runner (:func:`probkv.eval.runner.run_eval`) asks the engine of ``config.engine``
(:func:`engine_for`) four things and has no engine branch of its own: what it cannot run
(``check_run``, before anything loads), whether the model it needs (``check_model``, from
its files), whether this process loads the model (``loads_model``) and the pending units'
results rows (``rows``). Adding an engine is one subclass and one entry of :data:`ENGINES`
(docs/architecture.md has a worked example); ``--engine`` takes its name.

This module loads neither transformers nor vLLM: each engine imports what runs its jobs when
it runs them, so ``probkv --help`` can list the engines.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from probkv._checks import check_choice
from probkv.eval.config import FULL, RunConfig
from probkv.eval.plan import Unit
from probkv.models import load_model_config, resolve_model


class Engine:
    """One way to run an evaluation's jobs. Subclasses set ``NAME`` and implement ``rows``;
    the checks default to accepting everything."""

    NAME: ClassVar[str]

    def check_run(
        self,
        config: RunConfig,
        *,
        workers: int,
        threads: int,
        reuse_prefill: bool,
        tensor_parallel_size: int | None,
        spelled: Sequence[str],
        batch_size: int,
    ) -> None:
        """Refuse (ValueError naming the option) a run this engine cannot do, before any
        model or engine loads."""

    def check_model(self, config: RunConfig, *, tensor_parallel_size: int | None) -> None:
        """Refuse a model this engine cannot run, from its files (before it loads)."""

    def loads_model(self, workers: int) -> bool:
        """Whether the runner loads the model in this process (else only its tokenizer)."""
        return False

    def rows(
        self,
        config: RunConfig,
        units: Sequence[Unit],
        model: Any,
        tokenizer: Any,
        limit: int,
        *,
        workers: int,
        threads: int,
        batch_size: int,
        tensor_parallel_size: int | None,
    ) -> Iterator[dict[str, Any]]:
        """The pending ``units``' results rows (``probkv.eval.store.ROW_FIELDS``), lazily,
        in the order they finish; ``model`` is the loaded model where ``loads_model``."""
        raise NotImplementedError


class HfEngine(Engine):
    """transformers through ``probkv.hf`` (module docstring)."""

    NAME: ClassVar[str] = "hf"

    def check_run(self, config, *, tensor_parallel_size, **options) -> None:
        """Tensor parallelism is vLLM's; everything else runs."""
        if tensor_parallel_size is not None:
            raise ValueError(
                f"--tensor-parallel-size {tensor_parallel_size} applies to --engine vllm only; "
                "the hf engine runs on one device (use --workers for processes)"
            )

    def loads_model(self, workers: int) -> bool:
        return workers == 1  # else each worker process loads it

    def rows(
        self, config, units, model, tokenizer, limit, *, workers, threads, batch_size, **_
    ) -> Iterator[dict[str, Any]]:
        """This process, one unit or one batch at a time, or ``workers`` processes."""
        from probkv.eval.batching import plan_batches, run_batch  # transformers
        from probkv.eval.job import JobSettings, run_unit
        from probkv.eval.workers import run_in_workers

        settings = JobSettings(
            config.model, config.question_aware, config.seed, config.truncate_middle, config.dtype
        )
        batches = [[u] for u in units]
        if batch_size > 1:
            model_config = model.config if model is not None else load_model_config(config.model)
            length = question_length(config, tokenizer, limit, model_config)
            batches = plan_batches(units, batch_size, length)
        if workers == 1 and batch_size == 1:
            return (r for u in units for r in run_unit(model, tokenizer, u, settings))
        if workers == 1:
            return (r for b in batches for r in run_batch(model, tokenizer, b, settings))
        return run_in_workers(batches, settings, min(workers, len(batches)), threads)


def question_length(config: RunConfig, tokenizer, limit: int, model_config):
    """``plan_batches``' key for a model with sliding-window layers (a batch's questions must
    have one length there: ``probkv.eval.batching``), else ``None``."""
    from probkv.eval.job import job_prompt_ids, split_prompt

    layer_types = getattr(model_config.get_text_config(decoder=True), "layer_types", None)
    if "sliding_attention" not in (layer_types or ()):
        return None

    def length(unit) -> int:
        context, question, _ = job_prompt_ids(
            unit.example, tokenizer, limit, truncate_middle=config.truncate_middle
        )
        return len(split_prompt(context, question, config.question_aware)[1])

    return length


class VllmEngine(Engine):
    """One vLLM engine with probkv's plugin (module docstring)."""

    NAME: ClassVar[str] = "vllm"

    def check_run(
        self,
        config,
        *,
        workers,
        threads,
        reuse_prefill,
        tensor_parallel_size,
        spelled,
        batch_size,
    ) -> None:
        """Question-agnostic eviction, worker processes, torch threads, batches,
        ``--no-prefill-reuse`` and the methods the plugin refuses (``probkv.vllm.engine``),
        also as ``spelled`` by the user (a canonical name drops options equal to the
        defaults, such as ``scope=head``, which vLLM cannot run)."""
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

    def check_model(self, config, *, tensor_parallel_size) -> None:
        """A model the plugin cannot run, or whose heads do not divide over the ranks, from
        its ``config.json`` (``probkv.vllm.engine.check_model``), or that a kvzap method has no
        shipped scorer for (its config's identity) or whose KV heads do not split over the
        ranks."""
        from probkv.vllm.engine import check_methods, check_model, scorer_methods  # pure

        path, ranks = str(resolve_model(config.model).path), tensor_parallel_size or 1
        check_model(path, ranks)
        methods = scorer_methods([m for m in config.methods if m != FULL], config.ratios)
        if methods:
            model = load_model_config(path)
            check_methods(methods, config.ratios, model=model, tensor_parallel_size=ranks)

    def rows(
        self, config, units, model, tokenizer, limit, *, tensor_parallel_size, **_
    ) -> Iterator[dict[str, Any]]:
        return vllm_rows(config, units, tokenizer, limit, tensor_parallel_size=tensor_parallel_size)


#: The engines ``probkv eval --engine`` takes, by name, in ``--help`` order.
ENGINES: dict[str, Engine] = {engine.NAME: engine for engine in (HfEngine(), VllmEngine())}


def engine_for(config: RunConfig) -> Engine:
    """The engine of ``config.engine`` (a ValueError naming the engines otherwise)."""
    check_choice(config.engine, tuple(ENGINES), "engine")
    return ENGINES[config.engine]


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
    """Refuse (ValueError naming the option) a run its engine cannot do (``Engine.check_run``),
    and an engine that is none of :data:`ENGINES`."""
    engine_for(config).check_run(
        config,
        workers=workers,
        threads=threads,
        reuse_prefill=reuse_prefill,
        tensor_parallel_size=tensor_parallel_size,
        spelled=spelled,
        batch_size=batch_size,
    )


def check_engine_model(config: RunConfig, *, tensor_parallel_size: int | None = None) -> None:
    """Refuse a model its engine cannot run (``Engine.check_model``)."""
    engine_for(config).check_model(config, tensor_parallel_size=tensor_parallel_size)


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
    from probkv.eval.job import JobSettings, common_fields, job_prompt_ids, job_row
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
