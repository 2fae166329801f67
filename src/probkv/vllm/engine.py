"""Batches of evaluation requests through one evicting vLLM engine (``probkv eval --engine vllm``).

:class:`VllmRunner` starts ONE ``vllm.LLM`` for a whole run, with probkv's option
(``engine_options("full", 0)``: no eviction unless a request asks) and a report file, and runs
each batch of :class:`Request` (token ids, method, ratio, new tokens) through one
``llm.generate`` call, every request with its own method and ratio
(``SamplingParams(temperature=0, extra_args=request_options(method, ratio))``). What the
scheduler freed per request comes back from the report file
(``probkv.vllm.scheduler``) as :class:`Result`: KV bytes the block pool got back, the blocks
the request still holds, the fraction of prompt positions evicted.

vLLM evicts after the prefill of the whole prompt (question-aware only), and the first output
token is sampled from that prefill, before eviction. Times come from vLLM's per-request
timestamps (``RequestOutput.metrics``): ``prefill_s`` from being scheduled to the first token,
``decode_s`` from the first token to the last; the requests of a batch run concurrently, so
these are times under batching, not of one request alone.

:meth:`VllmRunner.forced` reads a forced continuation's log-likelihood (``probkv long-decode
--engine vllm``): each job's tokens are forced by ``probkv.vllm.forcing`` (an engine made with
``forcing=True``), its log-probabilities are vLLM's raw ones, and its method runs under a decode
budget (``max_entries``, ``every``; ``probkv.vllm.budget``) as it would while sampling.

This module imports vLLM only when a :class:`VllmRunner` is made, so that the checks
(:func:`check_methods`) run in any environment and before any engine starts.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from probkv.vllm.options import (
    KVZAP,
    EngineEviction,
    check_budget,
    model_problems,
    policy_for,
    request_options,
)
from probkv.vllm.weights import padded_head_size

#: Positions per KV block of the engines probkv eval starts (the CPU backend needs a multiple
#: of 32; the plugin's selections are in whole blocks).
BLOCK_SIZE = 32
#: Default KV memory when no cap is given: room for this many whole requests at once.
DEFAULT_CONCURRENT = 8


def check_methods(
    methods: Sequence[str],
    ratios: Sequence[float],
    *,
    model: object | None = None,
    tensor_parallel_size: int = 1,
) -> None:
    """Refuse, by name and before any engine starts, a method the plugin cannot run at any of
    ``ratios`` (per-head or per-layer scopes, reconstruction scores, calibrated weights,
    budgets the model-wide block selection cannot take; given the ``model``'s config, kvzap
    for a model no scorer is shipped for, or whose KV heads do not split over the ranks):
    ValueError."""
    for method in methods:
        for ratio in ratios:
            try:
                policy_for(method, ratio, BLOCK_SIZE, model, tensor_parallel_size)
            except ValueError as err:
                raise ValueError(f"--engine vllm: {err}") from None


def check_budget_methods(
    methods: Sequence[str], max_entries: int, every: int, tensor_parallel_size: int = 1
) -> None:
    """Refuse, by name and before any engine starts, a method the plugin cannot hold to a
    decode budget of ``max_entries`` positions with a stage every ``every`` tokens
    (``probkv.vllm.options.check_budget``: prob: methods, column-sum and fixed scores, a
    budget under one block): ValueError."""
    for method in methods:
        chosen = EngineEviction(method, 0.0, max_entries=max_entries, every=every)
        try:
            check_budget(chosen, BLOCK_SIZE, None, tensor_parallel_size)
        except ValueError as err:
            raise ValueError(f"--engine vllm: {err}") from None


def scorer_methods(methods: Sequence[str], ratios: Sequence[float]) -> list[str]:
    """The ``methods`` whose policy needs the model's kvzap scorer (checked by
    :func:`check_methods` with the model's config once it is known)."""
    return [
        m
        for m in methods
        if any(getattr(policy_for(m, r, BLOCK_SIZE), "score", None) == KVZAP for r in ratios)
    ]


