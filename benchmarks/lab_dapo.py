"""The DAPO lab's table (issue 55, configs/lab_dapo.yaml): per limit and method, held-out accuracy before -> after,
the paired difference from the same objective without DAPO's pieces, and what each piece changed on the way.

    make lab-dapo                                   # gspo lab --config configs/lab_dapo.yaml (resumable)
    python benchmarks/lab_dapo.py runs/lab-dapo --note "2 runs at a time, load 2"

For each run (regime-<level>-<method>-s<seed>): held-out mean@k and greedy accuracy at the first and last
evaluation; means over the steps of the truncated share, the completion length, the agreeing groups' share (of
those trained on, and for dynamic sampling of those sampled), groups sampled a step and the informative share
kept, seconds a step (rollout + updates) and the extra rounds' seconds. Per method the mean over seeds, and the
paired difference (final mean@k, points) from the objective alone (`gspo_all` - `gspo`, seed by seed) with the
lab's beyond/within rule (`lab_paired.verdict`). Writes benchmarks/results/lab_dapo.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402
from lab_paired import verdict  # noqa: E402


def run_row(folder: Path) -> dict:
    """One run's numbers (see the module docstring)."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/mean_at_k" in r]
    steps = [r for r in rows if "reward/mean" in r]
    mean = lambda key, default=0.0: statistics.fmean(r.get(key, default) for r in steps)  # noqa: E731
    return {"mean_at_k": (evals[0]["eval/mean_at_k"], evals[-1]["eval/mean_at_k"]),
            "greedy": (evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]),
            "truncated": mean("completion/truncated_frac"), "length": mean("completion/mean_len"),
            "zero_std": mean("groups/zero_std_frac"),
            "sampled_zero_std": mean("groups/sampled_zero_std_frac", None) if "groups/sampled" in steps[0] else None,
            "groups_sampled": mean("groups/sampled") if "groups/sampled" in steps[0] else None,
            "filled": mean("groups/filled_frac") if "groups/filled_frac" in steps[0] else None,
            "step_s": mean("time/rollout_s") + mean("time/train_s"), "extra_s": mean("time/extra_sampling_s"),
            "overlong": mean("reward/overlong") if "reward/overlong" in steps[0] else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("lab", type=Path, help="the lab's output_dir")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--note", default="", help="the conditions (runs side by side, load), kept in the result")
    args = p.parse_args()
    runs = sorted(d.name for d in (args.lab / "runs").iterdir() if (d / "metrics.jsonl").exists())
    cells = sorted({name.rsplit("-s", 1)[0] for name in runs})  # regime-<level>-<method>
    table = {}
    for cell in cells:
        per_seed = [run_row(args.lab / "runs" / f"{cell}-s{s}") for s in args.seeds
                    if f"{cell}-s{s}" in runs]
        head, method = cell.rsplit("-", 1)  # methods are written with underscores, levels with a dash
        level = head.removeprefix("regime-")
        base = f"regime-{level}-{method.split('_')[0]}"
        avg = {k: statistics.fmean(r[k] for r in per_seed) if per_seed[0][k] is not None else None
               for k in ("truncated", "length", "zero_std", "sampled_zero_std", "groups_sampled", "filled", "step_s",
                         "extra_s", "overlong")}
        out = {"level": level, "method": method, "seeds": len(per_seed), **avg,
               "mean_at_k": [statistics.fmean(r["mean_at_k"][i] for r in per_seed) for i in (0, 1)],
               "greedy": [statistics.fmean(r["greedy"][i] for r in per_seed) for i in (0, 1)],
               "final_per_seed": [r["mean_at_k"][1] for r in per_seed]}
        if base != cell and base in table and len(per_seed) == len(table[base]["final_per_seed"]) > 1:
            diffs = [100 * (a - b) for a, b in zip(out["final_per_seed"], table[base]["final_per_seed"], strict=True)]
            d, two_se, said = verdict(diffs)
            out["minus_base"] = {"per_seed": diffs, "mean": d, "two_se": two_se, "verdict": said}
        table[cell] = out
    print("| limit | method | mean@k start -> end | greedy end | minus the objective alone (2 SE) | truncated "
          "| length | agreeing groups (sampled) | groups sampled / step | s / step (extra rounds) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in table.values():
        diff = r.get("minus_base")
        said = f"{diff['mean']:+.1f} ({diff['two_se']:.1f}), {diff['verdict']}" if diff else "–"
        sampled = f" ({r['sampled_zero_std']:.1%})" if r["sampled_zero_std"] is not None else ""
        groups = f"{r['groups_sampled']:.1f}" if r["groups_sampled"] is not None else "–"
        print(f"| {r['level']} | {r['method']} | {r['mean_at_k'][0]:.1%} -> {r['mean_at_k'][1]:.1%} "
              f"| {r['greedy'][1]:.1%} | {said} | {r['truncated']:.1%} | {r['length']:.1f} "
              f"| {r['zero_std']:.1%}{sampled} | {groups} | {r['step_s']:.2f} ({r['extra_s']:.2f}) |")
    print("wrote", write_result("lab_dapo", {"note": args.note, "lab": str(args.lab), "cells": table}))


if __name__ == "__main__":
    main()
