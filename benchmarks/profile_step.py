"""Profile gspo RL steps: cProfile (Python call tree) and torch.profiler (operators), top entries printed.

    python benchmarks/profile_step.py                              # demo settings on the tiny-dense preset
    python benchmarks/profile_step.py --model runs/bench/vs_trl/cold_start/model --steps 6

cProfile's call tree is printed three ways: top entries by cumulative time, every gspo/ function,
and top entries by own time; then torch.profiler's operator table.

Steps 2..S are profiled: both profilers start once step 1 has been logged and stop when the final
evaluation begins (evaluation runs before step 1 and after step S only: eval_steps is 0).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-dense")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--B", type=int, default=16)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--M", type=int, default=4)
    parser.add_argument("--T", type=int, default=48)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--work-dir", default="runs/bench/profile")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    if args.threads:
        torch.set_num_threads(args.threads)

    import gspo.tracking as tracking
    from gspo.config import TrainConfig, make_config
    from gspo.trainer import train

    cfg = make_config(TrainConfig, dict(
        model=args.model, task="add3", seed=0, max_steps=args.steps, per_device_batch_size=args.B,
        num_generations=args.G, num_minibatches=args.M, max_completion_length=args.T, learning_rate=1e-4,
        eval_num_prompts=4, eval_k=1, log_samples_steps=0, progress=False, overwrite_output_dir=True,
        device="cpu", output_dir=args.work_dir))
    py = cProfile.Profile()
    torch_prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False)
    original_log = tracking.MetricsLogger.log

    def log(self, step, metrics):  # start both profilers after step 1, stop them before the final eval
        original_log(self, step, metrics)
        if step == 1:
            torch_prof.__enter__()
            py.enable()

    tracking.MetricsLogger.log = log
    import gspo.data.source as source  # the prompt source evaluates (before step 1 and after the last)

    original_evaluate, calls = source.evaluate, []

    def evaluate(*a, **k):  # called before step 1 and after the last step: stop the profilers at the second call
        calls.append(1)
        if len(calls) == 2:
            py.disable()
            torch_prof.__exit__(None, None, None)
        return original_evaluate(*a, **k)

    source.evaluate = evaluate
    train(cfg)
    texts = {}
    views = (("cprofile_cumulative", "cumulative", args.top), ("cprofile_gspo", "cumulative", "gspo/"),
             ("cprofile_self", "tottime", args.top))
    for name, key, restriction in views:
        s = io.StringIO()
        pstats.Stats(py, stream=s).sort_stats(key).print_stats(restriction)
        texts[name] = s.getvalue()
        print(texts[name])
    texts["torch_ops"] = torch_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)
    print(texts["torch_ops"])
    write_result("profile_step", {"settings": vars(args), **texts, "cores": machine()["cores"]}, args.out)


if __name__ == "__main__":
    main()
