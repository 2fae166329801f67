"""Evaluation harness (S7): generated tasks, data loading, scorers, win score, runs.

Layer 4 of docs/architecture.md: nothing below depends on it. Importing this package loads
only the model-free parts: examples and their JSONL form (:mod:`.examples`, :mod:`.data`,
:mod:`.longbench`), prompt assembly (:mod:`.prompt`), the seeded task generators
(:mod:`.tasks`, :mod:`.haystack`), scorers (:mod:`.scorers`) and the win score / average total
score (:mod:`.winscore`). The parts that run a model are imported from their modules:
:mod:`.runner` (``run_eval``; ``probkv eval``; its parts: :mod:`.config`, :mod:`.plan`,
:mod:`.store`, :mod:`.summary`, :mod:`.job`, :mod:`.workers`) and :mod:`.plots` (``probkv
plot`` of a run folder). The experiments built on it are in ``probkv.experiments``, the
training of the kvzap scorers in ``probkv.training``, the command line in ``probkv.cli``.
"""

from probkv.eval.data import load_examples
from probkv.eval.examples import Example, score_example, write_examples
from probkv.eval.longbench import LONGBENCH_DATASETS, load_templates
from probkv.eval.prompt import Prompt, build_prompt, prompt_length, prompt_token_ids
from probkv.eval.scorers import SCORERS, get_scorer, score
from probkv.eval.tasks import TASK_NAMES, TASKS, generate_examples
from probkv.eval.winscore import (
    average_total_score,
    average_total_scores,
    score_table,
    task_averages,
    win_scores,
    win_scores_per_task,
)

__all__ = [
    "LONGBENCH_DATASETS",
    "SCORERS",
    "TASKS",
    "TASK_NAMES",
    "Example",
    "Prompt",
    "average_total_score",
    "average_total_scores",
    "build_prompt",
    "generate_examples",
    "get_scorer",
    "load_examples",
    "load_templates",
    "prompt_length",
    "prompt_token_ids",
    "score",
    "score_example",
    "score_table",
    "task_averages",
    "win_scores",
    "win_scores_per_task",
    "write_examples",
]
