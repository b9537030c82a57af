"""Does a static KV cache with a `torch.compile`d decode step pay for its compile time within a run?

    python benchmarks/compile_decode.py --threads 1 --T 32 128 --calls 6

Sides, each in a fresh process (so the compile is paid where a run would pay it), on the packaged
SmolLM2-135M-Instruct (`make demo-real`) with its weights in bfloat16 (the sampler copy a static cache
would compile against), the real-model demo's 8 chat prompts x 4 completions:
  gspo      gspo's own decode loop (`gspo.rollout.decode.sample`: a preallocated cache whose filled
            prefix grows, eager forwards)
  static    HF `generate` with `cache_implementation="static"` and compilation off: the static cache alone
  compiled  the same with HF's `CompileConfig(mode="default")` told to compile on a CPU too
            (`_compile_all_devices`): the decode forward compiled by torch.compile (inductor), fixed shapes
Every call samples exactly T new tokens (end-of-sequence ignored), so the sides do the same number of
forwards. The first call of a process includes the compile; `compile_s` is it minus the median of the
later calls. `payback_calls` = compile_s / (gspo's median - compiled's median): the rollouts after which the
compile has paid for itself (none where the compiled step is not faster). A shape the process has not seen
(another batch size, prompt length or T) compiles again, which the figure does not count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median, served_as_worker, table, worker_result, write_result  # noqa: E402

B, G = 8, 4
SIDES = ("gspo", "static", "compiled")


def run_side(spec: dict) -> dict:
    """One side at one T: seconds of each call (the first includes any compile)."""
    import torch
    from transformers import CompileConfig

    from gspo.apps.demo_real import sum_rows
    from gspo.data.rows import render_prompts
    from gspo.models import load_model
    from gspo.rollout import decode

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    if spec["model"] == "smollm2":
        model, tokenizer = load_model("smollm2")
        prompts = [r["prompt"] for r in render_prompts(sum_rows("train")[:B], tokenizer)]
    else:  # a check of the script itself on the tiny preset (seconds, not a figure)
        model, tokenizer = load_model("tiny-dense", seed=0)
        prompts = [f"{i}+{i + 1}=" for i in range(B)]
    model = model.to(torch.bfloat16).eval()
    enc = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
    ids = enc["input_ids"].repeat_interleave(G, 0)  # (N, P)
    mask = enc["attention_mask"].repeat_interleave(G, 0)  # (N, P)
    T, side = spec["T"], spec["side"]
    never = model.config.vocab_size  # no token has this id: every row runs to T
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def call():
        if side == "gspo":
            out, _ = decode.sample(model, ids, mask, max_new_tokens=T, eos_token_ids=[never], pad_token_id=pad,
                                   with_logprobs=True)
            return out.shape[1]
        compile_config = None
        if side == "compiled":
            compile_config = CompileConfig(mode="default")  # its default, reduce-overhead, means CUDA graphs
            compile_config._compile_all_devices = True  # HF compiles on a CPU only when told to (a class flag)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=T, min_new_tokens=T,
                             cache_implementation="static", compile_config=compile_config,
                             disable_compile=side != "compiled", pad_token_id=pad, output_scores=False)
        return out.shape[1] - ids.shape[1]

    seconds, produced = [], []
    with torch.no_grad():
        for _ in range(spec["calls"]):
            t0 = time.perf_counter()
            produced.append(call())
            seconds.append(time.perf_counter() - t0)
    if any(n != T for n in produced):
        raise SystemExit(f"{side}: produced {produced} tokens, not {T} each")
    return {"seconds": seconds, "prompt_len": ids.shape[1], "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[32, 128], help="new tokens per call")
    parser.add_argument("--calls", type=int, default=6, help="rollouts per process (the first includes a compile)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", choices=["smollm2", "tiny-dense"], default="smollm2",
                        help="tiny-dense: a quick check of the script, not a figure")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES),
                        help="which sides to run (gspo and compiled are needed for the pay-back)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/compile_decode.json)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if served_as_worker(args.worker, run_side):
        return
    if args.calls < 2:
        sys.exit(f"--calls must be >= 2 (the first includes the compile); got {args.calls}")
    load_before = machine()["load_average"]
    results, rows = {}, []
    for T in args.T:
        res = {}
        for side in args.sides:
            spec = json.dumps({"side": side, "T": T, "calls": args.calls, "threads": args.threads,
                               "model": args.model})
            res[side] = worker_result([sys.executable, __file__, "--worker", spec], f"{side} at T={T}",
                                      dict(os.environ))
            s = res[side]["seconds"]
            res[side]["median_s"] = median(s[1:])
            res[side]["first_s"] = s[0]
            print(f"T={T} {side}: first {s[0]:.2f} s, then {', '.join(f'{x:.2f}' for x in s[1:])}", flush=True)
        results[T] = res
        if "compiled" not in res or "gspo" not in res:
            rows.append([T, *(res[s]["median_s"] if s in res else "-" for s in SIDES), "-", "-"])
            continue
        compile_s = res["compiled"]["first_s"] - res["compiled"]["median_s"]
        gain = res["gspo"]["median_s"] - res["compiled"]["median_s"]
        payback = compile_s / gain if gain > 0 else None
        results[T] = {**res, "compile_s": compile_s, "gain_per_call_s": gain, "payback_calls": payback}
        rows.append([T, *(res[s]["median_s"] if s in res else "-" for s in SIDES), compile_s,
                     "never" if payback is None else f"{payback:.0f}"])
    print()
    print(table(["T", "gspo s/rollout", "static s/rollout", "compiled s/rollout", "compile s", "pays back after"],
                rows))
    print(f"{B} prompts x {G}; load before {load_before}, after {machine()['load_average']}")
    path = write_result("compile_decode", {"model": args.model, "B": B, "G": G, "threads": args.threads,
                                           "calls": args.calls, "results": results, "load_before": load_before},
                        args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
