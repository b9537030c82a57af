"""Asynchronous rollouts (issue 34): gspo's synchronous loop against a rollout worker sampling K steps ahead.

    python benchmarks/async_rollouts.py --threads 1                        # demo settings, CPU, 3 seeds
    python benchmarks/async_rollouts.py --threads 1 --seeded --baseline 2699776 --out ...  # vs an older tree
    python benchmarks/async_rollouts.py --device cuda --model 50m --T 512 --B 4 --G 4 --M 2 --steps 8 --reps 2

Sides, alternating in fresh subprocesses (repetition i of every side uses seed i): `sync` (rollout_workers 0,
the loop as it always was), then one `async_k` per K in --staleness (rollout_workers 1, max_staleness K; the
worker takes the trainer's thread count and device: on one GPU both processes share it), and with
--mu-as-pi-old one `async_k_mu` per K as well (use_sampler_logprobs: mu serves as pi_old, no pi_old
forward). The model, prompts, reward and GSPO settings are vs_trl.py's (`rl_config`, `cold_start`,
`random_50m`), and so is the timing: one RL step's wall clock, from the end of the previous step to
the end of this one, the first `--skip-first` steps left out. With --baseline REV every async side runs
once more as `async_k_base`: the same spec in a git worktree of REV, with its own benchmark script and
package (issue 51: workers as gspo serve endpoints against the spawned workers before them).
For TRL on the same settings use `vs_trl.py --async K`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import baseline_tree, machine, median, served_as_worker, table, worker_result, write_result  # noqa: E402
from vs_trl import cold_start, random_50m, run_gspo, smollm2, summarise  # noqa: E402


def worker(spec: dict) -> dict:
    """One gspo run (vs_trl.run_gspo) at the spec's torch thread count."""
    if spec.get("threads"):
        import torch

        torch.set_num_threads(spec["threads"])
    return run_gspo(spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["demo", "50m", "smollm2"], default="demo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--staleness", default="1",
                        help="comma-separated K of the async sides (0: a worker, no overlap)")
    parser.add_argument("--mu-as-pi-old", action="store_true",
                        help="also run each async side with use_sampler_logprobs (the other ratio under staleness)")
    parser.add_argument("--seeded", action="store_true",
                        help="seeded sampling (per-row generators): every side draws the same tokens from the same "
                             "weights, so a pair does the same work where the weights do not move")
    parser.add_argument("--backend", default="auto", help="generation_backend of every side: auto, gspo, hf, vllm")
    parser.add_argument("--baseline", metavar="REV", help="also run each async side on this git revision")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--B", type=int, default=16)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--M", type=int, default=4)
    parser.add_argument("--T", type=int, default=48)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--eval-k", type=int, default=4)
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--skip-first", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads of the trainer (and of its worker)")
    parser.add_argument("--work-dir", default="runs/bench/async_rollouts")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/async_rollouts.json)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if served_as_worker(args.worker, worker):  # one run in a fresh process
        return

    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.model == "demo":
        model_dir, info = cold_start(work, args.sft_steps)
    elif args.model == "smollm2":
        model_dir, info = smollm2()
    else:
        model_dir, info = random_50m(work)
    sides = {"sync": (None, False), **{f"async_{k}": (int(k), False) for k in args.staleness.split(",")}}
    if args.mu_as_pi_old:
        sides.update({f"async_{k}_mu": (int(k), True) for k in args.staleness.split(",")})
    script = {side: Path(__file__).resolve() for side in sides}
    env = {side: None for side in sides}
    if args.baseline:
        base = baseline_tree(args.baseline, work)
        for side, k_mu in list(sides.items())[1:]:
            sides[f"{side}_base"], script[f"{side}_base"] = k_mu, base / "benchmarks" / "async_rollouts.py"
            path = str(base) + os.pathsep + os.environ.get("PYTHONPATH", "")
            env[f"{side}_base"] = {**os.environ, "PYTHONPATH": path}
    runs = []
    for rep in range(args.reps):
        for side, (k, mu) in sides.items():
            spec = dict(model_dir=model_dir, seed=rep, steps=args.steps, B=args.B, G=args.G, M=args.M, T=args.T,
                        lr=args.lr, eval_prompts=args.eval_prompts, eval_k=args.eval_k, threads=args.threads,
                        device=args.device, max_staleness=k, use_sampler_logprobs=mu, seeded=args.seeded,
                        backend=args.backend,
                        output_dir=str(work / f"{side}_seed{rep}"))
            load, t0 = os.getloadavg()[0], time.perf_counter()
            run = worker_result([sys.executable, str(script[side]), "--worker", json.dumps(spec)], f"{side} run {rep}",
                                env[side])
            run.update(side=side, seed=rep, process_s=time.perf_counter() - t0, load_before=load,
                       summary=summarise(run, args.skip_first))
            run["summary"]["clip_frac"] = sum(s["clip_frac"] for s in run["steps"]) / len(run["steps"])
            runs.append(run)
            s = run["summary"]
            print(f"  rep {rep} {side:8s} {s['s_per_step']:.3f} s/step  {s['tokens_per_s']:.0f} tok/s  "
                  f"reward {s['reward_first']:.3f} -> {s['reward_last5']:.3f}  eval acc {s['eval_accuracy']:.3f}  "
                  f"(load {load:.2f})", flush=True)
    by = {side: [r for r in runs if r["side"] == side] for side in sides}
    keys = ["s_per_step", "tokens_per_s", "generate_s", "train_s", "mean_len", "eval_accuracy", "eval_mean_at_k",
            "clip_frac"]
    med = {side: {k: median(r["summary"][k] for r in by[side]) for k in keys} for side in sides}
    ratio = {}
    for side in list(sides)[1:]:
        pairs = [s["summary"]["s_per_step"] / a["summary"]["s_per_step"] for a, s in zip(by[side], by["sync"])]
        ratio[side] = {"steps_per_s_over_sync": median(pairs), "pairs": pairs}
        if side.endswith("_base"):  # this tree's side over the baseline's, pair by pair
            mine = by[side[:-len("_base")]]
            pairs = [b["summary"]["s_per_step"] / m["summary"]["s_per_step"] for m, b in zip(mine, by[side])]
            ratio[side]["this_steps_per_s_over_baseline"] = {"median": median(pairs), "pairs": pairs}
            print(f"{side[:-len('_base')]}: this tree's steps/s over {args.baseline}'s: {median(pairs):.3f} "
                  f"(pairs {', '.join(f'{p:.3f}' for p in pairs)})")
    print(f"\n{args.reps} runs per side, {args.steps} RL steps each (first {args.skip_first} untimed), B={args.B} "
          f"G={args.G} M={args.M} T={args.T}, device {args.device}, threads {args.threads or 'default'}; "
          f"{machine()['cores']} CPU cores")
    print(table(["side", "steps/s", "tokens/s", "wait for rollout s", "train s", "clipped frac.",
                 "held-out greedy acc.", f"held-out mean@{args.eval_k}", "steps/s over sync (pairs)"],
                [[side, 1 / med[side]["s_per_step"], med[side]["tokens_per_s"], med[side]["generate_s"],
                  med[side]["train_s"], med[side]["clip_frac"], med[side]["eval_accuracy"], med[side]["eval_mean_at_k"],
                  "" if side == "sync" else f"{ratio[side]['steps_per_s_over_sync']:.2f}x ("
                  + ", ".join(f"{p:.2f}" for p in ratio[side]["pairs"]) + ")"] for side in sides]))
    print()
    print(table(["side", "seed", "held-out greedy acc.", f"held-out mean@{args.eval_k}"],
                [[side, r["seed"], r["summary"]["eval_accuracy"], r["summary"]["eval_mean_at_k"]]
                 for side in sides for r in by[side]]))
    path = write_result("async_rollouts", {
        "settings": {k: v for k, v in vars(args).items() if k != "worker"}, "model_info": info, "median": med,
        "ratio": ratio, "runs": [{k: r[k] for k in ("side", "seed", "summary", "steps", "eval", "process_s",
                                                    "load_before", "torch_threads")} for r in runs]}, args.out)
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
