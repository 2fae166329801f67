"""RULER-style synthetic tasks, generated offline, seeded and fitted to a token length (S7).

``generate_examples(task, tokenizer=..., length=..., num_examples=..., seed=...)`` returns
:class:`~probkv.eval.examples.Example` records whose prompt length (chat template overhead +
context + question + answer prefix, as defined in :mod:`probkv.eval.prompt`) is within 2% of
``length`` and never above it. The haystack grows word by word (or needle by needle, topped
up with noise words) until it fills the budget; a binary search on the real tokenizer finds
the size.

Tasks (RULER's families, as far as they can be made without downloads):

========================  ===========================================================  ======
name                      what                                                         metric
========================  ===========================================================  ======
``niah_single_1``         noise haystack, one word key, a 7-digit number               all
``niah_single_2``         prose haystack, one word key, a 7-digit number               all
``niah_single_3``         prose haystack, one word key, a UUID value                   all
``niah_multikey_1``       prose haystack, 4 keys planted, one asked                    all
``niah_multikey_2``       haystack made of distractor needles (word keys, numbers)     all
``niah_multikey_3``       haystack of UUID-key/UUID-value distractor needles           all
``niah_multivalue``       prose haystack, one key with 4 values, all asked             all
``niah_multiquery``       prose haystack, 4 keys, all asked                            all
``vt``                    variable-assignment chains (4 hops) among distractor chains  all
``cwe``                   10 common words in a numbered list of rarer words            all
``fwe``                   3 most frequent coded words, Zipf-like frequencies           all
``qa``                    a fact about a person among distractor facts in prose         part
========================  ===========================================================  ======

(all = ``string_match_all``, part = ``string_match_part``, as RULER scores them.)

One module per family (``niah``, ``variable_tracking``, ``common_words``, ``frequent_words``,
``qa``), the building blocks they share (``base``), the registry (``registry``: :data:`TASKS`)
and the fitting to a length (``generate``: :func:`generate_examples`).

Depth: within an example the planted items are spread evenly over the context (a random
rotation); across examples the depth of the asked needle follows a golden-ratio sequence
from a seeded start, so any number of examples covers depths evenly. Every example is a
pure function of ``(task, length, seed, index)`` and the tokenizer.
"""

from __future__ import annotations

from probkv.eval.tasks.blocks import Builder, Draft
from probkv.eval.tasks.catalog import TASK_NAMES, TASKS, Task, get_task, task_metric
from probkv.eval.tasks.common_words import CommonWordsTask
from probkv.eval.tasks.frequent_words import FrequentWordsTask
from probkv.eval.tasks.generate import LENGTH_TOLERANCE, generate_examples
from probkv.eval.tasks.niah import NeedleTask
from probkv.eval.tasks.qa import FactQATask
from probkv.eval.tasks.variable_tracking import VariableTrackingTask

__all__ = [
    "LENGTH_TOLERANCE",
    "TASKS",
    "TASK_NAMES",
    "Builder",
    "CommonWordsTask",
    "Draft",
    "FactQATask",
    "FrequentWordsTask",
    "NeedleTask",
    "Task",
    "VariableTrackingTask",
    "generate_examples",
    "get_task",
    "task_metric",
]
