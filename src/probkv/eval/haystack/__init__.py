"""Haystack text for the generated tasks (S7): license-clean, offline, seeded.

Two kinds of filler text surround the needles of the RULER-style tasks (:mod:`probkv.eval.tasks`):

- ``noise``: a short cycle of plain sentences repeated over and over (the classic
  passkey-retrieval haystack: nothing in it resembles a needle).
- ``prose``: English prose written by a small seeded grammar (:mod:`.prose`: sentence
  templates over a hand-written vocabulary, :mod:`.vocabulary`; paragraphs that follow one
  character), so a model reads varied, natural-looking text rather than repeated noise. No
  corpus is downloaded or shipped; every word comes from probkv's own lists (Apache-2.0).

Both are exposed as a :class:`WordStream` (:mod:`.stream`): words (with the whitespace that
follows them) and the positions where sentences start, so a task can cut the haystack to an
exact number of words and insert needles at sentence boundaries at a chosen depth.

The prose never contains digits or hyphens, so the needles' numbers, UUIDs and
``adjective-noun`` keys cannot occur in it by accident.
"""

from probkv.eval.haystack.prose import ProseGenerator
from probkv.eval.haystack.stream import (
    HAYSTACK_KINDS,
    NOISE_SENTENCES,
    WordStream,
    noise_sentences,
    word_stream,
)
from probkv.eval.haystack.vocabulary import prose_vocabulary

__all__ = [
    "HAYSTACK_KINDS",
    "NOISE_SENTENCES",
    "ProseGenerator",
    "WordStream",
    "noise_sentences",
    "prose_vocabulary",
    "word_stream",
]
