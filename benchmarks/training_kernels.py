"""Two levers for the training forward that docs/benchmarks.md section 9 measured and did not take: the eager
attention kernel instead of sdpa, and `torch.compile(dynamic=True)` of the backbone (its compile time too).

    python benchmarks/training_kernels.py --model runs/bench/vs_trl/cold_start/model --threads 1

One packed training minibatch as the demo's (`completion_logprobs(..., packed=True)`, forward + backward of
the summed log-probs): `--rows` sequences, left-padded prompts of 6-10 tokens and completions of 10-`--T`
tokens, fresh random ids and lengths per repeat (seeded). Each figure is the median over `--repeats` after
3 warm-up minibatches; compile time is the first 3 compiled minibatches (compilation and its recompiles),
with an empty inductor cache (a fresh TORCHINDUCTOR_CACHE_DIR): what a run pays the first time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median, table, write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-dense", help="a preset or a saved model (the demo's cold start)")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--T", type=int, default=45)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")  # cold: nothing compiled before
    import torch

    from gspo.algo.logprobs import completion_logprobs
    from gspo.models import load_model

    torch.set_num_threads(args.threads)
    rng = torch.Generator().manual_seed(0)
    P, T = 10, args.T

    def minibatch():
        ids = torch.randint(3, 60, (args.rows, P + T), generator=rng)  # (N, P+T)
        prompt = torch.randint(6, P + 1, (args.rows, 1), generator=rng)  # (N, 1)
        completion = torch.randint(10, T + 1, (args.rows, 1), generator=rng)  # (N, 1)
        pos = torch.arange(P + T)  # (P+T,)
        mask = ((pos >= P - prompt) & (pos < P + completion)).long()  # (N, P+T)
        return ids * mask, mask

    def update(model) -> float:
        ids, mask = minibatch()
        started = time.perf_counter()
        logp, _ = completion_logprobs(model, ids, mask, T, packed=True)  # (N, T)
        logp.sum().backward()
        return time.perf_counter() - started

    def timed(model) -> float:
        for _ in range(3):
            update(model)
        return median([update(model) for _ in range(args.repeats)])

    results = {}
    for kernel in ("sdpa", "eager"):
        model, _ = load_model(args.model, seed=0, attn_implementation=kernel)
        results[f"{kernel}_s"] = timed(model.train())
    model, _ = load_model(args.model, seed=0, attn_implementation="sdpa")
    model.train().model.compile(dynamic=True)
    started = time.perf_counter()
    for _ in range(3):
        update(model)
    results["compile_s"] = time.perf_counter() - started
    results["compiled_s"] = median([update(model) for _ in range(args.repeats)])
    results["compiled_speedup"] = results["sdpa_s"] / results["compiled_s"]

    print(table(["sdpa s", "eager s", "compile s", "compiled s", "sdpa / compiled"],
                [[results["sdpa_s"], results["eager_s"], results["compile_s"], results["compiled_s"],
                  results["compiled_speedup"]]]))
    path = write_result("training_kernels", {"settings": vars(args), "results": results}, args.out)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
