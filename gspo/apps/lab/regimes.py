"""Regimes of the stability lab: the axes along which GRPO is known to break, and which method runs where.

A regime is one level of one axis of `LabConfig.regimes` (axis -> level -> settings): TrainConfig
overrides (a low-precision or stale sampler, more minibatches per rollout, a task with long
answers) and `arch`, config overrides of the cold-start model (a deeper or wider MoE). The
`baseline` level is the lab's own settings, shared by every axis and run once. Each level runs
every method of `LabConfig.regime_methods` that applies to it (`not_applicable`), or only those that
`LabConfig.axis_methods` names for its axis (the baseline runs its own list there, or else every
method some axis runs, so each has its reference); the combinations left out are listed with
their reason, in the report as in the grid, so no setting tried is hidden.
Pure: names and rules; gspo.apps.lab.runs runs the runs, gspo.apps.lab.stability_map draws the map.
"""

from __future__ import annotations

import importlib.util

BASELINE = "baseline"


def levels(regimes: dict) -> list[tuple[str, dict]]:
    """(label, settings) of every regime, the baseline first; labels are "axis-level"."""
    out = [(BASELINE, {})]
    for axis, by_level in regimes.items():
        out += [(f"{axis}-{level}", dict(settings or {})) for level, settings in by_level.items()]
    return out


def train_settings(settings: dict) -> dict:
    """A level's TrainConfig overrides (its settings without `arch`)."""
    return {k: v for k, v in settings.items() if k != "arch"}


def has_mismatch(settings: dict) -> bool:
    """The level's sampler is not pi_old: another precision, stale weights (a fixed lag, or rollout workers
    sampling ahead of training) or an inference engine."""
    return (settings.get("sampler_dtype") not in (None, "float32") or bool(settings.get("sampler_lag"))
            or bool(settings.get("max_staleness")) or settings.get("generation_backend") == "vllm")


def not_applicable(method: dict, settings: dict, model: str) -> str | None:
    """Why `method` (TrainConfig overrides) is not run at a level on `model`; None when it is."""
    if method.get("routing_replay", "none") != "none" and model != "moe":
        return "routing replay needs an MoE model"
    if method.get("rollout_correction", "none") != "none" and not has_mismatch(settings):
        return "no sampler mismatch (mu = pi_old): the correction is the identity"
    if method.get("routing_replay") == "rollout" and not has_mismatch(settings):
        return ("no sampler mismatch: R3 replays the sampler's routes, which are pi_old's here, so it is R2 "
                "(up to routing ties in the last bits)")
    if settings.get("generation_backend") == "vllm":
        if importlib.util.find_spec("vllm") is None:
            return "vllm is not installed here (make test-vllm builds a venv with it)"
        if method.get("routing_replay") == "rollout":
            return "R3 from vLLM is not wired up (vLLM 0.32 records experts only in its CUDA model runner)"
    return None


def chosen(axis: str, axes: list[str], methods: dict, axis_methods: dict | None) -> list[str]:
    """The methods run on `axis`'s levels: `axis_methods[axis]`, else all; for the baseline,
    `axis_methods["baseline"]` if given, else every method that some axis of `axes` runs."""
    axis_methods = axis_methods or {}
    if axis != BASELINE or BASELINE in axis_methods:
        return list(axis_methods.get(axis, methods))
    return [m for m in methods if any(m in axis_methods.get(a, methods) for a in axes)]


def regime_runs(regimes: dict, methods: dict, model: str,
                axis_methods: dict | None = None) -> tuple[list[tuple], list[dict]]:
    """([(label, settings, method name, method overrides)], [{"regime", "method", "reason"} left out])."""
    run, left_out = [], []
    for label, settings in levels(regimes) if regimes else []:
        picked = chosen(label.split("-", 1)[0], list(regimes), methods, axis_methods)
        for name, overrides in methods.items():
            reason = (not_applicable(overrides, settings, model) if name in picked else
                      "not chosen for this axis (axis_methods): the grid's budget")
            if reason is None:
                run.append((label, settings, name, dict(overrides)))
            else:
                left_out.append({"regime": label, "method": name, "reason": reason})
    return run, left_out


def check_regimes(regimes: dict, methods: dict, axis_methods: dict | None = None) -> None:
    """The shapes `LabConfig.validate` needs (each run's TrainConfig is checked when it is built)."""
    if regimes and not methods:
        raise ValueError("config: regimes are set but regime_methods is empty")
    for axis, names in (axis_methods or {}).items():
        if axis not in regimes and axis != BASELINE:
            raise ValueError(f"config: axis_methods[{axis!r}]: no such axis in regimes "
                             f"({', '.join(regimes) or 'none'})")
        if not isinstance(names, list) or not (names or axis == BASELINE):
            raise ValueError(f"config: axis_methods[{axis!r}] must be a non-empty list of method names (only the "
                             f"baseline's may be empty: no baseline runs), got {names!r}")
        unknown = [n for n in names if n not in methods]
        if unknown:
            raise ValueError(f"config: axis_methods[{axis!r}] names {unknown}, not in regime_methods "
                             f"({', '.join(methods)})")
    for axis, by_level in regimes.items():
        if "-" in axis or axis == BASELINE:
            raise ValueError(f"config: regimes axis name {axis!r} must not be {BASELINE!r} nor contain '-'")
        if not isinstance(by_level, dict) or not by_level:
            raise ValueError(f"config: regimes[{axis!r}] must map level names to settings, got {by_level!r}")
        for level, settings in by_level.items():
            if settings is not None and not isinstance(settings, dict):
                raise ValueError(f"config: regimes[{axis!r}][{level!r}] must be a mapping, got {settings!r}")
            if not isinstance((settings or {}).get("arch", {}), dict):
                raise ValueError(f"config: regimes[{axis!r}][{level!r}].arch must be a mapping of model config fields")
    for name, overrides in methods.items():
        if not isinstance(overrides, dict):
            raise ValueError(f"config: regime_methods[{name!r}] must be a mapping of TrainConfig fields")
