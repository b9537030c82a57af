"""The lab's report: per-run summaries, collapse detection, tables over seeds, plots, report.md (the paper's
claims and their verdicts: gspo.apps.lab.claims).

Everything here reads files only (`lab.json`, each run's `done.json` and `metrics.jsonl`), so a
report can be rebuilt at any time: `gspo lab --report-only`.

Verdicts compare means over seeds with their standard error (SE of a difference of two means,
sqrt(s_a^2/n_a + s_b^2/n_b)): a difference counts only beyond 2 SE. With 2-3 seeds that is a
coarse test; the report gives the numbers next to every verdict.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import numpy as np

from gspo.apps.lab.claims import claims, regime_claims_section
from gspo.apps.lab.stability_map import regimes_section
from gspo.apps.lab.stats import compare, fmt, markdown_table, select, stat
from gspo.report import check_plotting, load_metrics

ACC = "eval/mean_at_k"  # sampled held-out accuracy: 4x the samples of greedy accuracy, so less noisy
COLORS = {("grpo", "none"): "tab:blue", ("gspo", "none"): "tab:red", ("gspo_token", "none"): "tab:orange",
          ("grpo", "old_policy"): "tab:cyan", ("grpo", "rollout"): "tab:purple", ("gspo", "old_policy"): "tab:pink"}


# ------------------------------------------------------------------------------- per run
def detect_collapse(evals: list[tuple[int, float]], entropy: list[tuple[int, float]], *, rel_drop: float = 0.5,
                    min_drop: float = 0.1, entropy_floor: float = 0.1) -> tuple[int | None, str]:
    """(step, reason) where a run collapsed, or (None, "").

    Accuracy collapse: an evaluation after the run's best falls below best - max(min_drop,
    rel_drop * best) and no later one climbs back above best - half that gap (no recovery).
    Entropy collapse: entropy falls below `entropy_floor` x its initial value (mean of the
    first 3 steps) and stays there to the end, for at least 3 steps.
    """
    if evals:
        steps, acc = zip(*evals)
        best_i = int(np.argmax(acc))
        gap = max(min_drop, rel_drop * acc[best_i])
        for i in range(best_i + 1, len(acc)):
            if acc[i] < acc[best_i] - gap and all(a < acc[best_i] - gap / 2 for a in acc[i:]):
                return steps[i], f"held-out accuracy {acc[best_i]:.1%} (step {steps[best_i]}) -> {acc[i]:.1%}"
    if len(entropy) >= 4:
        steps, ent = zip(*entropy)
        floor = entropy_floor * float(np.mean(ent[:3]))
        below = [e < floor for e in ent]
        if below[-1]:
            start = len(below) - 1
            while start > 0 and below[start - 1]:
                start -= 1
            if len(below) - start >= 3:
                return steps[start], f"entropy {np.mean(ent[:3]):.3f} -> {ent[start]:.4f} nats/token"
    return None, ""


PRECURSORS = ("grad/norm", "entropy", "mismatch/kl")


def precursor(metrics: dict, step: int | None) -> dict:
    """What led up to a collapse at `step`: {metric: (its first value, its last value before `step`)}
    for the gradient norm, the entropy and the sampler mismatch (those the run logged); {} without one."""
    if step is None:
        return {}
    out = {}
    for name in PRECURSORS:
        steps, values = metrics.get(name, ([], []))
        before = [v for s, v in zip(steps, values) if s < step]
        if before:
            out[name] = (values[0], before[-1])
    return out


def _mean(metrics: dict, name: str) -> float:
    values = metrics.get(name, ([], []))[1]
    return float(np.mean(values)) if values else float("nan")


def _relative_spread(metrics: dict) -> float:
    """Mean over steps of std/mean of the gradient norm across the step's minibatches (steps with gradients)."""
    norm = dict(zip(*metrics.get("grad/norm", ([], []))))
    spread = [sd / norm[s] for s, sd in zip(*metrics.get("grad/norm_std", ([], []))) if norm.get(s, 0) > 0]
    return float(np.mean(spread)) if spread else float("nan")


