"""An evicting layer's kinds on transformers' cache-layer protocol (S3, S4, S6).

One global-attention layer's cache changes behaviour twice in its life, and each behaviour is
one small class behind ``CacheLayerMixin`` (as transformers' own ``DynamicLayer``,
``DynamicSlidingWindowLayer``, ... are one class each):

- ``PromptLayer``: the prompt, stored densely (``[B, Hkv, T, d]``, like ``DynamicLayer``;
  ``B`` sequences of a left-padded batch, S11, usually one), undecided. Its ``phase``
  (``PromptPhase``) says what a forward does: ``PREFILL`` (the prompt is being read, in one or
  several forwards: ``probkv.hf.prefill``) -> ``OBSERVED`` (eviction waits for the prompt's end
  or the other layers); reconstruction scores (KVzip, S10.1) pass through
  ``AWAITING_RECONSTRUCTION`` and ``RECONSTRUCTING`` (each chunk of the pass) first.
- ``EvictedLayer``: a *ragged, weighted prefix* (every (sequence,) KV head's kept entries
  flattened head after head into ``[N, d]`` keys and ``[N, d_v]`` values, Ada-KV's layout,
  padding never kept, one float32 log-weight per entry, S4) and a dense *tail* of the tokens
  since. Decode attention is one softmax over prefix (logits ``+ log w``) and tail
  (``probkv.hf.attention``).
- ``BudgetedLayer``: an evicted layer held to a decode budget (S10.5): its tail grows to at
  most ``B + K`` entries per head and a stage evicts it again (``probkv.hf.decode_budget``, where
  the budget's code lives; the class only calls it by name). ``BudgetedBatchLayer``: a batch
  held to one, each sequence a ``BudgetedLayer`` of its own (``sequence_layers``).

``EvictingLayer`` is their common base: what every kind holds and the protocol's shared part.
A layer changes kind in place (an eviction assigns the class it becomes, ``reset`` the
prompt's again), because the cache's slot, transformers' forward and the attention handoff hold the
object itself. Logical length (positions: ``get_seq_length``) and physical length (storage,
masks: ``get_mask_sizes``) are kept apart (S6 pitfall).
"""

from __future__ import annotations

import enum

import torch
from transformers.cache_utils import CacheLayerMixin

from probkv.estimation.selection import RaggedSelection
from probkv.hf import guards, layer_handoff
from probkv.hf.decode_budget import (
    DecodeBudget,
    LayerDecodeState,
    append_to_sequences,
    check_no_budget,
    sequences_length,
    tail_room,
)
from probkv.hf.eviction import evict_layers
from probkv.hf.prefill import PromptReading
from probkv.hf.prefix import DenseTail, RaggedPrefix, kept_prefix
from probkv.hf.report import LayerReport
from probkv.policies.base import EvictionPolicy, LayerObservation

__all__ = [
    "BudgetedBatchLayer",
    "BudgetedLayer",
    "EvictedLayer",
    "EvictingLayer",
    "PromptLayer",
    "PromptPhase",
]


class PromptPhase(enum.Enum):
    """What a ``PromptLayer``'s forward does (module docstring)."""

    PREFILL = "prefill"  # the prompt is being read (``prompt.chunks``: chunks seen so far)
    # S10.1 scores: prefill seen (``last_query_attention`` kept), the reconstruction pass
    # (probkv.hf.reconstruct) has not run; during its forwards the phase is RECONSTRUCTING
    AWAITING_RECONSTRUCTION = "awaiting_reconstruction"
    RECONSTRUCTING = "reconstructing"  # a reconstruction chunk attends, never stored
    OBSERVED = "observed"  # prefill observed (``observations`` set), eviction pending


