"""Scorers on hand-computed cases (S7, "Task score")."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from probkv.eval import scorers
from probkv.eval.scorers import SCORERS, get_scorer, normalize_answer, score

EXPECTED_NAMES = {
    "string_match_all",
    "string_match_part",
    "qa_f1",
    "rouge_l",
    "classification",
    "retrieval",
    "retrieval_zh",
    "count",
    "code_sim",
    "exact_match",
    "contains",
}


def test_registry_names_and_unknown_name_lists_them():
    assert set(SCORERS) == EXPECTED_NAMES
    with pytest.raises(ValueError, match="bleu") as err:
        get_scorer("bleu")
    for name in EXPECTED_NAMES:
        assert name in str(err.value)


def test_string_match_all_is_fraction_of_references_case_insensitive():
    # "123" and "456" are in the prediction, "789" is not: 2 of 3.
    assert score(
        "string_match_all", "The numbers are 123 and 456", ["123", "456", "789"]
    ) == pytest.approx(2 / 3)
    assert score("string_match_all", "the KEY is abc", ["Key", "ABC"]) == 1.0
    assert score("string_match_all", "", ["1"]) == 0.0


def test_string_match_part_is_one_if_any_reference_matches():
    assert score("string_match_part", "The numbers are 123 and 456", ["999", "456"]) == 1.0
    assert score("string_match_part", "Paris", ["London", "Rome"]) == 0.0


def test_normalize_answer():
    # lower -> drop punctuation ("'", "-", ",", "!") -> drop articles -> collapse spaces.
    assert normalize_answer("The  Cat's-Hat, an apple!") == "catshat apple"
    # Articles only as whole words: "theatre" keeps its "the".
    assert normalize_answer("A theatre") == "theatre"


def test_qa_f1_hand_computed():
    # pred tokens: eiffel tower in paris (4); ref: eiffel tower (2); common 2.
    # P = 2/4, R = 2/2, F1 = 2 * 0.5 * 1 / 1.5 = 2/3.
    assert score("qa_f1", "The Eiffel Tower, in Paris!", ["Eiffel Tower"]) == pytest.approx(2 / 3)
    # Best over references: "Paris" gives P = 1/4, R = 1, F1 = 0.5 / 1.25 = 0.4 < 2/3.
    assert score("qa_f1", "The Eiffel Tower, in Paris!", ["Paris"]) == pytest.approx(0.4)
    assert score(
        "qa_f1", "The Eiffel Tower, in Paris!", ["Paris", "Eiffel Tower"]
    ) == pytest.approx(2 / 3)
    # Bag of tokens: pred "cat cat dog" (article dropped) vs "cat cat cat": common = min(2, 3) = 2,
    # P = 2/3, R = 2/3, F1 = 2/3.
    assert score("qa_f1", "a cat cat dog", ["cat cat cat"]) == pytest.approx(2 / 3)
    assert score("qa_f1", "", ["anything"]) == 0.0
    assert score("qa_f1", "yes", ["Yes."]) == 1.0


def test_rouge_l_hand_computed():
    # LCS of "the cat sat on the mat" / "the cat lay on the mat" = the cat on the mat (5 of 6):
    # P = R = 5/6, F = 5/6. The second reference shares nothing; the best is taken.
    assert score(
        "rouge_l", "the cat sat on the mat", ["the cat lay on the mat", "dog"]
    ) == pytest.approx(5 / 6)
    # Subsequence, not substring: pred "a b c d", ref "a c" -> LCS 2, P = 2/4, R = 1, F = 2/3.
    assert score("rouge_l", "a b c d", ["a c"]) == pytest.approx(2 / 3)
    assert score("rouge_l", "", ["the cat"]) == 0.0


def test_classification_hand_computed():
    classes = ["city", "country", "other city"]
    # "city" is a proper substring of the reference "other city" and is discarded: 1/1.
    assert score("classification", "other city", ["other city"], classes) == 1.0
    # Two classes named, the reference among them: 1/2.
    assert score("classification", "city or country", ["city"], classes) == 0.5
    assert score("classification", "country", ["city"], classes) == 0.0
    # Case-sensitive, as in LongBench.
    assert score("classification", "City", ["city"], classes) == 0.0
    with pytest.raises(ValueError, match="all_classes"):
        score("classification", "city", ["city"])


def test_retrieval_and_count_hand_computed():
    # Numbers in the prediction: 12 and 3; one of two equals the reference id 12.
    assert score("retrieval", "Paragraph 12, or maybe 3", ["Paragraph 12"]) == 0.5
    assert score("retrieval", "Paragraph 12", ["Paragraph 12"]) == 1.0
    assert score("retrieval", "I do not know", ["Paragraph 12"]) == 0.0
    assert score("retrieval_zh", "答案是段落5", ["段落5"]) == 1.0
    with pytest.raises(ValueError, match="Paragraph"):
        score("retrieval", "1", ["the first one"])
    # Numbers 7 and 10; one equals the reference count 7.
    assert score("count", "There are 7 unique paragraphs out of 10", ["7"]) == 0.5
    assert score("count", "seven", ["7"]) == 0.0


def test_code_sim_uses_first_code_line():
    prediction = "```python\n# the next line\nx = foo(1)\n```"
    assert scorers.first_code_line(prediction) == "x = foo(1)"
    assert score("code_sim", prediction, ["x = foo(1)"]) == 1.0
    assert scorers.first_code_line("\n\n// c\nreturn 1;") == "return 1;"
    # Indel ratio: "abcd" -> "abce" needs 1 deletion + 1 insertion over 8 characters: 1 - 2/8.
    assert score("code_sim", "abcd", ["abce"]) == pytest.approx(0.75)
    # Only comment lines: nothing to compare.
    assert score("code_sim", "# only a comment", ["x = 1"]) == 0.0


def test_exact_match_and_contains():
    assert score("exact_match", "The Answer.", ["answer"]) == 1.0
    assert score("exact_match", "answer two", ["answer"]) == 0.0
    assert score("contains", "I think it is Paris, France", ["paris"]) == 1.0
    # Whole words only: "par" is not a word of the prediction.
    assert score("contains", "I think it is Paris, France", ["par"]) == 0.0


@pytest.mark.parametrize(
    "name", sorted(EXPECTED_NAMES - {"classification", "retrieval", "retrieval_zh"})
)
def test_bad_answers_are_refused(name):
    with pytest.raises(ValueError, match="answers"):
        score(name, "x", [])
    with pytest.raises(ValueError, match="answers"):
        score(name, "x", "not a list")
    with pytest.raises(ValueError, match="prediction"):
        score(name, None, ["x"])  # type: ignore[arg-type]


_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(prediction=_text, answers=st.lists(_text, min_size=1, max_size=4))
def test_scores_are_in_unit_interval(prediction, answers):
    for name in EXPECTED_NAMES - {"classification", "retrieval", "retrieval_zh"}:
        value = score(name, prediction, answers)
        assert 0.0 <= value <= 1.0 and math.isfinite(value), name
    value = score("classification", prediction, answers, answers)
    assert 0.0 <= value <= 1.0


@settings(max_examples=60, deadline=None)
# ASCII: Unicode lower-casing is context-dependent for a few letters (final sigma).
@given(
    answers=st.lists(
        st.text(alphabet=st.characters(codec="ascii"), min_size=1, max_size=12),
        min_size=1,
        max_size=5,
    )
)
def test_joined_answers_are_a_perfect_string_match(answers):
    prediction = ", ".join(answers)
    assert score("string_match_all", prediction, answers) == 1.0
    assert score("string_match_part", prediction, answers) == 1.0
