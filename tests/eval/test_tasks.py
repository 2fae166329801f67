"""Generated RULER-style tasks: reproducible, fitted to the length, answerable (SPEC S7)."""

from __future__ import annotations

import itertools
import re
from collections import Counter

import pytest

from probkv.eval.examples import score_example
from probkv.eval.prompt import prompt_length
from probkv.eval.tasks import (
    LENGTH_TOLERANCE,
    TASK_NAMES,
    TASKS,
    NeedleTask,
    generate_examples,
    get_task,
)

RULER_TASKS = {
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa",
}


def _check_examples(examples, tokenizer, length, task):
    for ex in examples:
        n = prompt_length(ex, tokenizer)
        # Fitted from below: never longer than asked, at most 2% shorter.
        assert (1 - LENGTH_TOLERANCE) * length <= n <= length, (task, n)
        assert ex.metadata["prompt_tokens"] == n and ex.metadata["length"] == length
        # The answers are really in the compressed part, and the scorer finds them.
        for answer in ex.answers:
            assert answer.lower() in ex.context.lower(), (task, answer)
        assert score_example(ex, ex.reference_prediction()) == 1.0
        assert score_example(ex, "") == 0.0
        # Question-agnostic: the question part does not reveal the answers.
        for answer in ex.answers:
            assert answer.lower() not in (ex.question + ex.answer_prefix).lower()


def test_task_registry_matches_ruler():
    assert set(TASK_NAMES) == RULER_TASKS
    for name, task in TASKS.items():
        assert task.metric == ("string_match_part" if name == "qa" else "string_match_all")
    with pytest.raises(ValueError, match="niah_single_1"):
        get_task("niah_single_9")


@pytest.mark.parametrize("length", [512, 1024, 2048])
@pytest.mark.parametrize("task", sorted(RULER_TASKS))
def test_fits_length_and_answers_are_findable(simple_tokenizer, task, length):
    examples = generate_examples(
        task, tokenizer=simple_tokenizer, length=length, num_examples=2, seed=1
    )
    assert [e.id for e in examples] == [f"{task}-{length}-1-{i}" for i in range(2)]
    _check_examples(examples, simple_tokenizer, length, task)


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multikey_3", "cwe", "qa"])
def test_fits_without_chat_template(plain_tokenizer, task):
    examples = generate_examples(
        task, tokenizer=plain_tokenizer, length=700, num_examples=2, seed=0
    )
    _check_examples(examples, plain_tokenizer, 700, task)


@pytest.mark.parametrize("task", sorted(RULER_TASKS))
def test_reproducible_by_seed(simple_tokenizer, task):
    def make(seed, n=3):
        return [
            e.to_json()
            for e in generate_examples(
                task, tokenizer=simple_tokenizer, length=600, num_examples=n, seed=seed
            )
        ]

    first = make(5)
    assert make(5) == first
    # Example i does not depend on how many are generated.
    assert make(5, n=1) == first[:1]
    other = make(6)
    assert all(a["context"] != b["context"] for a, b in zip(first, other, strict=True))
    assert len({e["context"] for e in first}) == 3


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


def test_frequent_words_are_the_top_three(simple_tokenizer):
    for ex in generate_examples("fwe", tokenizer=simple_tokenizer, length=1024, num_examples=2):
        words = ex.context.split("\n\n", 1)[1].split()
        ranked = Counter(words).most_common()
        assert [w for w, _ in ranked[:3]] == list(ex.answers)
        assert ranked[2][1] > ranked[3][1]
        # Zipf-like with alpha = 2: counts of ranks 1 and 2 are about 4 : 1.
        assert 3.0 < ranked[0][1] / ranked[1][1] < 5.0


def test_qa_gold_fact_is_unique(simple_tokenizer):
    for ex in generate_examples(
        "qa", tokenizer=simple_tokenizer, length=2048, num_examples=3, seed=4
    ):
        person = re.search(r"(?:was|did|does|that) (\w+ \w+)", ex.question)
        assert person is not None
        facts = re.findall(re.escape(person.group(1)), ex.context)
        assert len(facts) == 1  # the asked person appears in one fact only
        assert ex.metadata["num_facts"] >= 4


def test_custom_task_object(simple_tokenizer):
    task = NeedleTask("my_niah", "noise", value_kind="words", num_keys=2)
    (ex,) = generate_examples(task, tokenizer=simple_tokenizer, length=512, num_examples=1)
    assert ex.task == "my_niah" and re.fullmatch(r"[a-z]+-[a-z]+", ex.answers[0])
    _check_examples([ex], simple_tokenizer, 512, "my_niah")


def test_bad_arguments(simple_tokenizer):
    with pytest.raises(ValueError, match="too small"):
        generate_examples("niah_single_1", tokenizer=simple_tokenizer, length=20, num_examples=1)
    with pytest.raises(ValueError, match="length"):
        generate_examples("niah_single_1", tokenizer=simple_tokenizer, length=0, num_examples=1)
    with pytest.raises(ValueError, match="num_examples"):
        generate_examples("niah_single_1", tokenizer=simple_tokenizer, length=512, num_examples=0)
    with pytest.raises(ValueError, match="seed"):
        generate_examples(
            "niah_single_1", tokenizer=simple_tokenizer, length=512, num_examples=1, seed="1"
        )
    with pytest.raises(ValueError, match="num_queries"):
        NeedleTask("x", "prose", num_keys=1, num_queries=2)
    with pytest.raises(ValueError, match="haystack"):
        NeedleTask("x", "essay")


@pytest.mark.slow
@pytest.mark.parametrize("length", [512, 1024, 2048])
def test_smollm2_tokenizer_fits_every_task(smollm2_tokenizer, length):
    for task in sorted(RULER_TASKS):
        examples = generate_examples(
            task, tokenizer=smollm2_tokenizer, length=length, num_examples=2, seed=0
        )
        _check_examples(examples, smollm2_tokenizer, length, task)
