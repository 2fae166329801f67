"""The scheduler of an evicting engine: frees what the workers evicted.

``ProbKVScheduler`` is vLLM's scheduler (set as ``scheduler_cls`` by ``probkv.vllm.plugin``).
When a step's output says which logical blocks of a request were evicted
(``probkv.vllm.worker.OUTPUT_FIELD``), it frees them the way vLLM's sliding-window manager
frees blocks that left the window: the request's block list gets the null block there and the
pool gets the block back. A request preempted after its eviction is refused by name: vLLM would
recompute it from the full prompt, which the kept set no longer describes. With a ``report``
file (``additional_config['probkv']['report']``) each eviction appends one JSON row.
"""

from __future__ import annotations

import json

from vllm.v1.core.sched.scheduler import Scheduler

from probkv.vllm import options as opts
from probkv.vllm.worker import OUTPUT_FIELD


class ProbKVScheduler(Scheduler):
    """vLLM's scheduler that frees evicted blocks (module docstring)."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self.probkv = opts.check_engine(vllm_config)
        self.probkv_evicted: dict[str, dict] = {}  # req_id -> what its eviction freed

    def update_from_output(self, scheduler_output, model_runner_output):
        evicted = getattr(model_runner_output, OUTPUT_FIELD, None) or {}
        for req_id, info in evicted.items():
            self._free_evicted(req_id, info)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _free_evicted(self, req_id: str, info: dict) -> None:
        managers = self.kv_cache_manager.coordinator.single_type_managers
        freed = 0
        for manager in managers:
            blocks = manager.req_to_blocks.get(req_id)
            if blocks is None:
                continue
            gone = []
            for i in info["freed"]:
                if i < len(blocks) and not blocks[i].is_null:
                    gone.append(blocks[i])
                    blocks[i] = manager._null_block
            manager.block_pool.free_blocks(gone)
            freed += len(gone)
        row = {"request_id": req_id, "freed_blocks": freed, "block_size": self.block_size, **info}
        row.pop("freed")
        self.probkv_evicted[req_id] = row
        if self.probkv is not None and self.probkv.report:
            with open(self.probkv.report, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    def _preempt_request(self, request, *args, **kwargs):
        if request.request_id in self.probkv_evicted:
            raise RuntimeError(
                f"probkv: request {request.request_id} was preempted after its eviction (the KV "
                "cache ran out); vLLM would recompute it from the whole prompt, which its kept "
                "set no longer describes. Give the engine more KV memory "
                "(kv_cache_memory_bytes) or fewer concurrent sequences (max_num_seqs)"
            )
        return super()._preempt_request(request, *args, **kwargs)

    def _free_request(self, request, *args, **kwargs):
        self.probkv_evicted.pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)
