"""The built-in demo: a partial cold start by SFT, then GSPO, then held-out evaluation.

Everything is built locally: a 0.6M-parameter Qwen3-style model with random init, a
character tokenizer, and 3-digit addition problems with a worked column-by-column solution.
The cold start stops at a target greedy accuracy on purpose, so the gain after it comes from
the reward, not from more supervised steps.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from gspo.config import SFTConfig, TrainConfig, make_config

# The demo's settings; configs/demo_sft.yaml and configs/demo_gspo.yaml hold the same values. Each evaluation is
# one generate call (eval_batch_size = eval_num_prompts; a tiny model needs no bound on its memory), as when the
# README's results were measured: chunks would draw other (unseeded) samples.
DEMO_SFT = dict(model="tiny-dense", task="add3", num_examples=2000, max_steps=400, batch_size=32, learning_rate=2e-3,
                warmup_steps=20, target_accuracy=0.4, eval_steps=20, eval_num_prompts=100, eval_batch_size=100,
                max_completion_length=48)
DEMO_RL = dict(task="add3", max_steps=60, per_device_batch_size=16, num_generations=8, num_minibatches=4,
               max_completion_length=48, learning_rate=1e-4, warmup_steps=8, objective="gspo",
               eval_num_prompts=200, eval_batch_size=200, eval_k=4, eval_steps=20, log_samples_steps=10)


COLD_START_FILE = "cold_start.json"  # a finished cold start's summary, beside its sft/: what --resume builds on


def saved_cold_start(folder: Path) -> dict | None:
    """The summary a finished cold start left in `folder` (COLD_START_FILE, with its model_dir), or None."""
    path = folder / COLD_START_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def rl_resume(run_dir: Path, resume: str | None) -> str | None:
    """resume_from_checkpoint of a demo's RL run in `run_dir`, the demo resumed with `resume` (latest, latest_valid
    or a checkpoint folder; None: not resumed): latest and latest_valid where the run saved a checkpoint, else
    None (it had not begun: it starts now); a folder as it is."""
    from gspo.checkpoint.files import named_checkpoints

    if resume in ("latest", "latest_valid") and not named_checkpoints(run_dir):
        return None
    return resume


def cold_start(out: Path, seed: int, resume: str | None, overrides: dict | None = None) -> tuple[dict, bool]:
    """[1/3]: the SFT cold start into out/sft, or with `resume` the one a demo there finished; (its summary, whether
    it is the earlier one). `overrides`: values over DEMO_SFT."""
    from gspo.sft import sft

    earlier = saved_cold_start(out) if resume is not None else None
    if earlier is not None:
        print(f"[1/3] cold start: done before ({earlier['steps']} SFT steps, {earlier['model_dir']})")
        return earlier, True
    (out / COLD_START_FILE).unlink(missing_ok=True)  # an earlier demo's: out/sft is about to change
    print(f"[1/3] cold-start SFT of a tiny model on 3-digit addition (until greedy accuracy >= "
          f"{DEMO_SFT['target_accuracy']:.0%})" + (" (none finished before: from the start)" if resume else ""))
    sft_cfg = make_config(SFTConfig, {**DEMO_SFT, **(overrides or {}), "seed": seed, "output_dir": str(out / "sft"),
                                      "overwrite_output_dir": True})  # the demo always starts afresh
    summary = sft(sft_cfg)
    (out / COLD_START_FILE).write_text(json.dumps(summary, indent=2))
    return summary, False


def run_demo(output_dir: str = "runs/demo", seed: int = 0, objective: str = "gspo", resume: str | None = None, *,
             sft_overrides: dict | None = None, rl_overrides: dict | None = None) -> dict:
    """SFT -> RL -> evaluation -> plots; prints and returns a summary.

    `resume` (latest, latest_valid or a checkpoint folder of output_dir/rl; `gspo demo --resume`): continue a demo
    that stopped (SIGINT, SIGTERM): its finished cold start is kept, its RL run continues from the checkpoint (or
    starts, if it had not); the other options must be as they were. `sft_overrides`, `rl_overrides`: values over
    DEMO_SFT and DEMO_RL (a smaller demo).
    """
    from gspo.report import plot_run_or_skip
    from gspo.trainer import train

    started = time.perf_counter()
    out = Path(output_dir)
    sft_summary, kept = cold_start(out, seed, resume, sft_overrides)
    again = rl_resume(out / "rl", resume) if kept else None  # a new cold start: RL from its start too
    print(f"[2/3] {objective.upper()} RL from the cold-start model" + (f" (resumed: {again})" if again else ""))
    rl_cfg = make_config(TrainConfig, {**DEMO_RL, **(rl_overrides or {}), "objective": objective, "seed": seed,
                                       "model": sft_summary["model_dir"], "output_dir": str(out / "rl"),
                                       "overwrite_output_dir": True, "resume_from_checkpoint": again})
    rl = train(rl_cfg)
    print("[3/3] plots")
    plots = plot_run_or_skip(out / "rl")
    summary = {
        "seed": seed,
        "objective": objective,
        "sft_steps": sft_summary["steps"],
        "before_rl": rl["evals"][0],
        "after_rl": rl["evals"][max(rl["evals"])],
        "seconds": round(time.perf_counter() - started, 1),  # this call's (resumed: since the resume)
        "sft_seconds": round(sft_summary["seconds"], 1),
        "rl_seconds": round(rl["seconds"], 1),
        "plots": str(out / "rl" / "plots"),
        "model": str(out / "rl" / "model"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary, rl_cfg.eval_num_prompts, rl_cfg.eval_k, len(plots), out)
    return summary


def print_summary(summary: dict, held_out: int, k: int, plots: int, out: Path) -> None:
    """The demo's table: scores on the `held_out` problems before and after RL (`k` samples each), times, where
    things are (`plots`: how many PNGs)."""
    before, after, objective = summary["before_rl"], summary["after_rl"], summary["objective"]
    print()
    print(f"held-out 3-digit addition ({held_out} problems never trained on)")
    print(f"  {'':24}{'cold start':>12}{'after ' + objective.upper():>14}")
    print(f"  {'greedy accuracy':24}{before['eval/accuracy']:>12.1%}{after['eval/accuracy']:>14.1%}")
    print(f"  {f'sampled mean@{k} (T=1)':24}{before['eval/mean_at_k']:>12.1%}{after['eval/mean_at_k']:>14.1%}")
    print(f"  {f'pass@{k}':24}{before['eval/pass_at_k']:>12.1%}{after['eval/pass_at_k']:>14.1%}")
    print(f"time: {summary['seconds']:.0f} s (SFT {summary['sft_seconds']:.0f} s, RL {summary['rl_seconds']:.0f} s)")
    print(f"plots: {summary['plots']} ({plots} PNGs)   model: {summary['model']}   summary: {out / 'summary.json'}")
