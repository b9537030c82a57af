"""The real model on a task of its own config, methods x seeds (issue 53 point 5: configs/letters_smollm2.yaml,
SmolLM2-135M-Instruct on reasoning-gym's letter counting): each run `gspo train --config CONFIG objective=...
seed=...` in a fresh process on one CPU thread, `--workers` at a time, then one table.

    python benchmarks/real_task.py --workers 2 --note "2 runs side by side, idle otherwise"

A method is an objective, `+correction` adds `rollout_correction`, and `pg` runs on-policy (num_minibatches 1):
`pg+token_tis` is on-policy policy gradient with token-level truncated IS. `:NAME` adds the overrides that
`--variant NAME KEY=VALUE ...` gives (`gspo:filter` with `--variant filter mask_truncated_completions=true`);
`--set KEY=VALUE ...` applies to every run. A finished run (its summary.json) is not
rerun; a run's model and checkpoint are deleted when it ends (its metrics.jsonl, samples.jsonl and summary stay).
Writes benchmarks/results/<--name>.json: per run greedy accuracy and sampled mean@k on the held-out rows before ->
after, completion length over steps, truncated and clipped fractions, gradient norms, seconds per step; per method
the mean gain and the per-seed differences from `--reference` (paired: same seed, same data order).
"""

from __future__ import annotations

import argparse
import json
import math
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
from lab_paired import verdict  # noqa: E402


def overrides(method: str, variants: dict | None = None) -> list[str]:
    """`gspo train` key=value overrides of a method name (objective[+correction][:variant]): a variant's are those
    `--variant NAME KEY=VALUE ...` gave it."""
    head, _, variant = method.partition(":")
    objective, _, correction = head.partition("+")
    if variant and variant not in (variants or {}):
        raise SystemExit(f"method {method!r}: no --variant {variant} KEY=VALUE ... was given")
    out = [f"objective={objective}"] + ([f"rollout_correction={correction}"] if correction else [])
    out += list((variants or {}).get(variant, []))
    return out + (["num_minibatches=1"] if objective == "pg" else [])  # plain PG is on-policy only (the guide)


def run_one(config: str, method: str, seed: int, folder: Path, variants: dict | None = None,
            common: list[str] = ()) -> dict:
    """Train one run (unless its summary.json exists) and return its summary with the method and seed."""
    summary = folder / "summary.json"
    if not summary.exists():
        if folder.exists():
            from gspo.runtime import run_lock

            with run_lock(folder):  # a run still going there (another invocation's) is an error, not deleted
                pass
            shutil.rmtree(folder)  # an interrupted run starts over
        cmd = [sys.executable, "-m", "gspo", "train", "--config", config, f"seed={seed}", f"output_dir={folder}",
               "progress=false", *common, *overrides(method, variants)]
        print(" ".join(cmd[2:]), flush=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, cwd=REPO)
        result = json.loads(done.stdout)
        for heavy in ("model", *(p.name for p in folder.glob("checkpoint-*"))):
            shutil.rmtree(folder / heavy, ignore_errors=True)
        summary.write_text(json.dumps(result, indent=1))
    return {"method": method, "seed": seed, **json.loads(summary.read_text()),
            "steps": [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
                      if "reward/mean" in r]}  # the steps' lines (not step 0's evaluation)


