"""Rollout generation time by sampler: HF `generate` with its default DynamicCache (grows by
torch.cat), HF `generate` with a StaticCache, and gspo's own loop (gspo/rollout/decode.py: a preallocated
cache exposing only its filled prefix).

    python benchmarks/generation_cache.py --threads 1

Calls `gspo.rollout.generate` as the trainer does (`backend="hf"` / `"gspo"`), on the tiny-dense
preset whose stop token is set to an id outside the vocabulary, so no completion ends early and
every one has exactly T tokens. The HF cache kind is chosen through the model's generation config
(`cache_implementation`). Alternates dynamic, static, gspo, dynamic, ... and reports medians;
checks that gspo's loop and HF generate sample the same tokens for the same seed.
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
    model.generation_config.eos_token_id = model.config.vocab_size + 1000  # never sampled: every completion runs to T
    prompts = [r["prompt"] for r in get_task("add3").dataset("train", args.B, 0)]
    results = []
    for T in args.lengths:
        times = {"dynamic": [], "static": [], "gspo": []}
        for rep in range(args.reps):
            tokens = {}
            for kind in ("dynamic", "static", "gspo"):
                model.generation_config.cache_implementation = "static" if kind == "static" else None
                torch.manual_seed(rep)
                t0 = time.perf_counter()
                rollout = generate(model, tokenizer, prompts, args.G, max_new_tokens=T,
                                   backend="gspo" if kind == "gspo" else "hf")
                times[kind].append(time.perf_counter() - t0)
                assert rollout.completion_len == T and bool(rollout.completion_mask.all())
                tokens[kind] = rollout.input_ids
            assert torch.equal(tokens["gspo"], tokens["dynamic"]), f"T={T} rep {rep}: gspo and HF sampled differently"
        row = {"T": T, **{f"{k}_s": median(v) for k, v in times.items()}, "times": times}
        row["static_speedup"] = row["dynamic_s"] / row["static_s"]
        row["gspo_speedup"] = row["dynamic_s"] / row["gspo_s"]
        results.append(row)
        print(f"  T={T}: dynamic {row['dynamic_s']:.2f} s, static {row['static_s']:.2f} s, gspo {row['gspo_s']:.2f} s",
              flush=True)
    print(f"\n{args.B * args.G} sequences, {args.reps} alternating repetitions, {machine()['cores']} CPU cores, "
          f"torch threads {torch.get_num_threads()}")
    print(table(["T", "HF DynamicCache s", "HF StaticCache s", "gspo loop s", "dynamic / static", "dynamic / gspo"],
                [[r["T"], r["dynamic_s"], r["static_s"], r["gspo_s"], f"{r['static_speedup']:.2f}x",
                  f"{r['gspo_speedup']:.2f}x"] for r in results]))
    path = write_result("generation_cache", {"settings": vars(args), "results": results}, args.out)
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
