"""Plots and summaries drawn from a run's `metrics.jsonl`.

`plot_run(run_dir)` writes one PNG per group of metrics the run logged (reward, eval, clipping,
ratio spread, lengths, entropy, losses, grad norm, MoE routing drift) into `run_dir/plots/`.
Matplotlib (the `lab` extra: pip install 'gspo[lab]') is imported lazily and used through `Figure` +
the Agg canvas directly, so pyplot's global state (current figure, backend) is never touched. Without
it `plot_run` raises PlotsUnavailable, one line naming the fix; `plot_run_or_skip` (the demos,
`gspo train`, Trainer.train) says in one line that the plots were skipped and goes on.
"""

from __future__ import annotations

import math
import os
import pathlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

from gspo.tracking import METRICS_FILE, read_jsonl

Series = tuple[list[int], list[float]]

FIGSIZE = (8.0, 4.5)  # inches
DPI = 100  # so every PNG is 800 x 450 pixels
MAX_LEGEND_LINES = 12  # beyond this (e.g. 48 MoE layers) lines are drawn without legend entries


LAB_EXTRA = "pip install 'gspo[lab]'"  # what installs matplotlib, for the plots and the lab


class PlotsUnavailable(ValueError):
    """Plots were asked for and matplotlib (the `lab` extra) is not installed."""


def check_plotting() -> None:
    """Raise PlotsUnavailable (one line naming the fix) where matplotlib cannot be imported here."""
    try:
        import matplotlib  # noqa: F401  (the package only: its figure modules load where a plot is drawn)
    except ModuleNotFoundError as err:
        if err.name != "matplotlib":  # installed, but something it needs is missing: its own error says what
            raise
        raise PlotsUnavailable(f"plots need matplotlib, which is not installed: {LAB_EXTRA}") from None


def _metrics_file(run_dir_or_file: str | os.PathLike) -> pathlib.Path:
    path = pathlib.Path(run_dir_or_file)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    return path


def _records(run_dir_or_file: str | os.PathLike) -> tuple[pathlib.Path, list[dict]]:
    """Parsed lines of a metrics file, checked to have an int `step` and numeric values."""
    path = _metrics_file(run_dir_or_file)
    records = read_jsonl(path, null_as_nan=True)
    for i, rec in enumerate(records):
        step = rec.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"{path}: record {i + 1} has no integer 'step' (got {step!r})")
        for name, value in rec.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{path}: record {i + 1}: metric {name!r} is not a number ({value!r})")
    return path, records


def load_metrics(run_dir_or_file: str | os.PathLike) -> dict[str, Series]:
    """Metric name -> (steps, values), in file order; NaN / null points are skipped.

    Accepts a run directory (reads its metrics.jsonl) or the file itself. A metric that never
    had a finite value does not appear.
    """
    _, records = _records(run_dir_or_file)
    out: dict[str, Series] = {}
    for rec in records:
        for name, value in rec.items():
            if name == "step" or not math.isfinite(value):
                continue
            steps, values = out.setdefault(name, ([], []))
            steps.append(rec["step"])
            values.append(float(value))
    return out


