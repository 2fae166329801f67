"""Variable tracking (probkv.eval.tasks.variable_tracking), against a slow reference that
follows every assignment."""

from __future__ import annotations

import re

from probkv.eval.tasks import generate_examples


def _resolve_variables(context: str) -> dict[str, str]:
    """Slow reference for vt: follow every assignment to its number."""
    direct = dict(re.findall(r"VAR (\w+) = (\d+)\.", context))
    copies = dict(re.findall(r"VAR (\w+) = VAR (\w+)\.", context))
    values = {}
    for name in [*direct, *copies]:
        seen, current = set(), name
        while current in copies and current not in seen:
            seen.add(current)
            current = copies[current]
        values[name] = direct.get(current)
    return values


def test_variable_tracking_answers_are_the_whole_chain(simple_tokenizer):
    for ex in generate_examples(
        "vt", tokenizer=simple_tokenizer, length=1024, num_examples=3, seed=2
    ):
        value = re.search(r"value (\d+)", ex.question).group(1)
        values = _resolve_variables(ex.context)
        assert {n for n, v in values.items() if v == value} == set(ex.answers)
        assert len(values) == 3 * 5  # 3 chains of 4 hops (5 variables each)
        # Each chain is stated in order: a copy comes after the variable it copies.
        order = re.findall(r"VAR (\w+) =", ex.context)
        for child, parent in re.findall(r"VAR (\w+) = VAR (\w+)\.", ex.context):
            assert order.index(parent) < order.index(child)
