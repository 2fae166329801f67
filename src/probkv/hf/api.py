"""The context / question workflow the paper evaluates (S7), and generation helpers.

Question-agnostic: ``compress`` prefills the context alone and evicts, before any question is
seen; ``answer`` then answers each question from that same compressed state. Question-aware:
put the question inside the prompt given to ``compress`` (or just call ``generate``).
"""

from __future__ import annotations

import copy

import torch

from probkv.hf import guards
from probkv.hf.cache import ProbKVCache
from probkv.hf.layers import EvictingLayer
from probkv.hf.model import attention_implementation, is_prepared
from probkv.hf.prefill import ObserveOnly
from probkv.hf.reconstruct import RepeatPrompt, reconstruct
from probkv.policies.base import EvictionPolicy


def as_token_ids(ids: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """``[1, t]`` token ids from ``[t]`` or ``[1, t]`` (batch size 1, ``t >= 1``): integers,
    each in ``[0, vocab_size)`` when ``vocab_size`` is given (checked before any forward)."""
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"token ids must be a torch.Tensor of integers, got {type(ids).__name__}")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
    if ids.ndim == 1:
        ids = ids.unsqueeze(0)
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(
            f"expected token ids of shape [t] or [1, t] (batch size 1), got {tuple(ids.shape)}"
        )
    if ids.shape[1] == 0:
        raise ValueError("expected at least one token")
    if vocab_size is not None:
        bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
        if bad.numel():
            i = int(bad[0, 1])
            raise ValueError(
                f"token id {int(ids[0, i])} at position {i} is outside the model's vocabulary: "
                f"ids must be in [0, {vocab_size}) (vocab_size={vocab_size})"
            )
    return ids


def _token_ids(model, ids: torch.Tensor) -> torch.Tensor:
    """``as_token_ids`` against ``model``'s vocabulary, on its device."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    return as_token_ids(ids, vocab).to(model.device)


def pad_left(sequences, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of token id sequences (1-D tensors or lists, each ``t_i >= 1``) left-padded
    the way ``transformers`` pads for generation: ``(ids [B, T], attention_mask [B, T])``,
    ``T = max t_i``, padding ``pad_id`` with mask 0 before each sequence."""
    rows = [torch.as_tensor(s).reshape(-1) for s in sequences]
    if not rows or any(r.numel() == 0 for r in rows):
        raise ValueError("pad_left needs at least one sequence, each of at least one token")
    t = max(r.numel() for r in rows)
    ids = torch.full((len(rows), t), pad_id, dtype=rows[0].dtype)
    mask = torch.zeros(len(rows), t, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, t - r.numel() :] = r
        mask[i, t - r.numel() :] = 1
    return ids, mask


