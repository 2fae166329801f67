"""Holding a budget during generation: decode-time eviction in sequential stages (S10.5).

``ProbKVCache(config, policy, max_entries=B, every=K)`` holds every KV head of every evicting
layer to at most ``B + K`` entries for any number of generated tokens:

- stage 1, the prompt: the policy evicts the prompt's ``t`` entries down to ``B`` (its
  ``ratio`` is replaced by ``1 - B / t``; a prompt of at most ``B`` tokens is kept whole);
- stages 2, 3, ...: whenever a head holds ``B + K`` entries (``B + 1`` for ``K = 1``), right
  after the attention of the step that brought it there, the policy evicts that layer's
  entries (kept prefix, then the tail) down to ``B``, on the statistics accumulated online
  since (``probkv.scores.decode_statistics``: column sums of decode rows for H2O, ``-h`` harmonic
  weights, the latest rows for TOVA / SnapKV's window / ``min``, positions for StreamingLLM,
  and for a score fixed per entry, ``kvzap``, each entry's score from when it entered: the
  tail's are computed at the stage from every KV head's entries, which the dense tail holds).

A sampling stage multiplies the weights of what it keeps by ``1 / P`` (``EvictingLayer.evict``
adds the log-weights), so the product over stages is an unbiased Horvitz-Thompson weight for
the final kept set (S10.5, by the tower property); each stage draws with its own seed
(``seed`` of the policy, the stage and the head), so the same seed gives the same kept sets. A
top-k stage keeps weight 1 and drops the rest (S5's bias, once per stage).

The bound, exactly: from the prompt's eviction on, no KV head holds more than ``B + K``
entries at any step that brings one token (a forward of ``q`` tokens at once may hold
``q - 1`` more during that forward), and no layer stores more than ``B + K`` entries per KV
head (the dense tail, shared by the heads, grows to at most what the head holding most may
reach), plus one float32 log-weight per kept entry. A top-k stage keeps ``B`` entries per
head, a pps stage at most ``B + K - 1`` (its blocks hold at most ``K`` entries, S10.3, so it
keeps up to ``block - 1`` more or fewer than ``B``).

A batch (S11) holds the budget per sequence: each sequence's stages come at the steps they
come alone, with its own seeds and statistics (``split_batch`` below); its new tokens must
not be padded (``check_budget_padding``).

Refused by name, since they cannot hold it: Ada-KV head budgets, PyramidKV / global layer
budgets, the global scope and a threshold (their budgets move between heads or layers, or
with the prompt, while a decode budget holds every head to ``B``), scores read from a reconstruction pass (KVzip, S10.1: a
second model run over the context, which a decode step does not have), spans (a random kept
count, S10.3), the with-replacement sampler (``B`` distinct entries in expectation only, S3)
and ``full`` (it keeps everything).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from probkv import scores
from probkv._checks import check_positive_int
from probkv.estimation.selection import RaggedSelection
from probkv.hf.prefix import RaggedPrefix
from probkv.policies.base import EvictionPolicy, LayerObservation
from probkv.policies.registry import FullCache
from probkv.scores.decode_statistics import DecodeStatistics

# Seeds of decode stages: the policy's seed, then this many per stage and one per head.
_STAGE_SEED_STRIDE = 1_000_003
_HEAD_SEED_STRIDE = 7_919


@dataclass(frozen=True)
class DecodeBudget:
    """``max_entries`` (``B``) kept per KV head and layer; re-evict every ``every`` (``K``)
    new entries, so a head holds at most ``B + K`` of them (module docstring: the exact
    bound)."""

    max_entries: int
    every: int = 1

    def __post_init__(self) -> None:
        check_positive_int(self.max_entries, "max_entries")
        check_positive_int(self.every, "every")

    @property
    def peak_entries(self) -> int:
        """The most entries a head holds: ``B + K``, during the step that triggers a stage."""
        return self.max_entries + self.every

    def check_policy(self, policy: EvictionPolicy) -> None:
        """Refuse what cannot hold a per-head budget at decode (module docstring)."""
        refused = []
        for name, allowed in (("head_budgets", "uniform"), ("layer_budgets", "uniform")):
            value = getattr(policy, name, allowed)
            if value != allowed:
                refused.append(f"{name}={value!r}")
        if getattr(policy, "threshold", None) is not None:
            refused.append(f"threshold={policy.threshold!r} (its kept count adapts per prompt)")
        if getattr(policy, "scope", "head") != "head":
            refused.append(f"scope={policy.scope!r}")
        if scores.needs_reconstruction(policy.score):
            refused.append(f"score={policy.score!r} (read from a reconstruction pass, S10.1)")
        spec = scores.score_spec(policy.score)
        if spec.cross_head and not spec.fixed:
            refused.append(
                f"score {policy.score!r} under a decode budget (each head's score reads every KV "
                "head at one position, which a stage's per-head sets break)"
            )
        if getattr(policy, "units", "blocks") != "blocks":
            # spans of unequal size keep a random count, with no bound of one block (S10.3)
            refused.append(f"units={policy.units!r} (its kept count has no bound)")
        if getattr(policy, "sampler", None) == "with_replacement":
            # S3: m draws keep B distinct entries in expectation only; up to m > B of them
            refused.append("sampler='with_replacement' (it keeps B entries in expectation only)")
        if isinstance(policy, FullCache):
            refused.append("method 'full' (it keeps every entry)")
        if refused:
            raise ValueError(
                f"a decode budget (max_entries) holds every KV head to {self.max_entries} "
                f"entries; this policy has {', '.join(refused)}, which cannot be held at decode. "
                "Use head_budgets='uniform', layer_budgets='uniform', scope='head' and a score "
                "computed from the model's own rows (h2o, h2o-h, snapkv, tova, ...), with "
                "units='blocks' and sampler='pps'"
            )

    def prompt_policy(self, policy: EvictionPolicy, prompt_entries: int) -> EvictionPolicy:
        """Stage 1: ``policy`` evicting ``prompt_entries`` down to ``B`` (ratio 0: all kept)."""
        ratio = max(0.0, 1.0 - self.max_entries / prompt_entries)
        return dataclasses.replace(policy, ratio=ratio, **self.block_limit(policy))

    def block_limit(self, policy: EvictionPolicy) -> dict:
        """A pps block design (S10.3) keeps up to ``block - 1`` entries above its budget: under
        a decode budget its blocks hold at most ``K`` entries, so no head passes ``B + K``."""
        block = getattr(policy, "block", None) or 1  # None: a top-k policy of head scope
        return {"block": self.every} if block > self.every else {}


@dataclass
class LayerDecodeState:
    """One layer's decode-time eviction, owned by this module: its budget, statistics (from
    the prompt's eviction on), stage count and peaks."""

    budget: DecodeBudget
    statistics: DecodeStatistics | None = None
    stages: int = 1  # the prompt's eviction is stage 1
    peak_entries: int = 0  # per KV head, at the largest (before a stage evicts)
    peak_bytes: int = 0


