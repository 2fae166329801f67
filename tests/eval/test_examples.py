"""The Example record: field checks, JSONL round trip, scoring (SPEC S7)."""

from __future__ import annotations

import json

import pytest

from probkv.eval.data import load_examples
from probkv.eval.examples import Example, score_example, write_examples


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
