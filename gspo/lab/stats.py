"""Statistics over seeds for the lab's report and its stability map: mean and std, and when two differ."""

from __future__ import annotations

import math

import numpy as np


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