def _batch_ids(model, ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids of one sequence (``[t]``, ``[1, t]``) or of a batch (a list of 1-D tensors,
    padded here, or ``[B, t]`` with its ``attention_mask``), checked and on the model's
    device, with the attention mask (``None``: nothing padded)."""
    if isinstance(ids, (list, tuple)) and ids and all(isinstance(r, torch.Tensor) for r in ids):
        if attention_mask is not None:
            raise ValueError("attention_mask is for a [B, t] tensor; a list is padded here")
        ids, attention_mask = pad_left(ids)
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[0] == 1:
        if attention_mask is not None and not bool(torch.as_tensor(attention_mask).all()):
            raise ValueError("one sequence is never padded: pass its ids without padding")
        return _token_ids(model, ids), None
    vocab = model.config.get_text_config(decoder=True).vocab_size
    checked = torch.cat([as_token_ids(row, vocab) for row in ids])
    if attention_mask is not None:
        attention_mask = torch.as_tensor(attention_mask).to(model.device)
        if attention_mask.shape != ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, the ids "
                f"{tuple(ids.shape)}: give one mask entry per token"
            )
        if bool(attention_mask.all()):
            attention_mask = None
    return checked.to(model.device), attention_mask


def _prefill(model, ids: torch.Tensor, mask: torch.Tensor | None, cache: ProbKVCache) -> None:
    """One prompt forward into ``cache``; a padded batch gets the positions transformers'
    ``generate`` gives it (each sequence from 0 at its first token)."""
    kwargs = {}
    if mask is not None:
        kwargs = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp_min(0)}
    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1, **kwargs)


def _check_prepared(model) -> None:
    if not is_prepared(model):
        raise ValueError(
            "the model is not prepared for probkv: call probkv.hf.prepare_model(model) first "
            f"(its attn_implementation is {attention_implementation(model)!r})"
        )


@torch.no_grad()
def compress(
    model,
    context_ids: torch.Tensor,
    policy: EvictionPolicy,
    *,
    repeat_prompt: RepeatPrompt | None = None,
    max_entries: int | None = None,
    every: int | None = None,
    attention_mask: torch.Tensor | None = None,
) -> ProbKVCache:
    """Prefill ``context_ids`` into a new ``ProbKVCache`` and evict with ``policy``.

    Returns the compressed cache; it remembers the context ids (``cache.token_ids``) so that
    generation can continue from it with true positions. Scores read from a reconstruction
    pass (``kvzip``, ``h2o-rec``, ``min-rec``; S10.1) run it between prefill and eviction, with
    ``repeat_prompt`` (``probkv.hf.repeat_prompt(tokenizer)``; see ``reconstruct``).
    ``max_entries``, ``every``: a decode budget held during the generation that follows
    (``ProbKVCache``, ``probkv.hf.decode_budget``); the context is evicted to it.

    A batch of contexts (a list of sequences, padded here with ``pad_left``, or ``[B, t]``
    ids left-padded with their ``attention_mask``) is compressed in one forward, each context
    on its own exactly as alone (its budget, kept entries, log-weights and random draws;
    S11 batches); the cache's ``attention_mask`` records the padding.
    """
    _check_prepared(model)
    ids, mask = _batch_ids(model, context_ids, attention_mask)
    # prompt_length: the prompt ends with this forward (probkv.hf.prefill), so layerwise
    # policies evict each layer during it.
    cache = ProbKVCache(
        model.config, policy, prompt_length=ids.shape[1], max_entries=max_entries, every=every
    )
    _prefill(model, ids, mask, cache)  # logits_to_keep=1: no [t, vocab] logits
    if cache.awaiting_reconstruction:
        reconstruct(model, cache, ids, repeat_prompt)
    if cache.eviction_pending:
        cache.evict()
    cache.token_ids, cache.attention_mask = ids, mask
    return cache


@torch.no_grad()
def observe(
    model,
    context_ids: torch.Tensor,
    score: str,
    score_params: dict | None = None,
    *,
    repeat_prompt: RepeatPrompt | None = None,
    attention_mask: torch.Tensor | None = None,
) -> ProbKVCache:
    """Prefill ``context_ids`` and observe ``score`` without evicting: copy the result
    (``copy.deepcopy``) and call ``cache.evict(policy)`` once per policy that observes the
    same score and parameters (e.g. several ratios, samplers or weights) to pay one prefill
    for all of them. Each copy evicts exactly as ``compress`` with that policy would
    (reconstruction scores run their pass here, with ``repeat_prompt``, S10.1). A batch of
    contexts as in ``compress``."""
    _check_prepared(model)
    ids, mask = _batch_ids(model, context_ids, attention_mask)
    cache = ProbKVCache(
        model.config,
        ObserveOnly(score=score, ratio=0.0, score_params=dict(score_params or {})),
        prompt_length=ids.shape[1],  # the prompt ends with this forward (probkv.hf.prefill)
    )
    _prefill(model, ids, mask, cache)
    if cache.awaiting_reconstruction:
        reconstruct(model, cache, ids, repeat_prompt)
    cache.token_ids, cache.attention_mask = ids, mask
    return cache


@torch.no_grad()
def generate(
    model, cache: ProbKVCache, input_ids: torch.Tensor, *, max_new_tokens: int, **generate_kwargs
) -> torch.Tensor:
    """Continue from a compressed ``cache`` with the new tokens ``input_ids`` (e.g. a question):
    greedy by default. Returns the generated token ids only, ``[n]``. The cache grows by the
    new tokens (see ``answer`` for several questions from one context).

    A cache of a batch takes one sequence of new tokens per sequence it holds (a list,
    padded on the left here, or ``[B, n]`` ids with ``attention_mask=``) and returns ``[B,
    n]`` (after a sequence's end of text, the model's pad token, as ``transformers`` does)."""
    _check_prepared(model)
    # a cache of another model, or beam search, refused by name before any work is done
    guards.check_same_layers(cache.layer_types, model.config)
    for option in ("num_beams", "num_return_sequences"):
        if generate_kwargs.get(option, 1) != 1:
            what = "beam search" if option == "num_beams" else "several returned sequences"
            raise ValueError(
                f"probkv caches hold one sequence: {what} ({option}="
                f"{generate_kwargs[option]}) is not supported; use {option}=1"
            )
    new, new_mask = _batch_ids(model, input_ids, generate_kwargs.pop("attention_mask", None))
    if new.shape[0] != cache.batch_size:
        raise ValueError(
            f"this cache holds {cache.batch_size} sequence(s), but generate was given "
            f"{new.shape[0]}: give one sequence of new tokens per sequence the cache holds"
        )
    prefix = cache.token_ids
    if prefix is None or prefix.shape[1] != cache.get_seq_length():
        known = "none" if prefix is None else f"only the first {prefix.shape[1]}"
        raise ValueError(
            f"this cache holds {cache.get_seq_length()} tokens and knows the ids of {known} "
            "(generate added tokens to it, or it was not built by compress): build a new "
            "cache with probkv.hf.compress, or use probkv.hf.answer, which leaves the "
            "compressed cache as it was"
        )
    full = torch.cat([prefix, new], dim=1)
    mask = torch.ones_like(full)
    if cache.attention_mask is not None:
        mask[:, : prefix.shape[1]] = cache.attention_mask
    if new_mask is not None:
        mask[:, prefix.shape[1] :] = new_mask
    generate_kwargs.setdefault("do_sample", False)
    out = model.generate(
        input_ids=full,
        attention_mask=mask,
        cache=cache,
        max_new_tokens=max_new_tokens,
        **generate_kwargs,
    )
    return out[0, full.shape[1] :] if full.shape[0] == 1 else out[:, full.shape[1] :]


def answer(
    model, compressed: ProbKVCache, question_ids: torch.Tensor, *, max_new_tokens: int, **kw
):
    """Answer one question from the compressed context, leaving ``compressed`` unchanged, so
    every question starts from the same compressed state and never sees another question."""
    only_evicting = all(isinstance(layer, EvictingLayer) for layer in compressed.layers)
    if only_evicting and compressed.decode_budget is None:
        # (a decode budget's stages evict the prefix too: such a cache is copied, below)
        # Back to the compressed state even when generate fails part-way through a forward
        # (then layers hold different numbers of new tokens: restore each layer's own).
        tails = [layer.tail_length for layer in compressed.layers]
        token_ids, mask = compressed.token_ids, compressed.attention_mask
        try:
            return generate(model, compressed, question_ids, max_new_tokens=max_new_tokens, **kw)
        finally:
            compressed.token_ids, compressed.attention_mask = token_ids, mask
            for layer, tail_length in zip(compressed.layers, tails):
                layer.truncate_tail(tail_length)
                layer.attention_done()  # a failed forward may have left an update pending
    working = copy.deepcopy(compressed)  # sliding-window layers, decode stages: no rewind
    working.token_ids, working.attention_mask = compressed.token_ids, compressed.attention_mask
    return generate(model, working, question_ids, max_new_tokens=max_new_tokens, **kw)
