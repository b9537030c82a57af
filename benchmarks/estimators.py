"""PPO (GAE critic) vs GRPO vs GSPO vs RLOO on the demo task, from the same cold start, over seeds.

    python benchmarks/estimators.py                          # 3 seeds x 4 methods: about 20-25 min on 2 idle cores
    python benchmarks/estimators.py --smoke --methods gspo   # the whole script end to end in about a minute

1. Cold start, once per seed s: gspo's SFT at the demo's settings (`gspo.apps.demo.DEMO_SFT`, seed s),
   cached under <work-dir>/coldstart-s{s}/ and reused while its marker file names the same settings.
2. RL from that model, one run per method, each in a fresh subprocess with --threads torch threads:
   the demo's RL settings (`gspo.apps.demo.DEMO_RL`: 60 steps, B = 16 prompts x G = 8 completions,
   4 minibatches, lr 1e-4, warmup 8, evaluation every 20 steps on 200 held-out prompts, k = 4)
   plus the method's overrides in METHODS. Within a seed the methods run one after another, the
   order rotated by one per seed, so a change of machine load hits every method alike.
3. Measured per run from its metrics.jsonl: held-out sampled mean@4 and greedy accuracy at every
   evaluation (step 0 is the cold start), the cumulative training wall time at each evaluation
   (time/rollout_s + time/train_s of the steps so far: evaluation time left out), optimizer steps
   (RL step x minibatches), the median time per step, the run's total wall time, the child's peak
   RSS, and the load average before the run.

Prints markdown tables (per method: mean +- std over seeds; per seed); writes
benchmarks/results/estimators.json and estimators.png (mean@4 against optimizer steps and
against wall seconds). --smoke: 2 RL steps, 8 evaluation prompts, 20 SFT steps, one seed; writes
estimators_smoke.json / .png from runs under runs/bench/estimators-smoke.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, median, table, write_result

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a hub

# method -> TrainConfig overrides on top of gspo.apps.demo.DEMO_RL: the one place these settings live
METHODS = {
    "gspo": {"objective": "gspo"},  # the demo's default (clip 3e-4 / 4e-4)
    "grpo": {"objective": "grpo", "clip_low": 0.2, "clip_high": 0.27},  # as configs/demo_grpo.yaml
    "rloo": {"objective": "grpo", "clip_low": 0.2, "clip_high": 0.27, "advantage_estimator": "rloo"},
    "ppo": {"objective": "grpo", "clip_low": 0.2, "clip_high": 0.2, "advantage_estimator": "gae",
            "gae_gamma": 1.0, "gae_lambda": 0.95, "value_clip": 0.2, "vf_coef": 1.0,
            "critic_learning_rate": None, "whiten_advantages": True},  # critic lr None: learning_rate
}
SMOKE_RL = {"max_steps": 2, "eval_num_prompts": 8, "eval_steps": 1}
SMOKE_SFT = {"max_steps": 20}

# One RL run in a fresh interpreter (argv: torch threads, TrainConfig values as JSON). It reports
# its own peak RSS: RUSAGE_CHILDREN in the parent holds the largest child so far, not the last one.
RUNNER = """
import json, resource, sys
import torch
torch.set_num_threads(int(sys.argv[1]))
from gspo.config import TrainConfig, make_config
from gspo.trainer import train
summary = train(make_config(TrainConfig, json.loads(sys.argv[2])))
print("RESULT " + json.dumps({"seconds": summary["seconds"],
                              "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def cold_start(work: Path, seed: int, overrides: dict) -> dict:
    """gspo's demo SFT with this seed, saved under work/coldstart-s{seed}/; reused while the settings match."""
    from gspo.apps.demo import DEMO_SFT
    from gspo.config import SFTConfig, make_config
    from gspo.sft import sft

    out = work / f"coldstart-s{seed}"
    marker = out / "coldstart.json"  # written last: present only once the model is complete
    settings = {**DEMO_SFT, **overrides, "seed": seed}
    if marker.is_file() and json.loads(marker.read_text())["settings"] == settings:
        return json.loads(marker.read_text())
    marker.unlink(missing_ok=True)
    summary = sft(make_config(SFTConfig, {**settings, "output_dir": str(out), "overwrite_output_dir": True,
                                          "progress": False}))
    info = {"settings": settings, "model_dir": summary["model_dir"], "sft_steps": summary["steps"],
            "greedy_accuracy": summary["eval/accuracy"], "seconds": summary["seconds"]}
    marker.write_text(json.dumps(info, indent=2) + "\n")
    return info


def measures(records: list[dict], num_minibatches: int) -> dict:
    """Per-step times, the evaluation curve and totals of one run, from its metrics.jsonl rows."""
    steps, curve, wall = [], [], 0.0
    for r in records:
        if r["step"] > 0:  # step 0 holds only the cold start's evaluation
            step_s = r["time/rollout_s"] + r["time/train_s"]
            wall += step_s
            steps.append({"step": r["step"], "step_s": step_s, "rollout_s": r["time/rollout_s"],
                          "train_s": r["time/train_s"], "reward": r["reward/mean"]})
        if "eval/mean_at_k" in r:
            curve.append({"step": r["step"], "optimizer_steps": r["step"] * num_minibatches, "wall_s": wall,
                          "mean_at_k": r["eval/mean_at_k"], "accuracy": r["eval/accuracy"],
                          "pass_at_k": r["eval/pass_at_k"]})
    first, last = curve[0], curve[-1]
    return {"steps": steps, "curve": curve, "start_mean_at_k": first["mean_at_k"], "final_mean_at_k": last["mean_at_k"],
            "gain_mean_at_k": last["mean_at_k"] - first["mean_at_k"], "start_accuracy": first["accuracy"],
            "final_accuracy": last["accuracy"], "optimizer_steps": last["optimizer_steps"],
            "median_step_s": median(s["step_s"] for s in steps), "rl_s": wall}


def rl_run(values: dict, threads: int) -> dict:
    """One RL run in its own subprocess; its measures, wall times, peak RSS and the load before it."""
    from gspo.tracking import read_jsonl

    load = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(threads), json.dumps(values)], cwd=REPO,
                          capture_output=True, text=True, check=False)  # a failure is reported below
    process_s = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"run {values['output_dir']} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    child = json.loads(lines[-1][len("RESULT "):])
    run = measures(read_jsonl(Path(values["output_dir"]) / "metrics.jsonl"), values["num_minibatches"])
    return {**run, "run_s": child["seconds"], "process_s": process_s, "peak_rss_mib": child["max_rss_kib"] / 1024,
            "load_before": load}


def mean_std(values: list[float], digits: int = 3) -> str:
    """'mean +- sample std' over seeds; the mean alone for one seed."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def plot(runs: list[dict], methods: list[str], k: int, path: Path) -> None:
    """Held-out mean@k against optimizer steps (left) and cumulative training seconds (right).

    Thin lines: one per seed; thick: the mean over seeds (on the right at the seeds' mean time).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)  # no pyplot: the Agg canvas attaches itself to the figure
    axes = fig.subplots(1, 2, sharey=True)
    for colour, method in enumerate(methods):
        mine = [r for r in runs if r["method"] == method]
        for ax, x in zip(axes, ("optimizer_steps", "wall_s")):
            for r in mine:
                ax.plot([p[x] for p in r["curve"]], [p["mean_at_k"] for p in r["curve"]], color=f"C{colour}",
                        lw=0.8, alpha=0.35)
            points = list(zip(*(r["curve"] for r in mine)))  # per evaluation step: every seed's point
            ax.plot([statistics.fmean(p[x] for p in ps) for ps in points],
                    [statistics.fmean(p["mean_at_k"] for p in ps) for ps in points], color=f"C{colour}", lw=2,
                    marker="o", ms=3, label=method)
    axes[0].set(xlabel="optimizer steps", ylabel=f"held-out mean@{k} (T = 1)")
    axes[1].set(xlabel="cumulative training wall seconds (evaluation excluded)")
    axes[0].legend(title=f"{len(runs) // len(methods)} seed(s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.savefig(path, format="png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="seeds; each gets its own cold start and one RL run per method (default 0 1 2)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
                        help=f"methods to run, a subset of {' '.join(METHODS)} (default all; settings in METHODS)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (and OMP_NUM_THREADS) of the SFT and every RL run (default 1)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny settings to check the script end to end: 2 RL steps, eval every step on 8 "
                             "prompts, 20 SFT steps, the first seed only; writes estimators_smoke.json/.png")
    parser.add_argument("--work-dir", default=None,
                        help="cold starts and run folders (default runs/bench/estimators, with --smoke "
                             "runs/bench/estimators-smoke)")
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/estimators[_smoke].json); the plot goes "
                             "next to it as .png")
    args = parser.parse_args()

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch loads; the children inherit it
    import torch

    from gspo.apps.demo import DEMO_RL

    torch.set_num_threads(args.threads)
    name = "estimators_smoke" if args.smoke else "estimators"
    seeds = args.seeds[:1] if args.smoke else args.seeds
    rl = {**DEMO_RL, **(SMOKE_RL if args.smoke else {})}
    sft_overrides = SMOKE_SFT if args.smoke else {}
    work = Path(args.work_dir or f"runs/bench/{name.replace('_', '-')}").resolve()
    work.mkdir(parents=True, exist_ok=True)

    cold, runs = {}, []
    for i, seed in enumerate(seeds):
        cold[seed] = cold_start(work, seed, sft_overrides)
        print(f"seed {seed} cold start: {cold[seed]['sft_steps']} SFT steps, greedy accuracy "
              f"{cold[seed]['greedy_accuracy']:.1%} ({cold[seed]['model_dir']})", flush=True)
        order = args.methods[i % len(args.methods):] + args.methods[:i % len(args.methods)]
        for method in order:
            values = {**rl, **METHODS[method], "seed": seed, "model": cold[seed]["model_dir"],
                      "output_dir": str(work / f"{method}-s{seed}"), "overwrite_output_dir": True, "progress": False}
            run = {"method": method, "seed": seed, **rl_run(values, args.threads)}
            runs.append(run)
            print(f"  {method:5s} mean@{rl['eval_k']} {run['start_mean_at_k']:.3f} -> {run['final_mean_at_k']:.3f}  "
                  f"greedy {run['start_accuracy']:.3f} -> {run['final_accuracy']:.3f}  "
                  f"{run['median_step_s']:.2f} s/step  RL {run['rl_s']:.0f} s  {run['peak_rss_mib']:.0f} MiB  "
                  f"(load before {run['load_before'][0]})", flush=True)

    k = rl["eval_k"]
    by = {m: [r for r in runs if r["method"] == m] for m in args.methods}
    summary = {m: {key: statistics.fmean(r[key] for r in rs) for key in
                   ("final_mean_at_k", "final_accuracy", "gain_mean_at_k", "median_step_s", "rl_s", "peak_rss_mib")}
               for m, rs in by.items()}
    print(f"\n{len(seeds)} seed(s), {rl['max_steps']} RL steps of B={rl['per_device_batch_size']} x "
          f"G={rl['num_generations']}, {rl['num_minibatches']} minibatches, {rl['eval_num_prompts']} held-out "
          f"prompts; {args.threads} thread(s); mean ± std over seeds\n")
    print(table(["method", f"final mean@{k}", "final greedy acc.", f"mean@{k} gain", "median s/step", "RL s",
                 "peak MiB"],
                [[m, mean_std([r["final_mean_at_k"] for r in rs]), mean_std([r["final_accuracy"] for r in rs]),
                  mean_std([r["gain_mean_at_k"] for r in rs]), mean_std([r["median_step_s"] for r in rs], 2),
                  mean_std([r["rl_s"] for r in rs], 0), mean_std([r["peak_rss_mib"] for r in rs], 0)]
                 for m, rs in by.items()]))
    eval_steps = [p["step"] for p in runs[0]["curve"]]
    print()
    print(table(["method", "seed", *(f"mean@{k} @{s}" for s in eval_steps), "final greedy acc.", "median s/step",
                 "RL s", "peak MiB", "load before"],
                [[r["method"], r["seed"], *(p["mean_at_k"] for p in r["curve"]), r["final_accuracy"],
                  r["median_step_s"], r["rl_s"], r["peak_rss_mib"], r["load_before"][0]]
                 for rs in by.values() for r in rs]))

    path = write_result(name, {
        "settings": {"seeds": seeds, "methods": args.methods, "threads": args.threads, "smoke": args.smoke,
                     "rl": rl, "method_overrides": {m: METHODS[m] for m in args.methods},
                     "sft_overrides": sft_overrides, "work_dir": str(work)},
        "cold_start": cold, "summary": summary, "runs": runs,
    }, args.out)
    png = path.with_suffix(".png")
    plot(runs, args.methods, k, png)
    print(f"\nwritten: {path}, {png}")


if __name__ == "__main__":
    main()
