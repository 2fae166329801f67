"""Haystack word streams (probkv.eval.haystack.stream): the noise cycle, word-exact cutting,
needle insertion at sentence boundaries (S7)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from probkv.eval.haystack import (
    NOISE_SENTENCES,
    ProseGenerator,
    WordStream,
    noise_sentences,
    word_stream,
)


def test_noise_cycles_its_sentences():
    first = [s for s, _ in itertools.islice(noise_sentences(), 2 * len(NOISE_SENTENCES))]
    assert first == list(NOISE_SENTENCES) * 2


def test_render_cuts_to_exactly_n_words_and_places_needles():
    stream = word_stream("noise", 0)
    text = stream.render(23)
    assert len(text.split()) == 23
    # Depth 0 is the very start, depth 1 the very end.
    text = stream.render(23, [(0.0, "FIRST."), (1.0, "LAST.")])
    assert text.startswith("FIRST. The grass is green.")
    assert text.endswith(" LAST.")
    # Depth 0.5: nearest sentence start to word 11.5. Noise sentences have 4, 4, 4, 4, 6 words,
    # so sentences start at words 0, 4, 8, 12, 16, 22 (the next cycle): 12 is nearest.
    words = stream.words[:23]
    middle = stream.render(23, [(0.5, "MID.")]).split()
    assert middle[:12] == words[:12] and middle[12] == "MID." and middle[13:] == words[12:]


def test_render_refuses_bad_depths():
    with pytest.raises(ValueError, match="depth"):
        word_stream("prose", 0).render(10, [(1.5, "x.")])
    with pytest.raises(ValueError, match="haystack"):
        word_stream("essay", 0)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 300),
    depths=st.lists(st.floats(0.0, 1.0), max_size=4),
    kind=st.sampled_from(["noise", "prose"]),
)
def test_render_keeps_haystack_words_in_order_and_each_insertion_once(n, depths, kind):
    stream = word_stream(kind, 7)
    needles = [f"NEEDLE{i}." for i in range(len(depths))]
    text = stream.render(n, list(zip(depths, needles, strict=True)))
    tokens = text.split()
    for needle in needles:
        assert tokens.count(needle) == 1
    assert [t for t in tokens if t not in needles] == stream.words[:n]
    # Needles sit at sentence boundaries: before a sentence start, or at the end.
    starts = set(stream.sentence_starts) | {n}
    position = 0
    for token in tokens:
        if token in needles:
            assert position in starts
        else:
            position += 1


def test_word_stream_grows_lazily_and_is_prefix_stable():
    a = WordStream(ProseGenerator(5).sentences())
    a.ensure(50)
    first = list(a.words[:50])
    a.ensure(5000)
    assert a.words[:50] == first
    b = word_stream("prose", 5)
    b.ensure(5000)
    assert b.words[:5000] == a.words[:5000]
