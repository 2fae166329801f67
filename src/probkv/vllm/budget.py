"""A decode budget inside vLLM: a request holds at most ``B + K`` positions (plus one partial
block) however many new tokens it generates up to the engine's ``max_model_len`` (vLLM's bound
on prompt plus output; S10.5, S12), while it is not recomputed after a preemption.

The option is the transformers integration's (``ProbKVCache(max_entries=B, every=K)``):
``max_entries`` B in positions, ``every`` K new tokens between stages (default: one block);
``probkv.vllm.options`` reads it from the engine's option or a request's flat keys
(``probkv_max_entries``, ``probkv_every``). Under it:

- stage 1 is the prompt's eviction (``probkv.vllm.request_eviction.RequestEviction``) at the ratio
  ``1 - B / t`` (a prompt of at most B positions keeps every block);
- whenever the positions a request holds (its compact sequence: kept blocks, then every
  position after the last stage) reach ``B + K``, at the end of that step a stage selects whole
  blocks (model-wide, S11, vLLM's block size; the last, partial block always kept) back to B,
  over the compact sequence, with the same policy and ``select_layers`` call as the prompt's;
  the worker reports the newly freed logical blocks and the scheduler frees them while the
  request runs on; the request's ``KeptPrefix`` becomes the stage's, whose ``CompactPlan``
  (``probkv.vllm.compaction``) lists the plans of the earlier stages (``earlier``).

Scores a serving step can afford (S12): a stage sees each layer's keys and values of the kept
positions and the last ``w`` query rows the request computed (kept per layer as the request
runs: ``w`` is the score's ``last_query_rows``, SnapKV's window, 1 for TOVA); the score reads
those rows' attention over the kept positions (``PrefillStatistics`` with the window as its last
rows), never a second pass over every past row. So ``snapkv``, ``tova``, ``knorm`` and
``streaming_llm`` run; scores built on every row's column sums (``h2o``, ``-h`` weightings,
``min``) are refused by name, and so are ``kvzap`` (its per-entry score fixed when written is
not kept yet) and ``prob:`` methods (their weights would compose across stages, S10.5, but
the spare key columns hold one weight per position and a request recomputed after a
preemption would read its earlier stages' rows with the last stage's weights).

Preemption (S12): vLLM recomputes a preempted request from its first token. Its kept set is
known for every position up to its last stage, so nothing is selected again there: the
compaction reads each recomputed row over the plan that was in force when it was first
computed (``CompactPlan.earlier``), the window rows are captured again (the scheduler limits
the recomputation's prefix-cache hit so that the next stage's window rows are computed), and
the scheduler frees each stage's blocks again as soon as the recomputation has passed that
stage.

Pure tensors and probkv; no vLLM import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from probkv import scores
from probkv.policies import ProbabilisticPolicy
from probkv.policies.base import EvictionPolicy, select_layers
from probkv.scores.observation import LayerObservation, PrefillStatistics
from probkv.vllm.compaction import CompactPlan
from probkv.vllm.paged import read_cache
from probkv.vllm.request_eviction import KeptPrefix, RequestEviction, gathered, no_gather

#: A prompt of at most B positions is observed at this ratio: every block is kept (the
#: model-wide budget rounds to whole blocks), and later stages have their first plan.
KEEP_ALL_RATIO = 1e-9
# Seeds of sampled stages, as the transformers integration's (probkv.hf.decode_budget).
_STAGE_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class Budget:
    """``max_entries`` B positions kept at each stage, a stage every ``every`` K new ones."""

    max_entries: int
    every: int

    def __post_init__(self) -> None:
        for name in ("max_entries", "every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    @property
    def peak(self) -> int:
        """Held positions that start a stage: ``B + K``."""
        return self.max_entries + self.every

    def prompt_ratio(self, prompt_length: int) -> float:
        """Stage 1's ratio: the prompt evicted down to B (``KEEP_ALL_RATIO`` at most)."""
        return max(KEEP_ALL_RATIO, 1.0 - self.max_entries / prompt_length)

    def stage_ratio(self, held: int) -> float:
        return max(KEEP_ALL_RATIO, 1.0 - self.max_entries / held)


