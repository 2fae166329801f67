"""The Example record: field checks, JSONL round trip, scoring (S7)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from probkv.eval.data import load_examples
from probkv.eval.examples import (
    MAX_NEW_TOKENS,
    ContextTooLongError,
    Example,
    check_context_fits,
    fit_context,
    iter_jsonl,
    score_example,
    truncate_middle,
    write_examples,
)


def _fields(**kw):
    fields = {
        "id": "e1",
        "task": "niah_single_1",
        "context": "ctx",
        "question": "\n\nq?",
        "answers": ["1234567"],
        "max_new_tokens": 16,
    }
    fields.update(kw)
    return fields


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("id", "", "non-empty"),
        ("task", 3, "string"),
        ("context", None, "string"),
        ("answers", [], "non-empty list"),
        ("answers", "1234567", "list of strings"),
        ("answers", ["a", 1], "only strings"),
        ("max_new_tokens", 0, ">= 1"),
        ("max_new_tokens", 2.5, "integer"),
        ("max_new_tokens", True, "integer"),
        ("metric", "bleu", "must be one of"),
        ("all_classes", [], "non-empty"),
        ("first_line_only", "yes", "true or false"),
        ("metadata", [1], "JSON object"),
    ],
)
def test_bad_fields_are_named(field, value, message):
    with pytest.raises(ValueError, match=message) as err:
        Example(**_fields(**{field: value}))
    assert f"'{field}'" in str(err.value)


def test_classification_needs_classes():
    with pytest.raises(ValueError, match="all_classes"):
        Example(**_fields(metric="classification"))


def test_answers_are_stored_as_a_tuple():
    ex = Example(**_fields(answers=["a", "b"]))
    assert ex.answers == ("a", "b")
    assert ex.reference_prediction() == "a, b"


def test_jsonl_round_trip(tmp_path):
    examples = [
        Example(**_fields()),
        Example(
            **_fields(
                id="e2",
                task="trec",
                answers=["Location"],
                metric="classification",
                all_classes=["Location", "Human"],
                first_line_only=True,
                chat_template=False,
                answer_prefix="Type:",
                metadata={"length": 512, "depths": [0.25]},
            )
        ),
    ]
    path = tmp_path / "data.jsonl"
    assert write_examples(path, examples) == 2
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["all_classes"] == ["Location", "Human"]
    assert load_examples(path) == examples
    with pytest.raises(ValueError, match="duplicate"):
        write_examples(path, [examples[0], examples[0]])
    with pytest.raises(ValueError, match="'metadata' is not JSON"):
        write_examples(path, [Example(**_fields(metadata={"x": object()}))])


def test_score_example_applies_first_line_rule():
    ex = Example(
        **_fields(
            answers=["Location"],
            metric="classification",
            all_classes=["Location", "Human"],
            first_line_only=True,
        )
    )
    # Only "Location" is scored; the second line naming "Human" is ignored.
    assert score_example(ex, "\nLocation\nor maybe Human") == 1.0
    # Without the rule both classes are named: 1/2.
    assert (
        score_example(Example(**{**ex.to_json(), "first_line_only": False}), "Location\nHuman")
        == 0.5
    )
    assert score_example(Example(**_fields()), "it is 1234567") == 1.0


# -- limits (issue 11) ---------------------------------------------------------------------------


def test_max_new_tokens_bound_names_example_value_and_bound():
    assert MAX_NEW_TOKENS == 4096
    assert Example(**_fields(max_new_tokens=4096)).max_new_tokens == 4096
    with pytest.raises(ValueError) as err:
        Example(**_fields(id="e9", max_new_tokens=4097))
    assert str(err.value) == (
        "example 'e9': field 'max_new_tokens' must be <= 4096 (the bound on an example's "
        "generation budget), got 4097"
    )


def test_iter_jsonl_line_limit_counts_content_not_line_endings(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"a": "12345"}\r\n\n{"b": 1}')
    assert list(iter_jsonl(path, max_line_bytes=14)) == [(1, {"a": "12345"}), (3, {"b": 1})]
    with pytest.raises(ValueError, match=rf"^{path}:1: line longer than the limit of 13 bytes"):
        list(iter_jsonl(path, max_line_bytes=13))


def test_iter_jsonl_unreadable_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist or is not a file"):
        list(iter_jsonl(tmp_path))


def test_check_context_fits_names_example_length_and_limit():
    check_context_fits(8000, 192, 8192, example_id="ok")  # exactly full
    with pytest.raises(ContextTooLongError) as err:
        check_context_fits(22034, 32, 8192, example_id="niah-3")
    assert isinstance(err.value, ValueError)
    assert str(err.value) == (
        "example 'niah-3' does not fit the model: its prompt has 22034 tokens and it may "
        "generate 32 more (22066 positions), but the model's limit is 8192 positions "
        "(max_position_embeddings); shorten the example or truncate the middle of its context"
    )
    assert (err.value.prompt_tokens, err.value.limit) == (22034, 8192)
    for bad in ({"prompt_tokens": -1}, {"max_new_tokens": 2.0}, {"max_positions": 0}):
        kwargs = {"prompt_tokens": 1, "max_new_tokens": 1, "max_positions": 8, **bad}
        name = next(iter(bad))
        with pytest.raises(ValueError, match=f"^{name} must be an integer"):
            check_context_fits(**kwargs, example_id="x")


def test_truncate_middle_keeps_both_ends():
    ids = list(range(10))
    assert truncate_middle(ids, 4) == [0, 1, 8, 9]
    assert truncate_middle(ids, 5) == [0, 1, 7, 8, 9]
    assert truncate_middle(ids, 1) == [9]
    assert truncate_middle(ids, 10) == ids and truncate_middle((1, 2), 5) == [1, 2]
    with pytest.raises(ValueError, match="tolist"):
        truncate_middle("abc", 2)
    with pytest.raises(ValueError, match="max_len must be an integer >= 1"):
        truncate_middle(ids, 0)


@given(n=st.integers(0, 300), max_len=st.integers(1, 300))
def test_truncate_middle_property(n, max_len):
    ids = list(range(n))
    out = truncate_middle(ids, max_len)
    assert len(out) == min(n, max_len)
    head = max_len // 2 if n > max_len else n
    assert out[:head] == ids[:head]  # a prefix of the input ...
    assert out[head:] == ids[n - (len(out) - head) :]  # ... then a suffix of it


def test_fit_context_truncates_only_when_asked_and_possible():
    context, question = list(range(100)), [500, 501]
    assert fit_context(context, question, 8, 110, example_id="a") == context
    with pytest.raises(ContextTooLongError, match="its prompt has 102 tokens"):
        fit_context(context, question, 8, 64, example_id="a")
    cut = fit_context(context, question, 8, 64, example_id="a", truncate=True)
    assert cut == [*range(27), *range(73, 100)] and len(cut) + 2 + 8 == 64
    # No room left for any context: even truncation cannot fit it.
    with pytest.raises(ContextTooLongError, match="limit is 10 positions"):
        fit_context(context, question, 8, 10, example_id="a", truncate=True)
