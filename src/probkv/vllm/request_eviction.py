"""One request's eviction inside a vLLM worker: pure tensors, no vLLM import.

A request's prompt is read in one or several prefill chunks; each chunk of each layer adds
its query rows to the layer's ``PrefillStatistics`` (the same accumulator the transformers
integration uses for chunked prefill), read against every key and value of the prompt so far.
When the last chunk of the last layer is done the policy (``scope="model"``, blocks of vLLM's
block size, S11) selects one kept set of whole blocks for every layer and head through
``probkv.policies.select_layers``, the same call as the transformers integration, from the
observations of every KV head of the model (``gather`` joins tensor-parallel ranks' heads, so
every rank makes the same selection from the same inputs). Decode attention of the request then
reads the kept prompt positions with their log-weights and every position after the prompt,
in vLLM's own kernel (``probkv.vllm.compaction``, ``probkv.vllm.weights``);
``decode_attention``, one request through ``probkv.estimation.corrected_attention`` (S4), is
its reference in the tests.

kvzap (S11) reads each position's keys and values, which the last chunk holds for every score;
under tensor parallelism its scorer reads every KV head of a position while a rank holds some:
``tensor_parallel_policy`` gives the rank a ``ScorerShard`` (its heads' share of every head's
prediction, summed over the TP group).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from probkv import scores
from probkv.estimation import corrected_attention
from probkv.policies.base import EvictionPolicy, select_layers
from probkv.scores.observation import LayerObservation, PrefillStatistics
from probkv.scores.surrogate import ScorerShard, SurrogateScorer
from probkv.vllm.compaction import CompactPlan

Gather = Callable[[torch.Tensor], torch.Tensor]  # [H_local, t] -> [H_all, t] over the TP ranks


def no_gather(x: torch.Tensor) -> torch.Tensor:
    """The gather of one rank (no tensor parallelism): ``x`` itself."""
    return x


@dataclass(frozen=True)
class KeptPrefix:
    """What a request keeps of its prompt: ``positions`` (int64 ``[n]``, sorted) with
    ``log_weights`` (float32 ``[n]``, zeros for top-k), the logical blocks that are evicted
    whole and lie inside the prompt (``freed``: what vLLM's pool gets back), and the prompt's
    length and block count."""

    positions: torch.Tensor
    log_weights: torch.Tensor
    freed: tuple[int, ...]
    prompt_length: int
    num_blocks: int
    plan: CompactPlan  # the blocks attention reads from now on (probkv.vllm.compaction)

    @property
    def weighted(self) -> bool:
        """Whether some kept position has a non-zero log-weight (a ``prob:`` selection)."""
        return bool(self.log_weights.any())


@dataclass
class RequestEviction:
    """A request's prefill observation, then its kept prefix (module docstring).

    ``layers``: the evicting layers' indices in the model (every attention layer); ``scale``:
    the attention scaling; ``block_size``: vLLM's block size, which the policy's ``block``
    must equal."""

    policy: EvictionPolicy
    prompt_length: int
    block_size: int
    layers: tuple[int, ...]
    scale: float
    statistics: dict[int, PrefillStatistics] = field(default_factory=dict)
    observations: dict[int, LayerObservation] = field(default_factory=dict)
    kept: KeptPrefix | None = None
    weights_due: bool = False  # the kept set's log-weights are not in the cache yet

    def __post_init__(self) -> None:
        block = getattr(self.policy, "block", None)
        if getattr(self.policy, "scope", None) != "model" or block != self.block_size:
            raise ValueError(
                f"a vLLM request evicts whole blocks of {self.block_size} positions for every "
                f"layer and head (scope='model', block={self.block_size}), got scope="
                f"{getattr(self.policy, 'scope', None)!r}, block={block!r}"
            )
        if self.prompt_length < 1:
            raise ValueError(f"prompt_length must be >= 1, got {self.prompt_length}")

    def restart(self) -> None:
        """The request is computed again from its first position (vLLM resumed it after a
        preemption): an observation under way starts over; a kept set stays, since the
        selection is a function of the prompt's observation and the policy's seed (S12)."""
        if self.kept is None:
            self.statistics.clear()
            self.observations.clear()
        else:
            self.weights_due = self.kept.weighted  # the recomputed prompt is written unweighted

    @property
    def rows_observed(self) -> int:
        """How many of the prompt's last positions must be computed (not read from a prefix
        cache) for the observation: every one for scores built on column sums, else the
        score's last query rows."""
        if scores.column_sums_needed(self.policy.score) is not None:
            return self.prompt_length
        rows = scores.last_query_rows(self.policy.score, self.policy.score_params)
        return min(self.prompt_length, rows)

    @property
    def observed(self) -> bool:
        """Every layer has seen the whole prompt."""
        return len(self.observations) == len(self.layers)

    def needs_entries(self, t: int) -> bool:
        """Whether a chunk ending at ``t`` reads the prompt's keys and values: every chunk for
        scores built on column sums, only the last one for the others (``add_chunk``)."""
        return t == self.prompt_length or scores.column_sums_needed(self.policy.score) is not None

    def add_chunk(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        t: int | None = None,
    ) -> None:
        """A prefill chunk of ``layer``: ``query [Hq, q, d]`` are the last ``q`` rows of
        ``key``/``value [Hkv, t, d]``, every prompt entry so far (``t <= prompt_length``).
        Where ``needs_entries(t)`` is false, ``key`` and ``value`` may be None (give ``t``)."""
        if layer not in self.layers:
            raise ValueError(f"layer {layer} is not one of the evicting layers {self.layers}")
        t = key.shape[1] if key is not None else t
        if t is None or (key is None and self.needs_entries(t)):
            raise ValueError(f"a chunk ending at {t} needs the prompt's keys and values")
        if t > self.prompt_length:
            raise ValueError(
                f"a prefill chunk ends at {t}, beyond the prompt ({self.prompt_length})"
            )
        stats = self.statistics.get(layer)
        if stats is None:
            stats = PrefillStatistics(
                self.policy.score,
                self.policy.score_params,
                self.scale,
                prompt_length=self.prompt_length,
            )
            self.statistics[layer] = stats
        if scores.column_sums_needed(self.policy.score) is None:
            if stats.length == 0 and stats.last_queries is None:
                stats.length = t - query.shape[1]  # earlier rows came from a prefix cache
            stats.add_rows(query, t)  # vLLM computed the output; only the last rows are read
        else:
            stats.add_chunk(query, key, value)
        if t == self.prompt_length:
            seen = 0 if stats.last_queries is None else stats.last_queries.shape[1]
            if stats.column_sums is None and seen < self.rows_observed:
                raise ValueError(
                    f"the observation needs the prompt's last {self.rows_observed} rows "
                    f"computed, got {seen} (the rest came from a prefix cache)"
                )
            rank = self.layers.index(layer)
            self.observations[layer] = stats.observe(key, value, layer_idx=layer, rank=rank)
            del self.statistics[layer]

    def select(self, gather: Gather = no_gather) -> KeptPrefix:
        """The kept prefix, once every layer is observed; ``gather`` joins the heads of the
        tensor-parallel ranks (the identity on one rank)."""
        if not self.observed:
            missing = sorted(set(self.layers) - set(self.observations))
            raise ValueError(f"select needs every layer observed; layers {missing} are not")
        full = [gathered(self.observations[i], gather) for i in self.layers]
        selection = select_layers(self.policy, full, num_layers=len(self.layers))[0]
        positions, logw = selection.head(0)  # scope="model": every head keeps the same
        if logw is None:
            logw = torch.zeros(positions.shape, dtype=torch.float32)
        t, b = self.prompt_length, self.block_size
        num_blocks = -(-t // b)
        kept_blocks = torch.zeros(num_blocks, dtype=torch.bool)
        kept_blocks[positions // b] = True
        whole = t // b  # blocks that lie inside the prompt; the last partial one takes new tokens
        freed = tuple(int(i) for i in torch.nonzero(~kept_blocks[:whole]).flatten())
        if whole < num_blocks and not bool(kept_blocks[whole]):
            raise RuntimeError(
                f"the prompt's last, partial block {whole} was evicted: a model-wide selection "
                "keeps it (probkv.policies.model_scope), since new tokens are written into it"
            )
        plan = CompactPlan(t, torch.nonzero(kept_blocks[:whole]).flatten().to(torch.int64), b)
        self.kept = KeptPrefix(positions.cpu(), logw.float().cpu(), freed, t, num_blocks, plan)
        self.weights_due = self.kept.weighted
        self.observations.clear()
        return self.kept


def tensor_parallel_policy(
    policy: EvictionPolicy,
    rank: int,
    world_size: int,
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
) -> EvictionPolicy:
    """``policy`` as tensor-parallel rank ``rank`` of ``world_size`` runs it: a kvzap scorer
    becomes the rank's ``ScorerShard`` (the rank holds KV heads ``[rank c, (rank + 1) c)``,
    ``c = Hkv / world_size``; each head's prediction reads every head, so the ranks' shares are
    summed by ``all_reduce``). Other policies, and one rank, unchanged."""
    scorer = policy.score_params.get("surrogate")
    if world_size == 1 or not isinstance(scorer, SurrogateScorer):
        return policy
    hkv = next(iter(scorer.layers.values())).weight.shape[1]
    if hkv % world_size:
        raise ValueError(
            f"kvzap over {world_size} tensor-parallel ranks: the model's {hkv} KV heads do not "
            "split over them (vLLM then copies KV heads to several ranks); choose a "
            f"tensor_parallel_size that divides {hkv}"
        )
    count = hkv // world_size
    shard = ScorerShard(scorer, rank * count, count, all_reduce)
    return dataclasses.replace(policy, score_params={**policy.score_params, "surrogate": shard})


def gathered(obs: LayerObservation, gather: Gather) -> LayerObservation:
    """``obs`` with its statistics gathered over the tensor-parallel group (``gather``: every
    rank's heads, the same on every rank), for a selection every rank makes alike."""
    forced = None
    if obs.forced is not None:
        forced = gather(obs.forced.to(torch.float32)) > 0  # float: every TP backend gathers it
    return LayerObservation(
        layer_idx=obs.layer_idx,
        rank=obs.rank,
        log_scores=gather(obs.log_scores),
        forced=forced,
        last_query_attention=gather(obs.last_query_attention),
    )


def visible_positions(kept: KeptPrefix, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions a request's attention reads at sequence length ``seq_len`` (the kept
    prompt positions, then every position after the prompt) and their log-weights (0 after
    the prompt)."""
    after = torch.arange(kept.prompt_length, seq_len, dtype=torch.int64)
    positions = torch.cat([kept.positions, after])
    logw = torch.cat([kept.log_weights, torch.zeros(after.shape, dtype=torch.float32)])
    return positions, logw


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_weights: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Attention of ``q`` new tokens (the last ``q`` of the ``n`` visible entries) in vLLM's
    layout: ``query [q, Hq, d]``, ``key``/``value [n, Hkv, d]``, ``log_weights [n]`` shared by
    the heads -> ``[q, Hq, d]`` (``probkv.estimation.corrected_attention``, S4)."""
    q, n = query.shape[0], key.shape[0]
    h_kv = key.shape[1]
    out = corrected_attention(
        query.transpose(0, 1),
        key.transpose(0, 1),
        value.transpose(0, 1),
        log_weights.to(key.device).expand(h_kv, n),
        scale=scale,
        causal_offset=n - q,
    )
    return out.transpose(0, 1)
