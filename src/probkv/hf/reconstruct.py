"""KVzip's reconstruction pass on a transformers model (S10.1).

After the prefill of a context (every layer observed, nothing evicted yet), the model reads
"repeat the previous context" followed by the context again, in chunks
(``probkv.scores.reconstruction.reconstruction_chunks``). Each chunk is one forward with the cache
in *scoring* mode: a ``PromptLayer`` in phase ``RECONSTRUCTING`` (its ``scoring`` set) hands
the chunk's keys and values to the attention function without storing them, which calls
``LayerScoring.attend`` (attention over the ``t`` cached entries plus the chunk,
causal; ``probkv.scores.reconstruction.reconstruction_attention``), which accumulates the layer's
statistics. Every chunk sits at positions ``t..t+n-1`` (the cache's logical length never
moves), as in KVzip's reference code. Gemma-3's sliding-window layers do store the chunk
(transformers' own layers); their state is saved before each chunk and put back after it.
The cache's tensors and lengths are unchanged by the pass (tests check bit-equality).

Then each layer's statistics become its observation (``probkv.scores.compute_scores(...,
reconstruction=stats)``) and the policy evicts as usual (``ProbKVCache.evict``).

The pass needs token ids for the instruction and the chat template's closing: build them
once from the model's tokenizer with ``repeat_prompt(tokenizer)``; the maths never sees a
tokenizer.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from probkv import scores as score_fns
from probkv.estimation.calibration import reference_stride
from probkv.hf.layers import EvictingLayer, PromptPhase
from probkv.scores.observation import LayerObservation
from probkv.scores.reconstruction import (
    DEFAULT_CHUNK_TOKENS,
    ReconstructionStats,
    reconstruction_attention,
    reconstruction_chunks,
)

# KVzip's instructions (its reference code; kvpress's KVzipPress uses the same words). They are
# the method's input, so probkv keeps them verbatim.
REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_LATER = "\n\nRepeat the part of the previous context exactly, starting with"

# Marks the user message inside the rendered chat template; cannot occur in text.
_USER_CONTENT = "\x00probkv-user-content\x00"


@dataclass(frozen=True)
class RepeatPrompt:
    """Token ids of the reconstruction prompt (S10.1), built by ``repeat_prompt(tokenizer)``.

    ``first`` / ``later``: the instruction of the first / a later chunk; ``suffix``: the chat
    template's end of the user turn and assistant header (``"\\n"`` without a template);
    ``template_prefix``: the template's opening (system prompt, user header). Cached entries
    that start with it are not reconstructed and always kept, as KVzip keeps its system prompt.
    ``RepeatPrompt()`` (all empty) feeds the context again with no instruction.
    """

    first: tuple[int, ...] = ()
    later: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    template_prefix: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("first", "later", "suffix", "template_prefix"):
            ids = getattr(self, name)
            if isinstance(ids, (str, bytes)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
            ):
                raise ValueError(f"{name} must be a sequence of token ids (ints >= 0), got {ids!r}")
            object.__setattr__(self, name, tuple(ids))

    def context_start(self, context_ids: Sequence[int]) -> int:
        """How many leading cached tokens are the template's opening (the longest common
        prefix with ``template_prefix``), leaving at least one token to reconstruct."""
        n = 0
        for a, b in zip(self.template_prefix, context_ids):
            if a != b:
                break
            n += 1
        return min(n, len(context_ids) - 1)


def repeat_prompt(tokenizer) -> RepeatPrompt:
    """KVzip's reconstruction prompt in ``tokenizer``'s ids (S10.1): the instructions, and the
    chat template's opening and closing around a user message (kvpress finds them the same
    way); without a chat template the closing is a newline and there is no opening."""
    opening, closing = "", "\n"
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _USER_CONTENT}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,  # Qwen3: answer directly, as the reference does
        )
        if not isinstance(rendered, str) or rendered.count(_USER_CONTENT) != 1:
            raise ValueError(
                "the tokenizer's chat template did not render the user message verbatim; "
                "build RepeatPrompt(...) from token ids yourself"
            )
        opening, closing = rendered.split(_USER_CONTENT)

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()

    return RepeatPrompt(
        encode(REPEAT_FIRST), encode(REPEAT_LATER), encode(closing), encode(opening)
    )


class LayerScoring:
    """An evicting layer's state during the pass (``EvictingLayer.scoring``): the
    chunk's own keys and values, set by ``update`` and never stored, and the statistics."""

    def __init__(self, context_start: int, chunk_tokens: int, reference_every: int = 1) -> None:
        self.context_start = context_start
        self.chunk_tokens = chunk_tokens
        self.reference_every = reference_every  # keep every k-th row as a reference query (S9)
        self.rows_seen = 0
        self.stats: ReconstructionStats | None = None
        self.scale: float | None = None
        self.keys: torch.Tensor | None = None  # [1, Hkv, n, d], the current chunk's
        self.values: torch.Tensor | None = None
        # KVzip+ (S11): the layer's o_proj weight [hidden, Hq d_v], the chunk rows' 1 / ||h||
        # (set by a pre-hook on the attention module), the entries' ||W_o^q v_i|| [Hq, t]
        self.o_weight: torch.Tensor | None = None
        self.row_weights: torch.Tensor | None = None
        self.column_weights: torch.Tensor | None = None

    def attend(self, layer: EvictingLayer, query: torch.Tensor, scale: float) -> torch.Tensor:
        """The chunk's attention output ``[Hq, n, d_v]`` over the ``t`` cached entries and
        itself (causal), folding its statistics into ``stats``."""
        if self.keys is None:
            raise RuntimeError(f"layer {layer.layer_idx}: no reconstruction chunk was given")
        chunk_keys, chunk_values, row_weights = self.keys[0], self.values[0], self.row_weights
        self.keys = self.values = self.row_weights = None
        return self.attend_rows(
            layer.tail_keys[0],
            layer.tail_values[0],
            query,
            chunk_keys,
            chunk_values,
            scale,
            None if row_weights is None else row_weights[0],
        )

    def attend_rows(
        self,
        context_keys: torch.Tensor,
        context_values: torch.Tensor,
        query: torch.Tensor,
        chunk_keys: torch.Tensor,
        chunk_values: torch.Tensor,
        scale: float,
        row_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One sequence's chunk rows ``query [Hq, n, d]`` over its context's entries
        (``[Hkv, t, d]``, no padding) and the chunk's own (``[Hkv, n, d]``), causal ->
        ``[Hq, n, d_v]``; the statistics follow. ``row_weights [n]``: KVzip+'s ``1 / ||h||``."""
        t = context_keys.shape[1]
        keys = torch.cat([context_keys, chunk_keys], dim=1)
        values = torch.cat([context_values, chunk_values], dim=1)
        column_weights = None
        if self.o_weight is not None:
            if self.column_weights is None:
                self.column_weights = output_norms(self.o_weight, context_values)
            column_weights = self.column_weights
        else:
            row_weights = None
        out, max_attention, sum_attention, max_weighted = reconstruction_attention(
            query,
            keys,
            values,
            context_length=t,
            scale=scale,
            row_weights=row_weights,
            column_weights=column_weights,
        )
        if self.stats is None:
            self.stats = ReconstructionStats.empty(
                keys.shape[0],
                query.shape[0],
                t,
                context_start=self.context_start,
                chunk_tokens=self.chunk_tokens,
                device=query.device,
            )
            self.scale = scale
        self.stats.add(max_attention, sum_attention, query.shape[1], max_weighted)
        n = query.shape[1]
        first = (-self.rows_seen) % self.reference_every  # rows at global index 0, k, 2k, ...
        if first < n:
            self.stats.add_reference_queries(query[:, first :: self.reference_every])
        self.rows_seen += n
        return out


class BatchScoring:
    """A layer's state during the pass over a batch (S11 batches): one ``LayerScoring`` per
    sequence, each fed only its own chunk rows against its own context without padding, so
    every sequence gathers the statistics it gathers alone. A round's chunks are padded on the
    right (``chunk_lengths``: each sequence's real rows; 0: it has no chunk this round)."""

    def __init__(self, sequences: list[LayerScoring], pads: list[int]) -> None:
        self.sequences = sequences
        self.pads = pads
        self.chunk_lengths: list[int] = [0] * len(sequences)
        self.keys: torch.Tensor | None = None  # [B, Hkv, n, d], the round's, set by update
        self.values: torch.Tensor | None = None
        self.row_weights: torch.Tensor | None = None  # [B, n] (KVzip+)

    def attend(self, layer: EvictingLayer, query: torch.Tensor, scale: float) -> torch.Tensor:
        """The round's output ``[B, Hq, n, d_v]`` (zero on padding rows)."""
        if self.keys is None:
            raise RuntimeError(f"layer {layer.layer_idx}: no reconstruction chunk was given")
        keys, values, row_weights = self.keys, self.values, self.row_weights
        self.keys = self.values = self.row_weights = None
        out = query.new_zeros(*query.shape[:3], values.shape[-1])
        for b, (scoring, n, pad) in enumerate(zip(self.sequences, self.chunk_lengths, self.pads)):
            if n == 0:
                continue
            out[b, :, :n] = scoring.attend_rows(
                layer.tail_keys[b, :, pad:],
                layer.tail_values[b, :, pad:],
                query[b, :, :n],
                keys[b, :, :n],
                values[b, :, :n],
                scale,
                None if row_weights is None else row_weights[b, :n],
            )
        return out


@torch.no_grad()
def reconstruct(
    model, cache, context_ids: torch.Tensor, prompt: RepeatPrompt | None = None
) -> None:
    """Run the reconstruction pass over the prefilled ``cache`` (``context_ids [1, t]``, the
    tokens it holds) and give every evicting layer its observation of the cache's score.
    A left-padded batch (``[B, t]``, S11 batches) runs each sequence's chunks together, one
    forward per round (``_rounds``), and each sequence is scored on its own as alone.

    ``prompt``: from ``repeat_prompt(tokenizer)``. ``None`` feeds the context again with no
    instruction (``RepeatPrompt()``) and warns: KVzip's prompt needs the tokenizer.
    """
    layers = [cache.layers[i] for i in cache.evicting_layers]
    if not all(layer.phase is PromptPhase.AWAITING_RECONSTRUCTION for layer in layers):
        raise ValueError(
            "reconstruct() needs a cache whose prefill observed a reconstruction score "
            f"({', '.join(score_fns.RECONSTRUCTION_SCORES)}) and was not reconstructed yet"
        )
    if prompt is None:
        warnings.warn(
            f"score {cache.policy.score!r} without a repeat prompt: the context is fed again "
            "with no instruction; pass repeat_prompt=probkv.hf.repeat_prompt(tokenizer) for "
            "KVzip's prompt",
            stacklevel=3,
        )
        prompt = RepeatPrompt()
    batch, t = layers[0].batch_size, layers[0].tail_length
    if context_ids.ndim == 1:
        context_ids = context_ids.unsqueeze(0)
    if context_ids.ndim != 2 or tuple(context_ids.shape) != (batch, t):
        raise ValueError(
            f"context_ids has shape {tuple(context_ids.shape)} but the cache holds {batch} "
            f"sequence(s) of {t} tokens: pass the [B, t] ids it was prefilled with"
        )
    params = cache.policy.score_params
    chunk_tokens = int(params.get("chunk_tokens", DEFAULT_CHUNK_TOKENS))
    pads = layers[0].pads
    contexts = [[int(i) for i in context_ids[b, pad:].tolist()] for b, pad in enumerate(pads)]
    starts = [prompt.context_start(ids) for ids in contexts]
    chunks = [
        reconstruction_chunks(
            ids,
            first=prompt.first,
            later=prompt.later,
            suffix=prompt.suffix,
            context_start=start,
            chunk_tokens=chunk_tokens,
        )
        for ids, start in zip(contexts, starts)
    ]
    # calibrated weights (S9) fit to about DEFAULT_REFERENCE_ROWS rows per query head, evenly
    # spread over each sequence's pass
    every = [reference_stride(sum(len(c.input_ids) for c in seq)) for seq in chunks]

    def sequence_scorings() -> list[LayerScoring]:
        return [LayerScoring(s, chunk_tokens, k) for s, k in zip(starts, every)]

    if batch == 1:
        scorings = [sequence_scorings()[0] for _ in layers]
    else:
        scorings = [BatchScoring(sequence_scorings(), pads) for _ in layers]
    hooks = []
    if score_fns.score_spec(cache.policy.score).output_weighted:  # KVzip+ (S11)
        hooks = _weigh_by_output(model, layers, scorings)
    try:
        for inputs in _rounds(chunks, scorings, pads, t, context_ids.device):
            _run_chunk(model, cache, layers, scorings, inputs)
    finally:
        for hook in hooks:
            hook.remove()
    name = cache.policy.score
    kwargs = {k: v for k, v in params.items() if k in score_fns.score_param_names(name)}
    for layer, scoring in zip(layers, scorings):
        per_sequence = scoring.sequences if batch > 1 else [scoring]
        last = layer.last_query_attention if batch > 1 else [layer.last_query_attention]
        observations = []
        for b, sequence in enumerate(per_sequence):
            keys, values = layer.unpadded(b)
            scores = score_fns.compute_scores(
                name,
                None,
                keys,
                values,
                scale=sequence.scale,
                reconstruction=sequence.stats,
                **kwargs,
            )
            observations.append(
                LayerObservation(
                    layer_idx=layer.layer_idx,
                    rank=layer.rank,
                    log_scores=scores.log_scores,
                    forced=scores.forced,
                    last_query_attention=last[b],
                    reference_queries=sequence.stats.reference_queries,
                    scale=sequence.scale,
                )
            )
        layer.observed(observations)


def _rounds(chunks, scorings, pads: list[int], t: int, device):
    """The pass's forwards: each sequence's chunks in turn (``chunks[b]``), one forward per
    round. One sequence: its chunk ids. A batch: round ``r`` holds every sequence's ``r``-th
    chunk, padded on the right (a sequence with no chunk left is all padding), with the mask
    (the cache's left padding, then the chunk's real rows) and positions ``t_b, t_b + 1, ...``
    of each sequence's context length ``t_b``, as alone; each ``BatchScoring`` learns the
    round's real lengths. Right padding keeps every real row at the cache index it has alone
    (a sliding-window layer's window), and the rows after it are never stored."""
    for r in range(max(len(seq) for seq in chunks)):
        rows = [list(seq[r].input_ids) if r < len(seq) else [] for seq in chunks]
        if len(rows) == 1:
            yield {"input_ids": torch.tensor(rows, dtype=torch.long, device=device)}
            continue
        n = max(len(row) for row in rows)
        lengths = [len(row) for row in rows]
        ids = torch.zeros(len(rows), n, dtype=torch.long, device=device)
        mask = torch.zeros(len(rows), t + n, dtype=torch.long, device=device)
        for b, (row, pad) in enumerate(zip(rows, pads)):
            ids[b, : len(row)] = torch.tensor(row, dtype=torch.long, device=device)
            mask[b, pad:t] = 1
            mask[b, t : t + len(row)] = 1
        positions = torch.tensor([t - pad for pad in pads], device=device).view(-1, 1)
        positions = positions + torch.arange(n, device=device)
        for scoring in scorings:
            scoring.chunk_lengths = lengths
        yield {"input_ids": ids, "attention_mask": mask, "position_ids": positions}


def _run_chunk(model, cache, layers, scorings, inputs: dict) -> None:
    """One forward of a reconstruction round in scoring mode; the cache is left as it was."""
    others = [layer for layer in cache.layers if not isinstance(layer, EvictingLayer)]
    saved = [dict(layer.__dict__) for layer in others]  # transformers' layers store the chunk
    for layer, scoring in zip(layers, scorings):
        layer.start_scoring(scoring)
    try:
        model(**inputs, cache=cache, use_cache=True, logits_to_keep=1)
    finally:
        for layer in layers:
            layer.stop_scoring()
        for layer, state in zip(others, saved):
            layer.__dict__.clear()
            layer.__dict__.update(state)
    missed = [layer.layer_idx for layer, s in zip(layers, scorings) if s.keys is not None]
    if missed:
        raise RuntimeError(
            f"layers {missed} were not scored: the model did not run probkv's attention "
            "function (call probkv.hf.prepare_model(model))"
        )


def output_norms(o_weight: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``||W_o^q v_i||`` ``[Hq, t]`` float32 (KVzip+, S11): ``o_weight [hidden, Hq d_v]`` (the
    attention's output projection), ``values [Hkv, t, d_v]``; query head ``q`` reads KV head
    ``q // g``."""
    hkv, t, dv = values.shape
    hq = o_weight.shape[1] // dv
    per_head = o_weight.float().view(-1, hq, dv)  # [hidden, Hq, d_v]
    out = torch.empty(hq, t, dtype=torch.float32, device=values.device)
    for q in range(hq):
        v = values[q // (hq // hkv)].float()
        out[q] = torch.linalg.vector_norm(v @ per_head[:, q].T.to(v.device), dim=-1)
    return out


def _weigh_by_output(model, layers, scorings) -> list:
    """KVzip+'s weights (S11): each evicting layer's scoring gets its attention module's output
    projection, and a forward pre-hook that records ``1 / ||h_u||`` of the chunk's rows (the
    attention input, as KVzap's reference reads it). Returns the hooks to remove."""
    modules = {getattr(m, "layer_idx", None): m for m in model.modules() if hasattr(m, "o_proj")}
    hooks = []
    for layer, scoring in zip(layers, scorings):
        module = modules.get(layer.layer_idx)
        if module is None:
            raise ValueError(
                f"score 'kvzip-plus' needs layer {layer.layer_idx}'s attention output projection "
                "(an attention module with o_proj and layer_idx); this model has none"
            )
        for sequence in getattr(scoring, "sequences", [scoring]):
            sequence.o_weight = module.o_proj.weight.detach()

        def hook(mod, args, kwargs, scoring=scoring):
            h = kwargs.get("hidden_states", args[0] if args else None)
            norms = torch.linalg.vector_norm(h.float(), dim=-1)  # [B, n]
            scoring.row_weights = 1.0 / norms.clamp_min(1e-12)

        hooks.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return hooks
