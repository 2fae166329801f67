"""The scheduler of an evicting engine: frees what the workers evicted, survives preemption,
shares prefixes.

``ProbKVScheduler`` is vLLM's scheduler (set as ``scheduler_cls`` by ``probkv.vllm.plugin``).
When a step's output says which logical blocks of a request were evicted
(``probkv.vllm.worker.OUTPUT_FIELD``), it frees them the way vLLM's sliding-window manager
frees blocks that left the window: the request's block list gets the null block there and the
pool gets the block back (``probkv.vllm.internals.free_logical_blocks``).

- **Preemption** (S12): vLLM recomputes a preempted request from its first token. Its workers
  keep the kept set (a function of the prompt's observation and the request's seed), read the
  recomputed prompt in full and the generated tokens over the kept set
  (``probkv.vllm.compaction``); once the recomputation has passed the prompt, the scheduler
  frees the same logical blocks again.
- **Prefix caching**: a request's eviction only drops its own reference to a block, so blocks
  another request or the prefix cache holds stay. A ``prob:`` request shares no block at all
  (its kept keys hold its own log-weights). Blocks filled after an eviction never enter
  the prefix cache (their keys and values attended the kept set), and a request about to be
  observed takes at most the prefix its observation does not need from the cache (the score's
  last query rows, or none for scores built on every row's attention).

- **Decode budgets** (``probkv.vllm.budget``): a request under one evicts again at later
  stages while it runs; each stage's row frees its newly evicted blocks, and the request's row
  keeps the union (what a recomputation frees again once it has passed the last stage), the
  stage count and ``peak_positions``: the most positions it held at the end of a step from its
  prompt's eviction on (before a stage frees; a recomputation after a preemption holds every
  position until it passes the last stage, and is counted).

With a ``report`` file (``additional_config['probkv']['report']``) each eviction appends one
JSON row, and a request under a budget one more when it finishes (its ``peak_positions``).
"""

from __future__ import annotations

import json

from vllm.v1.core.sched.scheduler import Scheduler

from probkv.vllm import internals
from probkv.vllm import options as opts
from probkv.vllm.request_eviction import RequestEviction
from probkv.vllm.worker import OUTPUT_FIELD


class ProbKVScheduler(Scheduler):
    """vLLM's scheduler that frees evicted blocks (module docstring)."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self.probkv = opts.check_engine(vllm_config)
        problems = list(opts.kv_group_problems(self.kv_cache_config)) if self.probkv else []
        if problems:
            raise ValueError("probkv eviction in vLLM: " + "; ".join(problems))
        self.probkv_model = vllm_config.model_config.hf_config
        self.probkv_evicted: dict[str, dict] = {}  # req_id -> what its eviction freed
        self.probkv_recomputing: set[str] = set()  # evicted, preempted, not yet past the prompt
        self.probkv_preemptions = 0  # evicted requests preempted (and recomputed) so far
        if self.cache_config.enable_prefix_caching:
            internals.limit_prefix_hits(self, self._prefix_hit_limit)

    def _prefix_hit_limit(self, request) -> int | None:
        """The most tokens a request may take from the prefix cache (None: any)."""
        if self.probkv is None or request.request_id in self.probkv_evicted:
            return None  # not evicting, or the kept set is known: the prompt needs no observing
        chosen = opts.request_eviction(request.sampling_params.extra_args, self.probkv)
        if opts.frees_nothing(
            request.num_prompt_tokens,
            request.sampling_params.max_tokens,
            self.block_size,
            chosen.max_entries is not None,
        ):
            return None  # not observed (ProbKVWorker.start)
        ratio = chosen.ratio
        if chosen.max_entries is not None:  # a decode budget observes its prompt at stage 1,
            ratio = 0.5  # at the budget's ratio; the rows it reads depend on the score alone
        policy = opts.policy_for(chosen.method, ratio, self.block_size)
        if policy is None:
            return None
        t = request.num_prompt_tokens
        observing = RequestEviction(policy, t, self.block_size, (0,), 1.0)
        return t - observing.rows_observed

    def add_request(self, request) -> None:
        """A ``prob:`` request shares no block through the prefix cache: its kept keys will
        hold its own log-weights (``probkv.vllm.weights``), which no other request may read."""
        if self.probkv is not None and self.probkv.weighted:
            chosen = opts.request_eviction(request.sampling_params.extra_args, self.probkv)
            if opts.weighted(chosen.method, chosen.ratio):
                internals.stop_caching_new_blocks(request, from_start=True)
        super().add_request(request)

    def update_from_output(self, scheduler_output, model_runner_output):
        evicted = getattr(model_runner_output, OUTPUT_FIELD, None) or {}
        for req_id, row in self.probkv_evicted.items():  # held positions, before this step frees
            request = self.requests.get(req_id)
            if "max_entries" in row and request is not None:
                held = request.num_computed_tokens
                if req_id not in self.probkv_recomputing:
                    held -= len(row["freed"]) * self.block_size
                row["peak_positions"] = max(row.get("peak_positions", 0), held)
        for req_id, info in evicted.items():
            self._free_evicted(req_id, info)
        for req_id in list(self.probkv_recomputing):
            request = self.requests.get(req_id)
            row = self.probkv_evicted.get(req_id, {})
            if request is None:
                self.probkv_recomputing.discard(req_id)
            elif request.num_computed_tokens >= row.get("stage_length", request.num_prompt_tokens):
                row = self.probkv_evicted[req_id]
                internals.free_logical_blocks(self, req_id, row["freed"])
                self.probkv_recomputing.discard(req_id)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _free_evicted(self, req_id: str, info: dict) -> None:
        freed = internals.free_logical_blocks(self, req_id, info["freed"])
        request = self.requests.get(req_id)
        if request is not None:
            internals.stop_caching_new_blocks(request)
        row = {"request_id": req_id, "freed_blocks": freed, "block_size": self.block_size, **info}
        earlier = self.probkv_evicted.get(req_id)
        if earlier is not None and "max_entries" in info:  # a later stage of a decode budget
            held = earlier.get("peak_positions", 0)
            row = {**earlier, **info, "freed_blocks": earlier["freed_blocks"] + freed}
            row["freed"] = sorted(set(earlier["freed"]) | set(info["freed"]))
            row["peak_positions"] = held
        elif "max_entries" in info and request is not None:
            row["peak_positions"] = (
                request.num_computed_tokens - len(info["freed"]) * self.block_size
            )
        self.probkv_evicted[req_id] = row
        self._report(row)

    def _report(self, row: dict) -> None:
        if self.probkv is not None and self.probkv.report:
            report = {k: v for k, v in row.items() if k != "freed"}
            with open(self.probkv.report, "a", encoding="utf-8") as f:
                f.write(json.dumps(report) + "\n")

    def _preempt_request(self, request, *args, **kwargs):
        if request.request_id in self.probkv_evicted:
            self.probkv_recomputing.add(request.request_id)  # freed again once past the prompt
            self.probkv_preemptions += 1
        return super()._preempt_request(request, *args, **kwargs)

    def _free_request(self, request, *args, **kwargs):
        row = self.probkv_evicted.pop(request.request_id, None)
        if row is not None and "max_entries" in row:  # its peak, now final
            self._report({**row, "finished": True})
        self.probkv_recomputing.discard(request.request_id)
        return super()._free_request(request, *args, **kwargs)