def check_model(model_path: str, tensor_parallel_size: int = 1) -> None:
    """Refuse, from the folder's ``config.json`` and before any engine starts, a model the
    plugin cannot evict in (its architecture, sliding-window attention) or whose attention
    and KV heads do not divide over ``tensor_parallel_size`` ranks: ValueError naming it."""
    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config", config)
    problems = list(model_problems(SimpleNamespace(**config)))  # the plugin's own checks
    if problems:
        raise ValueError(f"--engine vllm: {model_path}: " + "; ".join(problems))
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    if heads % tensor_parallel_size:
        raise ValueError(
            f"--tensor-parallel-size {tensor_parallel_size}: the model's {heads} attention "
            f"heads ({kv_heads} KV heads) do not divide over {tensor_parallel_size} ranks; "
            f"choose a divisor of {heads}"
        )


@dataclass(frozen=True)
class Request:
    """One evaluation job: the prompt's token ids, its method and ratio, its new tokens."""

    prompt_ids: tuple[int, ...]
    method: str
    ratio: float
    max_tokens: int


@dataclass(frozen=True)
class Result:
    """What one request generated and what its eviction freed (module docstring)."""

    token_ids: tuple[int, ...]
    prefill_s: float
    decode_s: float
    effective_ratio: float  # fraction of the prompt's positions evicted
    cache_bytes: int  # bytes of the blocks the request holds after eviction (its prompt)
    freed_bytes: int  # bytes the block pool got back (freed blocks x block size x per position)
    freed_blocks: int
    prompt_blocks: int


@dataclass(frozen=True)
class ForcedJob:
    """A forced continuation: ``continuation`` generated after ``prompt_ids`` under ``method``
    held to ``max_entries`` positions, a stage every ``every`` tokens (None: no budget; a
    ``full`` method keeps everything)."""

    prompt_ids: tuple[int, ...]
    continuation: tuple[int, ...]
    method: str
    max_entries: int | None = None
    every: int | None = None


@dataclass(frozen=True)
class Forced:
    """A forced run: the mean negative log-likelihood of the continuation (the first token's
    from the prompt's prefill, the others from decode steps), each token's log-probability,
    the request's ``peak_positions`` and stage count from the report (None without a budget)
    and its decode time."""

    nll: float
    logprobs: tuple[float, ...]
    peak_positions: int | None
    stages: int | None
    decode_s: float


#: vLLM's CPU thread binding; its default (``auto``) fails when ranks outnumber the cores.
THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def bind_threads(tensor_parallel_size: int, cores: int | None = None) -> str | None:
    """With more tensor-parallel ranks than cores, vLLM's default thread binding fails an
    assertion: unless the user set ``VLLM_CPU_OMP_THREADS_BIND``, bind rank i to core
    ``i mod cores`` (``0|1|0`` for 3 ranks on 2 cores), say so on stderr, and return the value
    set (None: nothing set)."""
    cores = cores or os.cpu_count() or 1
    if tensor_parallel_size <= cores or os.environ.get(THREADS_BIND):
        return None
    value = "|".join(str(rank % cores) for rank in range(tensor_parallel_size))
    os.environ[THREADS_BIND] = value
    print(
        f"[probkv] {tensor_parallel_size} tensor-parallel ranks on {cores} cores: "
        f"{THREADS_BIND}={value} (vLLM's default binding fails with more ranks than cores; "
        "set it yourself to choose)",
        file=sys.stderr,
    )
    return value


