"""The vLLM worker of an evicting engine: each request's eviction state, in every TP rank.

``ProbKVWorker`` is vLLM's ``CPUWorker`` (set as ``worker_cls`` by ``probkv.vllm.plugin`` when
the engine has probkv's option). Before each step it starts the eviction state of new requests
(``probkv.vllm.requests.RequestEviction``, the engine's method or the request's own
``extra_args``) and drops finished ones; during the forward the attention backend
(``probkv.vllm.backend``) calls ``WorkerEviction.attend`` per layer; after the forward every
request whose prompt was read by every layer selects its kept blocks (the same selection on
every rank: the heads' observations are gathered over the TP group first), and the step's
output carries, per request, the logical blocks the scheduler frees
(``ModelRunnerOutput.probkv_evicted``, read by ``probkv.vllm.scheduler``).
"""

from __future__ import annotations

import torch
from vllm.distributed import get_tp_group
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.cpu_worker import CPUWorker

from probkv.vllm import compaction, internals
from probkv.vllm import options as opts
from probkv.vllm.paged import LAYER_INDEX, read_cache
from probkv.vllm.requests import (
    RequestEviction,
    WeightedBatch,
    tensor_parallel_policy,
    weighted_attention,
)

OUTPUT_FIELD = "probkv_evicted"  # req_id -> {"freed": [...], ...} on a ModelRunnerOutput
_ACTIVE: WorkerEviction | None = None


def active() -> WorkerEviction | None:
    """This process's eviction state (None: the engine does not evict)."""
    return _ACTIVE


