"""The vLLM worker of an evicting engine: each request's eviction state, in every TP rank.

``ProbKVWorker`` is vLLM's ``CPUWorker`` with ``EvictingWorker``'s hooks (set as ``worker_cls``
by ``probkv.vllm.plugin`` when the engine has probkv's option; ``probkv.vllm.gpu_worker`` mixes
the same hooks into vLLM's GPU worker). Before each step it starts the eviction state of new requests
(``probkv.vllm.request_eviction.RequestEviction``, the engine's method or the request's own
``extra_args``) and drops finished ones; during the forward the attention backend
(``probkv.vllm.backend``) calls ``WorkerEviction.attend`` per layer; after the forward every
request whose prompt was read by every layer selects its kept blocks (the same selection on
every rank: the heads' observations are gathered over the TP group first), and the step's
output carries, per request, the logical blocks the scheduler frees
(``ModelRunnerOutput.probkv_evicted``, read by ``probkv.vllm.scheduler``).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
from vllm.distributed import get_tp_group
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.v1.worker.cpu_worker import CPUWorker

from probkv.vllm import budget, compaction, internals
from probkv.vllm import options as opts
from probkv.vllm.paged import layer_index, read_cache
from probkv.vllm.request_eviction import RequestEviction, tensor_parallel_policy
from probkv.vllm.weights import padded_head_size

OUTPUT_FIELD = "probkv_evicted"  # req_id -> {"freed": [...], ...} on a ModelRunnerOutput
FLEX_BACKEND = "probkv.vllm.flex_backend.ProbKVFlexBackend"
_ACTIVE: WorkerEviction | None = None


def active() -> WorkerEviction | None:
    """The eviction state of the worker whose call runs now in this process (None: none, or
    its engine does not evict): what the attention backends read (``activated``)."""
    return _ACTIVE


@contextlib.contextmanager
def activated(state: WorkerEviction | None):
    """``state`` is ``active()`` while one worker call runs, and what was before it after.
    A process may hold several engines (vLLM's in-process engine core: an offline script's
    two ``LLM`` objects, the tests' engines), each with its own worker: a backend must read
    the state of the worker whose step it runs, never the last one built (a stale step's plans
    then compact another engine's rows: "3 plans for 1 rows"), and a plain engine's none."""
    global _ACTIVE
    before, _ACTIVE = _ACTIVE, state
    try:
        yield state
    finally:
        _ACTIVE = before


@dataclass(frozen=True)
class StepNotes:
    """What every evicting layer of a step needs from probkv
    (``WorkerEviction.compact_metadata``), one per KV cache group (each has its own block ids).

    ``work``: the prefill chunks of requests being observed, ``(row, request, lo, hi, n)``;
    ``table``: the group's true (not compacted) block table for the step; ``writes``: the
    log-weights to store in the spare key columns at this step, before the kernel reads them
    (physical blocks, offsets, log-weights, ``[n]`` each; None: none); ``unweighted_rows``:
    the query rows that must not add the log-weights (prompt rows of a ``prob:`` request
    computed again after a preemption; None: none)."""

    work: list
    table: torch.Tensor | None = None
    writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    unweighted_rows: torch.Tensor | None = None


@dataclass(frozen=True)
class StepRequests:
    """A step's evicting requests, found once for every KV cache group's metadata: the
    request ids of the batch's rows, each row's eviction state and compaction plan, the
    prefill work, the kept sets whose log-weights are due (``(row, KeptPrefix)``) and the
    unweighted query rows."""

    req_ids: list
    plans: list
    work: list
    writes: list
    unweighted: torch.Tensor | None


NO_NOTES = StepNotes([])


def register_attention_backend(backend: str | None = None) -> None:
    """vLLM's ``CPU_ATTN`` (``backend`` None or ``"CPU_ATTN"``) or ``FLEX_ATTENTION`` becomes
    probkv's subclass in this process (idempotent)."""
    if backend == internals.FLEX:
        register_backend(AttentionBackendEnum.FLEX_ATTENTION, FLEX_BACKEND)
        return
    register_backend(AttentionBackendEnum.CPU_ATTN, "probkv.vllm.backend.ProbKVCPUBackend")


class WorkerEviction:
    """Every evicting request of this worker (module docstring)."""

    def __init__(
        self,
        engine: opts.EngineEviction,
        block_size: int,
        runner,
        model: object | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        self.engine = engine
        self.block_size = block_size
        self.runner = runner
        self.model = model  # vLLM's hf_config: kvzap's scorer is found from it
        self.tensor_parallel_size = tensor_parallel_size
        self.requests: dict[str, RequestEviction] = {}
        self.pending: dict[str, dict] = {}
        self.stages: dict[str, budget.RequestStages] = {}  # requests under a decode budget
        self.layers: tuple[int, ...] | None = None
        self.scale: float | None = None
        self.notes: dict[int, StepNotes] = {}  # evicting layer -> its group's notes this step
        self._step: StepRequests | None = None  # the step's requests, once for every group
        self.backend: str | None = None  # the attention backend vLLM runs (its name)
        self._index_key: tuple | None = None
        self._index: torch.Tensor | None = None

    def start(self, req_id: str, prompt_length: int, sampling_params) -> None:
        """A new request: its policy from its ``extra_args`` or the engine's option."""
        chosen = opts.request_eviction(getattr(sampling_params, "extra_args", None), self.engine)
        method, ratio = chosen.method, chosen.ratio
        limit = budget.request_budget(chosen, self.block_size)
        max_tokens = getattr(sampling_params, "max_tokens", None)
        if opts.frees_nothing(prompt_length, max_tokens, self.block_size, limit is not None):
            return  # not observed: its eviction would change nothing
        if limit is not None:  # stage 1: the prompt evicted down to B (probkv.vllm.budget)
            ratio = limit.prompt_ratio(prompt_length)
        policy = opts.policy_for(
            method, ratio, self.block_size, self.model, self.tensor_parallel_size
        )
        if policy is None or self.layers is None:
            return
        group = get_tp_group()
        policy = tensor_parallel_policy(
            policy, group.rank_in_group, group.world_size, group.all_reduce
        )
        self.requests[req_id] = RequestEviction(
            policy, prompt_length, self.block_size, self.layers, self.scale
        )
        stages = budget.start(chosen, self.requests[req_id], self.block_size)
        if stages is not None:
            self.stages[req_id] = stages

    def restart(self, req_id: str) -> None:
        """A request vLLM resumed after a preemption (``RequestEviction.restart``)."""
        request = self.requests.get(req_id)
        if request is not None:
            request.restart()
        if req_id in self.stages:
            self.stages[req_id].restart()

    def finish(self, req_ids) -> None:
        for req_id in req_ids:
            self.requests.pop(req_id, None)
            self.pending.pop(req_id, None)
            self.stages.pop(req_id, None)

    def new_step(self) -> None:
        """A step starts (``execute_model``): its requests are read again from the metadata."""
        self._step = None
        self.notes = {}

    def notes_for(self, layer: int) -> StepNotes:
        """The step's notes of the evicting ``layer`` (NO_NOTES for a sliding-window layer,
        which probkv leaves to vLLM, or a step without evicting requests)."""
        return self.notes.get(layer, NO_NOTES)

    def compact_metadata(self, common, layer_names=None):
        """The step's attention metadata of one KV cache group (vLLM's
        ``CommonAttentionMetadata``, once per group and step, before the forward; the group's
        ``layer_names``, None: every layer) with every evicted request reading only its kept
        blocks (``probkv.vllm.compaction``) where the group's layers are evicting ones
        (full attention: a sliding-window group's metadata is returned as it is); also notes
        for those layers which rows need probkv: prefill chunks of requests being observed,
        and the rows after the prompt of ``prob:`` requests."""
        layers = self.layers or ()
        if layer_names is not None:
            layers = [i for i in map(layer_index, layer_names) if i in layers]
        if not layers:
            return common
        if self._step is None:
            self._step = self._step_requests(common)
        step, table = self._step, common.block_table_tensor
        writes = [
            (table[row, kept.positions // self.block_size].to(torch.int64),
             kept.positions % self.block_size, kept.log_weights)
            for row, kept in step.writes
        ]  # fmt: skip
        notes = StepNotes(
            step.work,
            table,
            tuple(torch.cat(parts) for parts in zip(*writes)) if writes else None,
            step.unweighted,
        )
        self.notes.update(dict.fromkeys(layers, notes))
        if not any(step.plans):
            return common
        width = table.shape[1]
        key = (tuple(step.req_ids), tuple(id(p) for p in step.plans), width)
        if self._index_key != key:
            self._index_key, self._index = key, compaction.block_indices(step.plans, width)
        out = compaction.compact(
            common.query_start_loc_cpu, common.seq_lens, table, step.plans, self._index
        )
        return internals.replace_metadata(
            common,
            query_start_loc=out.query_start_loc,
            query_start_loc_cpu=out.query_start_loc,
            seq_lens=out.seq_lens,
            block_table_tensor=out.block_table,
            num_reqs=out.num_seqs,
            max_query_len=out.max_query_len,
            max_seq_len=out.max_seq_len,
        )

    def _step_requests(self, common) -> StepRequests:
        """The step's evicting requests (``StepRequests``), from its first group's metadata:
        what does not depend on a group's block ids."""
        rows = common.num_reqs
        req_ids = internals.batch_request_ids(self.runner)[:rows]
        requests = [self.requests.get(r) for r in req_ids]
        plans = [None if q is None or q.kept is None else q.kept.plan for q in requests]
        starts = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens.tolist()
        work, writes, unweighted = [], [], []
        for row, request in enumerate(requests):
            if request is None:
                continue
            lo, hi, n = starts[row], starts[row + 1], seq_lens[row]
            kept = request.kept
            if kept is None:
                if n > request.prompt_length:
                    raise RuntimeError(
                        f"probkv: request {req_ids[row]} decodes before its prompt was observed"
                    )
                work.append((row, request, lo, hi, n))
            elif kept.weighted:
                prompt_rows = min(hi, hi - (n - kept.prompt_length)) - lo
                if prompt_rows > 0:  # the prompt computed again after a preemption
                    unweighted.append(torch.arange(lo, lo + prompt_rows, dtype=torch.int64))
                if request.weights_due and n >= kept.prompt_length:
                    writes.append((row, kept))
                    request.weights_due = False
        if self.stages:  # requests under a decode budget: window rows, due stages
            work += budget.step_work(self.stages, req_ids, requests, starts, seq_lens)
        return StepRequests(
            req_ids, plans, work, writes, torch.cat(unweighted) if unweighted else None
        )

    def attend(self, *, layer, query, caches, layout, output, scale) -> None:
        """One layer's step, after vLLM's kernel: observe the prefill chunks of evicting
        requests (``query [T, Hq, d]``; the caches may be wider than ``d``: spare columns).
        Decoding requests need nothing here: vLLM's kernel read their compacted sequence, with
        the log-weights of ``prob:`` requests in the keys' spare columns."""
        d = query.shape[-1]
        key_cache, value_cache = caches
        notes = self.notes_for(layer)
        for row, request, lo, hi, n in notes.work:
            rows = query[lo:hi]
            if isinstance(request, budget.RequestStages):  # a decode budget's work
                request.attend(layer, rows, caches, layout, notes.table[row], n)
                continue
            if not request.needs_entries(n):
                request.add_chunk(layer, rows.transpose(0, 1).float(), None, None, t=n)
                continue  # an early chunk: only its last query rows are kept
            positions = torch.arange(n, dtype=torch.int64)
            blocks = notes.table[row, positions // self.block_size].to(torch.int64)
            offsets = positions % self.block_size
            keys = read_cache(key_cache, layout[0], blocks, offsets)[..., :d]  # [n, Hkv, d]
            values = read_cache(value_cache, layout[1], blocks, offsets)[..., :d]
            request.add_chunk(
                layer,
                rows.transpose(0, 1).float(),
                keys.transpose(0, 1).float(),
                values.transpose(0, 1).float(),
            )

    def after_forward(self) -> None:
        """Select the kept blocks of every request whose prompt every layer has read."""
        group = get_tp_group()

        def gather(x: torch.Tensor) -> torch.Tensor:
            return x if group.world_size == 1 else group.all_gather(x.contiguous(), dim=0)

        for req_id, request in self.requests.items():
            if request.kept is None and request.observed:
                kept = request.select(gather)
                self.pending[req_id] = {
                    "freed": list(kept.freed),
                    "kept_positions": int(kept.positions.numel()),
                    "prompt_length": kept.prompt_length,
                    "num_blocks": kept.num_blocks,
                    "method": opts_name(request),
                    "ratio": request.policy.ratio,
                    # what was evicted: above ratio where a threshold set it (S11)
                    "effective_ratio": 1.0 - kept.positions.numel() / kept.prompt_length,
                    "attention_backend": self.backend,  # the one vLLM runs (load_model)
                    "evicted_layers": list(self.layers),  # the global ones (full attention)
                }
        if self.stages:
            budget.after_forward(self.stages, self.requests, self.pending, gather)

    def attach(self, output):
        """The step's output with the blocks to free (``OUTPUT_FIELD``), as a copy: vLLM hands
        shared objects here (``EMPTY_MODEL_RUNNER_OUTPUT``), which must never change. Under
        async scheduling the output is an ``AsyncModelRunnerOutput``: the list is attached to
        what its ``get_output`` returns, where the scheduler reads it."""
        if not self.pending:
            return output
        pending = dict(self.pending)
        if isinstance(output, ModelRunnerOutput):
            self.pending.clear()
            return with_evicted(output, pending)
        if isinstance(output, AsyncModelRunnerOutput):
            self.pending.clear()
            return AsyncEvicted(output, pending)
        return output  # None: the step's output comes later (sample_tokens)


def with_evicted(output: ModelRunnerOutput, evicted: dict) -> ModelRunnerOutput:
    """A shallow copy of ``output`` carrying ``evicted`` (``OUTPUT_FIELD``)."""
    out = copy.copy(output)
    setattr(out, OUTPUT_FIELD, evicted)
    return out


class AsyncEvicted(AsyncModelRunnerOutput):
    """vLLM's async output whose ``get_output`` carries probkv's freed blocks."""

    def __init__(self, inner: AsyncModelRunnerOutput, evicted: dict) -> None:
        self.inner, self.evicted = inner, evicted

    def get_output(self) -> ModelRunnerOutput:
        return with_evicted(self.inner.get_output(), self.evicted)


def opts_name(request: RequestEviction) -> str:
    """The request's method name for the report: its policy's, without tensor parameters
    (kvzap's scorer, which the plugin found from the model, not from the name)."""
    import dataclasses

    from probkv import scores
    from probkv.policies import method_name

    policy = request.policy
    tensors = scores.tensor_param_names(policy.score)
    params = {k: v for k, v in policy.score_params.items() if k not in tensors}
    return method_name(dataclasses.replace(policy, score_params=params))


class EvictingWorker:
    """probkv's eviction hooks on a vLLM worker, written once against what every vLLM worker
    has (``WorkerBase``'s ``get_kv_cache_spec``, ``load_model``, ``execute_model``,
    ``sample_tokens``): mixed into vLLM's CPU worker (``ProbKVWorker``) and its GPU worker
    (``probkv.vllm.gpu_worker``). Only the cache's layout differs by backend, and that is read
    in the attention backends (``backend``, ``flex_backend``)."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        engine = opts.check_engine(vllm_config)
        self._backend = internals.chosen_backend(vllm_config)
        if engine is not None:
            if self._backend == internals.FLEX:  # this process's platform too
                from vllm.platforms import current_platform

                internals.let_flex_through(type(current_platform))
            register_attention_backend(self._backend)
        super().__init__(vllm_config, *args, **kwargs)
        self._probkv = None
        if engine is not None:
            self._probkv = WorkerEviction(
                engine,
                vllm_config.cache_config.block_size,
                None,
                vllm_config.model_config.hf_config,
                vllm_config.parallel_config.tensor_parallel_size,
            )

    def get_kv_cache_spec(self):
        """vLLM's specs, with spare key columns in an engine whose method is a ``prob:`` one
        (``probkv.vllm.weights``)."""
        specs = super().get_kv_cache_spec()
        if self._probkv is None or not self._probkv.engine.weighted:
            return specs
        if self._backend == internals.FLEX:  # log-weights beside the cache (flex_backend)
            return specs
        sizes = internals.cpu_head_sizes()
        return internals.widened_kv_specs(specs, lambda d: padded_head_size(d, sizes))

    @property
    def eviction(self) -> WorkerEviction | None:
        """This worker's eviction state (None: its engine does not evict)."""
        return self._probkv

    # Every call that may run a forward does so with this worker's state active (``activated``)
    def determine_available_memory(self):
        with activated(self._probkv):
            return super().determine_available_memory()

    def initialize_from_config(self, kv_cache_config):
        with activated(self._probkv):
            return super().initialize_from_config(kv_cache_config)

    def compile_or_warm_up_model(self):
        with activated(self._probkv):
            return super().compile_or_warm_up_model()

    def execute_dummy_batch(self):
        with activated(self._probkv):
            return super().execute_dummy_batch()

    def load_model(self, *args, **kwargs):
        with activated(self._probkv):
            result = super().load_model(*args, **kwargs)
        if self._probkv is not None:
            layers = internals.attention_layers(self.vllm_config)
            evicting = internals.global_attention_layers(layers)  # not Gemma-3's local ones
            if not evicting:
                raise RuntimeError("probkv: every attention layer has a sliding window")
            indices = sorted(layer_index(name) for name in evicting)
            scales = {float(layer.impl.scale) for layer in evicting.values()}
            if len(scales) != 1:
                raise RuntimeError(f"probkv: the attention layers use several scales {scales}")
            self._probkv.layers = tuple(indices)
            self._probkv.backend = internals.backend_name(layers)
            self._probkv.scale = scales.pop()
            self._probkv.runner = self.model_runner
        return result

    def execute_model(self, scheduler_output):
        with activated(self._probkv):
            return self._execute_model(scheduler_output)

    def _execute_model(self, scheduler_output):
        state = self._probkv
        if state is not None:
            state.new_step()
            state.finish(scheduler_output.finished_req_ids)
            for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
                state.restart(req_id)  # computed again after a preemption
            for new in scheduler_output.scheduled_new_reqs:
                state.start(new.req_id, len(new.prompt_token_ids or ()), new.sampling_params)
        output = super().execute_model(scheduler_output)
        if state is None:
            return output
        state.after_forward()
        return state.attach(output)

    def sample_tokens(self, grammar_output):
        with activated(self._probkv), internals.no_draws_for_discarded_samples(self.model_runner):
            output = super().sample_tokens(grammar_output)
        return output if self._probkv is None else self._probkv.attach(output)


class ProbKVWorker(EvictingWorker, CPUWorker):
    """vLLM's CPU worker with probkv's eviction state (module docstring)."""