def digest(run: dict) -> dict:
    """One run's row: held-out before -> after, lengths, truncation, clipping, gradient norms, time per step."""
    evals = run["evals"]
    before, after = evals[min(evals, key=int)], evals[max(evals, key=int)]
    steps = run["steps"]
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in steps)  # noqa: E731
    return {"method": run["method"], "seed": run["seed"],
            "greedy": (before["eval/accuracy"], after["eval/accuracy"]),
            "sampled": (before["eval/mean_at_k"], after["eval/mean_at_k"]),
            # the greedy answers' mean reward: above the accuracy where the reward gives partial credit
            "greedy_reward": (before["eval/reward"], after["eval/reward"]),
            "length_first_last": (steps[0]["completion/mean_len"], steps[-1]["completion/mean_len"]),
            "length_mean": mean("completion/mean_len"),
            "length_early_late": (statistics.fmean(r["completion/mean_len"] for r in steps[:3]),
                                  statistics.fmean(r["completion/mean_len"] for r in steps[-3:])),
            "truncated": mean("completion/truncated_frac"),
            "clipped": mean("clip/low_frac") + mean("clip/high_frac"),
            "grad_norm": (mean("grad/norm"), max(r.get("grad/norm", 0.0) for r in steps)),
            # dynamic sampling: groups sampled a step, the share of the batch that informs, the extra rounds' time
            "groups_sampled": mean("groups/sampled") if "groups/sampled" in steps[0] else None,
            "filled": mean("groups/filled_frac") if "groups/filled_frac" in steps[0] else None,
            "extra_sampling_s": mean("time/extra_sampling_s"),
            "reward_first_last": (steps[0]["reward/mean"], steps[-1]["reward/mean"]),
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
    p.add_argument("--variant", nargs="+", action="append", default=[], metavar=("NAME", "KEY=VALUE"),
                   help="a variant of a method, `objective:NAME` in --methods: its own gspo train overrides")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="overrides of every run")
    p.add_argument("--plot", default=None, help="also draw each method's completion length over the steps (the mean "
                   "over seeds) and its held-out gains into this PNG (matplotlib)")
    args = p.parse_args()
    variants = {v[0]: v[1:] for v in args.variant}
    for method in args.methods:
        overrides(method, variants)  # an unknown variant is named before anything runs
    jobs = [(m, s) for s in args.seeds for m in args.methods]  # seed-major: a seed's methods finish together
    started = time.time()
    with ThreadPoolExecutor(args.workers) as pool:
        runs = list(pool.map(lambda job: run_one(args.config, *job, Path(args.out) / (
            f"{job[0].replace(':', '_')}-s{job[1]}"), variants, args.set), jobs))
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
    gain = lambda r, key: r[key][1] - r[key][0]  # noqa: E731
    for method in args.methods:
        mine = [r for r in rows if r["method"] == method]
        pairs = [(r, by[(args.reference, r["seed"])]) for r in mine if (args.reference, r["seed"]) in by]
        paired = {  # method minus the reference, seed by seed: held-out gains (points) and late length (tokens)
            "greedy": [gain(r, "greedy") - gain(q, "greedy") for r, q in pairs],
            "sampled": [gain(r, "sampled") - gain(q, "sampled") for r, q in pairs],
            "late_length": [r["length_early_late"][1] - q["length_early_late"][1] for r, q in pairs]}
        methods[method] = {
            "greedy_gain": statistics.fmean(gain(r, "greedy") for r in mine),
            "sampled_gain": statistics.fmean(gain(r, "sampled") for r in mine),
            "length_early": statistics.fmean(r["length_early_late"][0] for r in mine),
            "length_late": statistics.fmean(r["length_early_late"][1] for r in mine),
            "truncated": statistics.fmean(r["truncated"] for r in mine),
            "clipped": statistics.fmean(r["clipped"] for r in mine),
            f"minus_{args.reference}": {k: {"per_seed": v, **spread(v)} for k, v in paired.items()},
            "step_s": statistics.fmean(r["step_s"] for r in mine),
        }
        m = methods[method]
        diffs = "; ".join(f"{k} {d['mean']:+.3g} (2 SE {d['two_se']:.3g}, {d['verdict']})"
                          for k, d in m[f"minus_{args.reference}"].items() if d["n"])
        print(f"{method}: greedy gain {m['greedy_gain']:+.1%}, sampled {m['sampled_gain']:+.1%}, length "
              f"{m['length_early']:.1f} -> {m['length_late']:.1f}, truncated {m['truncated']:.1%}, clipped "
              f"{m['clipped']:.1%}, {m['step_s']:.0f} s/step" + (f"; minus {args.reference}: {diffs}" if diffs else ""))
    if args.plot:
        plot(rows, args.methods, args.plot)
    print("wrote", write_result(args.name, {"note": args.note, "config": args.config, "workers": args.workers,
                                            "set": args.set, "variants": variants,
                                            "wall_s": round(time.time() - started), "runs": rows,
                                            "methods": methods}))


def spread(values: list[float]) -> dict:
    """Mean of paired differences, 2 standard errors of it, and the lab's verdict (`verdict`: beyond or within);
    n = 1 has no spread."""
    n = len(values)
    if n < 2:
        return {"n": n, "mean": values[0] if values else math.nan, "two_se": math.nan, "verdict": "one seed"}
    mean, two_se, said = verdict(values)  # the regimes lab's rule (benchmarks/lab_paired.py)
    return {"n": n, "mean": mean, "two_se": two_se, "verdict": said}


def plot(rows: list[dict], methods: list[str], path: str) -> None:
    """Completion length over the steps (mean over seeds, the seeds' range shaded) and greedy / sampled gains."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for method in methods:
        curves = [r["lengths"] for r in rows if r["method"] == method]
        steps = range(1, min(map(len, curves)) + 1)
        by_step = [[c[i] for c in curves] for i in range(len(steps))]
        line = left.plot(steps, [statistics.fmean(v) for v in by_step], label=method)[0]
        left.fill_between(steps, [min(v) for v in by_step], [max(v) for v in by_step], alpha=0.15,
                          color=line.get_color())
    left.set(xlabel="RL step", ylabel="mean completion length (tokens)", title="answer length (seeds' range shaded)")
    left.legend(fontsize=8)
    for k, key in enumerate(("greedy", "sampled")):
        gains = [[100 * (r[key][1] - r[key][0]) for r in rows if r["method"] == m] for m in methods]
        x = [i + (k - 0.5) * 0.35 for i in range(len(methods))]
        right.bar(x, [statistics.fmean(g) for g in gains], width=0.35, label=key, alpha=0.7)
        for xi, g in zip(x, gains, strict=True):
            right.scatter([xi] * len(g), g, color="black", s=8, zorder=3)
    right.axhline(0, color="grey", lw=0.5)
    right.set_xticks(range(len(methods)), methods, rotation=20, fontsize=8)
    right.set(ylabel="held-out accuracy gain (points)", title="before -> after (dots: seeds)")
    right.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
