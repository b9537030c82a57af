"""AdamW's moments in float32 against bfloat16 (`adam_state_dtype`): peak memory and learning on the real model.

    python benchmarks/adam_states.py --threads 1 --seeds 3 --parallel 2

gspo on `benchmarks/vs_trl.py --model smollm2`'s run (SmolLM2-135M-Instruct, full fine-tuning, the real-model
demo's a+b task and reward, 8 prompts x 4, T 32, 4 optimizer steps per rollout, lr 2e-5, float32 weights under
bf16 autocast where native, 10 RL steps, 50 held-out prompts), once per seed with each `adam_state_dtype`, each
run a fresh process (vs_trl.py's gspo worker). Reports each run's peak resident memory (getrusage), reward and
held-out greedy accuracy and mean@k. `--parallel 2` runs the two settings of a seed at once on two cores: the
memory and the learning do not depend on it, the seconds per step do (they are reported, and marked).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median, table, worker_result, write_result  # noqa: E402

HERE = Path(__file__).resolve().parent
DTYPES = ("float32", "bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parallel", type=int, default=1, choices=[1, 2], help="runs at once (2: one per core)")
    parser.add_argument("--work-dir", default="runs/bench/adam_states")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/adam_states.json)")
    args = parser.parse_args()
    import vs_trl
    from gspo.apps.demo_real import resolve_precision, write_data

    work = Path(args.work_dir).resolve()
    model_dir, about = vs_trl.smollm2()
    train_file, test_file = write_data(work / "demo_real_data")
    preset = vs_trl.PRESETS["smollm2"]
    load_before = machine()["load_average"]

    def one(seed: int, dtype: str) -> dict:
        spec = dict(model_dir=model_dir, seed=seed, steps=args.steps, B=preset["B"], G=preset["G"], M=preset["M"],
                    T=preset["T"], lr=preset["lr"], eval_prompts=preset["eval_prompts"], eval_k=preset["eval_k"],
                    threads=args.threads, bf16=resolve_precision(preset["precision"]) == "bf16",
                    data={"task": None, "dataset": str(train_file), "eval_dataset": str(test_file),
                          "reward_funcs": ["last_number"]},
                    output_dir=str(work / f"{dtype}_seed{seed}"), overrides={"adam_state_dtype": dtype})
        run = worker_result([sys.executable, str(HERE / "vs_trl.py"), "--worker", "gspo", "--spec", json.dumps(spec)],
                            f"{dtype} seed {seed}", dict(os.environ))
        return {"seed": seed, "adam_state_dtype": dtype, "summary": vs_trl.summarise(run, 1), "eval": run["eval"]}

    runs = []
    with ThreadPoolExecutor(args.parallel) as pool:
        for seed in range(args.seeds):
            for result in pool.map(one, [seed] * len(DTYPES), DTYPES):
                runs.append(result)
                s = result["summary"]
                print(f"seed {seed} {result['adam_state_dtype']:8s}: peak {s['peak_rss_gib']:.2f} GiB, reward "
                      f"{s['reward_first']:.3f} -> {s['reward_last5']:.3f}, held-out greedy {s['eval_accuracy']:.2f}, "
                      f"mean@k {s['eval_mean_at_k']:.3f}, {s['s_per_step']:.1f} s/step", flush=True)
    rows = []
    for dtype in DTYPES:
        mine = [r["summary"] for r in runs if r["adam_state_dtype"] == dtype]
        rows.append([dtype, median(s["peak_rss_gib"] for s in mine),
                     ", ".join(f"{s['reward_last5']:.3f}" for s in mine),
                     ", ".join(f"{s['eval_accuracy']:.2f}" for s in mine),
                     ", ".join(f"{s['eval_mean_at_k']:.3f}" for s in mine), median(s["s_per_step"] for s in mine)])
    print()
    print(table(["adam_state_dtype", "peak GiB (median)", "reward, last 5 steps", "held-out greedy",
                 "held-out mean@k", "s/step" + (" (2 at once)" if args.parallel == 2 else "")], rows))
    print(f"load before {load_before}, after {machine()['load_average']}")
    path = write_result("adam_states", {"model": about, "seeds": args.seeds, "steps": args.steps,
                                        "threads": args.threads, "parallel": args.parallel, "runs": runs,
                                        "load_before": load_before}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
