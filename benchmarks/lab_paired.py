"""Paired differences between two methods of a regimes lab, seed by seed (every seed of a lab starts from the
same cold start, so a method's gain over another is best read per seed).

    python benchmarks/lab_paired.py runs/lab-part3-policy async-stale2,gspo,grpo onpolicy-mb1,pg_tis,grpo
    python benchmarks/lab_paired.py runs/lab-part3-moe mismatch-fp16/grpo,mismatch-bf16/grpo

Prints, for each `regime,method_a,method_b` (or `regime_a/method_a,regime_b/method_b`): the difference in
final held-out mean@k and in its mean over the run's evaluations (percentage points, a - b), per seed and on
average, and whether the average lies beyond 2 standard errors of the per-seed differences. A lone
`regime/method` prints its policy entropy (mean of the first and of the last 3 steps, over seeds) instead.
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


def entropy(lab: Path, run: str, seeds: list[int]) -> tuple[float, float]:
    """Mean policy entropy of the first and of the last 3 steps of `run` ("regime/method"), over seeds."""
    first, last = [], []
    for seed in seeds:
        rows = (lab / "runs" / f"regime-{run.replace('/', '-')}-s{seed}" / "metrics.jsonl").read_text().splitlines()
        values = [r["entropy"] for r in map(json.loads, rows) if "entropy" in r]
        first.append(statistics.fmean(values[:3]))
        last.append(statistics.fmean(values[-3:]))
    return statistics.fmean(first), statistics.fmean(last)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("lab", type=Path, help="the lab's output_dir")
    p.add_argument("pairs", nargs="+", help="regime,method_a,method_b or regime_a/method_a,regime_b/method_b")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = p.parse_args()
    for spec in args.pairs:
        fields = spec.split(",")
        if len(fields) == 1:
            start, end = entropy(args.lab, spec, args.seeds)
            print(f"{spec}: entropy {start:.3f} (first 3 steps) -> {end:.3f} (last 3)")
            continue
        a, b = fields if len(fields) == 2 else (f"{fields[0]}/{fields[1]}", f"{fields[0]}/{fields[2]}")
        parts = []
        for name, diffs in paired(args.lab, a, b, args.seeds).items():
            mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
            verdict = "beyond" if abs(mean) > 2 * se else "within"
            parts.append(f"{name} {mean:+.1f} (seeds {', '.join(f'{d:+.1f}' for d in diffs)}; 2 SE {2 * se:.1f}: "
                         f"{verdict})")
        print(f"{a} - {b}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
