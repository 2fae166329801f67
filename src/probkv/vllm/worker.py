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

from probkv.vllm import options as opts
from probkv.vllm.paged import LAYER_INDEX, read_cache
from probkv.vllm.requests import (
    RequestEviction,
    decode_attention,
    tensor_parallel_policy,
    visible_positions,
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

    def finish(self, req_ids) -> None:
        for req_id in req_ids:
            self.requests.pop(req_id, None)
            self.pending.pop(req_id, None)

    def attend(self, *, layer, query, caches, layout, metadata, output, scale) -> None:
        """One layer's step: observe prefill chunks of evicting requests, recompute the rows of
        evicted ones over their kept positions (``query [T, Hq, d]``, ``output [T, Hq, d]``)."""
        if not self.requests:
            return
        req_ids = self.runner.input_batch.req_ids
        starts = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        table = metadata.block_table
        key_cache, value_cache = caches
        for row, req_id in enumerate(req_ids[: len(seq_lens)]):
            request = self.requests.get(req_id)
            if request is None:
                continue
            lo, hi, n = starts[row], starts[row + 1], seq_lens[row]
            if request.kept is None:
                if n > request.prompt_length:
                    raise RuntimeError(
                        f"probkv: request {req_id} decodes before its prompt was observed"
                    )
                positions = torch.arange(n, dtype=torch.int64)
                logw = None
            else:
                positions, logw = visible_positions(request.kept, n)
            rows = query[lo:hi]
            if logw is None and not request.needs_entries(n):
                request.add_chunk(layer, rows.transpose(0, 1).float(), None, None, t=n)
                continue  # an early chunk: only its last query rows are kept
            blocks = table[row, positions // self.block_size].to(torch.int64)
            offsets = positions % self.block_size
            keys = read_cache(key_cache, layout[0], blocks, offsets)  # [n', Hkv, d]
            values = read_cache(value_cache, layout[1], blocks, offsets)
            if logw is None:
                request.add_chunk(
                    layer,
                    rows.transpose(0, 1).float(),
                    keys.transpose(0, 1).float(),
                    values.transpose(0, 1).float(),
                )
            else:
                out = decode_attention(rows, keys, values, logw, scale=scale)
                output[lo:hi] = out.to(output.dtype)

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
            from vllm.config import get_layers_from_vllm_config
            from vllm.model_executor.layers.attention import Attention

            layers = get_layers_from_vllm_config(self.vllm_config, Attention)
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