def budget_from_options(max_entries: int | None, every: int | None) -> DecodeBudget | None:
    """The decode budget of ``max_entries=B``, ``every=K`` (``K`` 1 unless given); ``every``
    without ``max_entries`` would be ignored, so it is refused."""
    if max_entries is None:
        if every is not None:
            check_positive_int(every, "every")
            raise ValueError(
                f"every={every} applies only to a decode budget: pass max_entries=B too "
                "(every=K re-evicts each KV head to B entries every K new ones), or leave "
                "every out"
            )
        return None
    return DecodeBudget(max_entries, 1 if every is None else every)


def check_no_budget(budget, operation: str) -> None:
    """``crop``/``rewind`` drop tail entries that a decode budget's stages and statistics
    already counted: refused by name."""
    if budget is not None:
        raise ValueError(
            f"{operation}() is not available on a cache with a decode budget "
            f"(max_entries={budget.max_entries}): its stages already evicted and weighted the "
            "entries it would drop; keep a copy (cache.copy()) before generating instead"
        )


def check_budget_padding(attention_mask: torch.Tensor | None, budget) -> None:
    """A batch held to a decode budget takes new tokens without padding: a padding token
    in a sequence's tail would be an entry its stages count, score and may keep (S10.5; alone
    it never exists). Refused by name (``attention_mask`` ``[B, n]``, zeros after ones)."""
    if budget is None or attention_mask is None or attention_mask.ndim != 2:
        return
    if attention_mask.shape[0] < 2:
        return
    if bool((attention_mask[:, 1:].long() < attention_mask[:, :-1].long()).any()):
        raise ValueError(
            f"this batch is held to a decode budget (max_entries={budget.max_entries}), and "
            "its new tokens are padded (the attention mask has zeros after ones): a padding "
            "token would be an entry of that sequence's stages. Give every sequence new "
            "tokens of the same length (e.g. generate from the prompts alone), or run them "
            "one at a time"
        )


