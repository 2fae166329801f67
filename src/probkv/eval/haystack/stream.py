"""Haystack text as words (S7): the ``noise`` and ``prose`` haystacks as a
:class:`WordStream`, cut to an exact number of words with needles inserted at sentence
boundaries at a chosen depth."""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from probkv._checks import check_choice, check_positive_int
from probkv.eval.haystack.prose import ProseGenerator

HAYSTACK_KINDS = ("noise", "prose")

# The noise cycle (own wording, in the style of the passkey-retrieval haystacks).
NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The river is wide.",
    "Here we go again.",
    "The day goes on and on.",
)


def noise_sentences() -> Iterator[tuple[str, bool]]:
    """The noise haystack: ``NOISE_SENTENCES`` cycled forever, one paragraph per cycle."""
    while True:
        for k, sentence in enumerate(NOISE_SENTENCES):
            yield sentence, k == len(NOISE_SENTENCES) - 1


class WordStream:
    """A haystack cut into words, materialised lazily from a sentence iterator.

    ``words[i]`` is the i-th word and ``separators[i]`` the whitespace after it (a space, or a
    blank line at a paragraph end); ``sentence_starts`` lists the word indices where sentences
    begin. :meth:`render` cuts the haystack to ``n`` words and inserts whole sentences
    (needles) at the sentence boundary nearest to each requested depth.
    """

    def __init__(self, sentences: Iterator[tuple[str, bool]]) -> None:
        self._sentences = sentences
        self.words: list[str] = []
        self.separators: list[str] = []
        self.sentence_starts: list[int] = []

    def ensure(self, n: int) -> None:
        """Materialise at least ``n`` words."""
        while len(self.words) < n:
            sentence, ends_paragraph = next(self._sentences)
            self.sentence_starts.append(len(self.words))
            parts = sentence.split()
            self.words.extend(parts)
            self.separators.extend([" "] * (len(parts) - 1))
            self.separators.append("\n\n" if ends_paragraph else " ")

    def boundary(self, n: int, depth: float) -> int:
        """The sentence start (or ``n``, the end) in the first ``n`` words nearest to ``depth * n``."""
        self.ensure(n)
        candidates = self.sentence_starts[: bisect.bisect_right(self.sentence_starts, n - 1)]
        candidates = [*candidates, n] if n > 0 else [0]
        target = depth * n
        i = bisect.bisect_left(candidates, target)
        best = min(candidates[max(i - 1, 0) : i + 1], key=lambda b: (abs(b - target), b))
        return best

    def render(self, n: int, insertions: Sequence[tuple[float, str]] = ()) -> str:
        """The first ``n`` words with each ``(depth, sentence)`` of ``insertions`` placed at the
        sentence boundary nearest to ``depth * n`` (depth in [0, 1]; 0 = start, 1 = end).
        Insertions that land on the same boundary keep their order in ``insertions``."""
        check_positive_int(n, "n", allow_zero=True)
        self.ensure(n)
        at: dict[int, list[str]] = {}
        for depth, text in insertions:
            if not 0.0 <= depth <= 1.0:
                raise ValueError(f"insertion depth must be in [0, 1], got {depth!r}")
            at.setdefault(self.boundary(n, depth), []).append(text)
        out: list[str] = []
        for i in range(n):
            out.extend(text + " " for text in at.get(i, ()))
            out.append(self.words[i] + (self.separators[i] if i < n - 1 else ""))
        if at.get(n) and n > 0:
            out.append(" " + " ".join(at[n]))
        elif n == 0:
            out = [" ".join(at.get(0, ()))]
        return "".join(out).strip()


def word_stream(kind: str, seed: int | str) -> WordStream:
    """A :class:`WordStream` over the ``noise`` or seeded ``prose`` haystack."""
    check_choice(kind, HAYSTACK_KINDS, "haystack")
    if kind == "noise":
        return WordStream(noise_sentences())
    return WordStream(ProseGenerator(seed).sentences())
