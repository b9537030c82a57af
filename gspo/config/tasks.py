"""Multi-task runs: their section (TaskSettings), and the `tasks` list read into one TaskSpec per entry.

Reading the list is config work: every problem is an error naming the entry and key before anything loads. The
mixture that samples from the tasks (gspo/data/mixture.py) is built from the TaskSpecs; it implements each
weighting named in WEIGHTINGS (docs/multitask.md).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from pathlib import Path

from gspo.config.machinery import check_choice, check_positive, checks

WEIGHTINGS = ("static", "dynamic")
"""How a batch's prompts are shared among the tasks (`task_weighting`); gspo.data.mixture implements each."""
TASK_KEYS = ("name", "task", "dataset", "eval_dataset", "reward_funcs", "reward_weights", "weight")
"""The keys a `tasks` entry may hold."""


@dataclass
class TaskSettings:
    """Multi-task runs (docs/multitask.md): the tasks and how each batch draws from them."""

    tasks: list | None = None
    """Multi-task entries {name, task or dataset, ..., weight}, drawn by weight each batch; null: one task."""
    task_weighting: str = "static"
    """Task sampling weights: static (the entries' `weight`) or dynamic (follows each task's signal)."""
    task_weight_floor: float = 0.05
    """Dynamic weighting: least sampling weight every task keeps (at most 1 / number of tasks)."""
    task_weight_smoothing: float = 0.8
    """Dynamic weighting: EMA factor in [0, 1) of each task's signal; higher: weights move slower."""
    task_progress_coef: float = 0.0
    """Dynamic weighting: weight of a task's recent change in mean reward added to its signal; 0: off."""


@checks(TaskSettings)
def _check_tasks(s: TaskSettings) -> None:
    check_choice(s, "task_weighting", WEIGHTINGS)
    check_positive(s, "task_weight_floor", "task_progress_coef", allow_zero=True)
    if not 0 <= s.task_weight_smoothing < 1:
        raise ValueError(f"config: task_weight_smoothing={s.task_weight_smoothing!r} must be in [0, 1)")


@dataclass
class TaskSpec:
    """One task of the mixture, read from an entry of `TrainConfig.tasks`."""

    name: str  # metrics go under task/<name>/
    task: str | None  # a built-in task (gspo.tasks.TASKS), or None with `dataset`
    dataset: str | None  # a local data file or folder
    eval_dataset: str | None  # held-out data for `dataset` (default: the run's eval_holdout of it)
    reward_funcs: list  # reward specs (names, "module:function") or callables
    reward_weights: list | None  # one per reward function; None: all 1
    weight: float  # static weight, and the prior of the dynamic rule (> 0, normalised over tasks)


def parse_tasks(entries, reward_funcs: list, reward_weights: list | None = None) -> list[TaskSpec]:
    """TaskSpecs from the `tasks` config list.

    An entry needs `task` or `dataset`; `name` defaults to the task name or the dataset's file
    stem; without `reward_funcs` it uses the run's `reward_funcs`/`reward_weights`; `weight`
    defaults to 1. Every problem is a ValueError naming the entry and key ("config: tasks[1].weight ...").
    """
    from gspo.tasks import TASKS  # the built-in tasks' names (gspo.tasks imports nothing outside itself)

    if not isinstance(entries, list) or not entries:
        raise ValueError(f"config: tasks must be a non-empty list of task entries (mappings), got {entries!r}")
    specs: list[TaskSpec] = []
    for i, entry in enumerate(entries):
        where = f"config: tasks[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a mapping with `task` or `dataset`, got {entry!r}")
        unknown = sorted(str(k) for k in set(entry) - set(TASK_KEYS))
        if unknown:
            raise ValueError(f"{where} has unknown key {unknown[0]!r}; known keys: {', '.join(TASK_KEYS)}")
        task, dataset, eval_dataset = entry.get("task"), entry.get("dataset"), entry.get("eval_dataset")
        if (task is None) == (dataset is None):
            raise ValueError(f"{where} needs exactly one of `task` (a built-in task) and `dataset` (local data)")
        if task is not None and task not in TASKS:
            raise ValueError(f"{where}.task={task!r} is not a built-in task; known: {', '.join(TASKS)}")
        for key, value in (("dataset", dataset), ("eval_dataset", eval_dataset)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{where}.{key}={value!r} must be a path (a non-empty string)")
        if eval_dataset is not None and dataset is None:
            raise ValueError(f"{where}.eval_dataset needs `dataset`: a built-in task is evaluated on its test split")
        name = entry.get("name", task if task is not None else Path(str(dataset)).stem)
        if not isinstance(name, str) or not name or "/" in name or name != name.strip():
            raise ValueError(f"{where}.name={name!r} must be a non-empty string without '/' or surrounding spaces "
                             "(it names the metrics task/<name>/...)")
        if any(s.name == name for s in specs):
            raise ValueError(f"{where}.name={name!r} is taken by an earlier entry; give each task a unique `name`")
        funcs = entry.get("reward_funcs", reward_funcs)
        funcs = [funcs] if isinstance(funcs, str) else funcs
        if not isinstance(funcs, list) or not funcs:
            raise ValueError(f"{where}.reward_funcs={funcs!r} must be a non-empty list of reward functions")
        weights = entry.get("reward_weights", None if "reward_funcs" in entry else reward_weights)
        if weights is not None and (not isinstance(weights, list) or len(weights) != len(funcs)
                                    or not all(_is_finite_number(w) for w in weights)):
            raise ValueError(f"{where}.reward_weights={weights!r} must be a list of {len(funcs)} finite numbers, "
                             "one per reward function")
        weight = entry.get("weight", 1.0)
        if not _is_finite_number(weight) or weight <= 0:
            raise ValueError(f"{where}.weight={weight!r} must be a finite number > 0")
        specs.append(TaskSpec(name, task, dataset, eval_dataset, list(funcs),
                              None if weights is None else [float(w) for w in weights], float(weight)))
    return specs


def _is_finite_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
