"""What a ``ProbKVCache`` refuses, and how it says so (never a silently wrong answer).

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
- A forward whose batch size is not the cache's (:func:`batch_message`: beam search and
  several returned sequences copy sequences). What a decode budget refuses (``every``
  without ``max_entries``, ``crop``/``rewind``, padded new tokens of a batch) is checked in
  ``probkv.hf.decode_budget``, with the budget's other code.
- ``model.generate`` on a prompt that does not begin with the ids the cache holds
  (:func:`check_generation_ids`: ``probkv.hf.prepare_model`` makes ``generate`` call it
  with the whole prompt, before transformers slices off what the cache holds).
- A ``prompt_length`` that is not the prompt's (:func:`check_prompt_end`).
- Construction and eviction that cannot be served, before any work: a policy that is not
  an ``EvictionPolicy`` (:func:`check_policy_type`), an eviction of layers not observed or
  already evicted (:func:`check_can_evict`), and a policy whose score or parameters differ
  from what the prefill observed (:func:`check_observed`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from probkv.policies.base import EvictionPolicy
from probkv.scores import needs_reconstruction

_REBUILD = "build the cache from the model's own config, ProbKVCache(model.config, policy)"


def check_continues(
    held: int, attention_kwargs: dict | None, prompt_tokens: list[int] | None = None
) -> None:
    """Refuse a forward whose first new token is not at position ``held`` (module docstring).
    A padded batch (``prompt_tokens``: each sequence's unpadded prompt tokens held) has
    positions per sequence, lower by its padding: each sequence's last new token must come
    after its prompt (a new prompt, which starts at 0 again, ends before)."""
    positions = None if attention_kwargs is None else attention_kwargs.get("position_ids")
    if positions is None or positions.numel() == 0:
        return
    if positions.ndim == 2 and positions.shape[0] > 1 and held:
        if prompt_tokens is None or len(prompt_tokens) != positions.shape[0]:
            return  # another batch size: refused with its own message at the update
        last = positions[:, -1].tolist()
        for b, (end, tokens) in enumerate(zip(last, prompt_tokens)):
            if end < tokens:
                raise ValueError(
                    f"sequence {b} of this ProbKVCache's batch holds a prompt of {tokens} "
                    f"tokens, but the input ends at position {end}: it does not continue it. "
                    f"{_ONE_PROMPT}"
                )
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


def batch_message(key_states: torch.Tensor, held: int) -> str:
    """Why a forward of another batch size than the cache holds is refused: copies of the
    prompt are what beam search and several returned sequences make of it."""
    b = key_states.shape[0]
    return (
        f"this ProbKVCache holds a batch of {held} sequence(s), but a forward has {b}: beam "
        "search (num_beams > 1) and several returned sequences (num_return_sequences > 1) "
        "copy sequences, which probkv caches do not support; use num_beams=1 and "
        "num_return_sequences=1 (one generate call per sampled answer), and a new cache for "
        "a new batch"
    )


def check_no_copies(generation_config, kwargs: dict) -> None:
    """``model.generate`` with beam search or several returned sequences would run copies of
    each prompt as a batch: refused by name before any work (``probkv.hf.model``)."""
    beams = kwargs.get("num_beams", getattr(generation_config, "num_beams", 1)) or 1
    returned = kwargs.get(
        "num_return_sequences", getattr(generation_config, "num_return_sequences", 1)
    )
    returned = returned or 1
    if beams != 1 or returned != 1:
        raise ValueError(
            f"generate would run {max(beams, returned)} copies of each prompt as a batch, which "
            f"is beam search (num_beams={beams}) or several returned sequences "
            f"(num_return_sequences={returned}): probkv caches do not copy sequences; use "
            "num_beams=1 and num_return_sequences=1 (one generate call per sampled answer)"
        )


def check_padding(attention_mask: torch.Tensor | None, layers: Sequence) -> None:
    """A batch's padding after the first real token of a sequence (a later input of
    different lengths, padded on the left) is masked by probkv's evicting layers, but
    transformers' sliding-window layers count the padding inside their window, so such a
    sequence would not see what it sees alone: refused by name for models with them."""
    if attention_mask is None or attention_mask.ndim != 2 or attention_mask.shape[0] < 2:
        return
    inner = (attention_mask[:, 1:].long() < attention_mask[:, :-1].long()).any()
    sliding = [i for i, layer in enumerate(layers) if getattr(layer, "is_sliding", False)]
    if bool(inner) and sliding:
        raise ValueError(
            "this batch pads a later input of its sequences (the attention mask has zeros "
            f"after ones), and the model's sliding-window layers ({len(sliding)}, e.g. layer "
            f"{sliding[0]}) would count that padding inside their window: give every "
            "sequence new tokens of the same length (or run them one at a time)"
        )


def check_rewind(layers: Sequence) -> None:
    """``rewind`` truncates every layer's tail: only evicting layers, all evicted."""
    for layer in layers:
        if not hasattr(layer, "is_evicted"):
            raise ValueError(
                "rewind() is not available for models with sliding-window layers; "
                "use copy.deepcopy(cache) before each question instead"
            )
        if not layer.is_evicted:
            raise ValueError("rewind() needs an evicted cache; compress the context first")


_ONE_PROMPT = (
    "A cache holds one prompt: build a new ProbKVCache for a new prompt, or use "
    "probkv.hf.compress and probkv.hf.answer to answer several questions from one "
    "compressed context"
)