def summarize_run(run_dir: str | os.PathLike) -> dict:
    """A finished run's numbers for the report: accuracies, clipping, ratio and gradient spread, drift."""
    run_dir = Path(run_dir)
    done = json.loads((run_dir / "done.json").read_text())
    metrics = load_metrics(run_dir)
    cfg = done["config"]
    evals = list(zip(*metrics.get(ACC, ([], []))))
    greedy = dict(zip(*metrics.get("eval/accuracy", ([], []))))
    steps, lengths = metrics.get("completion/mean_len", ([], []))
    tokens = np.cumsum(lengths) * cfg["per_device_batch_size"] * cfg["num_generations"]
    clip = [lo + hi for lo, hi in zip(metrics.get("clip/low_frac", ([], []))[1],
                                      metrics.get("clip/high_frac", ([], []))[1])]
    collapse_step, reason = detect_collapse(evals, list(zip(*metrics.get("entropy", ([], [])))))
    return {
        "name": run_dir.name,
        "spec": done["spec"],
        "seconds": done["seconds"],
        "acc_start": evals[0][1] if evals else float("nan"),
        "acc_final": evals[-1][1] if evals else float("nan"),
        "acc_mean": float(np.mean([a for s, a in evals if s > 0])) if len(evals) > 1 else float("nan"),
        "greedy_start": greedy.get(0, float("nan")),
        "greedy_final": greedy[max(greedy)] if greedy else float("nan"),
        "curve": evals,  # [(step, accuracy)]
        "tokens_at": dict(zip(steps, tokens.tolist())),  # step -> completion tokens trained on so far
        "clip": float(np.mean(clip)) if clip else float("nan"),
        "ratio_std": _mean(metrics, "ratio/std"),
        "grad_norm": _mean(metrics, "grad/norm"),
        "grad_norm_std": _mean(metrics, "grad/norm_std"),
        "grad_norm_rel_std": _relative_spread(metrics),
        "drift": _mean(metrics, "moe/expert_change_frac"),
        "drift_layers": {int(k.rsplit("_", 1)[1]): float(np.mean(v[1])) for k, v in metrics.items()
                         if k.startswith("moe/expert_change_frac/layer_")},
        "entropy_final": metrics["entropy"][1][-1] if "entropy" in metrics else float("nan"),
        "collapse_step": collapse_step,
        "collapse_reason": reason,
        "precursor": precursor(metrics, collapse_step),
        "mismatch_kl": _mean(metrics, "mismatch/kl"),  # NaN where the sampler is pi_old (not logged)
        "mismatch_ess": _mean(metrics, "mismatch/ess"),
    }


def load_lab(lab_dir: str | os.PathLike) -> list[dict]:
    """Summaries of every finished run of the lab (unfinished ones are left out)."""
    runs = Path(lab_dir) / "runs"
    return [summarize_run(d) for d in sorted(runs.iterdir()) if (d / "done.json").is_file()] if runs.is_dir() else []


# ------------------------------------------------------------------------------- tables
def config_rows(runs: list[dict], group: str) -> list[dict]:
    """One row per configuration (runs that differ only by seed), with mean ± std over seeds."""
    keys = []
    for r in select(runs, group=group):
        key = tuple(r["spec"][k] for k in ("label", "objective", "model", "layers", "replay"))
        if key not in keys:
            keys.append(key)
    rows = []
    for label, objective, model, layers, replay in keys:
        rs = select(runs, group=group, label=label, objective=objective, model=model, layers=layers, replay=replay)
        rows.append({"label": label, "objective": objective, "model": model, "layers": layers, "replay": replay,
                     "n": len(rs), **{k: stat(r[k] for r in rs) for k in
                                      ("acc_start", "acc_final", "acc_mean", "greedy_final", "clip", "ratio_std",
                                       "grad_norm_rel_std", "drift", "seconds")},
                     "collapsed": sum(r["collapse_step"] is not None for r in rs)})
    return rows


