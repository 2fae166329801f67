"""An evicting KV cache on transformers' cache-layer protocol (S3, S4, S6).

``ProbKVCache`` is the ``Cache``: an evicting layer per global-attention layer
(``probkv.hf.layers``: a ``PromptLayer`` that holds the prompt densely, undecided, and becomes
an ``EvictedLayer``, a ragged weighted prefix and a dense tail, when evicted; a
``BudgetedLayer`` under a decode budget), transformers' own sliding-window layers elsewhere
(Gemma-3's are not evicted). Every eviction goes through ``probkv.hf.eviction``; a decode
budget (``max_entries``) evicts again during generation (``probkv.hf.decode_budget``, S10.5),
in a batch per sequence (``BudgetedBatchLayer``).
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from probkv._checks import check_positive_int
from probkv.hf import accounting, guards
from probkv.hf.decode_budget import budget_from_options, check_no_budget
from probkv.hf.eviction import evict_layers
from probkv.hf.layers import (
    EvictingLayer,
    PromptLayer,
    PromptPhase,
)
from probkv.hf.report import LayerReport
from probkv.policies.base import EvictionPolicy
from probkv.scores.scorer_lookup import with_scorer

__all__ = ["ProbKVCache"]


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
                layers.append(PromptLayer(i, policy, rank, num_evicting, prompt_length, budget))
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
        return any(self._in_phase(PromptPhase.AWAITING_RECONSTRUCTION))

    @property
    def eviction_pending(self) -> bool:
        """Every evicting layer observed its prefill and waits for the policy (global scope)."""
        return all(self._in_phase(PromptPhase.OBSERVED))

    @property
    def prefill_open(self) -> bool:
        """The layers hold a provisional observation: the prompt may go on (module docstring)."""
        observed = self._in_phase(PromptPhase.OBSERVED)
        return any(
            o and not self.layers[i].prompt.complete for o, i in zip(observed, self.evicting_layers)
        )

    def _in_phase(self, phase: PromptPhase) -> list[bool]:
        """Per evicting layer, whether it is a prompt layer in ``phase`` (evicted: never)."""
        return [self.layers[i].phase is phase for i in self.evicting_layers]

    def end_prefill(self) -> None:
        """Declare the prompt ended (``probkv.hf.prefill``): the observations become final;
        layerwise policies evict now, a global one at the next forward or ``evict()``."""
        layers = [self.layers[i] for i in self.evicting_layers]
        if any(layer.phase is PromptPhase.PREFILL for layer in layers):
            of = f" of prompt_length={self.prompt_length}" if self.prompt_length else ""
            raise ValueError(f"the prompt cannot end after {self.get_seq_length()} tokens{of}")
        for layer in layers:
            if layer.phase is PromptPhase.OBSERVED and not layer.prompt.complete:
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
        guards.check_can_evict(
            {
                layer.layer_idx: "evicted" if layer.is_evicted else layer.phase.value
                for layer in layers
            }
        )
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
