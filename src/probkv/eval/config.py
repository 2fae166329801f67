"""What an evaluation run evaluates (S7): :class:`RunConfig`, checked on construction,
and its identity (:data:`IDENTITY_KEYS`), which a resume compares.

A data file enters the identity by its SHA-256, not its path; the model's dtype enters it by
its concrete name (``auto`` is resolved on construction, :mod:`probkv.models.dtypes`), so a resume
in another dtype never mixes rows; workers, threads and prefill reuse are execution details
(arguments of :func:`probkv.eval.runner.run_eval`), not part of the configuration, and may
change between reruns.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from probkv._checks import check_choice, check_positive_int, check_ratio
from probkv.eval.data import FORMATS
from probkv.eval.tasks import TASK_NAMES
from probkv.models.dtypes import check_dtype_name, resolve_dtype_name
from probkv.policies import method_name, parse_method

#: The plain model, no eviction: runs once per example, at ratio 0 (the runner's docstring).
FULL = "full"

#: Configuration fields that define a run's results; a resume needs them all equal.
IDENTITY_KEYS = (
    "model",
    "methods",
    "ratios",
    "data_sha256",
    "data_format",
    "tasks",
    "lengths",
    "per_task",
    "seed",
    "question_aware",
    "max_examples",
    "truncate_middle",
    "dtype",
    "engine",
)

#: What an identity key means when a run folder's config.json predates it (older probkv).
IDENTITY_DEFAULTS = {"truncate_middle": False, "dtype": "float32", "engine": "hf"}


def canonical_method(spec: str) -> str:
    """The registry's canonical name of a method spec (``probkv.policies.method_name``);
    unknown names and options raise ValueError listing the valid ones."""
    return method_name(parse_method(spec, 0.5))


def _tuple_of(value: Any, name: str) -> tuple:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a list, got {value!r}")
    return tuple(value)


def _no_duplicates(values: Sequence, name: str) -> None:
    seen = set()
    for v in values:
        if v in seen:
            raise ValueError(f"{name} lists {v!r} twice; give each once")
        seen.add(v)


@dataclass(frozen=True)
class RunConfig:
    """What a run evaluates (its identity, see :data:`IDENTITY_KEYS`).

    Attributes:
        model: registry name, ``.gguf`` file or Hugging Face folder (``probkv.models``).
        methods: method names (``probkv.policies.parse_method`` grammar), stored canonical.
        ratios: target compression ratios in [0, 1) (S1), stored sorted.
        data: a JSONL file (``probkv.eval.load_examples``); exclusive with ``tasks``.
        data_format: ``"auto"``, ``"probkv"`` or ``"longbench"``.
        tasks: generated task names (``probkv.eval.TASK_NAMES``), with ``lengths`` (prompt
            tokens), ``per_task`` examples per task and length, and ``seed``.
        question_aware: evict after the question instead of before it (see
            :mod:`probkv.eval.runner`).
        max_examples: keep only the first N examples (after loading or generating).
        truncate_middle: cut the middle of a context that, with its question and
            ``max_new_tokens``, exceeds the model's positions (LongBench's truncation);
            without it such an example is refused before any job runs.
        dtype: the model's dtype, ``"float32"`` or ``"bfloat16"``; ``"auto"`` is resolved
            here to the one this machine computes natively (:mod:`probkv.models.dtypes`).
        engine: the name of the engine that runs the jobs, one of
            :data:`probkv.eval.engines.ENGINES` (``"hf"``, the default, or ``"vllm"``);
            checked there with what that engine can run
            (:func:`probkv.eval.engines.check_engine_run`, the runner's first check).
    """

    model: str
    methods: tuple[str, ...]
    ratios: tuple[float, ...]
    data: str | None = None
    data_format: str = "auto"
    tasks: tuple[str, ...] = ()
    lengths: tuple[int, ...] = ()
    per_task: int = 5
    seed: int = 0
    question_aware: bool = False
    max_examples: int | None = None
    truncate_middle: bool = False
    dtype: str = "float32"
    engine: str = "hf"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        methods = _tuple_of(self.methods, "methods")
        if not methods:
            raise ValueError("methods must name at least one method, e.g. full,snapkv,prob:min-h")
        methods = tuple(canonical_method(m) for m in methods)
        _no_duplicates(methods, "methods (canonical names)")
        object.__setattr__(self, "methods", methods)
        ratios = tuple(check_ratio(r, "ratio") for r in _tuple_of(self.ratios, "ratios"))
        if not ratios:
            raise ValueError("ratios must list at least one compression ratio in [0, 1)")
        _no_duplicates(ratios, "ratios")
        object.__setattr__(self, "ratios", tuple(sorted(ratios)))
        check_choice(self.data_format, FORMATS, "data_format")
        tasks = _tuple_of(self.tasks, "tasks")
        lengths = _tuple_of(self.lengths, "lengths")
        object.__setattr__(self, "tasks", tasks)
        object.__setattr__(self, "lengths", lengths)
        if (self.data is None) == (not tasks):
            raise ValueError("give either data (a JSONL file) or tasks (generated), not both")
        if self.data is not None:
            if not isinstance(self.data, str) or not self.data:
                raise ValueError(f"data must be a file path, got {self.data!r}")
            if lengths:
                raise ValueError("lengths apply to generated tasks, not to a data file")
        else:
            for task in tasks:
                check_choice(task, TASK_NAMES, "task")
            _no_duplicates(tasks, "tasks")
            if not lengths:
                raise ValueError("generated tasks need lengths (prompt tokens), e.g. 2048,4096")
            for n in lengths:
                check_positive_int(n, "length")
            _no_duplicates(lengths, "lengths")
            check_positive_int(self.per_task, "per_task")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.question_aware, bool):
            raise ValueError(f"question_aware must be True or False, got {self.question_aware!r}")
        if self.max_examples is not None:
            check_positive_int(self.max_examples, "max_examples")
        if not isinstance(self.truncate_middle, bool):
            raise ValueError(f"truncate_middle must be True or False, got {self.truncate_middle!r}")
        check_dtype_name(self.dtype)
        if not isinstance(self.engine, str) or not self.engine:
            raise ValueError(f"engine must be an engine's name, got {self.engine!r}")
        object.__setattr__(self, "dtype", resolve_dtype_name(self.dtype))

    def jobs_per_example(self) -> list[tuple[str, float]]:
        """The (method, ratio) pairs every example is run with (``full`` once, at ratio 0)."""
        return [(m, r) for m in self.methods for r in ((0.0,) if m == FULL else self.ratios)]

    def to_json(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def config_identity(config: RunConfig) -> dict[str, Any]:
    """The fields a resume compares (:data:`IDENTITY_KEYS`)."""
    out = config.to_json()
    out["data_sha256"] = None if config.data is None else file_sha256(config.data)
    return {k: out[k] for k in IDENTITY_KEYS}


def stored_identity(record: Mapping[str, Any]) -> dict[str, Any]:
    """The identity a run folder's ``config.json`` record holds; a key it predates takes its
    default (:data:`IDENTITY_DEFAULTS`), so older folders still resume."""
    return {k: record.get(k, IDENTITY_DEFAULTS.get(k)) for k in IDENTITY_KEYS}


def describe_difference(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """``"key: old before, new now"`` for every identity key whose value differs."""
    keys = [k for k in IDENTITY_KEYS if old.get(k) != new.get(k)]
    return "; ".join(f"{k}: {old.get(k)!r} before, {new.get(k)!r} now" for k in keys)