def check_generation_ids(ids: torch.Tensor, held: int, known: torch.Tensor | None) -> None:
    """Refuse a ``generate`` prompt ``ids [B, n]`` that cannot continue a cache holding
    ``held`` tokens whose ids are ``known`` (``[B, held]``, or ``None``: only the count is
    checked): no longer than what the cache holds, or differing inside it."""
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or not held:
        return
    if known is not None and known.shape[0] != ids.shape[0]:
        raise ValueError(
            f"this ProbKVCache holds a batch of {known.shape[0]} sequence(s), but generate was "
            f"given {ids.shape[0]}. {_ONE_PROMPT}"
        )
    n = ids.shape[1]
    if n <= held:
        raise ValueError(
            f"this ProbKVCache holds {held} tokens, but generate was given a prompt of {n}: "
            f"a prompt must begin with the {held} tokens the cache holds and add at least "
            f"one. {_ONE_PROMPT}"
        )
    if known is None:
        return
    k = min(known.shape[1], n)
    differ = (ids[:, :k] != known[:, :k].to(ids.device)).nonzero()
    if differ.numel():
        s, i = int(differ[0, 0]), int(differ[0, 1])
        which = f" of sequence {s}" if ids.shape[0] > 1 else ""
        raise ValueError(
            f"this ProbKVCache holds {held} tokens, and the prompt given to generate differs "
            f"from them at position {i}{which} (the cache holds token id {int(known[s, i])} "
            f"there, the prompt has {int(ids[s, i])}): it does not continue them. {_ONE_PROMPT}"
        )


def check_prompt_end(prompt_length: int | None, held: int, new_tokens: int) -> None:
    """Refuse a single-token forward (a decode step) before the end of a ``prompt_length``
    prompt, after a prefill: ``prompt_length`` is larger than the prompt. (A chunk that goes
    past it is refused by ``probkv.scores.observation.PrefillStatistics``.)"""
    if prompt_length is None or held >= prompt_length:
        return
    if held and new_tokens == 1 and held + 1 < prompt_length:
        raise ValueError(
            f"prompt_length={prompt_length}, but after a prefill of {held} tokens a forward of "
            "one token (a decode step) came before the prompt's end: the prompt has "
            f"{held} tokens, not {prompt_length}. Pass prompt_length={held} (or leave it "
            "out); a prompt read in chunks must end with prompt_length tokens"
        )


def check_policy_type(policy) -> None:
    """A cache takes an ``EvictionPolicy``, not a method name or anything else."""
    if not isinstance(policy, EvictionPolicy):
        hint = (
            f"probkv.policies.parse_method({policy!r}, ratio=...)"
            if isinstance(policy, str)
            else "probkv.policies.parse_method(name, ratio=...)"
        )
        raise ValueError(
            f"policy must be an EvictionPolicy, got {type(policy).__name__} {policy!r}: build "
            f"one with {hint}"
        )


def check_can_evict(states: dict[int, str]) -> None:
    """``cache.evict``: every evicting layer (``{layer index: state}``) must hold its
    observation; say why not otherwise."""

    def named(*wanted: str) -> list[int]:
        return [i for i, state in states.items() if state in wanted]

    if not named("prefill", "awaiting_reconstruction", "reconstructing", "evicted"):
        return
    if named("evicted"):
        raise ValueError(
            f"layers {named('evicted')} were already evicted (by compress, by a layerwise "
            "policy at the prompt's end, or by an earlier evict()): eviction drops the "
            "prompt's observation, so another policy needs a fresh one. Observe once with "
            "probkv.hf.observe(model, ids, score, score_params) and evict one copy per "
            "policy (cache.copy().evict(policy))"
        )
    if named("awaiting_reconstruction", "reconstructing"):
        raise ValueError(
            f"cannot evict yet: layers {named('awaiting_reconstruction', 'reconstructing')} "
            "wait for the reconstruction pass (S10.1): use probkv.hf.compress or observe"
        )
    raise ValueError(
        f"cannot evict before prefill: layers {named('prefill')} have not been observed"
    )


def _comparable(params: dict) -> dict:
    # chunk_size changes how column sums are computed (memory), not what they are
    return {k: v for k, v in params.items() if k != "chunk_size"}


def _same(a, b) -> bool:
    """Equal parameter values, tensors compared by value, also inside dataclasses, dicts and
    sequences (a kvzap scorer is a dataclass of tensors; a copied cache holds a copy of it)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu())
        )
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            _same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _describe(policy: EvictionPolicy) -> str:
    params = {
        k: "<tensor>"
        if isinstance(v, torch.Tensor)
        else (f"<{type(v).__name__}>" if dataclasses.is_dataclass(v) else v)
        for k, v in sorted(_comparable(policy.score_params).items())
    }
    return f"score {policy.score!r} with {params or 'no parameters'}"


def check_observed(observed: EvictionPolicy, policy: EvictionPolicy) -> None:
    """Refuse to evict with ``policy`` a cache whose prefill observed ``observed``'s score
    unless they observe the same score with the same parameters (``chunk_size`` aside)."""
    mine, theirs = _comparable(observed.score_params), _comparable(policy.score_params)
    same = observed.score == policy.score and mine.keys() == theirs.keys()
    if same and all(_same(mine[k], theirs[k]) for k in mine):
        return
    ran = (
        "its reconstruction pass ran"
        if needs_reconstruction(observed.score)
        else ("no reconstruction pass ran")
    )
    needs = " and a reconstruction pass (S10.1)" if needs_reconstruction(policy.score) else ""
    raise ValueError(
        f"this cache observed {_describe(observed)} ({ran}); the policy needs "
        f"{_describe(policy)}{needs}, which that observation cannot serve. Observe the "
        "context with the policy's score and parameters: probkv.hf.observe(model, ids, "
        "policy.score, policy.score_params)"
    )