def request_budget(chosen, block_size: int) -> Budget | None:
    """The budget of a request's checked options (``options.EngineEviction``; None: none);
    ``every`` defaults to one block."""
    if chosen.max_entries is None:
        return None
    return Budget(int(chosen.max_entries), int(chosen.every or block_size))


def budget_refusal(method: str, policy: EvictionPolicy | None) -> str | None:
    """Why ``policy`` cannot run stages in vLLM (None: it can)."""
    if policy is None:
        return f"{method!r} keeps every position; choose a method that evicts (snapkv, tova, ...)"
    if getattr(policy, "threshold", None) is not None:
        return (
            f"threshold={policy.threshold!r}: its kept count adapts to each prompt (S11), while "
            "a decode budget keeps B positions; drop the threshold or the budget"
        )
    if isinstance(policy, ProbabilisticPolicy):
        return (
            "prob: methods are not run under a decode budget in vLLM yet (their weights compose "
            "across stages, S10.5, but the KV cache holds one weight per position, which a "
            "request recomputed after a preemption would read at its earlier stages too); "
            "use a top-k method: snapkv, tova, knorm, streaming_llm"
        )
    if scores.column_sums_needed(policy.score) is not None:
        return (
            f"score {policy.score!r} reads every past row's attention (column sums), a second "
            "attention pass a serving step does not run; use snapkv, tova, knorm or "
            "streaming_llm (the last rows' attention over the kept positions, or positions)"
        )
    spec = scores.score_spec(policy.score)
    if spec.fixed and spec.cross_head:
        return (
            f"score {policy.score!r} is fixed when an entry is written, which a stage does not "
            "keep yet; use snapkv, tova, knorm or streaming_llm"
        )
    return None


