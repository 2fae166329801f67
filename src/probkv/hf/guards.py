"""What a ``ProbKVCache`` refuses, and how it says so (issue 11: no silently wrong answer).

- Input that does not continue the tokens the cache holds (:func:`check_continues`). In
  transformers 5.24 a forward reaches the cache with its ``position_ids`` in the attention
  kwargs (``cache.update(..., kwargs=...)``), never with the token ids below the cache's
  length: ``generate`` slices those off before the forward. So the check is that the new
  tokens start at the cache's length. ``generate`` called again on a used cache with a prompt
  no longer than what the cache holds (the same prompt twice, or another one) starts before
  it and is refused; a longer prompt that differs inside its first tokens cannot be told from
  a continuation by the cache, which is why ``probkv.hf.generate`` takes only the new tokens
  and builds the full ids itself from ``cache.token_ids``.
- A cache built from another model's config (:func:`check_layer_index`,
  :func:`check_layers_used`, :func:`check_same_layers`): named with both layer counts.
- A batch (:func:`batch_message`): beam search and several returned sequences run copies of
  one prompt as a batch and are named as such.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

_REBUILD = "build the cache from the model's own config, ProbKVCache(model.config, policy)"


def check_continues(held: int, attention_kwargs: dict | None) -> None:
    """Refuse a forward whose first new token is not at position ``held`` (module docstring)."""
    positions = None if attention_kwargs is None else attention_kwargs.get("position_ids")
    if positions is None or positions.numel() == 0:
        return
    first = int(positions.reshape(-1)[0])
    if first != held:
        raise ValueError(
            f"this ProbKVCache holds {held} tokens, but the input starts at position {first}: "
            "it does not continue them (a different prompt, or generate called twice with one "
            "cache). A cache holds one prompt: build a new ProbKVCache for a new prompt, or use "
            "probkv.hf.compress and probkv.hf.answer to answer several questions from one "
            "compressed context"
        )


def check_layer_index(layer_idx: int, num_layers: int) -> None:
    """A model with more layers than the cache (transformers would raise an IndexError)."""
    if layer_idx >= num_layers:
        raise ValueError(
            f"this ProbKVCache was built for a model with {num_layers} layers, but the model's "
            f"layer {layer_idx} is running (it has at least {layer_idx + 1}): {_REBUILD}"
        )


def check_layers_used(layers: Sequence) -> None:
    """A model with fewer layers than the cache: its last layers were never used."""
    used = [bool(layer.is_initialized) for layer in layers]
    if any(used) and not all(used):
        n = used.index(False)
        raise ValueError(
            f"this ProbKVCache was built for a model with {len(layers)} layers, but a forward "
            f"used only its first {n}: the model has {n} layers (or a forward failed part-way: "
            f"then build a new cache); {_REBUILD}"
        )


def describe_types(layer_types: Sequence[str]) -> str:
    kinds = {kind: list(layer_types).count(kind) for kind in dict.fromkeys(layer_types)}
    return ", ".join(f"{n} {kind}" for kind, n in kinds.items())


def check_same_layers(built_for: Sequence[str], config) -> None:
    """Refuse a model ``config`` whose layers differ from ``built_for`` (both layer counts)."""
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    if list(layer_types) != list(built_for):
        raise ValueError(
            f"this ProbKVCache was built for a model with {len(built_for)} layers "
            f"({describe_types(built_for)}), but the model has {len(layer_types)} "
            f"({describe_types(layer_types)}): {_REBUILD}"
        )


def batch_message(key_states: torch.Tensor) -> str:
    """Why a batch is refused: copies of one prompt are what beam search and several returned
    sequences make of it, anything else is several prompts."""
    b = key_states.shape[0]
    if all(torch.equal(key_states[0], key_states[i]) for i in range(1, b)):
        return (
            f"probkv caches hold one sequence; generate ran {b} copies of the prompt as a batch, "
            f"which is beam search (num_beams={b}) or num_return_sequences={b}: neither is "
            "supported; use num_beams=1 and num_return_sequences=1 (one generate call per "
            "sampled answer)"
        )
    return (
        f"probkv evicts caches of batch size 1 only; got batch size {b}. Run prompts one at a time."
    )


def check_no_decode_budget(budget, operation: str) -> None:
    """``crop``/``rewind`` drop tail entries that a decode budget's stages and statistics
    (``probkv.hf.decode_budget``) already counted: refused by name."""
    if budget is not None:
        raise ValueError(
            f"{operation}() is not available on a cache with a decode budget "
            f"(max_entries={budget.max_entries}): its stages already evicted and weighted the "
            "entries it would drop; keep a copy (cache.copy()) before generating instead"
        )
