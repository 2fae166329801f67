"""Needle-in-a-haystack tasks (probkv.eval.tasks.niah): depths spread over examples, unique
keys, every value of multivalue and multiquery asked."""

from __future__ import annotations

import itertools
import re

from probkv.eval.tasks import generate_examples


def test_needle_depths_spread_over_examples(simple_tokenizer):
    n = 12
    examples = generate_examples(
        "niah_single_2", tokenizer=simple_tokenizer, length=1024, num_examples=n, seed=3
    )
    depths = sorted(e.metadata["depths"][0] for e in examples)
    gaps = [b - a for a, b in itertools.pairwise(depths)] + [depths[0] + 1 - depths[-1]]
    # Golden-ratio sequence: by the three-gap theorem the largest gap is below 1.81 / n.
    assert max(gaps) < 2 / n
    for ex in examples:
        # The needle really sits near its depth in the haystack (sentence granularity).
        haystack = ex.context.split("\n\n", 1)[1]
        where = haystack.index(ex.answers[0]) / len(haystack)
        assert abs(where - ex.metadata["depths"][0]) < 0.1


def test_needle_keys_are_unique_and_asked_once(simple_tokenizer):
    for task in ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3", "niah_single_2"):
        for ex in generate_examples(
            task, tokenizer=simple_tokenizer, length=1024, num_examples=2, seed=0
        ):
            needles = re.findall(r"A special magic \w+ for (\S+) is (\S+)\.", ex.context)
            keys = [k for k, _ in needles]
            assert len(keys) == len(set(keys)), task  # one value per key
            (asked,) = ex.metadata["keys"]
            assert dict(needles)[asked] == ex.answers[0]
            if task != "niah_single_2":
                assert len(needles) >= 4  # distractor needles are present


def test_multivalue_and_multiquery_answers(simple_tokenizer):
    (mv,) = generate_examples(
        "niah_multivalue", tokenizer=simple_tokenizer, length=1024, num_examples=1
    )
    needles = re.findall(r"A special magic number for (\S+) is (\d+)\.", mv.context)
    assert len(needles) == 4 and {k for k, _ in needles} == set(mv.metadata["keys"])
    assert sorted(v for _, v in needles) == sorted(mv.answers)
    (mq,) = generate_examples(
        "niah_multiquery", tokenizer=simple_tokenizer, length=1024, num_examples=1
    )
    needles = dict(re.findall(r"A special magic number for (\S+) is (\d+)\.", mq.context))
    assert [needles[k] for k in mq.metadata["keys"]] == list(mq.answers)
    assert all(k in mq.question for k in mq.metadata["keys"])