def tail_room(layer, need: int, planned: int) -> int:
    """How far an evicted layer's dense tail grows under its budget: to at most what the head
    holding most entries may reach, ``B + K`` (the tail is shared by the heads)."""
    room = layer.decode_state.budget.peak_entries - max(layer.prefix.lengths)
    return max(need, min(planned, room))


def start_decode(layer, observation, selection: RaggedSelection) -> None:
    """Stage 1, called before ``layer`` (holding the whole prompt) applies ``selection``:
    statistics over the entries it keeps."""
    policy = layer.policy
    layer.decode_state.statistics = DecodeStatistics.from_prompt(
        policy.score,
        policy.score_params,
        prompt_log_scores=observation.log_scores,
        last_query_attention=observation.last_query_attention,
        kept=[selection.head(h)[0] for h in range(selection.num_heads)],
        values=layer.tail_values[0],  # min-h: value norms divided out (its score row)
        prompt_forced=observation.forced,  # a fixed score (kvzap): carried as they are
    )


def decode_rows_needed(layer) -> bool:
    """Whether ``layer``'s statistics read this decode step's attention probabilities: every
    step for column sums (``h2o``, ``-h``), else only when the step starts a stage (its
    latest row, ``LayerObservation.last_query_attention``). Called after the step's keys
    entered the cache, before its attention."""
    return layer.decode_state.statistics.weighting is not None or stage_due(layer)


def stage_due(layer) -> bool:
    """Whether a head of ``layer`` holds ``B + K`` entries (``B + 1`` for ``K = 1``)."""
    return layer.physical_length() >= layer.decode_budget.peak_entries


def after_decode_attention(
    layer, query: torch.Tensor, probabilities: torch.Tensor | None = None
) -> bool:
    """A decode forward attended over ``layer`` (a ``BudgetedLayer``; ``query [Hq, q, d]``): add its rows
    to the statistics. Returns whether a head now holds ``B + K`` entries: then the caller
    runs one more stage through ``probkv.hf.eviction.evict_decode_stage``, the eviction path
    the prompt's stage takes too.

    ``probabilities [Hkv, g, q, n]``: the ones the attention computed
    (``probkv.hf.attention.evicted_attention_with_probabilities``), required whenever
    ``decode_rows_needed``."""
    state: LayerDecodeState = layer.decode_state
    due = stage_due(layer)
    if probabilities is None and due:
        raise ValueError(f"layer {layer.layer_idx}: a stage needs this step's probabilities")
    state.statistics.observe(probabilities, query)
    record_peak(layer)
    return due


def record_peak(layer) -> None:
    """The entries per head and bytes ``layer`` holds now, into its peaks."""
    state = layer.decode_state
    state.peak_entries = max(state.peak_entries, layer.physical_length())
    state.peak_bytes = max(state.peak_bytes, layer.nbytes())


def _head_entries(layer, h: int):
    """Head ``h``'s entries now (prefix, then tail) and its prefix log-weights."""
    tail_k = layer.tail_keys[0, h]
    tail_v = layer.tail_values[0, h]
    k, v, lw = layer.prefix.head(h)
    return torch.cat([k, tail_k]), torch.cat([v, tail_v]), lw


