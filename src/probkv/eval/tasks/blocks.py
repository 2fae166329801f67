"""What every generated task is made of (S7): a :class:`Draft` prompt, the
:class:`Builder` that drafts it at a given haystack size, and seeded value streams (keys,
numbers, UUIDs, made-up words) whose k-th value does not depend on how many are drawn."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from probkv.eval.haystack.vocabulary import ROLE_ADJECTIVES, ROLES, THING_ADJECTIVES, THINGS

KEY_KINDS = ("words", "numbers", "uuids")


@dataclass(frozen=True)
class Draft:
    """A generated prompt before tokenization: context, question, answer prefix, answers."""

    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Builder:
    """One example's generator: ``draft(units, fill)`` is the prompt with a haystack of
    ``units`` units (words, distractor needles or list entries, depending on the task) and
    ``fill`` extra noise words; ``fill_capacity`` is the most fill words it accepts (0: none).
    A draft is a deterministic function of ``(units, fill)``; its length grows with both."""

    draft: Callable[[int, int], Draft]
    fill_capacity: int = 0


class UniqueValues:
    """Draws distinct values of one kind from a seeded stream (prefix-stable: the k-th value
    does not depend on how many are drawn)."""

    def __init__(
        self,
        rng: random.Random,
        draw: Callable[[random.Random], str],
        used: set[str],
        reject: Callable[[str], bool] | None = None,
    ):
        self._rng, self._draw, self._used, self._reject = rng, draw, used, reject
        self.values: list[str] = []

    def next(self) -> str:
        """Draw the next distinct value."""
        for _ in range(10_000):
            value = self._draw(self._rng)
            if value not in self._used and not (self._reject and self._reject(value)):
                self._used.add(value)
                self.values.append(value)
                return value
        raise ValueError(
            f"ran out of distinct values after {len(self.values)}; use a shorter length"
        )

    def take(self, n: int) -> list[str]:
        """The first ``n`` values (drawing more as needed)."""
        while len(self.values) < n:
            self.next()
        return self.values[:n]


_KEY_ADJECTIVES = tuple(sorted(set(THING_ADJECTIVES) | set(ROLE_ADJECTIVES)))
_KEY_NOUNS = tuple(sorted({t for t, _ in THINGS} | {r for r, _ in ROLES}))


def _draw_word_key(rng: random.Random) -> str:
    return f"{rng.choice(_KEY_ADJECTIVES)}-{rng.choice(_KEY_NOUNS)}"


def _draw_number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _draw_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


VALUE_DRAWS = {"words": _draw_word_key, "numbers": _draw_number, "uuids": _draw_uuid}
KIND_NAMES = {
    "words": ("word", "words"),
    "numbers": ("number", "numbers"),
    "uuids": ("uuid", "uuids"),
}

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def pseudo_word(rng: random.Random, syllables: int = 2) -> str:
    """A pronounceable made-up word: consonant-vowel syllables and a final consonant (CVCVC)."""
    parts = [rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables)]
    return "".join(parts) + rng.choice(_CONSONANTS)


def occurs_in(text: str) -> Callable[[str], bool]:
    """Predicate: does a candidate answer occur in ``text`` (case-insensitive)? Answers must not
    occur in the question or answer prefix, or echoing the prompt would score (S7 scorers
    match substrings)."""
    lowered = text.lower()
    return lambda candidate: candidate.lower() in lowered


def spread_depths(position: float, count: int) -> list[float]:
    """``count`` depths evenly spaced over [0, 1), the first one at ``position``."""
    return [(position + j / count) % 1.0 for j in range(count)]
