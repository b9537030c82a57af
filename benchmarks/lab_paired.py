"""Paired differences between two methods of a regimes lab, seed by seed (every seed of a lab starts from the
same cold start, so a method's gain over another is best read per seed).

    python benchmarks/lab_paired.py runs/lab-part3-policy async-stale2,gspo,grpo onpolicy-mb1,pg_tis,grpo
    python benchmarks/lab_paired.py runs/lab-part3-moe mismatch-fp16/grpo,mismatch-bf16/grpo

Prints, for each `regime,method_a,method_b` (or `regime_a/method_a,regime_b/method_b`): the difference in
final held-out mean@k and in its mean over the run's evaluations (percentage points, a - b), per seed and on
average, and whether the average lies beyond 2 standard errors of the per-seed differences. A lone
`regime/method` prints its policy entropy (mean of the first and of the last 3 steps, over seeds) instead.

With `--metric NAME` (a training metric, e.g. completion/mean_len or clip/high_frac) a pair compares the metric's
mean over the last 3 steps (a - b, in its own units) and a lone `regime/method` prints it for the first and the
last 3 steps, per seed and on average:

    python benchmarks/lab_paired.py runs/lab-part4-length --metric completion/mean_len length-x3,luspo,gspo
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path


def evaluations(lab: Path, run: str) -> list[float]:
    """The run's held-out mean@k at each evaluation, in order."""
    rows = [json.loads(line) for line in (lab / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    return [r["eval/mean_at_k"] for r in rows if "eval/mean_at_k" in r]


def paired(lab: Path, a: str, b: str, seeds: list[int]) -> dict:
    """{"final": [...], "run_mean": [...]}: run a - run b per seed, in points; a and b are "regime/method"."""
    out = {"final": [], "run_mean": []}
    for seed in seeds:
        ea, eb = (evaluations(lab, f"regime-{run.replace('/', '-')}-s{seed}") for run in (a, b))
        out["final"].append(100 * (ea[-1] - eb[-1]))
        out["run_mean"].append(100 * (statistics.fmean(ea) - statistics.fmean(eb)))
    return out


def trajectory(lab: Path, run: str, seed: int, metric: str) -> list[float]:
    """The training metric's value at each step of `run` ("regime/method") with `seed`, in order."""
    rows = (lab / "runs" / f"regime-{run.replace('/', '-')}-s{seed}" / "metrics.jsonl").read_text().splitlines()
    values = [r[metric] for r in map(json.loads, rows) if metric in r]
    if not values:
        raise SystemExit(f"{run} seed {seed}: no metric {metric!r} in its metrics.jsonl")
    return values


def ends(lab: Path, run: str, seeds: list[int], metric: str = "entropy") -> tuple[list[float], list[float]]:
    """The metric's mean over the first and over the last 3 steps of `run`, one value per seed."""
    values = [trajectory(lab, run, seed, metric) for seed in seeds]
    return [statistics.fmean(v[:3]) for v in values], [statistics.fmean(v[-3:]) for v in values]


def entropy(lab: Path, run: str, seeds: list[int]) -> tuple[float, float]:
    """Mean policy entropy of the first and of the last 3 steps of `run` ("regime/method"), over seeds."""
    first, last = ends(lab, run, seeds)
    return statistics.fmean(first), statistics.fmean(last)


def verdict(diffs: list[float]) -> tuple[float, float, str]:
    """(mean, 2 standard errors, "beyond" or "within") of per-seed differences."""
    mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
    return mean, 2 * se, "beyond" if abs(mean) > 2 * se else "within"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("lab", type=Path, help="the lab's output_dir")
    p.add_argument("pairs", nargs="+", help="regime,method_a,method_b or regime_a/method_a,regime_b/method_b")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--metric", help="compare this training metric (its last 3 steps) instead of held-out mean@k")
    args = p.parse_args()
    for spec in args.pairs:
        fields = spec.split(",")
        if len(fields) == 1 and args.metric:
            first, last = ends(args.lab, spec, args.seeds, args.metric)
            print(f"{spec}: {args.metric} {statistics.fmean(first):.4g} (first 3 steps) -> "
                  f"{statistics.fmean(last):.4g} (last 3); seeds "
                  + ", ".join(f"{a:.4g} -> {b:.4g}" for a, b in zip(first, last)))
            continue
        if len(fields) == 1:
            start, end = entropy(args.lab, spec, args.seeds)
            print(f"{spec}: entropy {start:.3f} (first 3 steps) -> {end:.3f} (last 3)")
            continue
        a, b = fields if len(fields) == 2 else (f"{fields[0]}/{fields[1]}", f"{fields[0]}/{fields[2]}")
        if args.metric:
            diffs = [x - y for x, y in zip(ends(args.lab, a, args.seeds, args.metric)[1],
                                           ends(args.lab, b, args.seeds, args.metric)[1])]
            mean, two_se, where = verdict(diffs)
            print(f"{a} - {b}: {args.metric}, last 3 steps {mean:+.4g} (seeds {', '.join(f'{d:+.4g}' for d in diffs)};"
                  f" 2 SE {two_se:.4g}: {where})")
            continue
        parts = []
        for name, diffs in paired(args.lab, a, b, args.seeds).items():
            mean, two_se, where = verdict(diffs)
            parts.append(f"{name} {mean:+.1f} (seeds {', '.join(f'{d:+.1f}' for d in diffs)}; 2 SE {two_se:.1f}: "
                         f"{where})")
        print(f"{a} - {b}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
