"""Frequent words extraction (probkv.eval.tasks.frequent_words): the Zipf top words."""

from __future__ import annotations

from collections import Counter

from probkv.eval.tasks import generate_examples


def test_frequent_words_are_the_top_three(simple_tokenizer):
    for ex in generate_examples("fwe", tokenizer=simple_tokenizer, length=1024, num_examples=2):
        words = ex.context.split("\n\n", 1)[1].split()
        ranked = Counter(words).most_common()
        assert [w for w, _ in ranked[:3]] == list(ex.answers)
        assert ranked[2][1] > ranked[3][1]
        # Zipf-like with alpha = 2: counts of ranks 1 and 2 are about 4 : 1.
        assert 3.0 < ranked[0][1] / ranked[1][1] < 5.0
