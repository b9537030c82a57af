"""The real-model demo over seeds, objectives and full fine-tuning vs LoRA: held-out accuracy before and
after, time and peak memory, each run `gspo demo --model smollm2 ...` in a fresh process, one at a time.

    python benchmarks/real_demo.py --seeds 0 1 2 --objectives gspo grpo --modes full lora
    python benchmarks/real_demo.py --objectives gspo gspo_token grpo grpo+token_tis --modes full --name real_part3

An objective `grpo+token_tis` is GRPO with `--rollout-correction token_tis`.

Writes benchmarks/results/real_demo.json (or `--name`.json: every run's summary.json, its training's
precursors of instability, and the machine) and prints markdown tables: greedy accuracy and sampled
mean@4 on the ~100 held-out problems, before -> after, with the mean gain per objective and mode; and per
run the precursors over its RL steps: clipped fraction (low + high), ratio std, gradient norm (mean,
max) and policy entropy (first step -> last). A finished run (its summary.json) is not rerun.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, write_result  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--objectives", nargs="+", default=["gspo", "grpo"])
    p.add_argument("--modes", nargs="+", default=["full", "lora"], choices=("full", "lora"))
    p.add_argument("--out", default=str(REPO / "runs" / "bench" / "real_demo"))
    p.add_argument("--note", default="", help="the conditions (threads, runs side by side, load), kept in the result")
    p.add_argument("--name", default="real_demo", help="the result's name: benchmarks/results/<name>.json")
    p.add_argument("--existing", action="store_true", help="only the runs already finished (run nothing)")
    args = p.parse_args()
    runs = []
    for mode in args.modes:
        for objective in args.objectives:
            for seed in args.seeds:
                folder = Path(args.out) / f"{objective}-{mode}-seed{seed}"
                if not (folder / "summary.json").exists():
                    if args.existing:
                        continue
                    name, _, correction = objective.partition("+")
                    cmd = [sys.executable, "-m", "gspo", "demo", "--model", "smollm2", "--objective", name,
                           "--seed", str(seed), "--output-dir", str(folder)]
                    cmd += ["--lora"] if mode == "lora" else []
                    cmd += ["--rollout-correction", correction] if correction else []
                    print(" ".join(cmd[1:]), flush=True)
                    subprocess.run(cmd, check=True, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
                runs.append({"mode": mode, **json.loads((folder / "summary.json").read_text()), "method": objective,
                             "precursors": precursors(folder / "rl" / "metrics.jsonl")})
    print("\n| objective | mode | seed | greedy before -> after | sampled mean@4 before -> after | time | peak |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        b, a = r["before"], r["after"]
        print(f"| {r['method']} | {r['mode']} | {r['seed']} | {b['eval/accuracy']:.0%} -> {a['eval/accuracy']:.0%} "
              f"| {b['eval/mean_at_k']:.1%} -> {a['eval/mean_at_k']:.1%} | {r['seconds']:.0f} s "
              f"| {r['peak_rss_gib']:.1f} GiB |")
    print("\n| objective | mode | seed | clipped | ratio std | grad norm mean (max) | entropy first -> last "
          "| mismatch/kl (ess) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        q = r["precursors"]
        print(f"| {r['method']} | {r['mode']} | {r['seed']} | {q['clipped']:.1%} | {q['ratio_std']:.3f} "
              f"| {q['grad_norm_mean']:.2f} ({q['grad_norm_max']:.2f}) | {q['entropy_first']:.3f} -> "
              f"{q['entropy_last']:.3f} | " + ("–" if q["mismatch_kl"] is None else
                                              f"{q['mismatch_kl']:.1e} ({q['mismatch_ess']:.3f})") + " |")
    means = {}
    for mode in args.modes:
        for objective in args.objectives:
            mine = [r for r in runs if r["mode"] == mode and r["method"] == objective]
            if not mine:
                continue
            gains = [r["after"]["eval/accuracy"] - r["before"]["eval/accuracy"] for r in mine]
            sampled = [r["after"]["eval/mean_at_k"] - r["before"]["eval/mean_at_k"] for r in mine]
            means[f"{objective}-{mode}"] = {"greedy_gain_mean": statistics.fmean(gains), "greedy_gains": gains,
                                            "sampled_gain_mean": statistics.fmean(sampled)}
            print(f"{objective} {mode}: greedy gain {statistics.fmean(gains):+.1%} (per seed "
                  f"{', '.join(f'{g:+.0%}' for g in gains)}), sampled mean@4 gain {statistics.fmean(sampled):+.1%}")
    print("wrote", write_result(args.name, {"note": args.note, "runs": runs, "gains": means}))


def precursors(metrics: Path) -> dict:
    """Means over a run's RL steps of what precedes instability: clipped fraction, ratio std, gradient norm
    (and its max), the policy entropy at its first and last step, and the sampler mismatch where logged."""
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "grad/norm" in r]
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in rows)  # noqa: E731
    logged = all("mismatch/kl" in r for r in rows)
    return {"clipped": mean("clip/low_frac") + mean("clip/high_frac"), "ratio_std": mean("ratio/std"),
            "grad_norm_mean": mean("grad/norm"), "grad_norm_max": max(r["grad/norm"] for r in rows),
            "entropy_first": rows[0]["entropy"], "entropy_last": rows[-1]["entropy"],
            "mismatch_kl": mean("mismatch/kl") if logged else None,
            "mismatch_ess": mean("mismatch/ess") if logged else None}


if __name__ == "__main__":
    main()
