"""What one sandboxed code_tests run costs: this tree against git revision REV, alternating fresh processes.

    python benchmarks/sandbox_cost.py --baseline bbf266e --rounds 6 --runs 20

Each process imports its tree's gspo.sandbox.runner, does one run as warm-up, then `--runs` runs of a
correct two-line program against two asserts (each must pass), one after another, and reports the
median and the total wall seconds per run. Rounds alternate the order of the sides. Since issue 31 a
run is two sandboxed interpreters (the program's and the judge's) plus a memory cgroup where one can
be made; before, one interpreter ran program and tests together.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, baseline_tree, served_as_worker, worker_result, write_result  # noqa: E402

PROGRAM = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"


def cost(spec: dict) -> dict:
    sys.path.insert(0, spec["tree"])
    from gspo.sandbox.runner import run_sandboxed

    run_sandboxed(PROGRAM, TESTS, sandbox=spec["sandbox"])  # warm-up (probes the boundary)
    seconds = []
    for _ in range(spec["runs"]):
        t0 = time.perf_counter()
        result = run_sandboxed(PROGRAM, TESTS, sandbox=spec["sandbox"])
        seconds.append(time.perf_counter() - t0)
        assert result.passed, result
    return {"seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="git revision to compare against")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--sandbox", default="os", choices=("os", "weak"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if served_as_worker(args.worker, cost):
        return
    import json

    work = REPO / "runs" / "bench" / "sandbox_cost"
    trees = {"this": str(REPO), args.baseline: str(baseline_tree(args.baseline, work))}
    seconds: dict[str, list[float]] = {side: [] for side in trees}
    for r in range(args.rounds):
        for side in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            spec = {"tree": trees[side], "runs": args.runs, "sandbox": args.sandbox}
            out = worker_result([sys.executable, __file__, "--baseline", args.baseline, "--worker", json.dumps(spec)],
                                f"{side} side")
            seconds[side] += out["seconds"]
    summary = {side: {"median_ms": 1000 * statistics.median(s), "mean_ms": 1000 * statistics.fmean(s)}
               for side, s in seconds.items()}
    summary["ratio_median"] = summary["this"]["median_ms"] / summary[args.baseline]["median_ms"]
    for side in trees:
        print(f"{side:>10}: median {summary[side]['median_ms']:.1f} ms, mean {summary[side]['mean_ms']:.1f} ms per run")
    print(f"this / {args.baseline}: {summary['ratio_median']:.2f}x (medians)")
    print("wrote", write_result("sandbox_cost", {"sandbox": args.sandbox, "runs": len(seconds["this"]),
                                                 "summary": summary}))


if __name__ == "__main__":
    main()
