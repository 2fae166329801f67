"""The generated tasks by name (S7): :data:`TASKS`, :data:`TASK_NAMES`, :func:`get_task`
and :func:`task_metric`."""

from __future__ import annotations

from probkv._checks import check_choice
from probkv.eval.tasks.common_words import CommonWordsTask
from probkv.eval.tasks.frequent_words import FrequentWordsTask
from probkv.eval.tasks.niah import NeedleTask
from probkv.eval.tasks.qa import FactQATask
from probkv.eval.tasks.variable_tracking import VariableTrackingTask

Task = NeedleTask | VariableTrackingTask | CommonWordsTask | FrequentWordsTask | FactQATask

TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        NeedleTask("niah_single_1", "noise"),
        NeedleTask("niah_single_2", "prose"),
        NeedleTask("niah_single_3", "prose", value_kind="uuids", max_new_tokens=48),
        NeedleTask("niah_multikey_1", "prose", num_keys=4),
        NeedleTask("niah_multikey_2", "needles"),
        NeedleTask(
            "niah_multikey_3", "needles", key_kind="uuids", value_kind="uuids", max_new_tokens=48
        ),
        NeedleTask("niah_multivalue", "prose", num_values=4, max_new_tokens=64),
        NeedleTask("niah_multiquery", "prose", num_keys=4, num_queries=4, max_new_tokens=64),
        VariableTrackingTask(),
        CommonWordsTask(),
        FrequentWordsTask(),
        FactQATask(),
    )
}
"""The generated tasks by name (S7)."""

TASK_NAMES = tuple(TASKS)


def get_task(task: str | Task) -> Task:
    """A task by name (see :data:`TASKS`), or a task object as is."""
    if isinstance(task, str):
        return TASKS[check_choice(task, TASK_NAMES, "task")]
    if isinstance(
        task, (NeedleTask, VariableTrackingTask, CommonWordsTask, FrequentWordsTask, FactQATask)
    ):
        return task
    raise ValueError(
        f"task must be a task name ({', '.join(TASK_NAMES)}) or a task object, got {task!r}"
    )


def task_metric(task: str) -> str | None:
    """The scorer of a generated task name, or None for other names."""
    spec = TASKS.get(task)
    return None if spec is None else spec.metric
