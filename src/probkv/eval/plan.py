"""What a run does (S7): its examples, and its jobs grouped into units.

A *job* is one (example, method, ratio); a *unit* is the jobs of one example that run from
one prefill. The prefill (model forward and the policy's observation, S2) depends only on the
method's score and score parameters, not on the ratio or the policy's other options
(sampling, weights, tau, budgets), so with prefill reuse the jobs of one example that share a
score form one unit; ``full`` is always a unit of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from probkv.eval.config import FULL, RunConfig
from probkv.eval.data import load_examples
from probkv.eval.examples import Example
from probkv.eval.tasks import generate_examples
from probkv.policies import parse_method


def load_run_examples(config: RunConfig, tokenizer: Any = None) -> list[Example]:
    """The run's examples, in order: a data file's (refused with file, line and field if
    malformed), or the generated tasks (task by task, length by length); the first
    ``max_examples``. ``tokenizer`` is needed for generated tasks only."""
    if config.data is not None:
        examples = load_examples(config.data, format=config.data_format)
    else:
        if tokenizer is None:
            raise ValueError("generated tasks need the model's tokenizer (tokenizer=...)")
        examples = [
            ex
            for task in config.tasks
            for length in config.lengths
            for ex in generate_examples(
                task,
                tokenizer=tokenizer,
                length=length,
                num_examples=config.per_task,
                seed=config.seed,
            )
        ]
    return examples[: config.max_examples] if config.max_examples else examples


def job_key(example_id: str, method: str, ratio: float) -> tuple[str, str, float]:
    """What identifies a job (and its results row): ``(example id, method, ratio)``."""
    return (example_id, method, float(ratio))


@dataclass(frozen=True)
class Unit:
    """Jobs of one example that run from one prefill: ``full`` alone, or methods that observe
    the same score (``jobs``: (method, ratio) pairs)."""

    example: Example
    jobs: tuple[tuple[str, float], ...]


def _observation_key(method: str, ratio: float) -> tuple:
    policy = parse_method(method, ratio)
    return (policy.score, tuple(sorted(policy.score_params.items())))


def plan_units(
    examples: Sequence[Example],
    jobs: Sequence[tuple[str, float]],
    done: Iterable[tuple[str, str, float]] = (),
    *,
    reuse_prefill: bool = True,
) -> list[Unit]:
    """The units of the jobs not in ``done``, example after example (so a partial run has
    complete examples). With ``reuse_prefill``, jobs of one example with the same observation
    (score and its parameters) form one unit; otherwise every job is its own unit."""
    finished = set(done)
    units = []
    for ex in examples:
        pending = [(m, r) for m, r in jobs if job_key(ex.id, m, r) not in finished]
        groups: dict[Any, list[tuple[str, float]]] = {}
        for i, (m, r) in enumerate(pending):
            key = ("job", i) if m == FULL or not reuse_prefill else _observation_key(m, r)
            groups.setdefault(key, []).append((m, r))
        units.extend(Unit(ex, tuple(g)) for g in groups.values())
    return units
