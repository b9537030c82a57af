"""What one decode step of the real model costs, by batch size, and the token draw beside it.

    python benchmarks/decode_step.py --threads 1

SmolLM2-135M-Instruct (make demo-real), float32 weights, a `prefix_cache` holding 60 prompt positions: the
median of `--reps` single-token forwards at each batch size, and of a softmax + `torch.multinomial` draw over
the full 49,152-token vocabulary for all 32 rows (what the sampling loop draws each step, finished rows
included) and for one. The weights' bytes over the machine's read bandwidth are the forward's floor.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 16, 8, 4, 2, 1])
    args = parser.parse_args()
    import torch

    from gspo.models import load_model
    from gspo.rollout.decode import _num_layers, prefix_cache

    torch.set_num_threads(args.threads)
    model, _ = load_model("smollm2")
    model.eval()
    V, prompt = model.config.vocab_size, 60

    def forward_s(n: int) -> float:
        cache = prefix_cache(_num_layers(model), prompt + args.reps)
        with torch.no_grad():
            model(input_ids=torch.randint(0, 1000, (n, prompt)), use_cache=True, cache=cache, logits_to_keep=1)
            token, seconds = torch.randint(0, 1000, (n, 1)), []
            for i in range(args.reps):
                t0 = time.perf_counter()
                model(input_ids=token, position_ids=torch.full((n, 1), prompt + i), use_cache=True, cache=cache,
                      logits_to_keep=1)
                seconds.append(time.perf_counter() - t0)
        return statistics.median(seconds)

    def draw_s(n: int) -> float:
        seconds = []
        for _ in range(args.reps):
            logits = torch.randn(n, V)  # (n, V)
            t0 = time.perf_counter()
            torch.multinomial(torch.softmax(logits, -1), 1)
            seconds.append(time.perf_counter() - t0)
        return statistics.median(seconds)

    forwards = {n: forward_s(n) for n in args.rows}
    draws = {n: draw_s(n) for n in (32, 1)}
    weight_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    print(table(["rows", "decode forward ms"], [[n, f"{s * 1e3:.1f}"] for n, s in forwards.items()]))
    print(f"draw over 32 rows {draws[32] * 1e3:.1f} ms, over 1 row {draws[1] * 1e3:.1f} ms; weights {weight_gb:.3f} GB")
    print(write_result("decode_step", {"args": vars(args), "forward_s": forwards, "draw_s": draws,
                                       "weight_gb": weight_gb}))


if __name__ == "__main__":
    main()