class VllmRunner:
    """One evicting vLLM engine for a whole evaluation (module docstring).

    ``max_model_len``: the longest prompt plus its new tokens; ``kv_cache_bytes``: the KV
    memory (default: :data:`DEFAULT_CONCURRENT` requests of ``max_model_len``); at most as
    many requests run at once as fit whole in it (``max_num_seqs``), so no request is ever
    preempted (a preempted request is recomputed: the same tokens, more time). With more
    tensor-parallel ranks than cores, threads are bound by :func:`bind_threads`.
    ``prefix_caching``: vLLM's ``enable_prefix_caching`` (None: vLLM's default, on); a
    benchmark timing the same prompts run after run turns it off."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        tensor_parallel_size: int = 1,
        max_model_len: int,
        kv_cache_bytes: int | None = None,
        seed: int = 0,
        log_weights: bool = True,
        forcing: bool = False,
        prefix_caching: bool | None = None,
    ) -> None:
        from vllm import LLM

        from probkv.vllm import engine_options, internals

        bind_threads(tensor_parallel_size)

        fd, report = tempfile.mkstemp(prefix="probkv-vllm-", suffix=".jsonl")
        os.close(fd)
        self.report = Path(report)
        blocks = -(-max_model_len // BLOCK_SIZE)
        sizes = internals.cpu_head_sizes() if log_weights else None
        per_request = blocks * BLOCK_SIZE * position_bytes_for(model_path, dtype, sizes)
        if kv_cache_bytes is None:
            kv_cache_bytes = DEFAULT_CONCURRENT * per_request
        concurrent = kv_cache_bytes // per_request
        if concurrent < 1:
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} does not hold one request of "
                f"{max_model_len} positions ({per_request} bytes)"
            )
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=True,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=int(kv_cache_bytes),
            max_num_seqs=int(min(concurrent, 256)),
            disable_log_stats=False,  # per-request timestamps (RequestOutput.metrics)
            seed=seed,
            **({"logits_processors": [_forcing_processor()]} if forcing else {}),
            **({} if prefix_caching is None else {"enable_prefix_caching": prefix_caching}),
            **engine_options(
                "full", 0.0, report=str(self.report), block_size=BLOCK_SIZE,
                log_weights=log_weights,
            ),
        )  # fmt: skip
        config = self.llm.llm_engine.model_config
        self.position_bytes = _position_bytes(config, sizes)

    def run(self, requests: Sequence[Request]) -> list[Result]:
        """Generate every request in one ``llm.generate`` call (greedy); results in order."""
        from vllm import SamplingParams

        done = _read_report(self.report)
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=r.max_tokens,
                extra_args=request_options(r.method, r.ratio),
            )
            for r in requests
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        evicted = {k: v for k, v in _read_report(self.report).items() if k not in done}
        return [self._result(r, out, evicted) for r, out in zip(requests, outputs, strict=True)]

    def forced(self, jobs: Sequence[ForcedJob]) -> list[Forced]:
        """Every job in one ``llm.generate`` call, its tokens forced (module docstring; the
        engine needs ``forcing=True``); results in order."""
        from vllm import SamplingParams

        from probkv.vllm.forcing import FORCED_KEY

        done = _read_report(self.report)
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=len(job.continuation),
                logprobs=0,
                ignore_eos=True,
                extra_args={**_job_options(job), FORCED_KEY: list(job.continuation)},
            )
            for job in jobs
        ]
        prompts = [{"prompt_token_ids": list(job.prompt_ids)} for job in jobs]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        evicted = _read_report(self.report)
        results = []
        for job, output in zip(jobs, outputs, strict=True):
            out = output.outputs[0]
            if tuple(out.token_ids) != tuple(job.continuation):
                raise RuntimeError(
                    f"probkv: request {output.request_id} did not generate its forced tokens "
                    "(was the engine made with forcing=True?)"
                )
            logprobs = tuple(
                float(step[token].logprob) for step, token in zip(out.logprobs, out.token_ids)
            )
            row = _find({k: v for k, v in evicted.items() if k not in done}, output.request_id)
            stats = output.metrics
            decode = float("nan")
            if stats is not None and stats.first_token_ts:
                decode = stats.last_token_ts - stats.first_token_ts
            results.append(
                Forced(
                    nll=-sum(logprobs) / len(logprobs),
                    logprobs=logprobs,
                    peak_positions=None if row is None else row.get("peak_positions"),
                    stages=None if row is None else row.get("stages"),
                    decode_s=decode,
                )
            )
        return results

    def _result(self, request: Request, output, evicted: dict[str, dict]) -> Result:
        t = len(request.prompt_ids)
        blocks = -(-t // BLOCK_SIZE)
        row = _find(evicted, output.request_id)
        if policy_for(request.method, request.ratio, BLOCK_SIZE) is not None and row is None:
            raise RuntimeError(
                f"probkv: request {output.request_id} ({request.method}, r={request.ratio}) "
                "finished without an eviction report"
            )
        freed = row["freed_blocks"] if row else 0
        kept = row["kept_positions"] if row else t
        stats = output.metrics
        prefill = decode = float("nan")
        if stats is not None and stats.first_token_ts:
            prefill = stats.first_token_ts - stats.scheduled_ts
            decode = stats.last_token_ts - stats.first_token_ts
        block_bytes = BLOCK_SIZE * self.position_bytes
        return Result(
            token_ids=tuple(output.outputs[0].token_ids),
            prefill_s=prefill,
            decode_s=decode,
            effective_ratio=1.0 - kept / t,
            cache_bytes=(blocks - freed) * block_bytes,
            freed_bytes=freed * block_bytes,
            freed_blocks=freed,
            prompt_blocks=blocks,
        )

    def close(self) -> None:
        """Stop the engine (its processes, with tensor parallelism) and remove the report."""
        engine = getattr(self.llm, "llm_engine", None)
        shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.report.unlink(missing_ok=True)


def _find(evicted: dict[str, dict], request_id: str) -> dict | None:
    """The report row of ``request_id``: the engine core may add a suffix to the id."""
    if request_id in evicted:
        return evicted[request_id]
    matches = [v for k, v in evicted.items() if k.startswith(request_id + "-")]
    return matches[0] if len(matches) == 1 else None


def _read_report(path: Path) -> dict[str, dict]:
    """The report's last row per request (a budgeted request's final one carries its
    ``peak_positions``)."""
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    return {r["request_id"]: r for r in rows}


def long_decode_rows(
    runner: VllmRunner,
    ids: Sequence[int],
    *,
    prompt_tokens: int,
    tokens: int,
    budgets: Sequence[int],
    every: int,
    methods: Sequence[str],
) -> list[dict]:
    """``probkv long-decode --engine vllm``: the first ``prompt_tokens`` of ``ids`` as the
    prompt, the next ``tokens`` forced (``VllmRunner.forced``) with the full cache and under
    each budget with each method (every job in one ``generate`` call), one row each with the
    transformers engine's fields where they mean the same (``nll``, ``nll_full``,
    ``nll_gap``, ``stages``) and ``peak_positions`` (the most positions the request held from
    its prompt's eviction on, vLLM's report) instead of the peak entries per head."""
    need = prompt_tokens + tokens
    if len(ids) < need:
        raise ValueError(f"ids has {len(ids)} tokens, fewer than prompt_tokens + tokens = {need}")
    prompt, continuation = tuple(ids[:prompt_tokens]), tuple(ids[prompt_tokens:need])
    jobs = [ForcedJob(prompt, continuation, "full")] + [
        ForcedJob(prompt, continuation, m, b, every)
        for b in budgets
        for m in methods
        if m != "full"
    ]
    results = runner.forced(jobs)
    full = results[0].nll
    rows = []
    for job, result in zip(jobs, results, strict=True):
        rows.append(
            {
                "engine": "vllm",
                "method": job.method,
                "seed": None,
                "prompt_tokens": prompt_tokens,
                "tokens": tokens,
                "budget": job.max_entries,
                "every": job.every,
                "nll": result.nll,
                "nll_full": full,
                "nll_gap": result.nll - full,
                "peak_positions": result.peak_positions,
                "stages": result.stages,
                "decode_s": result.decode_s,
            }
        )
    return rows


def _job_options(job: ForcedJob) -> dict:
    """A forced job's probkv keys: its method under its budget (the ratio is the budget's)."""
    return request_options(
        job.method, 0.0 if job.max_entries is None else 0.5,
        max_entries=job.max_entries, every=job.every,
    )  # fmt: skip


def _forcing_processor():
    from probkv.vllm.forcing import ForcedTokens

    return ForcedTokens


def _position_bytes(model_config, sizes=None) -> int:
    """KV bytes of one position in every layer and KV head (keys and values), with the spare
    key columns of an engine that holds log-weights (``sizes``: the kernel's head sizes;
    ``probkv.vllm.weights``)."""
    hf = model_config.hf_text_config
    layers = hf.num_hidden_layers
    heads, head_dim = model_config.get_total_num_kv_heads(), model_config.get_head_size()
    head_dim = head_dim if sizes is None else padded_head_size(head_dim, sizes)
    return 2 * layers * heads * head_dim * model_config.dtype.itemsize


def position_bytes_for(model_path: str, dtype: str, sizes=None) -> int:
    """KV bytes per position of the model in ``model_path`` at ``dtype`` (head size padded to
    one of the CPU kernel's ``sizes`` where given), from its config.json, before any engine
    exists (``_position_bytes`` reads the engine's own config)."""
    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    itemsize = 2 if dtype in ("bfloat16", "float16") else 4
    head_dim = head_dim if sizes is None else padded_head_size(head_dim, sizes)
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * itemsize
