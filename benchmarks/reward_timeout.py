"""What reward_timeout_s costs a step: one `score_completions` of a batch, three ways, alternating in one process.

    OMP_NUM_THREADS=1 python benchmarks/reward_timeout.py --rounds 7 --calls 200

- `none`: reward_timeout_s 0, the functions called right there;
- `main`: the default (10 s) on the main thread, where the trainer scores: the call runs there, and a watchdog
  thread would interrupt it with a signal (gspo/data/reward_timeout.py);
- `thread`: the same timeout from another thread (the API called from a thread of the user's), where each call
  runs in a daemon thread of its own: what every call did before issue 49.

Each call scores a batch of `--batch` completions with two rewards: a cheap one (a string test) and, with
math-verify installed, open-r1's style of accuracy (parse and verify, which needs the main thread). Reported:
the median over rounds of the mean seconds per `score_completions` call, and the overhead of `main` and `thread`
over `none`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from gspo.data.reward_scoring import score_completions


def has_answer(completions, **_):
    return [1.0 if "answer" in c else 0.0 for c in completions]


def math_accuracy(completions, solution, **_):
    from math_verify import parse, verify

    return [float(verify(parse(s), parse(c))) for c, s in zip(completions, solution)]


def rewards() -> list:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return [has_answer]
    return [has_answer, math_accuracy]


def timed(fns, batch: int, calls: int, timeout_s: float) -> float:
    prompts = [f"What is {i}+{i}?" for i in range(batch)]
    completions = [f"The answer is ${2 * i}$" for i in range(batch)]
    columns = {"solution": [f"${2 * i}$" for i in range(batch)]}
    start = time.perf_counter()
    for _ in range(calls):
        score_completions(fns, None, prompts, completions, columns, timeout_s=timeout_s)
    return (time.perf_counter() - start) / calls


def in_thread(fn, *args) -> float:
    box = {}
    worker = threading.Thread(target=lambda: box.setdefault("t", fn(*args)))
    worker.start()
    worker.join()
    return box["t"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results/reward_timeout.json")
    args = ap.parse_args()
    fns = rewards()
    ways = {"none": lambda: timed(fns, args.batch, args.calls, 0),
            "main": lambda: timed(fns, args.batch, args.calls, 10.0),
            "thread": lambda: in_thread(timed, [has_answer], args.batch, args.calls, 10.0)}
    if len(fns) > 1:  # math-verify cannot run off the main thread: `thread` scores the cheap reward alone,
        ways["none (cheap only)"] = lambda: timed([has_answer], args.batch, args.calls, 0)  # against this
    ways["main (cheap only)"] = lambda: timed([has_answer], args.batch, args.calls, 10.0)
    times = {k: [] for k in ways}
    for r in range(args.rounds):
        for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
            times[name].append(ways[name]())
    median = {k: statistics.median(v) for k, v in times.items()}
    cheap = median.get("none (cheap only)", median["none"])
    result = {"rewards": [f.__name__ for f in fns], "batch": args.batch, "calls": args.calls,
              "rounds": args.rounds, "seconds_per_call": median,
              "overhead_us": {"main": 1e6 * (median["main"] - median["none"]),
                              "main (cheap only)": 1e6 * (median["main (cheap only)"] - cheap),
                              "thread (cheap only)": 1e6 * (median["thread"] - cheap)}}
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
