"""Statistics over seeds for the lab's report and its stability map: the runs a statistic is over, mean and
std, when two differ, how one is written, and the markdown table both reports are made of."""

from __future__ import annotations

import math

import numpy as np


def select(runs: list[dict], **spec) -> list[dict]:
    """The run summaries whose spec has every given value, e.g. `select(runs, group="main", model="moe")`."""
    return [r for r in runs if all(r["spec"][k] == v for k, v in spec.items())]


def stat(values) -> dict:
    """mean, std (n-1; 0 for one value), n of the finite values."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    if not len(v):
        return {"mean": float("nan"), "std": float("nan"), "n": 0}
    std = float(v.std(ddof=1)) if len(v) > 1 else 0.0
    std = 0.0 if std < 1e-12 * max(1.0, abs(float(v.mean()))) else std  # float noise of equal values
    return {"mean": float(v.mean()), "std": std, "n": int(len(v))}


def compare(a: dict, b: dict) -> tuple[float, float, str]:
    """(a - b, its SE, "higher" | "lower" | "same") for two `stat` results; beyond 2 SE counts."""
    diff = a["mean"] - b["mean"]
    if not (a["n"] and b["n"]):
        return float("nan"), float("nan"), "n/a"
    se = math.sqrt(a["std"] ** 2 / a["n"] + b["std"] ** 2 / b["n"])
    if abs(diff) > 2 * se and abs(diff) > 1e-12:
        return diff, se, "higher" if diff > 0 else "lower"
    return diff, se, "same"


def fmt(s: dict, pct: bool = True, digits: int = 1) -> str:
    """A `stat` result as "mean ± std" (in % with pct), "–" when it holds no value."""
    if not s["n"]:
        return "–"
    if pct:
        return f"{100 * s['mean']:.{digits}f} ± {100 * s['std']:.{digits}f}%"
    return f"{s['mean']:.{digits}g} ± {s['std']:.{digits}g}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table: the header row, the separator, one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
