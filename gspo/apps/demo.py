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


def run_demo(output_dir: str = "runs/demo", seed: int = 0, objective: str = "gspo") -> dict:
    """SFT -> RL -> evaluation -> plots; prints and returns a summary."""
    from gspo.report import plot_run_or_skip
    from gspo.sft import sft
    from gspo.trainer import train

    started = time.perf_counter()
    out = Path(output_dir)
    print(f"[1/3] cold-start SFT of a tiny model on 3-digit addition (until greedy accuracy >= "
          f"{DEMO_SFT['target_accuracy']:.0%})")
    sft_cfg = make_config(SFTConfig, {**DEMO_SFT, "seed": seed, "output_dir": str(out / "sft"),
                                      "overwrite_output_dir": True})  # the demo always starts afresh
    sft_summary = sft(sft_cfg)
    print(f"[2/3] {objective.upper()} RL from the cold-start model")
    rl_cfg = make_config(TrainConfig, {**DEMO_RL, "objective": objective, "seed": seed,
                                       "model": sft_summary["model_dir"], "output_dir": str(out / "rl"),
                                       "overwrite_output_dir": True})
    rl = train(rl_cfg)
    print("[3/3] plots")
    plots = plot_run_or_skip(out / "rl")
    before, after = rl["evals"][0], rl["evals"][max(rl["evals"])]
    k = rl_cfg.eval_k
    summary = {
        "seed": seed,
        "objective": objective,
        "sft_steps": sft_summary["steps"],
        "before_rl": before,
        "after_rl": after,
        "seconds": round(time.perf_counter() - started, 1),
        "sft_seconds": round(sft_summary["seconds"], 1),
        "rl_seconds": round(rl["seconds"], 1),
        "plots": str(out / "rl" / "plots"),
        "model": str(out / "rl" / "model"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print()
    print(f"held-out 3-digit addition ({rl_cfg.eval_num_prompts} problems never trained on)")
    print(f"  {'':24}{'cold start':>12}{'after ' + objective.upper():>14}")
    print(f"  {'greedy accuracy':24}{before['eval/accuracy']:>12.1%}{after['eval/accuracy']:>14.1%}")
    print(f"  {f'sampled mean@{k} (T=1)':24}{before['eval/mean_at_k']:>12.1%}{after['eval/mean_at_k']:>14.1%}")
    print(f"  {f'pass@{k}':24}{before['eval/pass_at_k']:>12.1%}{after['eval/pass_at_k']:>14.1%}")
    print(f"time: {summary['seconds']:.0f} s (SFT {summary['sft_seconds']:.0f} s, RL {summary['rl_seconds']:.0f} s)")
    print(f"plots: {summary['plots']} ({len(plots)} PNGs)   model: {summary['model']}   "
          f"summary: {out / 'summary.json'}")
    return summary