def summarize(run_dir: str | os.PathLike) -> dict[str, dict[str, float | int | None]]:
    """Per metric: first, last, min, max of its finite values, `n` (how many) and `nonfinite`.

    `nonfinite` counts logged NaN / inf points (stored as null), the usual sign of a diverged
    run; a metric that was only ever non-finite has None for first/last/min/max.
    """
    _, records = _records(run_dir)
    finite: dict[str, list[float]] = {}
    bad: dict[str, int] = {}
    for rec in records:
        for name, value in rec.items():
            if name == "step":
                continue
            finite.setdefault(name, [])
            bad.setdefault(name, 0)
            if math.isfinite(value):
                finite[name].append(float(value))
            else:
                bad[name] += 1
    out = {}
    for name, vals in finite.items():
        out[name] = {
            "first": vals[0] if vals else None,
            "last": vals[-1] if vals else None,
            "min": min(vals) if vals else None,
            "max": max(vals) if vals else None,
            "n": len(vals),
            "nonfinite": bad[name],
        }
    return out


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` points (fewer at the start), same length as input.

    Example: moving_average([1, 2, 3, 4], 2) == [1.0, 1.5, 2.5, 3.5].
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _auto_window(n: int) -> int:
    # Smooth only long curves, over ~5% of the points: short ones are readable raw.
    return n // 20 if n >= 40 else 1


# ---------------------------------------------------------------------------
# plot groups


@dataclass(frozen=True)
class PlotGroup:
    """One PNG: which metrics it draws, how it is titled."""

    filename: str
    title: str
    ylabel: str
    select: Callable[[str], bool]


def _prefix(*prefixes: str) -> Callable[[str], bool]:
    return lambda name: any(name == p or name.startswith(p + "/") for p in prefixes)


GROUPS: tuple[PlotGroup, ...] = (
    PlotGroup("reward.png", "Reward", "reward", _prefix("reward")),
    PlotGroup("eval.png", "Evaluation", "value", _prefix("eval")),
    PlotGroup("groups.png", "Groups with zero reward spread", "fraction of groups", _prefix("groups")),
    PlotGroup("clip.png", "Clipped fraction (tokens: GRPO; sequences: GSPO)", "fraction", _prefix("clip")),
    PlotGroup("ratio.png", "Importance ratio", "ratio", _prefix("ratio")),
    PlotGroup("completion.png", "Completion length", "tokens", _prefix("completion")),
    PlotGroup("entropy.png", "Policy entropy", "nats / token", _prefix("entropy")),
    PlotGroup("loss.png", "Losses", "loss", _prefix("loss")),
    PlotGroup("grad_norm.png", "Gradient norm", "norm", _prefix("grad")),
    PlotGroup("moe.png", "MoE routing drift", "fraction of tokens changing expert", _prefix("moe")),
)


def _draw(ax, steps: list[int], values: list[float], label: str | None, window: int, **style) -> None:
    """A raw line, plus a moving average over it when `window` > 1 (raw drawn faint)."""
    if window > 1 and len(values) > window:
        (raw,) = ax.plot(steps, values, alpha=0.25, linewidth=1.0, color=style.get("color"))
        ax.plot(steps, moving_average(values, window), label=label, color=raw.get_color(),
                linewidth=style.get("linewidth", 1.6), alpha=style.get("alpha", 1.0))
    else:
        ax.plot(steps, values, label=label, marker="o" if len(values) == 1 else None, **style)


def _plot_group(ax, group: PlotGroup, series: dict[str, Series], smooth: int | None) -> None:
    from matplotlib.ticker import MaxNLocator

    def window(n: int) -> int:
        return _auto_window(n) if smooth is None else max(smooth, 1)

    if group.filename == "reward.png" and "reward/mean" in series and "reward/std" in series:
        # Band of +-std around the mean, matched point by point on step.
        steps, mean = series["reward/mean"]
        std = dict(zip(*series["reward/std"]))
        pts = [(s, m, std[s]) for s, m in zip(steps, mean) if s in std]
        if pts:
            ax.fill_between([p[0] for p in pts], [p[1] - p[2] for p in pts], [p[1] + p[2] for p in pts],
                            alpha=0.2, label="reward/mean ± std")
        series = {k: v for k, v in series.items() if k != "reward/std"}

    n_layers = sum("/layer_" in name for name in series) if group.filename == "moe.png" else 0
    label_layers = n_layers <= MAX_LEGEND_LINES
    for name, (steps, values) in series.items():
        if n_layers and "/layer_" in name:
            # Per-layer drift thin and faint under the all-layer mean.
            _draw(ax, steps, values, name if label_layers else None, window(len(values)),
                  linewidth=0.8, alpha=0.5)
        elif n_layers:
            _draw(ax, steps, values, name, window(len(values)), linewidth=2.2, color="black")
        else:
            _draw(ax, steps, values, name, window(len(values)), linewidth=1.6)
    if not label_layers:
        ax.text(0.01, 0.98, f"thin lines: {n_layers} layers (unlabelled)", transform=ax.transAxes,
                va="top", fontsize=8)
    ax.set_title(group.title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_ylabel(group.ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")


def plot_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None, *,
             smooth: int | None = None) -> list[pathlib.Path]:
    """Write one PNG per metric group present in `run_dir/metrics.jsonl`; return their paths.

    Groups with no finite data are skipped. `smooth`: moving-average window drawn over the faint
    raw line; None picks one from the curve length (none under 40 points), 0 or 1 turns it off.
    """
    if smooth is not None and (isinstance(smooth, bool) or not isinstance(smooth, int) or smooth < 0):
        raise ValueError(f"smooth must be None or an int >= 0, got {smooth!r}")
    check_plotting()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics = load_metrics(run_dir)
    out = pathlib.Path(out_dir) if out_dir is not None else _metrics_file(run_dir).parent / "plots"
    written = []
    for group in GROUPS:
        series = {k: v for k, v in metrics.items() if group.select(k)}
        if not series:
            continue
        out.mkdir(parents=True, exist_ok=True)
        fig = Figure(figsize=FIGSIZE, dpi=DPI)
        FigureCanvasAgg(fig)  # attaches itself to fig: no pyplot, no global backend switch
        _plot_group(fig.add_subplot(), group, series, smooth)
        fig.tight_layout()
        path = out / group.filename
        fig.savefig(path, format="png")
        written.append(path)
    return written


def plot_run_or_skip(run_dir: str | os.PathLike) -> list[pathlib.Path]:
    """`plot_run(run_dir)`, or [] and one line on stderr where matplotlib is missing: for a run that finishes
    without its plots (the demos, `gspo train`, Trainer.train) rather than failing at its end."""
    try:
        return plot_run(run_dir)
    except PlotsUnavailable:
        print(f"plots skipped: matplotlib is not installed; {LAB_EXTRA}, then `gspo plot {run_dir}` draws them",
              file=sys.stderr, flush=True)
        return []
