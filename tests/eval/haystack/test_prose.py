"""Seeded prose (probkv.eval.haystack.prose): reproducible, varied, well formed (S7)."""

from __future__ import annotations

import itertools
import re

from probkv.eval.haystack import ProseGenerator


def _prose(seed, n):
    return [s for s, _ in itertools.islice(ProseGenerator(seed).sentences(), n)]


def test_prose_is_reproducible_by_seed_and_varies_with_it():
    assert _prose(3, 200) == _prose(3, 200)
    assert _prose(3, 200) != _prose(4, 200)
    assert _prose("a", 50) == _prose("a", 50)


def test_prose_is_varied_well_formed_text():
    sentences = _prose(0, 600)
    # Varied: almost no sentence repeats (a repeated-noise haystack would be ~1% distinct).
    assert len(set(sentences)) / len(sentences) > 0.95
    words = " ".join(sentences).split()
    assert len({w.strip('.,"').lower() for w in words}) > 400
    for sentence in sentences:
        assert sentence[0].isupper() or sentence[0] == '"', sentence
        assert sentence[-1] in '."', sentence
        # Needles use digits and hyphenated keys; the prose never does.
        assert not re.search(r"[0-9\-]", sentence), sentence
        assert "  " not in sentence
        # a/an agree with the next word (the vocabulary has no silent-h or "you"-sounding words).
        for article, word in re.findall(r"\b(a|an) (\w+)", sentence):
            assert (article == "an") == (word[0] in "aeiou"), sentence


def test_prose_paragraphs_have_three_to_seven_sentences():
    ends = [end for _, end in itertools.islice(ProseGenerator(1).sentences(), 500)]
    lengths, run = [], 0
    for end in ends:
        run += 1
        if end:
            lengths.append(run)
            run = 0
    assert lengths and min(lengths) >= 3 and max(lengths) <= 7
