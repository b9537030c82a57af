"""Built-in verifiable tasks and the character tokenizer they are written in.

    task = get_task("add3")
    rows = task.dataset("train", n=1000, seed=0)   # [{"prompt", "answer", "solution"}, ...]
"""

from __future__ import annotations

from gspo.tasks.arithmetic import ArithmeticTask, extract_answer
from gspo.tasks.tokenizer import build_char_tokenizer

# name -> the ArithmeticTask arguments it fixes; "arithmetic" fixes none (pass digits, op).
_REGISTRY: dict[str, dict] = {
    "add2": {"digits": 2, "op": "+"},
    "add3": {"digits": 3, "op": "+"},
    "add4": {"digits": 4, "op": "+"},
    "add3x3": {"digits": 3, "op": "+", "times": 3},  # a+3*b, 102-145-token answers: lab part 4's length level
    "add3x6": {"digits": 3, "op": "+", "times": 6},  # a+6*b, 195-289-token answers: the regimes lab's long answers
    "sub3": {"digits": 3, "op": "-"},
    "mul3": {"digits": 3, "op": "*"},
    "arithmetic": {},
}
TASKS: list[str] = list(_REGISTRY)


def get_task(name: str, **kwargs) -> ArithmeticTask:
    """Build a task by registry name; "arithmetic" takes `digits`, `op` and `times` as kwargs."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    fixed = _REGISTRY[name]
    clash = sorted(set(fixed) & set(kwargs))
    if clash:
        raise ValueError(f"task {name!r} fixes {clash}; set them via get_task('arithmetic', ...)")
    unknown = sorted(set(kwargs) - {"digits", "op", "times"})
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown} for task {name!r}; allowed: digits, op, times")
    return ArithmeticTask(**fixed, **kwargs)


__all__ = ["TASKS", "ArithmeticTask", "build_char_tokenizer", "extract_answer", "get_task"]
