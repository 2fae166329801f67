"""An evicting KV cache on transformers' cache-layer protocol (S3, S4, S6).

``EvictingLayer`` is one global-attention layer's cache: before eviction a dense ``[B, Hkv, T,
d]`` buffer like transformers' ``DynamicLayer`` (``B`` sequences of a left-padded batch, S11;
usually one); after it a *ragged, weighted prefix* (every (sequence,) KV head's kept entries
flattened head after head into ``[N, d]`` keys and ``[N, d_v]`` values, Ada-KV's layout, padding
never kept, one float32 log-weight per entry, S4) and a dense *tail* of the tokens since. Decode
attention is one softmax over prefix (logits ``+ log w``) and tail (``probkv.hf.attention``).
Logical length (positions: ``get_seq_length``) and physical length (storage, masks:
``get_mask_sizes``) are kept apart (S6 pitfall).

States (``LayerState``): ``PREFILL`` (the prompt, in one or several forwards:
``probkv.hf.prefill``) -> ``OBSERVED`` (eviction waits for the prompt's end or the other layers)
-> ``EVICTED``; reconstruction scores (KVzip, S10.1) pass through ``AWAITING_RECONSTRUCTION``
and ``RECONSTRUCTING`` (each chunk of the pass) before ``OBSERVED``.

``ProbKVCache`` is the ``Cache``: an ``EvictingLayer`` per global-attention layer, transformers'
own sliding-window layers elsewhere (Gemma-3's are not evicted). Every eviction goes through
``probkv.hf.eviction``; a decode budget (``max_entries``) evicts again during generation
(``probkv.hf.decode_budget``, S10.5), in a batch per sequence (``sequence_layers``).
"""

from __future__ import annotations

import copy
import enum

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from probkv._checks import check_positive_int
from probkv.estimation.selection import RaggedSelection
from probkv.hf import accounting, guards, layer_handoff
from probkv.hf.decode_budget import (
    DecodeBudget,
    LayerDecodeState,
    append_to_sequences,
    budget_from_options,
    check_no_budget,
    sequences_length,
    tail_room,
)
from probkv.hf.eviction import evict_layers
from probkv.hf.prefill import ObserveOnly, PromptReading
from probkv.hf.prefix import DenseTail, RaggedPrefix, kept_prefix
from probkv.hf.report import LayerReport
from probkv.policies.base import EvictionPolicy, LayerObservation
from probkv.scores.scorer_lookup import with_scorer

__all__ = ["EvictingLayer", "LayerReport", "LayerState", "ObserveOnly", "ProbKVCache"]


class LayerState(enum.Enum):
    """Where an ``EvictingLayer`` is in its life (module docstring)."""

    PREFILL = "prefill"  # the prompt is being read (``prompt.chunks``: chunks seen so far)
    # S10.1 scores: prefill seen (``last_query_attention`` kept), the reconstruction pass
    # (probkv.hf.reconstruct) has not run; during its forwards the state is RECONSTRUCTING
    AWAITING_RECONSTRUCTION = "awaiting_reconstruction"
    RECONSTRUCTING = "reconstructing"  # a reconstruction chunk attends, never stored
    OBSERVED = "observed"  # prefill observed (``observation`` set), eviction pending
    EVICTED = "evicted"  # a ragged weighted prefix (``prefix``) and a dense tail