@dataclass
class RequestStages:
    """One request's decode stages in one worker (module docstring).

    ``policy``: the request's model-wide policy (its prompt's ratio; a stage replaces it);
    ``layers``, ``scale``, ``block_size``: as ``RequestEviction``'s."""

    budget: Budget
    policy: EvictionPolicy
    layers: tuple[int, ...]
    scale: float
    block_size: int
    stage: int = 1  # the prompt's eviction is stage 1
    windows: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [Hq, <= w, d]
    window_end: dict[int, int] = field(default_factory=dict)  # layer -> position after it
    observations: dict[int, LayerObservation] = field(default_factory=dict)
    due: tuple[int, CompactPlan] | None = None  # this step's (length, plan) when a stage runs

    @property
    def rows(self) -> int:
        """Query rows a stage reads (the score's ``last_query_rows``)."""
        return scores.last_query_rows(self.policy.score, self.policy.score_params)

    def restart(self) -> None:
        """Recomputed after a preemption: the window rows are captured again."""
        self.windows.clear()
        self.window_end.clear()
        self.observations.clear()
        self.due = None

    def note(self, kept: KeptPrefix | None, n: int) -> None:
        """A step that computes the request's rows up to length ``n``: a stage is due when
        its held positions reach ``B + K`` past its last stage (never inside a recomputation
        that has not passed it)."""
        self.due = None
        if kept is None or n < kept.plan.prompt_length:
            return
        if n - kept.plan.evicted >= self.budget.peak:
            self.due = (n, kept.plan)

    def attend(self, layer, query, caches, layout, table_row, n: int) -> None:
        """One layer of the step: keep the last rows of ``query [q, Hq, d]`` (positions
        ``n - q .. n - 1``); when a stage is due, observe the layer over the held positions."""
        rows = query.transpose(0, 1).float()
        q, w = rows.shape[1], self.rows
        window = self.windows.get(layer)
        if window is not None and self.window_end.get(layer) == n - q:
            rows = torch.cat([window, rows], 1)
        self.windows[layer] = rows[:, -w:].clone()
        self.window_end[layer] = n
        if self.due is None:
            return
        length, plan = self.due
        d = query.shape[-1]
        held = length - plan.evicted
        positions = torch.arange(held, dtype=torch.int64)
        logical = plan.block_index(table_row.numel())[positions // self.block_size]
        blocks = table_row[logical].to(torch.int64)
        offsets = positions % self.block_size
        keys = read_cache(caches[0], layout[0], blocks, offsets)[..., :d].transpose(0, 1)
        values = read_cache(caches[1], layout[1], blocks, offsets)[..., :d].transpose(0, 1)
        window = self.windows[layer]
        stats = PrefillStatistics(self.policy.score, self.policy.score_params, self.scale)
        stats.length = held - window.shape[1]
        stats.add_rows(window, held)
        self.observations[layer] = stats.observe(
            keys.float(), values.float(), layer_idx=layer, rank=self.layers.index(layer)
        )

    @property
    def observed(self) -> bool:
        return self.due is not None and len(self.observations) == len(self.layers)

    def select(self, kept: KeptPrefix, gather=no_gather) -> KeptPrefix:
        """The stage's kept set (every layer observed): whole blocks of the held positions
        back to B; the returned ``KeptPrefix`` has the stage's length as its
        ``prompt_length``, the newly freed logical blocks as ``freed``."""
        length, plan = self.due
        b = self.block_size
        held = length - plan.evicted
        full = [gathered(self.observations[i], gather) for i in self.layers]
        changes = {"ratio": self.budget.stage_ratio(held)}
        if hasattr(self.policy, "seed"):
            changes["seed"] = self.policy.seed + _STAGE_SEED_STRIDE * self.stage
        policy = dataclasses.replace(self.policy, **changes)
        selection = select_layers(policy, full, num_layers=len(self.layers))[0]
        compact_positions, _ = selection.head(0)  # scope="model": every head keeps the same
        blocks = -(-held // b)
        logical = plan.block_index(-(-length // b))[:blocks]  # compact -> logical block
        kept_compact = torch.zeros(blocks, dtype=torch.bool)
        kept_compact[compact_positions // b] = True
        whole = length // b
        if whole < -(-length // b) and not bool(kept_compact[-1]):
            raise RuntimeError(
                f"a decode stage evicted the last, partial block {whole}: a model-wide "
                "selection keeps it (new tokens are written into it)"
            )
        freed = tuple(int(i) for i in logical[~kept_compact] if int(i) < whole)
        kept_logical = logical[kept_compact]
        kept_whole = kept_logical[kept_logical < whole]
        positions = logical[compact_positions // b] * b + compact_positions % b
        new_plan = CompactPlan(length, kept_whole, b, earlier=(*plan.earlier, plan))
        self.stage += 1
        self.observations.clear()
        self.due = None
        return KeptPrefix(
            positions,
            torch.zeros(positions.shape, dtype=torch.float32),
            freed,
            length,
            -(-length // b),
            new_plan,
        )


def start(chosen, request: RequestEviction, block_size: int) -> RequestStages | None:
    """The stages of a request just started with ``request`` (None: no budget)."""
    budget = request_budget(chosen, block_size)
    if budget is None:
        return None
    return RequestStages(budget, request.policy, request.layers, request.scale, block_size)


def step_work(stages: dict, req_ids, requests, starts, seq_lens) -> list:
    """This step's work of budgeted requests, ``(row, RequestStages, lo, hi, n)``, for
    ``WorkerEviction.attend``; notes which run a stage."""
    work = []
    for row, req_id in enumerate(req_ids):
        state = stages.get(req_id)
        if state is None:
            continue
        n = seq_lens[row]
        state.note(requests[row].kept, n)
        work.append((row, state, starts[row], starts[row + 1], n))
    return work


def after_forward(stages: dict, requests: dict, pending: dict, gather) -> None:
    """After the forward: every due stage selects (``pending`` gets the request's row for the
    scheduler), and rows of prompt evictions under a budget get the budget's fields."""
    for req_id, state in stages.items():
        request = requests.get(req_id)
        if request is None or request.kept is None:
            continue
        row = pending.get(req_id)
        if row is not None and state.due is None:  # the prompt's eviction: stage 1
            row.update(_budget_fields(state, request.kept))
        if state.observed:
            kept = state.select(request.kept, gather)
            request.kept = kept
            pending[req_id] = {
                "freed": list(kept.freed),
                "kept_positions": int(kept.positions.numel()),
                "prompt_length": request.prompt_length,
                "num_blocks": kept.num_blocks,
                **_budget_fields(state, kept),
            }


def _budget_fields(state: RequestStages, kept: KeptPrefix) -> dict:
    return {
        "max_entries": state.budget.max_entries,
        "every": state.budget.every,
        "stages": state.stage,
        "stage_length": kept.prompt_length,
    }
