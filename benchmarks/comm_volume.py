"""What crosses ranks per RL step, counted: every torch.distributed collective a 2-process run makes.

    torchrun --standalone --nproc_per_node 2 benchmarks/comm_volume.py --mode ddp --B 2 --G 4 --T 8
    torchrun --standalone --nproc_per_node 2 benchmarks/comm_volume.py --mode ddp --B 4 --G 4 --T 32

Wraps the collectives the trainer calls (all_reduce, all_gather, all_gather_object, broadcast,
barrier) and counts calls and bytes per step on rank 0, steps 2.. (step 1 and the set-up include the
initial broadcast and evaluation). FSDP2's own parameter all-gathers and reduce-scatters run in
C++ hooks and are not seen here, so `--mode fsdp` counts only gspo's own traffic. Prints one JSON
line per collective kind: calls and bytes per step. docs/distributed.md has the table this checks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="ddp", choices=["ddp", "fsdp"])
    ap.add_argument("--B", type=int, default=2, help="prompts per rank")
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--T", type=int, default=8, help="max completion tokens")
    ap.add_argument("--M", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from gspo.config import TrainConfig, make_config
    from gspo.tracking import MetricsLogger
    from gspo.trainer import train

    calls, sizes, step = Counter(), Counter(), [0]

    def nbytes(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)):
            return sum(nbytes(t) for t in x)
        return len(repr(x))  # objects: a rough size (pickled in fact)

    def counted(name, fn):
        def wrapper(*a, **k):
            if step[0] >= 2:
                calls[name] += 1
                sizes[name] += nbytes(a[0]) if a else 0
            return fn(*a, **k)
        return wrapper

    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier"):
        setattr(dist, name, counted(name, getattr(dist, name)))
    original_log = MetricsLogger.log

    def log(self, s, metrics):  # a step's line is logged at its end: later collectives belong to the next
        step[0] = s + 1
        return original_log(self, s, metrics)

    MetricsLogger.log = log
    out = tempfile.mkdtemp(prefix="gspo-comm-")
    cfg = make_config(TrainConfig, dict(
        model="tiny-dense", task="add3", max_steps=args.steps, per_device_batch_size=args.B, num_generations=args.G,
        num_minibatches=args.M, max_completion_length=args.T, eval_num_prompts=2, eval_k=1, eval_steps=0,
        progress=False, device="cpu", output_dir=out, log_samples_steps=0, save_steps=0, distributed=args.mode,
        reward_funcs=["format"]))
    step[0] = 0
    train(cfg)
    if int(os.environ.get("RANK", 0)) == 0:
        steps = args.steps - 1
        N = args.B * args.G * int(os.environ.get("WORLD_SIZE", 1))
        for name in sorted(calls):
            print(json.dumps({"mode": args.mode, "N": N, "T": args.T, "M": args.M, "collective": name,
                              "calls_per_step": calls[name] / steps, "bytes_per_step": sizes[name] / steps}))


if __name__ == "__main__":
    main()