class EvictingLayer(CacheLayerMixin):
    """One global-attention layer's cache with eviction and decode-time correction.

    Its state is grouped into small objects, each written by one module: ``prompt``
    (``probkv.hf.prefill.PromptReading``), ``tail`` and ``prefix`` (``probkv.hf.prefix``),
    ``decode_state`` (``probkv.hf.decode_budget.LayerDecodeState``), ``scoring``
    (``probkv.hf.reconstruct.LayerScoring``), ``report`` (``probkv.hf.eviction``). Other
    modules change the layer through its methods: ``observed``, ``continue_prefill``,
    ``end_prefill``, ``awaits_reconstruction``, ``start_scoring``/``stop_scoring``, ``evict``,
    ``record_report``, ``use_policy``, ``truncate_tail``, ``attention_done``.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

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
        self.state = LayerState.PREFILL
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
        # S10.5 in a batch: from the prompt's eviction on, one single-sequence layer per
        # sequence, its prefix a view of ``prefix`` (``probkv.hf.decode_budget.split_batch``)
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
        if self.sequence_layers is not None:  # a batch held to a decode budget: own tails
            append_to_sequences(self.sequence_layers, key_states, value_states)
        elif self.state is LayerState.RECONSTRUCTING:
            # S10.1: the chunk attends to the cache and to itself but is never stored
            self.scoring.keys, self.scoring.values = key_states, value_states
        else:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.tail.append(key_states, value_states, self.tail_capacity)
        layer_handoff.hand_over(self, kwargs)  # to the attention function (probkv.hf.layer_handoff)
        self._awaiting_attention = True
        if self.sequence_layers is not None:
            return key_states, value_states  # probkv's attention reads the sequences' own
        return self.tail_keys, self.tail_values

    def tail_capacity(self, need: int, planned: int) -> int:
        """How far the tail grows: the whole prompt at its first chunk when its length is
        known (no copy per chunk); with a decode budget, ``decode_budget.tail_room``."""
        if self.state is LayerState.PREFILL and self.prompt.length:
            return max(need, self.prompt.length)
        if self.state is LayerState.EVICTED and self.decode_state is not None:
            return tail_room(self, need, planned)
        return planned

    def get_seq_length(self) -> int:
        """Logical length: every token the layer has seen, evicted or not (positions, RoPE)."""
        if self.sequence_layers is not None:  # the padded length: each sequence's, + its pad
            return self.sequence_layers[0].get_seq_length() + self.pads[0]
        return self.prefix_length + self.tail.length

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
        args = (self.policy, self.rank, self.num_evicting, self.prompt.length)
        self.__init__(self.layer_idx, *args, self.decode_budget)

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

    def physical_length(self, head: int | None = None) -> int:
        """Entries stored for one KV head (a (sequence, KV head) segment in a batch: index
        ``b * Hkv + h``), or the longest."""
        if self.sequence_layers is not None:
            return sequences_length(self.sequence_layers, self.num_heads, head)
        if self.prefix is None:
            return self.tail.length
        lengths = self.prefix.lengths if head is None else [self.prefix.lengths[head]]
        return max(lengths) + self.tail.length

    def nbytes(self) -> int:
        """Bytes held by this layer: prefix (keys, values, log-weights) plus the
        allocated tail buffer (capacity, not just length); in a batch held to a decode budget,
        the joined prefix and every sequence's own tail."""
        held = (0 if self.prefix is None else self.prefix.nbytes()) + self.tail.nbytes()
        if self.sequence_layers is not None:
            held += sum(layer.tail.nbytes() for layer in self.sequence_layers)
        return held

    # ----------------------------------------------------------------- eviction
    @property
    def is_evicted(self) -> bool:
        return self.state is LayerState.EVICTED

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
        """Per sequence, held in state ``OBSERVED``; provisional ones (the prompt's end
        unknown) are computed from the chunk statistics when first read."""
        prompt = self.prompt
        if prompt.observations is None and self.state is LayerState.OBSERVED and prompt.chunks:
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

    def observed(self, observations: list[LayerObservation] | None, *, final: bool = True) -> None:
        """``PREFILL`` -> ``OBSERVED``. ``final`` (the whole prompt): a layerwise policy evicts
        now (the full cache never exists at once); else :meth:`end_prefill` ends it later."""
        if self.state not in (LayerState.PREFILL, LayerState.AWAITING_RECONSTRUCTION):
            raise RuntimeError(
                f"layer {self.layer_idx} was observed twice (state {self.state.name})"
            )
        self.prompt.observations = observations
        self.prompt.last_query_attention = None
        self.state = LayerState.OBSERVED
        if final:
            self.end_prefill()

    def continue_prefill(self) -> None:
        """Another prompt chunk after a provisional observation: ``OBSERVED`` -> ``PREFILL``."""
        for chunks in self.prompt.chunks:
            chunks.check_next_chunk()
        self.prompt.observations = None
        self.state = LayerState.PREFILL

    def end_prefill(self) -> None:
        """The observation covers the whole prompt (computed now if provisional): drop the
        chunk statistics; a layerwise policy evicts now."""
        self.prompt.observations = self.observations
        self.prompt.chunks = None
        self.prompt.complete = True
        if self.policy.layerwise:
            evict_layers(self.policy, [self], num_layers=self.num_evicting)

    def record_report(self, reports: list[LayerReport]) -> None:
        """What the latest eviction left, per sequence (``probkv.hf.eviction.apply_selection``)."""
        self.sequence_reports = list(reports)

    def awaits_reconstruction(self, last_query_attention: torch.Tensor | list) -> None:
        """The prefill of a reconstruction score (S10.1): keep ``p_t`` (a batch: one per
        sequence) for the report and wait for the pass (``PREFILL`` ->
        ``AWAITING_RECONSTRUCTION``)."""
        if self.state is not LayerState.PREFILL:
            raise RuntimeError(f"layer {self.layer_idx}: prefill seen twice ({self.state.name})")
        self.prompt.last_query_attention = last_query_attention
        self.state = LayerState.AWAITING_RECONSTRUCTION

    def start_scoring(self, scoring) -> None:
        """A reconstruction chunk's forward (S10.1): ``AWAITING_RECONSTRUCTION`` ->
        ``RECONSTRUCTING``, ``scoring`` (a ``LayerScoring``) receives the chunk."""
        if self.state is not LayerState.AWAITING_RECONSTRUCTION:
            raise RuntimeError(f"layer {self.layer_idx}: not awaiting reconstruction")
        self.scoring, self.state = scoring, LayerState.RECONSTRUCTING

    def stop_scoring(self) -> None:
        """After a reconstruction chunk: back to ``AWAITING_RECONSTRUCTION``."""
        self.scoring, self.state = None, LayerState.AWAITING_RECONSTRUCTION

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
        self.prefix = kept_prefix(self, selection)
        self.tail.clear()  # free the dense buffer; the next token allocates a small tail
        self.prompt = PromptReading(self.prompt.length, complete=True, pads=self.prompt.pads)
        self.state = LayerState.EVICTED


