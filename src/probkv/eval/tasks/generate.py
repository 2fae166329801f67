"""Generating examples (S7): a task's drafts fitted to a prompt length on the real
tokenizer, at depths spread over the examples (:func:`generate_examples`)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from probkv._checks import check_positive_int
from probkv.eval.examples import Example
from probkv.eval.prompt import prompt_length
from probkv.eval.tasks.blocks import Builder
from probkv.eval.tasks.catalog import Task, get_task

LENGTH_TOLERANCE = 0.02  # generated prompts are in [(1 - 2%) * length, length] tokens
_GOLDEN = 0.6180339887498949  # fractional part of the golden ratio (low-discrepancy depths)
_MAX_UNITS = 10_000_000


def _fit(spec: Task, build: Builder, tokenizer: Any, length: int, example_id: str) -> Example:
    """The largest haystack whose prompt is at most ``length`` tokens (binary search on the
    real tokenizer), topped up with fill words where the task allows them."""

    def measure(units: int, fill: int) -> tuple[int, Example]:
        draft = build.draft(units, fill)
        example = Example(
            id=example_id,
            task=spec.name,
            context=draft.context,
            question=draft.question,
            answers=draft.answers,
            max_new_tokens=spec.max_new_tokens,
            metric=spec.metric,
            answer_prefix=draft.answer_prefix,
            metadata=draft.metadata,
        )
        return prompt_length(example, tokenizer), example

    def largest(
        fits_at: Callable[[int], tuple[int, Example]],
        known: tuple[int, int, Example],
        hi: int | None,
    ) -> tuple[int, int, Example]:
        """Largest ``x < hi`` with ``fits_at(x)[0] <= length``, from a ``known`` fitting
        ``(x, tokens, example)``; ``hi=None`` searches upwards exponentially first."""
        lo, lo_n, lo_ex = known
        step = 16
        while hi is None:
            probe = lo + step
            n, ex = fits_at(probe)
            if n > length:
                hi = probe
            else:
                lo, lo_n, lo_ex = probe, n, ex
                step *= 2
                if lo > _MAX_UNITS:
                    raise ValueError(f"task {spec.name!r} cannot reach length={length}")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            n, ex = fits_at(mid)
            if n <= length:
                lo, lo_n, lo_ex = mid, n, ex
            else:
                hi = mid
        return lo, lo_n, lo_ex

    n, example = measure(0, 0)
    if n > length:
        raise ValueError(
            f"length={length} is too small for task {spec.name!r}: its prompt without haystack "
            f"already takes {n} tokens"
        )
    units, n, example = largest(lambda u: measure(u, 0), (0, n, example), None)
    if build.fill_capacity and n < length:
        fit = largest(lambda f: measure(units, f), (0, n, example), build.fill_capacity + 1)
        _, n, example = fit
    if n < (1.0 - LENGTH_TOLERANCE) * length:
        raise ValueError(
            f"task {spec.name!r} could not be fitted to length={length} within "
            f"{LENGTH_TOLERANCE:.0%} (closest: {n} tokens); use a larger length"
        )
    return replace(example, metadata={**example.metadata, "length": length, "prompt_tokens": n})


def generate_examples(
    task: str | Task,
    *,
    tokenizer: Any,
    length: int,
    num_examples: int,
    seed: int = 0,
) -> list[Example]:
    """Generate ``num_examples`` examples of ``task`` whose prompts fit ``length`` tokens.

    Args:
        task: a name from :data:`TASK_NAMES` or a task object (e.g. a custom ``NeedleTask``).
        tokenizer: a transformers tokenizer (or any object with ``encode(text,
            add_special_tokens=...)`` and optionally ``chat_template``/``apply_chat_template``).
        length: target prompt length in tokens, as defined by
            :func:`probkv.eval.prompt.prompt_length` (chat template + context + question +
            answer prefix); every prompt has between ``0.98 * length`` and ``length`` tokens.
        num_examples: how many examples (ids ``<task>-<length>-<seed>-<index>``).
        seed: the same seed (with the same task, length and tokenizer) gives the same examples.
    """
    spec = get_task(task)
    check_positive_int(length, "length")
    check_positive_int(num_examples, "num_examples")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    start = random.Random(f"probkv-depth:{spec.name}:{seed}").random()
    examples = []
    for index in range(num_examples):
        position = (start + index * _GOLDEN) % 1.0
        seed_key = f"probkv:{spec.name}:{length}:{seed}:{index}"
        build = spec.builder(seed_key, position, length)
        example_id = f"{spec.name}-{length}-{seed}-{index}"
        examples.append(_fit(spec, build, tokenizer, length, example_id))
    return examples