def write_report(lab_dir: str | os.PathLike) -> Path:
    """Write `lab_dir/report.md` and its plots (`lab_dir/plots/*.png`); returns the report's path.

    PlotsUnavailable (one line naming the fix) where matplotlib, the `lab` extra, is not installed.
    """
    check_plotting()
    lab_dir = Path(lab_dir)
    runs = load_lab(lab_dir)
    if not runs:
        raise ValueError(f"lab report: no finished runs under {lab_dir / 'runs'}")
    lab = json.loads((lab_dir / "lab.json").read_text()) if (lab_dir / "lab.json").is_file() else {}
    cfg, command = lab.get("config", {}), lab.get("command")
    plots = draw_plots(runs, lab_dir / "plots")
    out = _header(runs, cfg, command) + _claims_section(runs) + _main_grid_section(runs) + _depth_section(runs)
    out += _search_section(runs)
    out += regimes_section(runs, cfg, lab_dir / "plots")
    out += regime_claims_section(runs, cfg)
    out += _collapse_section(runs)
    out += ["## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots] + [""]
    path = lab_dir / "report.md"
    path.write_text("\n".join(out))
    return path


def _header(runs: list[dict], lab_config: dict, command: str | None) -> list[str]:
    """report.md's title, the command that made the lab, and what its runs were (`lab_config`: lab.json's)."""
    out = ["# Stability lab report", ""]
    if command:
        out += [f"Command: `{command}`", ""]
    total = sum(r["seconds"] for r in runs)
    c = lab_config
    settings = (f" Task `{c['task']}`; B={c['per_device_batch_size']} prompts x G={c['num_generations']} "
                f"completions, {c['num_minibatches']} minibatches per rollout batch, lr {c['learning_rate']}, "
                f"{c['max_steps']} steps; seeds {c['seeds']}. Accuracy is the held-out sampled "
                f"mean@{c['eval_k']} (T=1) on {c['eval_num_prompts']} problems never trained on." if c else "")
    out += [f"{len(runs)} runs, {total / 60:.1f} min of training on {platform.machine()} with {os.cpu_count()} CPU "
            "cores." + settings + " Verdicts count a difference only beyond 2 standard errors over seeds.", ""]
    return out


def _claims_section(runs: list[dict]) -> list[str]:
    """The claims table (gspo.apps.lab.claims), where the lab has the main grid or the depth sweep it reads."""
    if select(runs, group="main") or select(runs, group="depth"):  # what `claims` reads
        return ["## Claims", "", markdown_table(["claim", "paper", "measured here", "verdict"],
                                        [[c["claim"], c["paper"], c["measured"], f"**{c['verdict']}**" +
                                          (f" ({c['rule']})" if c["rule"] else "")] for c in claims(runs)]), ""]
    return ["## Claims", "", "(No main grid in this lab: the claims are measured per regime below.)", ""]


def _main_grid_section(runs: list[dict]) -> list[str]:
    """One table row per main-grid configuration, mean ± std over its seeds; nothing without a main grid."""
    main = config_rows(runs, "main")
    if not main:
        return []
    cols = ["objective", "model", "replay", "seeds", "start", "final", "mean over run", "greedy final", "clipped",
            "ratio std", "grad-norm std/mean", "expert change/update", "collapsed", "s/run"]

    def cells(row, first):
        return first + [str(row["n"]), fmt(row["acc_start"]), fmt(row["acc_final"]), fmt(row["acc_mean"]),
                        fmt(row["greedy_final"]), fmt(row["clip"], digits=2), fmt(row["ratio_std"], False, 2),
                        fmt(row["grad_norm_rel_std"], False, 2), fmt(row["drift"], digits=2),
                        f"{row['collapsed']}/{row['n']}", f"{row['seconds']['mean']:.0f}"]

    return ["## Main grid", "",
            markdown_table(cols, [cells(r, [r["objective"], f"{r['model']}-L{r['layers']}", r["replay"]])
                                  for r in main]), ""]


def _depth_section(runs: list[dict]) -> list[str]:
    """The routing drift of the depth sweep's runs, per depth; nothing without one."""
    depth = config_rows(runs, "depth")
    if not depth:
        return []
    return ["## Routing drift vs depth (GRPO, no replay)", "",
            markdown_table(["layers", "seeds", "expert change/update", "final mean@k"],
                           [[str(r["layers"]), str(r["n"]), fmt(r["drift"], digits=2), fmt(r["acc_final"])]
                            for r in depth]), ""]


def _search_section(runs: list[dict]) -> list[str]:
    """Per search setting and objective: accuracy, clipping, collapses and GSPO's edge over GRPO."""
    search = config_rows(runs, "search")
    if not search:
        return []
    out = ["## Search: settings that might separate GRPO and GSPO", "",
           "Each setting changes the main grid's run as named; same cold start. 'Δ mean over run' is GSPO "
           "minus GRPO.", ""]
    srows = []
    for label in dict.fromkeys(r["label"] for r in search):
        by_obj = {r["objective"]: r for r in search if r["label"] == label}
        for r in by_obj.values():
            delta = ""
            if r["objective"] == "gspo" and "grpo" in by_obj:
                diff, se, how = compare(r["acc_mean"], by_obj["grpo"]["acc_mean"])
                delta = f"{100 * diff:+.1f} ± {100 * se:.1f} pts ({how})"
            srows.append([label, r["objective"], str(r["n"]), fmt(r["acc_final"]), fmt(r["acc_mean"]),
                          fmt(r["clip"], digits=2), f"{r['collapsed']}/{r['n']}", delta])
    return out + [markdown_table(["setting", "objective", "seeds", "final", "mean over run", "clipped", "collapsed",
                                  "Δ mean over run"], srows), ""]


def _collapse_section(runs: list[dict]) -> list[str]:
    """The rule that flags a collapsed run, and every run it flagged."""
    collapsed = [r for r in runs if r["collapse_step"] is not None]
    out = ["## Collapse detection", "",
           "A run is flagged when its held-out accuracy falls below its best by max(10 pts, half the best) and "
           "does not climb back, or its entropy drops below 10% of its start for good.", ""]
    return out + [markdown_table(["run", "step", "what"], [[r["name"], str(r["collapse_step"]), r["collapse_reason"]]
                                                          for r in collapsed]) if collapsed else "No run collapsed.",
                  ""]


# ------------------------------------------------------------------------------- plots
def _figure(ncols: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0 * ncols, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def _band(ax, runs: list[dict], x_of, label: str, color: str) -> None:
    """Mean ± std over seeds of held-out accuracy, against x_of(run, step)."""
    steps = sorted(set.intersection(*[{s for s, _ in r["curve"]} for r in runs]))
    if not steps:
        return
    values = np.array([[dict(r["curve"])[s] for s in steps] for r in runs])  # (seeds, evals)
    xs = np.mean([[x_of(r, s) for s in steps] for r in runs], axis=0)
    mean, std = values.mean(0), values.std(0)
    ax.plot(xs, mean, label=f"{label} (n={len(runs)})", color=color, marker="o", markersize=3)
    ax.fill_between(xs, mean - std, mean + std, color=color, alpha=0.15)


def draw_plots(runs: list[dict], out: Path) -> list[Path]:
    """The lab's PNGs in `out`: learning curves per architecture, clipping and spread per main-grid configuration,
    drift against depth, the search's accuracies; each where the lab has its runs. Returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    main = select(runs, group="main")
    written = _learning_curves(main, out)
    if main:  # clipping and spread, bars per configuration
        written.append(_clipping_and_spread(config_rows(runs, "main"), out / "clipping_and_spread.png"))
    depth = config_rows(runs, "depth")
    if depth:
        written.append(_drift_vs_depth(runs, depth, out / "drift_vs_depth.png"))
    search = config_rows(runs, "search")
    if search:
        written.append(_search_bars(search, out / "search.png"))
    return written


def _learning_curves(main: list[dict], out: Path) -> list[Path]:
    """Held-out accuracy against RL steps and against completion tokens, one panel per architecture."""
    written = []
    models = [m for m in ("dense", "moe") if select(main, model=m)]
    for name, x_of, xlabel in (("learning_curves.png", lambda r, s: s, "RL step"),
                               ("learning_vs_tokens.png", lambda r, s: r["tokens_at"].get(s, 0.0) / 1e3,
                                "completion tokens trained on (thousands)")):
        if not models:
            break
        fig, axes = _figure(len(models))
        for ax, model in zip(axes, models):
            for objective, replay in dict.fromkeys((r["spec"]["objective"], r["spec"]["replay"])
                                                   for r in select(main, model=model)):
                rs = select(main, model=model, objective=objective, replay=replay)
                label = objective + (f" + replay {replay}" if replay != "none" else "")
                _band(ax, rs, x_of, label, COLORS.get((objective, replay), "gray"))
            ax.set(title=f"{model}: held-out mean@k", xlabel=xlabel, ylabel="accuracy")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        written.append(_save(fig, out / name))
    return written


def _clipping_and_spread(rows: list[dict], path: Path) -> Path:
    """Bars per main-grid configuration: clipped fraction, importance-ratio std, gradient-norm spread."""
    labels = [f"{r['objective']}\n{r['model']}" + ("\n+replay" if r["replay"] != "none" else "") for r in rows]
    fig, axes = _figure(3)
    for ax, key, title, log in ((axes[0], "clip", "clipped fraction (log)", True),
                                (axes[1], "ratio_std", "importance-ratio std", False),
                                (axes[2], "grad_norm_rel_std", "grad-norm std/mean across minibatches", False)):
        means = [r[key]["mean"] for r in rows]
        ax.bar(range(len(rows)), means, yerr=[r[key]["std"] for r in rows], capsize=3,
               color=[COLORS.get((r["objective"], r["replay"]), "gray") for r in rows])
        ax.set_xticks(range(len(rows)), labels, fontsize=6)
        ax.set_title(title, fontsize=9)
        if log and all(m > 0 for m in means):
            ax.set_yscale("log")
    return _save(fig, path)


def _drift_vs_depth(runs: list[dict], depth: list[dict], path: Path) -> Path:
    """Expert choices changed per update against depth, and per layer for each depth."""
    fig, axes = _figure(2)
    xs = [r["layers"] for r in depth]
    axes[0].errorbar(xs, [100 * r["drift"]["mean"] for r in depth], yerr=[100 * r["drift"]["std"] for r in depth],
                     marker="o", capsize=3)
    axes[0].set(title="expert choices changed per update", xlabel="MoE layers", ylabel="%")
    for r in depth:
        per_layer = np.mean([[run["drift_layers"][k] for k in sorted(run["drift_layers"])]
                             for run in select(runs, group="depth", layers=r["layers"])], axis=0)
        axes[1].plot(range(len(per_layer)), 100 * per_layer, marker="o", label=f"{r['layers']} layers")
    axes[1].set(title="per layer", xlabel="layer", ylabel="%")
    axes[1].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    return _save(fig, path)


def _search_bars(search: list[dict], path: Path) -> Path:
    """Mean held-out accuracy over the run, per search setting and objective."""
    fig, axes = _figure(1)
    labels = list(dict.fromkeys(r["label"] for r in search))
    objectives = list(dict.fromkeys(r["objective"] for r in search))
    width = 0.8 / len(objectives)
    for j, objective in enumerate(objectives):
        rows = [next((r for r in search if r["label"] == lb and r["objective"] == objective), None)
                for lb in labels]
        axes[0].bar([i + j * width for i in range(len(labels))], [r["acc_mean"]["mean"] if r else 0 for r in rows],
                    width, yerr=[r["acc_mean"]["std"] if r else 0 for r in rows], capsize=3, label=objective,
                    color=COLORS.get((objective, "none"), "gray"))
    axes[0].set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, fontsize=7)
    axes[0].set(title="search: mean held-out mean@k over the run", ylabel="accuracy")
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path