class EvictingLayer(CacheLayerMixin):
    """One global-attention layer's cache with eviction and decode-time correction: the base
    of its kinds (module docstring), never built itself (``ProbKVCache`` builds a
    ``PromptLayer``).

    Its state is grouped into small objects, each written by one module: ``prompt``
    (``probkv.hf.prefill.PromptReading``), ``tail`` and ``prefix`` (``probkv.hf.prefix``),
    ``decode_state`` (``probkv.hf.decode_budget.LayerDecodeState``), ``scoring``
    (``probkv.hf.reconstruct.LayerScoring``), ``report`` (``probkv.hf.eviction``). Other
    modules change the layer through its methods: ``observed``, ``continue_prefill``,
    ``end_prefill``, ``awaits_reconstruction``, ``start_scoring``/``stop_scoring``, ``evict``,
    ``hold_prefix``, ``split_sequences``, ``share_prefix``, ``record_report``, ``use_policy``,
    ``truncate_tail``, ``attention_done``.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False
    is_evicted = False

    def __init__(
        self,
        layer_idx: int,
        policy: EvictionPolicy,
        rank: int,
        num_evicting: int,
        prompt_length: int | None = None,
        decode_budget: DecodeBudget | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.policy = policy
        self.rank = rank  # position among the evicting layers
        self.num_evicting = num_evicting
        self.phase = PromptPhase.PREFILL  # while a PromptLayer (None once evicted)
        self.prompt = PromptReading(prompt_length)  # where the prompt ends (probkv.hf.prefill)
        self.tail = DenseTail()  # [1, Hkv, capacity, d]: the prompt, then tokens since eviction
        self.prefix: RaggedPrefix | None = None  # the ragged weighted prefix, once evicted
        # set by every eviction: one report per sequence of the batch
        self.sequence_reports: list[LayerReport] = []
        self.batch_size = 1  # sequences (set by the first update)
        self.scoring = None  # S10.1: the pass's per-layer scoring (RECONSTRUCTING)
        self._awaiting_attention = False  # update() ran, probkv's attention not yet
        # S10.5 (probkv.hf.decode_budget): the budget and its statistics
        self.decode_state = None if decode_budget is None else LayerDecodeState(decode_budget)
        # S10.5 in a batch (``BudgetedBatchLayer``): one single-sequence layer per sequence,
        # its prefix a view of ``prefix`` (``probkv.hf.decode_budget.split_batch``)
        self.sequence_layers: list[EvictingLayer] | None = None

    @property
    def prompt_length(self) -> int | None:
        return self.prompt.length

    @property
    def decode_budget(self) -> DecodeBudget | None:
        return None if self.decode_state is None else self.decode_state.budget

    @property
    def prefix_length(self) -> int:
        """Logical entries covered by the prefix (tokens seen at the latest eviction)."""
        return 0 if self.prefix is None else self.prefix.covers

    @property
    def tail_length(self) -> int:
        return self.tail.length

    @property
    def last_query_attention(self) -> torch.Tensor | None:
        return self.prompt.last_query_attention

    @property
    def report(self) -> LayerReport | None:
        """The latest eviction's report of one sequence (a batch: ``sequence_reports``)."""
        self._check_single("report", "sequence_reports")
        return self.sequence_reports[0] if self.sequence_reports else None

    @property
    def pads(self) -> list[int]:
        """Each sequence's left padding in the prompt (``probkv.hf.prefill.prompt_pads``)."""
        return self.prompt.pads if self.prompt.pads is not None else [0] * self.batch_size

    @property
    def num_segments(self) -> int:
        """(sequence, KV head) pairs: the heads of the ragged layout, sequence after sequence."""
        return self.batch_size * self.num_heads

    def _check_single(self, name: str, instead: str) -> None:
        if self.batch_size != 1:
            raise ValueError(
                f"layer {self.layer_idx} holds a batch of {self.batch_size} sequences: "
                f"{name} describes one sequence; read {instead} (one per sequence)"
            )

    # ----------------------------------------------------------------- protocol
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.num_heads = key_states.shape[1]
        self.batch_size = key_states.shape[0]
        self.is_initialized = True

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args,
        kwargs: dict | None = None,
        **other,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_initialized and key_states.shape[0] != self.batch_size:
            raise ValueError(guards.batch_message(key_states, self.batch_size))
        if self._awaiting_attention:
            raise RuntimeError(
                f"layer {self.layer_idx}: the previous forward did not run probkv's attention function; "
                "call probkv.hf.prepare_model(model) so the model uses attn_implementation='probkv'."
            )
        seen = self.store(key_states, value_states)
        layer_handoff.hand_over(self, kwargs)  # to the attention function (probkv.hf.layer_handoff)
        self._awaiting_attention = True
        return seen

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """``update``'s storage: the new entries into the dense tail; returns the keys and
        values the attention sees (the whole tail)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.tail.append(key_states, value_states, self.tail_capacity)
        return self.tail_keys, self.tail_values

    def tail_capacity(self, need: int, planned: int) -> int:
        """How far the tail grows (``DenseTail.append``'s ``limit``): as planned, unless a
        kind bounds it."""
        return planned

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Physical sizes: what the attention actually sees after this update (S6 pitfall).
        probkv's attention function builds the masks of evicting layers itself from these.
        In a batch, the offset aligns the mask's last columns with the dense tail, whose
        padding (a later input padded on the left) the evicted attention reads from it."""
        offset = self.get_seq_length() - self.physical_length() if self.batch_size > 1 else 0
        return self.physical_length() + query_length, offset

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Back to an empty ``PromptLayer`` of the same prompt length and budget."""
        args = (self.policy, self.rank, self.num_evicting, self.prompt.length)
        budget = self.decode_budget
        self.__class__ = PromptLayer
        self.__init__(self.layer_idx, *args, budget)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens of the tail (never the evicted prefix)."""
        check_no_budget(self.decode_budget, "crop")
        if tokens_to_remove > 0 or -tokens_to_remove > self.tail.length:
            raise ValueError(
                f"crop takes a negative count of at most the {self.tail.length} tokens added since "
                f"eviction; got {tokens_to_remove}"
            )
        self.tail.truncate(self.tail.length + tokens_to_remove)

    def truncate_tail(self, length: int) -> None:
        """Keep the first ``length`` tokens added since eviction (``answer``, ``rewind``)."""
        self.tail.truncate(length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("probkv caches do not support beam search (num_beams > 1)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise ValueError(
                "probkv caches do not copy their sequences: num_return_sequences/num_beams > 1 "
                f"(got {repeats}) is not supported"
            )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not torch.equal(indices.cpu(), torch.arange(self.batch_size)):
            raise ValueError(
                "probkv caches do not select sequences of their batch (contrastive search)"
            )

    # ------------------------------------------------------------------ storage
    @property
    def tail_keys(self) -> torch.Tensor:
        return self.tail.keys

    @property
    def tail_values(self) -> torch.Tensor:
        return self.tail.values

    def nbytes(self) -> int:
        """Bytes held by this layer: prefix (keys, values, log-weights) plus the
        allocated tail buffer (capacity, not just length)."""
        return (0 if self.prefix is None else self.prefix.nbytes()) + self.tail.nbytes()

    # ----------------------------------------------------------------- eviction
    def attention_done(self) -> None:
        """probkv's attention function ran after ``update`` (checked at the next update)."""
        self._awaiting_attention = False

    def use_policy(self, policy: EvictionPolicy) -> None:
        """The policy that evicts this layer (``ProbKVCache.evict(policy)``)."""
        self.policy = policy

    @property
    def observation(self) -> LayerObservation | None:
        """A single sequence's observation (``observations``: each sequence's in a batch)."""
        self._check_single("observation", "observations")
        observations = self.observations
        return None if observations is None else observations[0]

    @property
    def observations(self) -> list[LayerObservation] | None:
        """Per sequence, held by a prompt layer in phase ``OBSERVED`` (``None`` after eviction)."""
        return self.prompt.observations

    def record_report(self, reports: list[LayerReport]) -> None:
        """What the latest eviction left, per sequence (``probkv.hf.eviction.apply_selection``)."""
        self.sequence_reports = list(reports)

    def evict(self, selection: RaggedSelection) -> None:
        """Keep ``selection`` of the entries this layer holds now, compose log-weights (S4).
        Called by ``probkv.hf.eviction.apply_selection`` only (every eviction goes there).

        Indices of head ``h`` refer to its current entries in order: its prefix entries (if
        this layer was evicted before), then every tail entry. Tail entries carry no weight;
        prefix entries keep theirs and the new ones add (a second eviction multiplies weights).
        In a batch, the selection's heads are the (sequence, KV head) segments, sequence after
        sequence, and a sequence's prompt entries exclude its padding.
        """
        if not self.is_initialized:
            raise ValueError(f"layer {self.layer_idx} holds nothing to evict")
        if selection.num_heads != self.num_segments:
            raise ValueError(
                f"selection has {selection.num_heads} heads, layer {self.layer_idx} has "
                f"{self.num_segments} ({self.batch_size} sequences of {self.num_heads} KV heads)"
            )
        self.hold_prefix(kept_prefix(self, selection))

    def hold_prefix(self, prefix: RaggedPrefix) -> None:
        """Hold ``prefix`` in place of every entry so far (``evict``; a budgeted batch's joined
        prefix, ``decode_budget.join_batch``): the dense buffer is freed (the next token
        allocates a small tail), the prompt's reading is done, and the layer becomes its
        evicted kind: ``EvictedLayer``, ``BudgetedLayer`` with a decode budget,
        ``BudgetedBatchLayer`` for a batch held to one."""
        self.prefix = prefix
        self.tail.clear()
        self.prompt = PromptReading(self.prompt.length, complete=True, pads=self.prompt.pads)
        self.phase = None
        if self.decode_state is None:
            self.__class__ = EvictedLayer
        elif self.sequence_layers is None:
            self.__class__ = BudgetedLayer
        else:
            self.__class__ = BudgetedBatchLayer

    def share_prefix(self, prefix: RaggedPrefix) -> None:
        """A sequence of a budgeted batch: hold ``prefix``, the same entries as its own prefix
        as a view of the batch's joined one (``decode_budget.join_batch``)."""
        self.prefix = prefix


class PromptLayer(EvictingLayer):
    """The prompt, stored densely and undecided (module docstring): its ``phase`` moves through
    ``observed``, ``continue_prefill``, ``end_prefill``, ``awaits_reconstruction`` and
    ``start_scoring``/``stop_scoring``; ``evict`` makes it an evicted kind."""

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor):
        if self.phase is PromptPhase.RECONSTRUCTING:
            # S10.1: the chunk attends to the cache and to itself but is never stored
            self.scoring.keys, self.scoring.values = key_states, value_states
            return self.tail_keys, self.tail_values
        return super().store(key_states, value_states)

    def tail_capacity(self, need: int, planned: int) -> int:
        """The whole prompt at its first chunk when its length is known (no copy per chunk)."""
        if self.phase is PromptPhase.PREFILL and self.prompt.length:
            return max(need, self.prompt.length)
        return planned

    def get_seq_length(self) -> int:
        """Logical length: every token the layer has seen (positions, RoPE)."""
        return self.tail.length

    def physical_length(self, head: int | None = None) -> int:
        """Entries stored for one KV head, or the longest: the prompt so far."""
        return self.tail.length

    @property
    def observations(self) -> list[LayerObservation] | None:
        """Per sequence, held in phase ``OBSERVED``; provisional ones (the prompt's end
        unknown) are computed from the chunk statistics when first read."""
        prompt = self.prompt
        if prompt.observations is None and self.phase is PromptPhase.OBSERVED and prompt.chunks:
            prompt.observations = [
                chunks.observe(
                    self.tail_keys[b, :, pad:],
                    self.tail_values[b, :, pad:],
                    layer_idx=self.layer_idx,
                    rank=self.rank,
                )
                for b, (chunks, pad) in enumerate(zip(prompt.chunks, self.pads))
            ]
        return prompt.observations

    def unpadded(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``b``'s prompt keys and values ``[Hkv, t_b, d]`` before eviction."""
        pad = self.pads[b]
        return self.tail_keys[b, :, pad:], self.tail_values[b, :, pad:]

    def split_sequences(self) -> list[PromptLayer]:
        """This ``OBSERVED`` batch held to a decode budget as one single-sequence layer per
        sequence (``sequence_layers``, ``decode_budget.split_batch``)."""
        self.sequence_layers = [self.sequence(b) for b in range(len(self.pads))]
        return self.sequence_layers

    def sequence(self, b: int) -> PromptLayer:
        """Sequence ``b`` of this ``OBSERVED`` batch as a single-sequence layer holding its
        unpadded prompt (views of this one's tail) and observation, as if that prompt had been
        read alone."""
        args = (self.policy, self.rank, self.num_evicting, None, self.decode_budget)
        one = PromptLayer(self.layer_idx, *args)
        one.device, one.dtype, one.num_heads = self.device, self.dtype, self.num_heads
        one.batch_size, one.is_initialized = 1, True
        one.tail = self.tail.sequence(b, self.pads[b])
        one.prompt = PromptReading(
            one.tail.length, complete=True, observations=[self.observations[b]], pads=[0]
        )
        one.phase = PromptPhase.OBSERVED
        return one

    def observed(self, observations: list[LayerObservation] | None, *, final: bool = True) -> None:
        """``PREFILL`` -> ``OBSERVED``. ``final`` (the whole prompt): a layerwise policy evicts
        now (the full cache never exists at once); else :meth:`end_prefill` ends it later."""
        if self.phase not in (PromptPhase.PREFILL, PromptPhase.AWAITING_RECONSTRUCTION):
            raise RuntimeError(
                f"layer {self.layer_idx} was observed twice (phase {self.phase.name})"
            )
        self.prompt.observations = observations
        self.prompt.last_query_attention = None
        self.phase = PromptPhase.OBSERVED
        if final:
            self.end_prefill()

    def continue_prefill(self) -> None:
        """Another prompt chunk after a provisional observation: ``OBSERVED`` -> ``PREFILL``."""
        for chunks in self.prompt.chunks:
            chunks.check_next_chunk()
        self.prompt.observations = None
        self.phase = PromptPhase.PREFILL

    def end_prefill(self) -> None:
        """The observation covers the whole prompt (computed now if provisional): drop the
        chunk statistics; a layerwise policy evicts now."""
        self.prompt.observations = self.observations
        self.prompt.chunks = None
        self.prompt.complete = True
        if self.policy.layerwise:
            evict_layers(self.policy, [self], num_layers=self.num_evicting)

    def awaits_reconstruction(self, last_query_attention: torch.Tensor | list) -> None:
        """The prefill of a reconstruction score (S10.1): keep ``p_t`` (a batch: one per
        sequence) for the report and wait for the pass (``PREFILL`` ->
        ``AWAITING_RECONSTRUCTION``)."""
        if self.phase is not PromptPhase.PREFILL:
            raise RuntimeError(f"layer {self.layer_idx}: prefill seen twice ({self.phase.name})")
        self.prompt.last_query_attention = last_query_attention
        self.phase = PromptPhase.AWAITING_RECONSTRUCTION

    def start_scoring(self, scoring) -> None:
        """A reconstruction chunk's forward (S10.1): ``AWAITING_RECONSTRUCTION`` ->
        ``RECONSTRUCTING``, ``scoring`` (a ``LayerScoring``) receives the chunk."""
        if self.phase is not PromptPhase.AWAITING_RECONSTRUCTION:
            raise RuntimeError(f"layer {self.layer_idx}: not awaiting reconstruction")
        self.scoring, self.phase = scoring, PromptPhase.RECONSTRUCTING

    def stop_scoring(self) -> None:
        """After a reconstruction chunk: back to ``AWAITING_RECONSTRUCTION``."""
        self.scoring, self.phase = None, PromptPhase.AWAITING_RECONSTRUCTION


class EvictedLayer(EvictingLayer):
    """A ragged weighted prefix and the dense tail of the tokens since (module docstring);
    ``evict`` may run again (a second eviction composes the weights)."""

    is_evicted = True

    def get_seq_length(self) -> int:
        """Logical length: every token the layer has seen, evicted or not (positions, RoPE)."""
        return self.prefix_length + self.tail.length

    def physical_length(self, head: int | None = None) -> int:
        """Entries stored for one KV head (a (sequence, KV head) segment in a batch: index
        ``b * Hkv + h``), or the longest."""
        lengths = self.prefix.lengths if head is None else [self.prefix.lengths[head]]
        return max(lengths) + self.tail.length


class BudgetedLayer(EvictedLayer):
    """An evicted layer held to a decode budget (S10.5, ``probkv.hf.decode_budget``): its
    tail grows to at most what the head holding most entries may reach, ``B + K``; the
    attention runs a stage when one is due; ``crop`` is refused."""

    def tail_capacity(self, need: int, planned: int) -> int:
        return tail_room(self, need, planned)


class BudgetedBatchLayer(BudgetedLayer):
    """A batch held to a decode budget (S10.5, S11 batches): each sequence is a
    ``BudgetedLayer`` of its own (``sequence_layers``: its own tail, stages and statistics);
    this layer holds their prefixes joined (views of it), for one attention call over every
    (sequence, KV head) segment (``probkv.hf.attention.batched_budget_attention``)."""

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Each sequence's new entries into its own tail; the attention reads them there."""
        append_to_sequences(self.sequence_layers, key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        """The padded length: each sequence's, plus its padding."""
        return self.sequence_layers[0].get_seq_length() + self.pads[0]

    def physical_length(self, head: int | None = None) -> int:
        return sequences_length(self.sequence_layers, self.num_heads, head)

    def nbytes(self) -> int:
        """The joined prefix and every sequence's own tail."""
        return super().nbytes() + sum(one.tail.nbytes() for one in self.sequence_layers)
