"""Rollout generation time by KV-cache kind: HF's default DynamicCache (grows by torch.cat) vs a StaticCache.

    python benchmarks/generation_cache.py --threads 1

Calls `gspo.rollout.generate` as the trainer does, on the tiny-dense preset with EOS masked
(`min_new_tokens`, see scaling.py) so every completion has exactly T tokens. The cache kind is
chosen through the model's generation config (`cache_implementation`), which HF `generate`
reads; gspo itself is unchanged. Alternates dynamic, static, dynamic, ... and reports medians.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median, table, write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--B", type=int, default=4)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    from gspo.models import load_model
    from gspo.rollout import generate
    from gspo.tasks import get_task

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model("tiny-dense", seed=0, overrides={"max_position_embeddings": 2048})
    model.generation_config.min_new_tokens = 100_000  # EOS never sampled: every completion runs to T
    prompts = [r["prompt"] for r in get_task("add3").dataset("train", args.B, 0)]
    results = []
    for T in args.lengths:
        times = {"dynamic": [], "static": []}
        for rep in range(args.reps):
            for kind in ("dynamic", "static"):
                model.generation_config.cache_implementation = None if kind == "dynamic" else "static"
                torch.manual_seed(rep)
                t0 = time.perf_counter()
                rollout = generate(model, tokenizer, prompts, args.G, max_new_tokens=T)
                times[kind].append(time.perf_counter() - t0)
                assert rollout.completion_len == T and bool(rollout.completion_mask.all())
        row = {"T": T, "dynamic_s": median(times["dynamic"]), "static_s": median(times["static"]), "times": times}
        row["static_speedup"] = row["dynamic_s"] / row["static_s"]
        results.append(row)
        print(f"  T={T}: dynamic {row['dynamic_s']:.2f} s, static {row['static_s']:.2f} s", flush=True)
    print(f"\n{args.B * args.G} sequences, {args.reps} alternating repetitions, {machine()['cores']} CPU cores, "
          f"torch threads {torch.get_num_threads()}")
    print(table(["T", "DynamicCache s", "StaticCache s", "dynamic / static"],
                [[r["T"], r["dynamic_s"], r["static_s"], f"{r['static_speedup']:.2f}x"] for r in results]))
    path = write_result("generation_cache", {"settings": vars(args), "results": results}, args.out)
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
