"""Multi-task RL: dynamic task weights against uniform ones, on three built-in tasks of unequal difficulty.

    python benchmarks/multitask.py                       # defaults below; about 10-15 min on 2 CPU cores
    python benchmarks/multitask.py --seeds 0 --steps 10  # a quick look

1. Cold start (once, shared by every run, cached under --work-dir): SFT of the tiny dense model
   on an equal mix of the tasks' worked solutions, for a fixed number of steps, so the tasks end
   at clearly different held-out accuracies (easy, medium, hard).
2. RL (GSPO) from that model with `tasks` set, once with `task_weighting: static` and equal
   weights (uniform) and once with `task_weighting: dynamic`, for each seed; every other setting
   is equal. Held-out greedy accuracy of each task every --eval-steps steps.
3. Reported per mode over the seeds: the first evaluated step at which the mean held-out
   accuracy over the tasks (unweighted) reaches each target (the cold start's mean + each of
   --gains), the mean accuracy after the last step (the fixed budget) and averaged over the
   evaluations after step 0, each task's final accuracy and its mean sampling weight.

Finished runs are reused when rerun with the same settings (a settings file in each run folder),
so the report can be redrawn without training again.

Prints a markdown table; writes benchmarks/results/multitask.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_result  # noqa: E402
from gspo.config import SFTConfig, TrainConfig, make_config  # noqa: E402
from gspo.tracking import read_jsonl  # noqa: E402

MODES = {"uniform": {"task_weighting": "static"}, "dynamic": {"task_weighting": "dynamic"}}


def cold_start(work: Path, tasks: list[str], args) -> tuple[str, dict]:
    """SFT on an equal mix of the tasks (cached); returns the model folder and its per-task accuracy.

    The accuracy is greedy, on the held-out problems of the RL runs with seed 0.
    """
    from gspo.config import EvalSettings, RewardSettings, SamplingSettings, section
    from gspo.data.evaluation import Evaluation, evaluate
    from gspo.models import load_model
    from gspo.sft import sft
    from gspo.tasks import get_task

    model_dir = work / "sft" / "model"
    summary_file = work / "sft_summary.json"
    settings = {"tasks": tasks,
                **{k: getattr(args, k) for k in ("sft_steps", "sft_examples", "max_len", "eval_prompts")}}
    if model_dir.is_dir() and summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        if summary["settings"] == settings:
            return str(model_dir), summary["accuracy"]
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    train = [r for t in tasks for r in get_task(t).dataset("train", args.sft_examples // len(tasks), 0)]
    held = [r for t in tasks for r in get_task(t).dataset("test", 30, 1)]  # SFT's own progress check only
    for name, rows in (("train", train), ("test", held)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_config(SFTConfig, dict(
        model="tiny-dense", dataset=str(data / "train.jsonl"), eval_dataset=str(data / "test.jsonl"),
        task=None, num_examples=len(train), max_steps=args.sft_steps, batch_size=32, learning_rate=2e-3,
        warmup_steps=20, eval_steps=args.sft_steps, eval_num_prompts=len(held), max_completion_length=args.max_len,
        output_dir=str(work / "sft"), overwrite_output_dir=True, progress=False, seed=0, device="cpu"))
    sft(cfg)
    model, tokenizer = load_model(str(model_dir), device="cpu")
    accuracy, plan = {}, Evaluation.of(section(cfg, EvalSettings), section(cfg, RewardSettings),
                                       SamplingSettings(max_completion_length=cfg.max_completion_length), seed=cfg.seed)
    for t in tasks:  # the RL runs' held-out problems (seed 10_000: TrainConfig's default eval split)
        rows = get_task(t).dataset("test", args.eval_prompts, 10_000)
        accuracy[t] = evaluate(model, tokenizer, rows, plan, sampled=False)["eval/accuracy"]
    summary_file.write_text(json.dumps({"settings": settings, "accuracy": accuracy}, indent=1))
    return str(model_dir), accuracy


def rl_run(work: Path, model_dir: str, tasks: list[str], mode: str, seed: int, args) -> tuple[list[dict], float]:
    """One RL run: its metrics lines and seconds. A finished run with the same settings is reused."""
    from gspo.trainer import train

    out = work / f"{mode}-seed{seed}"
    settings = dict(
        model=model_dir, tasks=[{"task": t} for t in tasks], **MODES[mode], task_weight_floor=args.floor,
        task_weight_smoothing=args.smoothing, seed=seed, max_steps=args.steps, per_device_batch_size=16,
        num_generations=8, num_minibatches=4, max_completion_length=args.max_len, learning_rate=1e-4, warmup_steps=8,
        objective="gspo", eval_num_prompts=args.eval_prompts, eval_k=1, eval_steps=args.eval_steps,
        log_samples_steps=0, output_dir=str(out), overwrite_output_dir=True, progress=False, device="cpu")
    done = out / "bench_run.json"
    if done.is_file() and json.loads(done.read_text())["settings"] == settings:
        return read_jsonl(out / "metrics.jsonl"), json.loads(done.read_text())["seconds"]
    t0 = time.perf_counter()
    train(make_config(TrainConfig, settings))
    seconds = round(time.perf_counter() - t0, 1)
    done.write_text(json.dumps({"settings": settings, "seconds": seconds}))
    return read_jsonl(out / "metrics.jsonl"), seconds


def summarise(lines: list[dict], tasks: list[str], targets: list[float]) -> dict:
    evals = [r for r in lines if "eval/accuracy" in r]
    steps = [r for r in lines if f"task/{tasks[0]}/weight" in r]
    return {
        "steps_to_target": [next((r["step"] for r in evals if r["eval/accuracy"] >= t), None) for t in targets],
        "final_mean_accuracy": evals[-1]["eval/accuracy"],
        "mean_accuracy_over_evals": statistics.fmean(r["eval/accuracy"] for r in evals if r["step"] > 0),
        "final_accuracy": {t: evals[-1][f"task/{t}/eval_accuracy"] for t in tasks},
        "mean_weight": {t: statistics.fmean(r[f"task/{t}/weight"] for r in steps) for t in tasks},
        "curve": [[r["step"], r["eval/accuracy"]] for r in evals],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs=3, default=["add2", "add3", "add4"], help="easy, medium, hard")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30, help="RL steps per run (the fixed budget)")
    parser.add_argument("--eval-steps", type=int, default=5)
    parser.add_argument("--eval-prompts", type=int, default=100, help="held-out prompts per task")
    parser.add_argument("--sft-steps", type=int, default=350)
    parser.add_argument("--sft-examples", type=int, default=3000)
    parser.add_argument("--max-len", type=int, default=48, help="max completion tokens")
    parser.add_argument("--floor", type=float, default=0.1, help="dynamic: task_weight_floor")
    parser.add_argument("--smoothing", type=float, default=0.8, help="dynamic: task_weight_smoothing")
    parser.add_argument("--gains", nargs="+", type=float, default=[0.10, 0.20],
                        help="targets: the cold start's mean accuracy plus each gain")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; on a busy 2-core machine 1 ran several times faster than 2")
    parser.add_argument("--work-dir", default="runs/bench_multitask")
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/multitask.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    started = time.perf_counter()
    model_dir, cold = cold_start(work, args.tasks, args)
    cold_mean = statistics.fmean(cold.values())
    targets = [round(cold_mean + g, 4) for g in args.gains]
    print(f"cold start: {', '.join(f'{t} {a:.1%}' for t, a in cold.items())} (mean {cold_mean:.1%}); "
          f"targets {', '.join(f'{t:.1%}' for t in targets)}", flush=True)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for seed in args.seeds:
        for mode in MODES:  # alternate, so a slow spell of the shared machine hits both modes alike
            lines, seconds = rl_run(work, model_dir, args.tasks, mode, seed, args)
            result = summarise(lines, args.tasks, targets)
            runs[mode].append({"seed": seed, "seconds": seconds, **result})
            print(f"{mode:8} seed {seed}: steps to targets {result['steps_to_target']}, final mean accuracy "
                  f"{result['final_mean_accuracy']:.1%} ({seconds:.0f} s)", flush=True)

    def per_seed(values) -> str:
        return " / ".join("-" if v is None else str(v) for v in values)

    def spread(values) -> str:
        return f"{statistics.fmean(values):.1%} ± {statistics.pstdev(values):.1%}"

    rows = []
    for mode, rs in runs.items():
        rows.append([mode, *[per_seed(r["steps_to_target"][i] for r in rs) for i in range(len(targets))],
                     spread([r["final_mean_accuracy"] for r in rs]),
                     spread([r["mean_accuracy_over_evals"] for r in rs]),
                     *[f"{statistics.fmean(r['final_accuracy'][t] for r in rs):.1%}" for t in args.tasks],
                     " / ".join(f"{statistics.fmean(r['mean_weight'][t] for r in rs):.2f}" for t in args.tasks)])
    headers = ["weights", *[f"steps to {t:.1%} (per seed)" for t in targets],
               f"final mean acc. (step {args.steps})", "mean acc. over evals", *[f"{t} final" for t in args.tasks],
               "mean weight " + " / ".join(args.tasks)]
    print()
    print(f"cold start: {' / '.join(f'{t} {cold[t]:.1%}' for t in args.tasks)}; seeds {args.seeds}; "
          f"mean over seeds ± population std")
    print(table(headers, rows))
    path = write_result("multitask", {"settings": vars(args), "cold_start_accuracy": cold, "targets": targets,
                                      "runs": runs,
                                      "rl_seconds": round(sum(r["seconds"] for rs in runs.values() for r in rs), 1),
                                      "seconds": round(time.perf_counter() - started, 1)}, args.out)
    print(f"\n{path}  ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
