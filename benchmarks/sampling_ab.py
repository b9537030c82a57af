"""Sampling time before/after a library change: `gspo.rollout.generate` of this tree against the same
call as of git revision REV, in alternating fresh processes on the same machine state.

    python benchmarks/sampling_ab.py --baseline a4a988c --threads 1 --rounds 4 --repeats 4
    python benchmarks/sampling_ab.py --baseline a4a988c --threads 1 --case 50M-long --rounds 2 --repeats 2
    python benchmarks/sampling_ab.py --baseline 1300c9f --threads 1 --case smollm2 --rounds 2 --repeats 2
    python benchmarks/sampling_ab.py --baseline 1fbb88f --threads 1 --case smollm2-128 --rounds 2 --repeats 2

Each process builds the case's model from config (random init, seed 0; nothing downloaded; `smollm2`: the
packaged SmolLM2-135M-Instruct of `make demo-real`, under bf16 autocast where the CPU has it natively), samples
once as warm-up, then `--repeats` rollouts of B prompts x G completions of up to T tokens, each row
seeded (seed = repeat * 1000 + row), so both sides sample the same tokens (checked). Rounds alternate
the order of the sides (this, REV; REV, this; ...). The figure is the ratio of summed seconds, per
round and over all rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODEL_50M, REPO, baseline_tree, machine, served_as_worker, worker_result, write_result  # noqa: E402

# name: (model_overrides of tiny-dense, prompts B, completions per prompt G, max new tokens T)
CASES = {
    "demo": ({}, 16, 8, 48),  # the demo's RL rollout
    "50M": (MODEL_50M, 16, 8, 48),
    "50M-long": (MODEL_50M, 2, 4, 512),  # random init: completions stop anywhere up to T
    # SmolLM2-135M-Instruct (make demo-real) on the real-model demo's a+b chat prompts, bf16 autocast where native
    "smollm2": ("smollm2", 8, 4, 32),
    "smollm2-128": ("smollm2", 8, 4, 128),  # the same up to 128 tokens: a row that runs on keeps the batch going
}


def sample(spec: dict) -> dict:
    """One side: seconds and sampled tokens of each rollout, and a digest of the tokens."""
    import torch

    import gspo
    from gspo.models import load_model
    from gspo.rollout import generate
    from gspo.tasks import get_task

    torch.set_num_threads(spec["threads"])
    overrides, B, G, T = CASES[spec["case"]]
    autocast = False
    if overrides == "smollm2":  # the packaged real model, its demo's chat prompts
        from gspo.apps.demo_real import native_bf16, sum_rows
        from gspo.data.rows import render_prompts

        model, tokenizer = load_model("smollm2")
        prompts = [r["prompt"] for r in render_prompts(sum_rows("train")[:B], tokenizer)]  # as the trainer renders
        autocast = native_bf16()
    else:
        model, tokenizer = load_model("tiny-dense", seed=0, overrides=overrides)
        prompts = [r["prompt"] for r in get_task("add3").dataset("train", B, 0)]
    model.eval()

    def rollout(repeat: int):
        seeds = [repeat * 1000 + row for row in range(B * G)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return generate(model, tokenizer, prompts, G, max_new_tokens=T, max_prompt_length=128, row_seeds=seeds,
                            with_logprobs=True)

    rollout(spec["repeats"])  # warm-up
    seconds, tokens, digest = [], [], []
    for repeat in range(spec["repeats"]):
        t0 = time.perf_counter()
        out = rollout(repeat)
        seconds.append(time.perf_counter() - t0)
        tokens.append(int(out.completion_mask.sum()))
        digest.append(int((out.input_ids * torch.arange(out.input_ids.numel()).view_as(out.input_ids)).sum()))
    return {"seconds": seconds, "tokens": tokens, "digest": digest, "gspo_file": gspo.__file__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", metavar="REV", help="git revision to compare this tree against")
    parser.add_argument("--case", choices=list(CASES), default="demo")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4, help="process pairs (each side once per round)")
    parser.add_argument("--repeats", type=int, default=4, help="timed rollouts per process")
    parser.add_argument("--work-dir", default="runs/bench/sampling_ab", help="holds the baseline's worktree")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/sampling_ab_<case>.json)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if served_as_worker(args.worker, sample):
        return
    if args.baseline is None:
        sys.exit("--baseline REV is required: the revision to compare this tree against")
    for name, value in (("--rounds", args.rounds), ("--repeats", args.repeats), ("--threads", args.threads)):
        if value < 1:
            sys.exit(f"{name} must be >= 1; got {value}")
    base = baseline_tree(args.baseline, Path(args.work_dir))
    env = {"this": dict(os.environ), "baseline": dict(os.environ)}
    env["baseline"]["PYTHONPATH"] = str(base) + os.pathsep + env["baseline"].get("PYTHONPATH", "")
    spec = json.dumps({"case": args.case, "threads": args.threads, "repeats": args.repeats})
    load_before = machine()["load_average"]
    rounds = []
    for r in range(args.rounds):
        order = ("this", "baseline") if r % 2 == 0 else ("baseline", "this")
        result = {side: worker_result([sys.executable, __file__, "--worker", spec], f"{side} side", env[side])
                  for side in order}
        for side, tree in (("this", REPO), ("baseline", base)):  # an installed gspo elsewhere would win quietly
            if Path(result[side]["gspo_file"]).resolve().parents[1] != tree.resolve():
                sys.exit(f"the {side} side imported gspo from {result[side]['gspo_file']}, not from {tree}: run with "
                         f"PYTHONPATH={REPO}")
        if result["this"]["digest"] != result["baseline"]["digest"]:
            sys.exit(f"round {r}: the two sides sampled different tokens; the timing would compare unlike work")
        ratio = sum(result["baseline"]["seconds"]) / sum(result["this"]["seconds"])
        rounds.append({**result, "baseline_over_this": ratio})
        print(f"round {r} ({order[0]} first): this {sum(result['this']['seconds']):.2f} s, "
              f"{args.baseline} {sum(result['baseline']['seconds']):.2f} s, {args.baseline}/this {ratio:.3f}")
    total = {side: sum(sum(x[side]["seconds"]) for x in rounds) for side in ("this", "baseline")}
    overall = total["baseline"] / total["this"]
    _, B, G, T = CASES[args.case]
    print(f"{args.case} (B {B}, G {G}, T {T}): {args.baseline}/this {overall:.3f} over {args.rounds} rounds "
          f"(rounds {', '.join(format(x['baseline_over_this'], '.3f') for x in rounds)}); load before {load_before}, "
          f"after {machine()['load_average']}")
    path = write_result(f"sampling_ab_{args.case}", {
        "baseline": args.baseline, "case": args.case, "B": B, "G": G, "T": T, "threads": args.threads,
        "rounds": rounds, "baseline_over_this": overall, "load_before": load_before}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
