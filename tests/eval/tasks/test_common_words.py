"""Common words extraction (probkv.eval.tasks.common_words): RULER's repeat counts."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from probkv.eval.tasks import generate_examples


@pytest.mark.parametrize("length", [1024, 4096])
def test_common_words_are_strictly_most_frequent(simple_tokenizer, length):
    (ex,) = generate_examples("cwe", tokenizer=simple_tokenizer, length=length, num_examples=1)
    counts = Counter(re.findall(r"\d+\. (\w+)", ex.context))
    common = set(ex.answers)
    assert len(common) == 10
    assert min(counts[w] for w in common) > max(c for w, c in counts.items() if w not in common)
    expected = (30, 3) if length >= 4096 else (6, 1)
    assert {counts[w] for w in common} == {expected[0]}
    assert {c for w, c in counts.items() if w not in common} == {expected[1]}