class ProbKVCache(Cache):
    """A ``transformers.Cache`` that evicts with a probkv policy after prefill.

    Build it for a model prepared with ``probkv.hf.prepare_model`` and pass it to ``generate``
    (``cache=...``) or to a forward loop. The prompt is observed: the attention function
    computes each layer's output and the statistics the policy needs from the real post-RoPE
    queries, keys and values, in one or several forwards (``probkv.hf.prefill``: where the
    prompt ends). Eviction runs when it has ended and every evicting layer is observed, at
    the next forward or on ``evict()``; with ``prompt_length``, layerwise policies evict each
    layer right after its last prefill attention (the full cache never exists at once). A
    cache holds one prompt and refuses input that does not continue it (``hf.guards``).
    ``max_entries=B``, ``every=K`` (default 1; only with ``max_entries``): a decode budget,
    at most ``B + K`` entries per KV head from the prompt's eviction on, for any length
    generated one token at a time (the prompt evicted to ``B``, then every ``K`` new
    entries; the budget replaces the policy's ``ratio``; ``probkv.hf.decode_budget``, S10.5);
    in a batch, per sequence, at the steps it would alone (new tokens without padding).
    """

    def __init__(
        self,
        config,
        policy: EvictionPolicy,
        *,
        prompt_length: int | None = None,
        max_entries: int | None = None,
        every: int | None = None,
    ) -> None:
        guards.check_policy_type(policy)
        if prompt_length is not None:
            check_positive_int(prompt_length, "prompt_length")
        budget = budget_from_options(max_entries, every)
        if budget is not None:
            budget.check_policy(policy)
        policy = with_scorer(policy, config)  # kvzap: the model's scorer (S11)
        text_config = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
        num_evicting = layer_types.count("full_attention")
        layers: list[CacheLayerMixin] = []
        for i, (kind, kw) in enumerate(zip(layer_types, layer_kwargs)):
            if kind == "full_attention":
                rank = layer_types[:i].count("full_attention")
                layers.append(EvictingLayer(i, policy, rank, num_evicting, prompt_length, budget))
            elif kind == "sliding_attention":
                layers.append(DynamicSlidingWindowLayer(**kw))
            else:
                raise ValueError(
                    f"layer {i} has type {kind!r}; probkv supports 'full_attention' (evicted) and "
                    "'sliding_attention' (kept as is) layers"
                )
        if not any(isinstance(layer, EvictingLayer) for layer in layers):
            raise ValueError(
                "this model has no global-attention layer to evict (every layer uses a sliding window)"
            )
        super().__init__(layers=layers)
        self.model_config = config  # a later evict(policy) finds kvzap's scorer with it
        self.policy = policy
        self.observing = policy  # the score (and parameters) its prefill observes
        self.evicting_layers = [
            i for i, layer in enumerate(layers) if isinstance(layer, EvictingLayer)
        ]
        self.num_evictions = 0
        self.prompt_length = prompt_length
        self.decode_budget = budget
        self.layer_types = list(layer_types)  # of the config it was built for (checked)
        # ``[B, t]`` the token ids the cache holds, set by ``probkv.hf.compress`` / ``observe``
        # and by ``model.generate`` (``probkv.hf.model``), so that generation continues with
        # true positions and a different prompt is refused; ``None`` while unknown. A padded
        # batch's ``attention_mask`` ``[B, t]`` (``None``: nothing padded) goes with them.
        self.token_ids: torch.Tensor | None = None
        self.attention_mask: torch.Tensor | None = None
        self.generate_mask: torch.Tensor | None = (
            None  # the mask of a running generate (hf.accounting)
        )

    # ---------------------------------------------------------------- protocol
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        guards.check_layer_index(layer_idx, len(self.layers))  # another model's layers: refused
        if layer_idx == 0:  # a new forward starts at layer 0
            first = self.layers[self.evicting_layers[0]]
            if first.is_initialized and key_states.shape[0] != first.batch_size:
                raise ValueError(guards.batch_message(key_states, first.batch_size))
            self._start_forward(key_states.shape[-2], kwargs.get("kwargs"))
        if layer_idx == 0 and self.awaiting_reconstruction:
            raise ValueError(
                f"score {self.policy.score!r} is read from a reconstruction pass over the context "
                "(KVzip, S10.1), a second model run that a cache cannot start from inside "
                "generate() or a forward; build the cache with probkv.hf.compress(model, ids, "
                "policy, repeat_prompt=...) or probkv.hf.observe(...)"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _start_forward(self, new_tokens: int, attention_kwargs: dict | None) -> None:
        """Checks and decisions before a forward's first layer: the model is the cache's, the
        input continues what the cache holds, and where the prompt ends (module docstring)."""
        guards.check_layers_used(self.layers)
        guards.check_continues(
            self.get_seq_length(), attention_kwargs, accounting.prompt_tokens(self)
        )
        guards.check_prompt_end(self.prompt_length, self.get_seq_length(), new_tokens)
        if self.prefill_open:
            if new_tokens > 1:  # another chunk of the prompt
                for i in self.evicting_layers:
                    self.layers[i].continue_prefill()
            else:  # the first decode step: the prompt has ended
                self.end_prefill()
        if self.eviction_pending:  # a global decision, or the prompt's end, left pending
            self.evict()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Any evicting layer gives the logical length; sliding layers count tokens too.
        return self.layers[self.evicting_layers[0]].get_seq_length()

    # ---------------------------------------------------------------- eviction
    @property
    def awaiting_reconstruction(self) -> bool:
        """The prefill observed a reconstruction score (S10.1) and the pass has not run."""
        return any(
            self.layers[i].state is LayerState.AWAITING_RECONSTRUCTION for i in self.evicting_layers
        )

    @property
    def eviction_pending(self) -> bool:
        """Every evicting layer observed its prefill and waits for the policy (global scope)."""
        return all(self.layers[i].state is LayerState.OBSERVED for i in self.evicting_layers)

    @property
    def prefill_open(self) -> bool:
        """The layers hold a provisional observation: the prompt may go on (module docstring)."""
        return any(
            self.layers[i].state is LayerState.OBSERVED and not self.layers[i].prompt.complete
            for i in self.evicting_layers
        )

    def end_prefill(self) -> None:
        """Declare the prompt ended (``probkv.hf.prefill``): the observations become final;
        layerwise policies evict now, a global one at the next forward or ``evict()``."""
        layers = [self.layers[i] for i in self.evicting_layers]
        if any(layer.state is LayerState.PREFILL for layer in layers):
            of = f" of prompt_length={self.prompt_length}" if self.prompt_length else ""
            raise ValueError(f"the prompt cannot end after {self.get_seq_length()} tokens{of}")
        for layer in layers:
            if layer.state is LayerState.OBSERVED and not layer.prompt.complete:
                layer.end_prefill()

    def evict(self, policy: EvictionPolicy | None = None) -> None:
        """Run the policy on every observed layer and evict them.

        ``policy`` replaces the cache's policy first: a cache observed once (``observe``) can
        be copied and evicted with several policies that observe the same score. A
        ``layerwise`` policy selects layer by layer, exactly as it would have during prefill
        (same random draws); a global one sees every layer at once (S3 global scope).
        """
        layers = [self.layers[i] for i in self.evicting_layers]
        if policy is not None:  # what the policy is, before whether the cache can serve it
            guards.check_policy_type(policy)
            if self.decode_budget is not None:
                self.decode_budget.check_policy(policy)
            policy = with_scorer(policy, self.model_config)
        guards.check_can_evict({layer.layer_idx: layer.state.value for layer in layers})
        if policy is not None:
            guards.check_observed(self.observing, policy)
            self.policy = policy
            for layer in layers:
                layer.use_policy(policy)
        evict_layers(self.policy, layers, num_layers=len(self.evicting_layers))
        self.num_evictions += 1

    def rewind(self) -> None:
        """Drop every token added after eviction, back to the compressed state (question-
        agnostic workflow: each question starts from the same compressed context)."""
        check_no_budget(self.decode_budget, "rewind")
        guards.check_rewind(self.layers)
        for layer in self.layers:
            layer.truncate_tail(0)

    def before_generate(self, ids: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
        """Before ``model.generate`` on ``ids [B, n]``: ``probkv.hf.accounting.before_generate``."""
        return accounting.before_generate(self, ids, attention_mask)

    def after_generate(self, sequences: torch.Tensor) -> None:
        """After ``model.generate``: ``probkv.hf.accounting.after_generate``."""
        accounting.after_generate(self, sequences)

    def copy(self) -> ProbKVCache:
        return copy.deepcopy(self)

    # ------------------------------------------------------------- diagnostics
    # (``probkv.hf.accounting``: per ``sequence`` of a batch, or the whole cache's)
    @property
    def batch_size(self) -> int:
        return accounting.batch_size(self)

    def reports(self, sequence: int | None = None) -> list[LayerReport]:
        return accounting.reports(self, sequence)

    def nbytes(self, sequence: int | None = None) -> int:
        return accounting.nbytes(self, sequence)

    def effective_ratio(self, sequence: int | None = None) -> float:
        """Mean over evicting layers and heads of the fraction of prefix entries evicted."""
        return accounting.effective_ratio(self, sequence)