def register_attention_backend() -> None:
    """vLLM's ``CPU_ATTN`` becomes probkv's subclass in this process (idempotent)."""
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
        self.layers: tuple[int, ...] | None = None
        self.scale: float | None = None
        self.step: tuple = ([], None, None)  # compact_metadata's notes for this step
        self._index_key: tuple | None = None
        self._index: torch.Tensor | None = None
        self._weighted_key: tuple | None = None
        self._weighted: WeightedBatch | None = None

    def start(self, req_id: str, prompt_length: int, sampling_params) -> None:
        """A new request: its policy from its ``extra_args`` or the engine's option."""
        chosen = opts.request_eviction(getattr(sampling_params, "extra_args", None), self.engine)
        method, ratio = chosen.method, chosen.ratio
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

    def restart(self, req_id: str) -> None:
        """A request vLLM resumed after a preemption (``RequestEviction.restart``)."""
        request = self.requests.get(req_id)
        if request is not None:
            request.restart()

    def finish(self, req_ids) -> None:
        for req_id in req_ids:
            self.requests.pop(req_id, None)
            self.pending.pop(req_id, None)

    def compact_metadata(self, common):
        """The step's attention metadata (vLLM's ``CommonAttentionMetadata``, once per step
        before the forward) with every evicted request reading only its kept blocks
        (``probkv.vllm.compaction``); also notes which rows need probkv at each layer: prefill
        chunks of requests being observed, and the rows after the prompt of ``prob:`` requests."""
        rows = common.num_reqs
        req_ids = internals.batch_request_ids(self.runner)[:rows]
        requests = [self.requests.get(r) for r in req_ids]
        plans = [None if q is None or q.kept is None else q.kept.plan for q in requests]
        starts = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens.tolist()
        work, weighted = [], []
        for row, request in enumerate(requests):
            if request is None:
                continue
            lo, hi, n = starts[row], starts[row + 1], seq_lens[row]
            if request.kept is None:
                if n > request.prompt_length:
                    raise RuntimeError(
                        f"probkv: request {req_ids[row]} decodes before its prompt was observed"
                    )
                work.append((row, request, lo, hi, n))
            elif request.kept.weighted and n > request.prompt_length:
                weighted.append((row, request.kept, max(lo, hi - (n - request.prompt_length)), hi))
        self.step = (work, self._weighted_step(weighted, common), common.block_table_tensor)
        if not any(plans):
            return common
        width = common.block_table_tensor.shape[1]
        key = (tuple(req_ids), tuple(id(p) for p in plans), width)
        if self._index_key != key:
            self._index_key, self._index = key, compaction.block_indices(plans, width)
        out = compaction.compact(
            common.query_start_loc_cpu, common.seq_lens, common.block_table_tensor, plans,
            self._index,
        )  # fmt: skip
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

    def _weighted_step(self, items, common):
        """The step's ``prob:`` rows after their prompts as one batch (``None``: none), what
        every layer reads: the physical block and offset of each visible position (``[R N]``
        each, and ``(R, N)``), the logit bias ``[R, Q, N]``, the query index of each of the last
        ``Q`` rows ``[R, Q]`` and which of them are real ``[R, Q]``."""
        if not items:
            return None
        key = tuple((row, id(kept)) for row, kept, _, _ in items)
        if self._weighted_key != key:
            self._weighted_key = key
            self._weighted = WeightedBatch.of([kept for _, kept, _, _ in items])
        rows = torch.tensor([row for row, *_ in items], dtype=torch.int64)
        first = torch.tensor([lo for _, _, lo, _ in items], dtype=torch.int64)
        end = torch.tensor([hi for *_, hi in items], dtype=torch.int64)
        queries = int((end - first).max())
        positions, bias = self._weighted.step(common.seq_lens.to(torch.int64)[rows], queries)
        index = end[:, None] - queries + torch.arange(queries, dtype=torch.int64)[None, :]
        real = index >= first[:, None]
        table = common.block_table_tensor  # the true (not compacted) table: positions are true
        blocks = table[rows[:, None], positions // self.block_size].to(torch.int64).flatten()
        offsets = (positions % self.block_size).flatten()
        index = torch.where(real, index, end[:, None] - 1)
        return blocks, offsets, positions.shape, bias, index, real

    def attend(self, *, layer, query, caches, layout, output, scale) -> None:
        """One layer's step, after vLLM's kernel: observe prefill chunks of evicting requests;
        recompute, over their kept positions with log-weights, the rows after the prompt of
        ``prob:`` requests (``query [T, Hq, d]``, ``output [T, Hq, d]``). Top-k requests need
        nothing here: vLLM's kernel read their compacted sequence."""
        work, weighted, table = self.step
        key_cache, value_cache = caches
        if weighted is not None:  # every prob: row in one call (S4), no loop over requests
            blocks, offsets, (r, n), bias, index, real = weighted  # the same at every layer
            keys = read_cache(key_cache, layout[0], blocks, offsets)
            values = read_cache(value_cache, layout[1], blocks, offsets)
            out = weighted_attention(
                query[index],
                keys.view(r, n, *keys.shape[1:]),
                values.view(r, n, *values.shape[1:]),
                bias,
                scale=scale,
            )
            output[index[real]] = out[real].to(output.dtype)
        for row, request, lo, hi, n in work:  # prefill chunks being observed
            rows = query[lo:hi]
            if not request.needs_entries(n):
                request.add_chunk(layer, rows.transpose(0, 1).float(), None, None, t=n)
                continue  # an early chunk: only its last query rows are kept
            positions = torch.arange(n, dtype=torch.int64)
            blocks = table[row, positions // self.block_size].to(torch.int64)
            offsets = positions % self.block_size
            keys = read_cache(key_cache, layout[0], blocks, offsets)  # [n, Hkv, d]
            values = read_cache(value_cache, layout[1], blocks, offsets)
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
                }

    def attach(self, output):
        if self.pending and isinstance(output, ModelRunnerOutput):
            setattr(output, OUTPUT_FIELD, dict(self.pending))
            self.pending.clear()
        return output


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


class ProbKVWorker(CPUWorker):
    """vLLM's CPU worker with probkv's eviction state (module docstring)."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        global _ACTIVE
        engine = opts.check_engine(vllm_config)
        if engine is not None:
            register_attention_backend()
        super().__init__(vllm_config, *args, **kwargs)
        if engine is not None:
            _ACTIVE = WorkerEviction(
                engine,
                vllm_config.cache_config.block_size,
                None,
                vllm_config.model_config.hf_config,
                vllm_config.parallel_config.tensor_parallel_size,
            )
        self._probkv = _ACTIVE

    def load_model(self, *args, **kwargs):
        result = super().load_model(*args, **kwargs)
        if self._probkv is not None:
            layers = internals.attention_layers(self.vllm_config)
            indices = sorted(int(LAYER_INDEX.search(name).group(1)) for name in layers)
            scales = {float(layer.impl.scale) for layer in layers.values()}
            if len(scales) != 1:
                raise RuntimeError(f"probkv: the attention layers use several scales {scales}")
            self._probkv.layers = tuple(indices)
            self._probkv.scale = scales.pop()
            self._probkv.runner = self.model_runner
        return result

    def execute_model(self, scheduler_output):
        state = self._probkv
        if state is not None:
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
        output = super().sample_tokens(grammar_output)
        return output if self._probkv is None else self._probkv.attach(output)
