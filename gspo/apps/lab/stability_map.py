"""The stability map: for every method x regime cell of a lab, did the method learn, learn slowly,
or collapse? Pure functions of the run summaries (`gspo.apps.lab.report.summarize_run`), and a figure.

A cell holds the runs of one method in one regime, one per seed (`summarize_run`'s dicts: acc_start,
acc_final, collapse_step). Its outcome, by rule:
  collapsed  at least half of its seeds collapsed (`detect_collapse`: held-out accuracy fell from its
             best without recovering, or the entropy fell to a tenth and stayed); the number is the
             median step of those collapses
  learned    otherwise, if its mean gain in held-out accuracy (final - start) is at least
             `learned_share` of the best mean gain among the regime's cells that did not collapse,
             and at least `min_gain` (5 points: a cell that hardly moved did not learn, alone or not)
  slowed     otherwise (it kept learning, but clearly less than the best method of the regime)
A regime's column also says whether anything in it separates: some two cells that did not collapse
differ in gain by more than 2 standard errors (`gspo.apps.lab.stats.compare`), or some cells collapsed
and others did not. A regime where nothing separates is reported as such, not ranked.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from itertools import combinations
from pathlib import Path

from gspo.apps.lab.regimes import levels, regime_runs
from gspo.apps.lab.stats import compare, fmt, markdown_table, stat

OUTCOMES = ("learned", "slowed", "collapsed")
COLORS = {"learned": "#4caf50", "slowed": "#ffc107", "collapsed": "#e53935"}


def cell(runs: list[dict]) -> dict:
    """The seeds of one method in one regime: gain statistics (`stat`) and collapses.

    Returns {"gain": stat of acc_final - acc_start, "n": seeds, "collapsed": how many collapsed,
    "collapse_step": median step of those (None if none)}.
    """
    steps = [r["collapse_step"] for r in runs if r["collapse_step"] is not None]
    return {"gain": stat([r["acc_final"] - r["acc_start"] for r in runs]), "n": len(runs), "collapsed": len(steps),
            "collapse_step": statistics.median(steps) if steps else None}


def stability_map(runs: list[dict], *, method_of: Callable[[dict], str], regime_of: Callable[[dict], str],
                  learned_share: float = 0.5, min_gain: float = 0.05, order: tuple[list, list] = ((), ())) -> dict:
    """{"methods": [...], "regimes": [...], "cells": {(method, regime): cell + "outcome" + "text"},
    "separated": {regime: bool}} from run summaries. Rows and columns: `order` (methods, regimes) first,
    then any other in first-seen order."""
    if not 0 < learned_share <= 1:
        raise ValueError(f"learned_share={learned_share!r} must be in (0, 1]")
    groups = {}
    for r in runs:
        groups.setdefault((method_of(r), regime_of(r)), []).append(r)
    methods = [m for m in dict.fromkeys([*order[0], *(m for m, _ in groups)]) if any(k[0] == m for k in groups)]
    regimes = [g for g in dict.fromkeys([*order[1], *(g for _, g in groups)]) if any(k[1] == g for k in groups)]
    cells = {key: cell(group) for key, group in groups.items()}
    separated = {}
    for regime in regimes:
        column = {m: cells[(m, regime)] for m in methods if (m, regime) in cells}
        standing = {m: c for m, c in column.items() if 2 * c["collapsed"] < c["n"]}
        best = max((c["gain"]["mean"] for c in standing.values()), default=float("nan"))
        for m, c in column.items():
            if m not in standing:
                c["outcome"] = "collapsed"
                c["text"] = f"collapsed at step {c['collapse_step']:g} ({c['collapsed']}/{c['n']} seeds)"
                continue
            gain = c["gain"]["mean"]
            c["outcome"] = "learned" if gain >= max(min_gain, learned_share * best) else "slowed"
            c["text"] = f"{100 * gain:+.1f} ± {100 * c['gain']['std']:.1f} pp"
        mixed = 0 < len(standing) < len(column)  # some collapsed, some did not
        differ = any(compare(a["gain"], b["gain"])[2] != "same" for a, b in combinations(standing.values(), 2))
        separated[regime] = mixed or differ
    return {"methods": methods, "regimes": regimes, "cells": cells, "separated": separated}


def map_table(smap: dict) -> str:
    """The map as a markdown table: a row per method, a column per regime, "outcome: number" cells."""
    header = ["method"] + [r + ("" if smap["separated"][r] else " (nothing separates)") for r in smap["regimes"]]
    rows = [[m] + [f"{c['outcome']}: {c['text']}" if (c := smap["cells"].get((m, r))) else "–"
                   for r in smap["regimes"]] for m in smap["methods"]]
    return markdown_table(header, rows)


def draw_map(smap: dict, path: Path, title: str = "stability map") -> Path:
    """The map as a coloured grid (learned / slowed / collapsed), each cell with its number."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods, regimes = smap["methods"], smap["regimes"]
    fig, ax = plt.subplots(figsize=(1.8 + 2.0 * len(regimes), 0.9 + 0.6 * len(methods)))
    for i, m in enumerate(methods):
        for j, r in enumerate(regimes):
            c = smap["cells"].get((m, r))
            color = COLORS[c["outcome"]] if c else "#eeeeee"
            ax.add_patch(plt.Rectangle((j, i), 1, 1, facecolor=color, edgecolor="white", linewidth=2))
            ax.text(j + 0.5, i + 0.5, c["text"].replace(" (", "\n(") if c else "–", ha="center", va="center",
                    fontsize=7)
    ax.set_xlim(0, len(regimes))
    ax.set_ylim(len(methods), 0)
    ax.set_xticks([j + 0.5 for j in range(len(regimes))],
                  [r + ("" if smap["separated"][r] else "\n(nothing separates)") for r in regimes], fontsize=8)
    ax.set_yticks([i + 0.5 for i in range(len(methods))], methods, fontsize=8)
    ax.tick_params(length=0)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[o]) for o in OUTCOMES]
    ax.legend(handles, OUTCOMES, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def details_table(runs: list[dict], smap: dict) -> str:
    """One row per cell of the map: final accuracy, mismatch KL and ESS, routing drift, clipping, collapses."""
    def cell_stat(method, regime, key, pct=True, digits=2):
        rs = [r for r in runs if (r["spec"]["method"], r["spec"]["label"]) == (method, regime)]
        return fmt(stat(r[key] for r in rs), pct, 1 if pct else digits)

    header = ["regime", "method", "outcome", "final", "mismatch/kl", "ess", "expert change/update", "clipped"]
    rows = [[regime, method, c["outcome"], cell_stat(method, regime, "acc_final"),
             cell_stat(method, regime, "mismatch_kl", False), cell_stat(method, regime, "mismatch_ess", False, 3),
             cell_stat(method, regime, "drift"), cell_stat(method, regime, "clip")]
            for regime in smap["regimes"] for method in smap["methods"]
            if (c := smap["cells"].get((method, regime)))]
    return markdown_table(header, rows)


def draw_drift_per_layer(runs: list[dict], path: Path, method: str = "grpo") -> Path | None:
    """Experts changed per update at each layer (mean over seeds and steps), one line per regime, for
    `method`'s runs (GRPO: no replay, so the drift acts on it unchecked); None when none logged it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_regime = {}
    for r in runs:
        if r["spec"]["method"] == method and r["drift_layers"]:
            by_regime.setdefault(r["spec"]["label"], []).append(r["drift_layers"])
    if not by_regime:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for regime, seeds in by_regime.items():
        layers = sorted(seeds[0])
        ax.plot(layers, [100 * statistics.fmean(d[i] for d in seeds) for i in layers], marker=".", label=regime)
    ax.set_xlabel("layer")
    ax.set_ylabel("experts changed per update (%)")
    ax.set_title(f"routing drift per layer, {method}", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def regimes_section(runs: list[dict], cfg: dict, plots_dir: Path) -> list[str]:
    """report.md's lines for the lab's regime runs: the map as a table and a figure, and every
    method x regime combination the grid left out, with its reason. `cfg`: the lab's config (lab.json)."""
    runs = [r for r in runs if r["spec"]["group"] == "regime"]
    if not runs:
        return []
    order = (list(cfg.get("regime_methods", {})), [label for label, _ in levels(cfg.get("regimes", {}))])
    smap = stability_map(runs, method_of=lambda r: r["spec"]["method"], regime_of=lambda r: r["spec"]["label"],
                         order=order)
    figure = draw_map(smap, Path(plots_dir) / "stability_map.png")
    left_out = [x for x in regime_runs(cfg.get("regimes", {}), cfg.get("regime_methods", {}),
                                       cfg.get("regime_model", "moe"), cfg.get("axis_methods", {}))[1]
                if (x["method"], x["regime"]) not in smap["cells"]]  # e.g. vllm runs made in another venv
    out = ["## Regimes: the stability map", "",
           "Each cell: one method in one regime over its seeds; the number is the mean gain in held-out "
           "accuracy (final - start, ± std over seeds) or the step of collapse. collapsed: half the seeds or more "
           "collapsed; learned: at least half the best gain of the regime; slowed: less. A regime marked "
           "'nothing separates' has no two cells apart by more than 2 standard errors.", "",
           map_table(smap), "", f"![stability map](plots/{figure.name})", ""]
    drift = draw_drift_per_layer(runs, Path(plots_dir) / "drift_per_layer.png")
    if drift is not None:
        out += ["Routing drift per layer (GRPO, every regime that logged it: depth and width of the MoE):", "",
                f"![drift per layer](plots/{drift.name})", ""]
    out += ["Per cell (mean ± std over seeds): final held-out accuracy, the sampler mismatch (mismatch/kl: "
            "KL(mu || pi_old) per token; ess: effective sample size of pi_old/mu), experts changed per update, "
            "clipped fraction; '–' where not logged.", "", details_table(runs, smap), ""]
    collapsed = [r for r in runs if r["collapse_step"] is not None]
    if collapsed:
        out += ["Collapses and what came before (first value -> last value before the collapse step):", ""]
        out += [f"- {r['name']}: step {r['collapse_step']}, {r['collapse_reason']}; " + ", ".join(
            f"{k} {a:.3g} -> {b:.3g}" for k, (a, b) in r["precursor"].items()) for r in collapsed] + [""]
    if left_out:
        by_reason = {}
        for x in left_out:
            by_reason.setdefault((x["regime"], x["reason"]), []).append(x["method"])
        out += ["Not run (the rule that left each out):", ""]
        out += [f"- {regime}: {', '.join(names)}: {reason}" for (regime, reason), names in by_reason.items()] + [""]
    return out