def _stage_groups(layer):
    """``[(heads, keys, values)]``, each head's entries now (prefix, then tail) as ``[len(heads),
    n, d]``: all heads in one group (one copy of the layer's entries) when their lengths are
    equal, else one group per head."""
    prefix = layer.prefix
    h = layer.num_heads
    if prefix.uniform_length:
        length = prefix.lengths[0]
        # explicit sizes: every head's prefix may be empty (S4)
        pk = prefix.keys.view(h, length, prefix.keys.shape[-1])
        pv = prefix.values.view(h, length, prefix.values.shape[-1])
        keys = torch.cat([pk, layer.tail_keys[0]], dim=1)
        values = torch.cat([pv, layer.tail_values[0]], dim=1)
        return [(list(range(h)), keys, values)]
    groups = []
    for i in range(h):
        k, v, _ = _head_entries(layer, i)
        groups.append(([i], k.unsqueeze(0), v.unsqueeze(0)))
    return groups


@dataclass(frozen=True)
class Stage:
    """What one decode stage asks of the eviction path (``probkv.hf.eviction``): one
    ``(policy, observation)`` per group of heads of equal length (each selects its heads),
    the layer's latest attention ``[Hkv, n]`` over the entries it holds (padded) for the
    report's retained mass, and the stage's target ratio ``1 - B / (tokens seen)``."""

    groups: list[tuple[EvictionPolicy, LayerObservation]]
    attention: torch.Tensor
    target_ratio: float


def next_stage(layer, scale: float) -> Stage:
    """One decode stage (S10.5): the observations on which the policy evicts every head of
    ``layer`` to ``B`` entries; heads of equal length are observed together (one selection),
    ragged heads (a with-replacement stage keeps fewer than ``B``) one at a time."""
    state: LayerDecodeState = layer.decode_state
    budget: DecodeBudget = layer.decode_budget
    state.stages += 1
    # a fixed score (kvzap): the tail's entries scored once, from every head's (S11)
    state.statistics.enter(
        layer.tail_keys[0],
        layer.tail_values[0],
        first_position=layer.prefix_length,
        layer_idx=layer.layer_idx,
    )
    groups = []
    for heads, keys, values in _stage_groups(layer):
        n = keys.shape[1]
        obs = state.statistics.observation(
            heads, keys, values, scale=scale, layer_idx=layer.layer_idx, rank=layer.rank
        )
        policy = _stage_policy(
            layer.policy, budget, n, state.stages, heads[0] if len(heads) == 1 else 0
        )
        groups.append((policy, obs))
    seen = layer.get_seq_length()
    attention = state.statistics.last_attention[:, : state.statistics.width]
    return Stage(groups, attention, max(0.0, 1.0 - budget.max_entries / seen))


def stage_done(layer, selection: RaggedSelection) -> None:
    """After a decode stage evicted ``layer`` to ``selection``: the statistics follow."""
    layer.decode_state.statistics.keep([selection.head(h)[0] for h in range(selection.num_heads)])


def _stage_policy(policy, budget: DecodeBudget, n: int, stage: int, head: int):
    """``policy`` keeping ``B`` of ``n`` entries, with the stage's own seed."""
    changes = {"ratio": max(0.0, 1.0 - budget.max_entries / n), **budget.block_limit(policy)}
    if hasattr(policy, "seed"):
        changes["seed"] = policy.seed + _STAGE_SEED_STRIDE * stage + _HEAD_SEED_STRIDE * head
    return dataclasses.replace(policy, **changes)


# ------------------------------------------------------------------ batches (S11)
# A batch held to a decode budget: each sequence's stages come at the steps they come alone
# (its prompt's length, and a pps stage's ragged count, decide them), with its own seeds and
# statistics. So from the prompt's eviction on, each sequence is a single-sequence layer of its
# own (``BudgetedBatchLayer.sequence_layers``, ``probkv.hf.layers``), which every function
# above serves unchanged: its prefix, its dense tail (sized as alone: no sequence's entries linger in a shared buffer after
# its stage), its ``LayerDecodeState``. The batch layer keeps the sequences' prefixes joined
# into one ragged prefix of ``B * Hkv`` (sequence, KV head) segments, whose slices are the
# sequences' prefixes (views, no copy), so that decode attention stays one call over all
# segments (``probkv.hf.attention.batched_budget_attention``).


