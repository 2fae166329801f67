"""Scorers: generated text -> a score in [0, 1] (S7, "Task score").

Every scorer has the same signature, ``scorer(prediction, answers, all_classes=None) -> float``,
where ``answers`` are the reference strings of one example:

- RULER: ``string_match_all`` (fraction of the references contained in the prediction,
  case-insensitive) and ``string_match_part`` (1 if any reference is contained).
- LongBench (the maximum over the references, as LongBench's ``eval.py`` does):
  ``qa_f1`` (token F1 after normalisation), ``rouge_l`` (ROUGE-L F-measure, via the
  ``rouge-score`` package), ``classification`` (needs ``all_classes``), ``retrieval`` and
  ``retrieval_zh`` (the paragraph number), ``count`` (the paragraph count) and ``code_sim``
  (edit similarity of the first code line, via ``rapidfuzz``).
- Generic: ``exact_match`` and ``contains`` (on normalised text).

Known differences from LongBench's own ``metrics.py`` (kept small on purpose, and documented):

- ``rouge_l`` uses Google's ``rouge-score`` (tokens are lower-cased runs of ``[a-z0-9]``, no
  stemming) instead of the ``rouge`` package; the two tokenise slightly differently.
- ``code_sim`` uses ``rapidfuzz.fuzz.ratio`` (exact Indel similarity) instead of
  ``fuzzywuzzy``'s difflib-based, integer-rounded ratio.
- ``classification`` drops every matched class that is a proper substring of the reference;
  LongBench removes items from the list it is iterating over and so may keep some of them.
- Scores are in [0, 1]; LongBench reports 100 times the mean.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from types import MappingProxyType

Scorer = Callable[..., float]

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"\d+")
_PARAGRAPH_EN = re.compile(r"Paragraph (\d+)")
_PARAGRAPH_ZH = re.compile(r"段落(\d+)")


def normalize_answer(text: str) -> str:
    """SQuAD/LongBench normalisation: lower-case, drop ASCII punctuation, drop the articles
    a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _check_answers(answers: Sequence[str], metric: str) -> Sequence[str]:
    if isinstance(answers, str) or not isinstance(answers, Sequence):
        raise ValueError(f"{metric}: answers must be a sequence of strings, got {answers!r}")
    if len(answers) == 0:
        raise ValueError(f"{metric}: answers must not be empty (no reference to score against)")
    if not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{metric}: every answer must be a string, got {list(answers)!r}")
    return answers


def _best(
    per_answer: Callable[[str, str], float], prediction: str, answers: Sequence[str]
) -> float:
    """LongBench's reduction: the best score over the references."""
    return max(per_answer(prediction, answer) for answer in answers)


# --- RULER -------------------------------------------------------------------------------------


