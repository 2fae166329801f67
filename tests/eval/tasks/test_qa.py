"""Question answering over planted facts (probkv.eval.tasks.qa)."""

from __future__ import annotations

import re

from probkv.eval.tasks import generate_examples


def test_qa_gold_fact_is_unique(simple_tokenizer):
    for ex in generate_examples(
        "qa", tokenizer=simple_tokenizer, length=2048, num_examples=3, seed=4
    ):
        person = re.search(r"(?:was|did|does|that) (\w+ \w+)", ex.question)
        assert person is not None
        facts = re.findall(re.escape(person.group(1)), ex.context)
        assert len(facts) == 1  # the asked person appears in one fact only
        assert ex.metadata["num_facts"] >= 4
