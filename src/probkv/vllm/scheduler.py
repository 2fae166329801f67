"""The scheduler of an evicting engine: frees what the workers evicted, survives preemption,
shares prefixes.

``ProbKVScheduler`` is vLLM's scheduler (set as ``scheduler_cls`` by ``probkv.vllm.plugin``).
When a step's output says which logical blocks of a request were evicted
(``probkv.vllm.worker.OUTPUT_FIELD``), it frees them the way vLLM's sliding-window manager
frees blocks that left the window: the request's block list gets the null block there and the
pool gets the block back (``probkv.vllm.internals.free_logical_blocks``), in the full-attention
KV cache groups only: a hybrid model's sliding-window groups (Gemma-3's local layers) are left
to vLLM, whose sliding-window manager frees their out-of-window blocks itself.

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
  keeps the union, the stage count and ``peak_positions``: the most positions it held at the
  end of a step from its prompt's eviction on (before that step's frees). A recomputation
  after a preemption frees each stage's blocks again as soon as it has passed that stage, so
  at the end of each of its steps it holds what the unpreempted request held (at most
  ``B + K`` positions, one partial block more); inside a step it holds one prefill chunk more.
  Its prefix-cache hit stops where the rows the next stage's window reads begin, so that
  window is computed again, never taken short from the cache.

With a ``report`` file (``additional_config['probkv']['report']``) each eviction appends one
JSON row, and a request under a budget one more when it finishes (its ``peak_positions``).
"""

from __future__ import annotations

import json

from vllm.v1.core.sched.scheduler import Scheduler

from probkv import scores
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
        # the full-attention groups: a hybrid model's sliding-window groups stay vLLM's
        self.probkv_groups = opts.evicting_groups(self.kv_cache_config)
        self.probkv_model = vllm_config.model_config.hf_config
        self.probkv_evicted: dict[str, dict] = {}  # req_id -> what its eviction freed
        # evicted, preempted, not yet past its last stage -> the stages it has freed again
        self.probkv_recomputing: dict[str, int] = {}
        self.probkv_preemptions = 0  # evicted requests preempted (and recomputed) so far
        self.probkv_evictions = 0  # requests whose blocks an eviction freed so far
        if self.cache_config.enable_prefix_caching:
            internals.limit_prefix_hits(self, self._prefix_hit_limit)

    def _prefix_hit_limit(self, request) -> int | None:
        """The most tokens a request may take from the prefix cache (None: any)."""
        if self.probkv is None:
            return None
        row = self.probkv_evicted.get(request.request_id)
        if row is not None:  # the kept set is known: only a next stage's window needs rows
            return self._next_window_start(request, row)
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

    def _next_window_start(self, request, row: dict) -> int | None:
        """Where the rows begin that the next decode stage of a recomputed request reads: it is
        due once ``B + K`` positions are held past the last stage (``RequestStages.note``), and
        its window is the last ``w`` rows computed (None: no budget, nothing to read)."""
        if "max_entries" not in row:
            return None
        chosen = opts.request_eviction(request.sampling_params.extra_args, self.probkv)
        policy = opts.policy_for(chosen.method, 0.5, self.block_size)
        rows = scores.last_query_rows(policy.score, policy.score_params)
        due = len(row["freed"]) * self.block_size + row["max_entries"] + row["every"]
        return due - rows

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
                freed = row["stage_frees"]
                if req_id in self.probkv_recomputing:
                    freed = freed[: self.probkv_recomputing[req_id]]
                held = request.num_computed_tokens - sum(len(f) for _, f in freed) * self.block_size
                row["peak_positions"] = max(row.get("peak_positions", 0), held)
        for req_id, info in evicted.items():
            self._free_evicted(req_id, info)
        for req_id in list(self.probkv_recomputing):
            self._free_passed_stages(req_id)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _free_passed_stages(self, req_id: str) -> None:
        """A recomputed request frees again the blocks of every stage it has passed."""
        request = self.requests.get(req_id)
        row = self.probkv_evicted.get(req_id)
        if request is None or row is None:
            self.probkv_recomputing.pop(req_id, None)
            return
        stages = row["stage_frees"]
        done = self.probkv_recomputing[req_id]
        while done < len(stages) and request.num_computed_tokens >= stages[done][0]:
            internals.free_logical_blocks(self, req_id, stages[done][1], self.probkv_groups)
            done += 1
        self.probkv_recomputing[req_id] = done
        if done == len(stages):
            del self.probkv_recomputing[req_id]

    def _free_evicted(self, req_id: str, info: dict) -> None:
        freed = internals.free_logical_blocks(self, req_id, info["freed"], self.probkv_groups)
        request = self.requests.get(req_id)
        if request is not None:
            internals.stop_caching_new_blocks(request)
        row = {"request_id": req_id, "freed_blocks": freed, "block_size": self.block_size,
               "kv_cache_groups": list(self.probkv_groups), **info}  # fmt: skip
        length = info.get("stage_length", request.num_prompt_tokens if request else 0)
        row["stage_frees"] = [(length, list(info["freed"]))]  # what a recomputation frees again
        earlier = self.probkv_evicted.get(req_id)
        self.probkv_evictions += earlier is None
        if earlier is not None and "max_entries" in info:  # a later stage of a decode budget
            held = earlier.get("peak_positions", 0)
            row = {**earlier, **info, "freed_blocks": earlier["freed_blocks"] + freed}
            row["freed"] = sorted(set(earlier["freed"]) | set(info["freed"]))
            row["stage_frees"] = [*earlier["stage_frees"], (length, list(info["freed"]))]
            row["peak_positions"] = held
        elif "max_entries" in info and request is not None:
            row["peak_positions"] = (
                request.num_computed_tokens - len(info["freed"]) * self.block_size
            )
        self.probkv_evicted[req_id] = row
        self._report(row)

    def _report(self, row: dict) -> None:
        if self.probkv is not None and self.probkv.report:
            report = {k: v for k, v in row.items() if k not in ("freed", "stage_frees")}
            with open(self.probkv.report, "a", encoding="utf-8") as f:
                f.write(json.dumps(report) + "\n")

    def _preempt_request(self, request, *args, **kwargs):
        if request.request_id in self.probkv_evicted:
            self.probkv_recomputing[request.request_id] = 0  # each stage freed again once passed
            self.probkv_preemptions += 1
        return super()._preempt_request(request, *args, **kwargs)

    def _free_request(self, request, *args, **kwargs):
        row = self.probkv_evicted.pop(request.request_id, None)
        if row is not None and "max_entries" in row:  # its peak, now final
            self._report({**row, "finished": True})
        self.probkv_recomputing.pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)