def string_match_all(
    prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """RULER: fraction of the references contained in the prediction (case-insensitive)."""
    _check_answers(answers, "string_match_all")
    pred = prediction.lower()
    return sum(1.0 for a in answers if a.lower() in pred) / len(answers)


def string_match_part(
    prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """RULER: 1 if any reference is contained in the prediction (case-insensitive), else 0."""
    _check_answers(answers, "string_match_part")
    pred = prediction.lower()
    return max(1.0 if a.lower() in pred else 0.0 for a in answers)


# --- LongBench ---------------------------------------------------------------------------------


def token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1: ``2 P R / (P + R)`` with ``P = common / |pred|``, ``R = common / |ref|``."""
    common = sum((Counter(prediction_tokens) & Counter(reference_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(prediction_tokens)
    recall = common / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(
    prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """LongBench ``qa_f1_score``: token F1 of the normalised texts, best over the references."""
    _check_answers(answers, "qa_f1")
    pred_tokens = normalize_answer(prediction).split()
    return _best(
        lambda _, a: token_f1(pred_tokens, normalize_answer(a).split()), prediction, answers
    )


@lru_cache(maxsize=1)
def _rouge_l_scorer():
    try:
        from rouge_score import rouge_scorer
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ValueError(
            "metric 'rouge_l' needs the rouge-score package: pip install 'probkv[eval]'"
        ) from err
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(
    prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """ROUGE-L F-measure (``rouge-score``, no stemming), best over the references."""
    _check_answers(answers, "rouge_l")
    scorer = _rouge_l_scorer()
    # rouge-score's argument order is (target, prediction).
    return _best(lambda p, a: float(scorer.score(a, p)["rougeL"].fmeasure), prediction, answers)


def classification(
    prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """LongBench ``classification_score``: the classes named in the prediction (case-sensitive
    substring), minus those that are proper substrings of the reference; ``1 / #matched`` if the
    reference is among them, else 0. Best over the references."""
    _check_answers(answers, "classification")
    if all_classes is None or isinstance(all_classes, str) or len(all_classes) == 0:
        raise ValueError(
            f"metric 'classification' needs all_classes (the list of class names), got {all_classes!r}"
        )
    named = [c for c in all_classes if c in prediction]

    def per_answer(_: str, reference: str) -> float:
        matched = [c for c in named if not (c in reference and c != reference)]
        return 1.0 / len(matched) if reference in matched else 0.0

    return _best(per_answer, prediction, answers)


def _numbers_score(prediction: str, target: str) -> float:
    """Fraction of the numbers in the prediction equal to ``target`` (0 if there are none)."""
    numbers = _NUMBER.findall(prediction)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if n == target) / len(numbers)


def _paragraph_id(reference: str, pattern: re.Pattern[str], metric: str) -> str:
    match = pattern.search(reference)
    if match is None:
        raise ValueError(
            f"metric {metric!r}: reference {reference!r} does not name a paragraph "
            f"(expected the form {pattern.pattern!r})"
        )
    return match.group(1)


def retrieval(
    prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """LongBench ``retrieval_score``: reference "Paragraph N"; the fraction of the numbers in the
    prediction equal to N."""
    _check_answers(answers, "retrieval")
    return _best(
        lambda p, a: _numbers_score(p, _paragraph_id(a, _PARAGRAPH_EN, "retrieval")),
        prediction,
        answers,
    )


def retrieval_zh(
    prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """LongBench ``retrieval_zh_score``: as :func:`retrieval` with references "段落N"."""
    _check_answers(answers, "retrieval_zh")
    return _best(
        lambda p, a: _numbers_score(p, _paragraph_id(a, _PARAGRAPH_ZH, "retrieval_zh")),
        prediction,
        answers,
    )


def count(
    prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """LongBench ``count_score``: the fraction of the numbers in the prediction equal to the
    reference count."""
    _check_answers(answers, "count")
    return _best(lambda p, a: _numbers_score(p, a.strip()), prediction, answers)


def first_code_line(prediction: str) -> str:
    """LongBench's rule for code: the first line (after leading newlines) that contains no
    backtick, ``#`` or ``//`` (so markdown fences and comments are skipped); "" if none."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim(
    prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """LongBench ``code_sim_score``: ``rapidfuzz.fuzz.ratio / 100`` between the first code line
    of the prediction and the reference line. Best over the references."""
    _check_answers(answers, "code_sim")
    try:
        from rapidfuzz import fuzz
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ValueError(
            "metric 'code_sim' needs the rapidfuzz package: pip install 'probkv[eval]'"
        ) from err
    line = first_code_line(prediction)
    return _best(lambda _, a: fuzz.ratio(line, a) / 100.0, prediction, answers)


# --- generic -----------------------------------------------------------------------------------


def exact_match(
    prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """1 if the normalised prediction equals a normalised reference (see :func:`normalize_answer`)."""
    _check_answers(answers, "exact_match")
    pred = normalize_answer(prediction)
    return max(1.0 if pred == normalize_answer(a) else 0.0 for a in answers)


def contains(
    prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """1 if some normalised reference occurs, as whole words, in the normalised prediction."""
    _check_answers(answers, "contains")
    pred = f" {normalize_answer(prediction)} "
    return max(1.0 if (ref := normalize_answer(a)) and f" {ref} " in pred else 0.0 for a in answers)


SCORERS: Mapping[str, Scorer] = MappingProxyType(
    {
        "string_match_all": string_match_all,
        "string_match_part": string_match_part,
        "qa_f1": qa_f1,
        "rouge_l": rouge_l,
        "classification": classification,
        "retrieval": retrieval,
        "retrieval_zh": retrieval_zh,
        "count": count,
        "code_sim": code_sim,
        "exact_match": exact_match,
        "contains": contains,
    }
)
"""Scorers by metric name (S7)."""


def check_metric(name: str, what: str = "metric") -> str:
    """``name`` if it is a registered scorer, else a ValueError listing the names."""
    if not isinstance(name, str) or name not in SCORERS:
        raise ValueError(f"{what} must be one of {', '.join(sorted(SCORERS))}; got {name!r}")
    return name


def get_scorer(name: str) -> Scorer:
    """The scorer registered under ``name`` (see :data:`SCORERS`)."""
    return SCORERS[check_metric(name)]


def score(
    metric: str,
    prediction: str,
    answers: Sequence[str],
    all_classes: Sequence[str] | None = None,
) -> float:
    """Score one prediction with the named metric; a float in [0, 1]."""
    if not isinstance(prediction, str):
        raise ValueError(f"prediction must be a string, got {type(prediction).__name__}")
    return float(get_scorer(metric)(prediction, answers, all_classes))