def split_batch(layer) -> list:
    """Before the prompt's eviction of a batch ``layer`` (an ``OBSERVED`` ``PromptLayer``,
    holding the padded prompt): one single-sequence layer per sequence, holding that
    sequence's unpadded prompt (views of the batch's tail) and observation, as if that prompt
    had been read alone (``PromptLayer.split_sequences``)."""
    return layer.split_sequences()


def join_batch(layer) -> None:
    """After any sequence's eviction (the prompt's, or a stage): the batch layer's prefix
    becomes the sequences' prefixes joined (``B * Hkv`` segments, sequence after sequence), and
    each sequence's prefix a view of its slice; the batch's own buffers are freed. A sequence
    without log-weights (a prompt kept whole, a top-k stage) while another has them gets zeros
    in the joined tensor (the same softmax; 4 bytes per entry, until its first weighted stage),
    and keeps ``None`` itself."""
    sequences = layer.sequence_layers
    parts = [one.prefix for one in sequences]
    weighted = any(p.log_weights is not None for p in parts)
    log_weights = None
    if weighted:
        log_weights = torch.cat(
            [
                p.log_weights
                if p.log_weights is not None
                else torch.zeros(p.keys.shape[0], device=p.keys.device)
                for p in parts
            ]
        )
    joined = RaggedPrefix(
        keys=torch.cat([p.keys for p in parts]),
        values=torch.cat([p.values for p in parts]),
        log_weights=log_weights,
        lengths=[n for p in parts for n in p.lengths],
        covers=min(p.covers + pad for p, pad in zip(parts, layer.pads, strict=True)),
    )
    h = layer.num_heads
    for b, (one, p) in enumerate(zip(sequences, parts)):
        first, last = joined.offsets[b * h], joined.offsets[(b + 1) * h]
        one.share_prefix(
            RaggedPrefix(
                keys=joined.keys[first:last],
                values=joined.values[first:last],
                log_weights=None if p.log_weights is None else joined.log_weights[first:last],
                lengths=p.lengths,
                covers=p.covers,
            )
        )
    layer.hold_prefix(joined)  # a BudgetedBatchLayer from the prompt's eviction on
    layer.record_report([one.sequence_reports[0] for one in sequences])
    record_batch_peak(layer)


def record_batch_peak(layer) -> None:
    """A batch layer's own ``decode_state``: the most stages any sequence ran, the most
    entries any of its (sequence, KV head) segments held, and the most bytes the whole layer
    held (each sequence's own state holds its own, as alone)."""
    state, sequences = layer.decode_state, layer.sequence_layers
    state.stages = max(one.decode_state.stages for one in sequences)
    state.peak_entries = max(one.decode_state.peak_entries for one in sequences)
    state.peak_bytes = max(state.peak_bytes, layer.nbytes())


def sequence_probabilities(layer, probabilities: torch.Tensor, b: int, q: int) -> torch.Tensor:
    """Sequence ``b``'s share of a batch's decode probabilities (``[B Hkv, g q, width]``:
    each segment's prefix, then the batch's tail slots, the sequence's own first, zeros after)
    in the layout its statistics read alone: ``[Hkv, g, q, n]``, ``n`` its longest head's
    prefix plus its tail."""
    one = layer.sequence_layers[b]
    h = layer.num_heads
    n = max(one.prefix.lengths) + one.tail.length
    rows = probabilities[b * h : (b + 1) * h, :, :n]
    return rows.reshape(h, -1, q, n)


def append_to_sequences(layers: list, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """A budgeted batch's new entries ``[B, Hkv, q, d]``: each sequence's into its own tail."""
    for b, layer in enumerate(layers):
        layer.tail.append(key_states[b : b + 1], value_states[b : b + 1], layer.tail_capacity)


def sequences_length(layers: list, num_heads: int, head: int | None) -> int:
    """Entries a budgeted batch stores for segment ``head`` (``b * Hkv + h``), or the most."""
    if head is None:
        return max(layer.physical_length() for layer in layers)
    b, h = divmod(head, num_heads)
    return layers[b].physical_length(h)
