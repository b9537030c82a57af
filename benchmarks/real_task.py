"""The real model on a task of its own config, methods x seeds (issue 53 point 5: configs/letters_smollm2.yaml,
SmolLM2-135M-Instruct on reasoning-gym's letter counting): each run `gspo train --config CONFIG objective=...
seed=...` in a fresh process on one CPU thread, `--workers` at a time, then one table.

    python benchmarks/real_task.py --workers 2 --note "2 runs side by side, idle otherwise"

A method is an objective, `+correction` adds `rollout_correction`, and `pg` runs on-policy (num_minibatches 1):
`pg+token_tis` is on-policy policy gradient with token-level truncated IS. A finished run (its summary.json) is not
rerun; a run's model and checkpoint are deleted when it ends (its metrics.jsonl, samples.jsonl and summary stay).
Writes benchmarks/results/<--name>.json: per run greedy accuracy and sampled mean@k on the held-out rows before ->
after, completion length over steps, truncated and clipped fractions, gradient norms, seconds per step; per method
the mean gain and the per-seed differences from `--reference` (paired: same seed, same data order).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, write_result  # noqa: E402


def overrides(method: str) -> list[str]:
    """`gspo train` key=value overrides of a method name (objective[+correction])."""
    objective, _, correction = method.partition("+")
    out = [f"objective={objective}"] + ([f"rollout_correction={correction}"] if correction else [])
    return out + (["num_minibatches=1"] if objective == "pg" else [])  # plain PG is on-policy only (the guide)


def run_one(config: str, method: str, seed: int, folder: Path) -> dict:
    """Train one run (unless its summary.json exists) and return its summary with the method and seed."""
    summary = folder / "summary.json"
    if not summary.exists():
        if folder.exists():
            shutil.rmtree(folder)  # an interrupted run starts over
        cmd = [sys.executable, "-m", "gspo", "train", "--config", config, f"seed={seed}", f"output_dir={folder}",
               "progress=false", *overrides(method)]
        print(" ".join(cmd[2:]), flush=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, cwd=REPO)
        result = json.loads(done.stdout)
        for heavy in ("model", *(p.name for p in folder.glob("checkpoint-*"))):
            shutil.rmtree(folder / heavy, ignore_errors=True)
        summary.write_text(json.dumps(result, indent=1))
    return {"method": method, "seed": seed, **json.loads(summary.read_text()),
            "steps": [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
                      if "grad/norm" in r]}


def digest(run: dict) -> dict:
    """One run's row: held-out before -> after, lengths, truncation, clipping, gradient norms, time per step."""
    evals = run["evals"]
    before, after = evals[min(evals, key=int)], evals[max(evals, key=int)]
    steps = run["steps"]
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in steps)  # noqa: E731
    return {"method": run["method"], "seed": run["seed"],
            "greedy": (before["eval/accuracy"], after["eval/accuracy"]),
            "sampled": (before["eval/mean_at_k"], after["eval/mean_at_k"]),
            "length_first_last": (steps[0]["completion/mean_len"], steps[-1]["completion/mean_len"]),
            "length_mean": mean("completion/mean_len"), "truncated": mean("completion/truncated_frac"),
            "clipped": mean("clip/low_frac") + mean("clip/high_frac"),
            "grad_norm": (mean("grad/norm"), max(r["grad/norm"] for r in steps)),
            "reward_first_last": (steps[0]["reward"], steps[-1]["reward"]),
            "step_s": statistics.fmean(r["time/rollout_s"] + r["time/train_s"] for r in steps),
            "lengths": [r["completion/mean_len"] for r in steps]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/letters_smollm2.yaml")
    p.add_argument("--methods", nargs="+", default=["gspo", "grpo", "luspo", "vespo", "cispo", "pg+token_tis"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--reference", default="gspo", help="the method every other one is compared with, seed by seed")
    p.add_argument("--workers", type=int, default=1, help="runs at a time (each on one thread)")
    p.add_argument("--out", default=str(REPO / "runs" / "lab-part4-real"))
    p.add_argument("--note", default="", help="the conditions (runs side by side, load), kept in the result")
    p.add_argument("--name", default="real_task_letters")
    args = p.parse_args()
    jobs = [(m, s) for s in args.seeds for m in args.methods]  # seed-major: a seed's methods finish together
    started = time.time()
    with ThreadPoolExecutor(args.workers) as pool:
        runs = list(pool.map(lambda job: run_one(args.config, *job, Path(args.out) / f"{job[0]}-s{job[1]}"), jobs))
    rows = [digest(r) for r in runs]
    print("\n| method | seed | greedy before -> after | sampled before -> after | length first -> last (mean) "
          "| truncated | clipped | grad norm mean (max) | s/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['seed']} | {r['greedy'][0]:.1%} -> {r['greedy'][1]:.1%} | {r['sampled'][0]:.1%} "
              f"-> {r['sampled'][1]:.1%} | {r['length_first_last'][0]:.1f} -> {r['length_first_last'][1]:.1f} "
              f"({r['length_mean']:.1f}) | {r['truncated']:.1%} | {r['clipped']:.1%} | {r['grad_norm'][0]:.2f} "
              f"({r['grad_norm'][1]:.2f}) | {r['step_s']:.0f} |")
    by = {(r["method"], r["seed"]): r for r in rows}
    methods = {}
    for method in args.methods:
        mine = [r for r in rows if r["method"] == method]
        gain = lambda r, key: r[key][1] - r[key][0]  # noqa: E731
        ref = [by.get((args.reference, r["seed"])) for r in mine]
        paired = [gain(r, "greedy") - gain(q, "greedy") for r, q in zip(mine, ref, strict=True) if q]
        methods[method] = {"greedy_gain": statistics.fmean(gain(r, "greedy") for r in mine),
                           "sampled_gain": statistics.fmean(gain(r, "sampled") for r in mine),
                           "length_mean": statistics.fmean(r["length_mean"] for r in mine),
                           f"greedy_gain_minus_{args.reference}_per_seed": paired,
                           "step_s": statistics.fmean(r["step_s"] for r in mine)}
        m = methods[method]
        print(f"{method}: greedy gain {m['greedy_gain']:+.1%}, sampled {m['sampled_gain']:+.1%}, minus "
              f"{args.reference} per seed {', '.join(f'{d:+.1%}' for d in paired)}, mean length "
              f"{m['length_mean']:.1f}, {m['step_s']:.0f} s/step")
    print("wrote", write_result(args.name, {"note": args.note, "config": args.config, "workers": args.workers,
                                            "wall_s": round(time.time() - started), "runs": rows,
                                            "methods": methods}))


if __name__ == "__main__":
    main()
