"""Step time as completion length doubles (128 -> 1024) and as group size doubles (4 -> 32).

    python benchmarks/scaling.py                  # both sweeps, 3 RL steps per point (first untimed)
    python benchmarks/scaling.py --sweep length --steps 4

Model: the tiny-dense preset (random init, max_position_embeddings raised to 2048), saved once
with its generation config's stop token set to an id outside the vocabulary, so no completion
stops early and every one runs to `max_completion_length`: lengths are fixed by the sweep, not by
what a random model happens to sample. (Rewards are meaningless here; only time is measured.) The
trainer samples with its default backend (gspo's own loop, gspo/rollout/decode.py).

Per point: median over the timed steps of time/rollout_s (generation + rewards + pi_old
log-probs), generation alone, and time/train_s (M = 4 optimizer steps), from the trainer's own
clocks; the growth factor between consecutive points is printed next to each.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median, table, write_result  # noqa: E402


def forced_length_model(work_dir: Path) -> str:
    """The tiny-dense preset whose stop token is never sampled (an id outside the vocabulary), saved."""
    path = work_dir / "tiny_dense_no_stop"
    if (path / "config.json").is_file():
        return str(path)
    from gspo.models import load_model

    model, tokenizer = load_model("tiny-dense", seed=0, overrides={"max_position_embeddings": 2048})
    model.generation_config.eos_token_id = model.config.vocab_size + 1000  # never sampled: no early stop
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def run_point(model_dir: str, B: int, G: int, T: int, M: int, steps: int, skip_first: int, out_dir: Path) -> dict:
    import gspo.tracking as tracking
    import gspo.trainer as trainer
    from gspo.config import TrainConfig, make_config

    cfg = make_config(TrainConfig, dict(
        model=model_dir, task="add3", seed=0, max_steps=steps, per_device_batch_size=B, num_generations=G,
        num_minibatches=M, max_completion_length=T, learning_rate=1e-5, eval_num_prompts=1, eval_k=1,
        log_samples_steps=0, progress=False, overwrite_output_dir=True, device="cpu", output_dir=str(out_dir)))
    records, gen_s = {}, []
    from gspo.rollout import Sampler  # the trainer's rollout sampler (evaluation samples elsewhere)

    original_log, original_generate = tracking.MetricsLogger.log, Sampler.sample

    def log(self, step, metrics):
        records[step] = dict(metrics)
        return original_log(self, step, metrics)

    def generate(*a, **k):
        t0 = time.perf_counter()
        out = original_generate(*a, **k)
        gen_s.append(time.perf_counter() - t0)
        return out

    tracking.MetricsLogger.log, Sampler.sample = log, generate
    try:
        trainer.train(cfg)
    finally:
        tracking.MetricsLogger.log, Sampler.sample = original_log, original_generate
    timed = range(skip_first + 1, steps + 1)
    lens = [records[s]["completion/mean_len"] for s in timed]
    if min(lens) < T:
        raise RuntimeError(f"completions stopped early (mean length {min(lens)} < {T}): EOS was not masked")
    generate_s = median(gen_s[s - 1] for s in timed)
    rollout_s = median(records[s]["time/rollout_s"] for s in timed)
    train_s = median(records[s]["time/train_s"] for s in timed)
    step_s = median(records[s]["time/rollout_s"] + records[s]["time/train_s"] for s in timed)
    return {"B": B, "G": G, "T": T, "M": M, "tokens": B * G * T, "generate_s": generate_s,
            "pi_old_s": rollout_s - generate_s, "train_s": train_s, "step_s": step_s,
            "tokens_per_s": B * G * T / step_s, "timed_steps": len(lens)}


def print_sweep(name: str, key: str, points: list[dict]) -> None:
    rows = []
    for i, p in enumerate(points):
        prev = points[i - 1] if i else None

        def grow(k, p=p, prev=prev):
            return f" (x{p[k] / prev[k]:.2f})" if prev else ""

        rows.append([p[key], p["tokens"], f"{p['generate_s']:.2f}{grow('generate_s')}",
                     f"{p['pi_old_s']:.2f}{grow('pi_old_s')}", f"{p['train_s']:.2f}{grow('train_s')}",
                     f"{p['step_s']:.2f}{grow('step_s')}", f"{p['tokens_per_s']:.0f}"])
    print(f"\n{name}")
    print(table([key, "completion tokens", "generate s", "pi_old s", "train s", "step s", "tokens/s"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", nargs="+", default=["length", "group"], choices=["length", "group"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--B", type=int, default=4, help="prompts per rollout")
    parser.add_argument("--G", type=int, default=8, help="group size of the length sweep")
    parser.add_argument("--T", type=int, default=128, help="completion length of the group sweep")
    parser.add_argument("--M", type=int, default=4, help="optimizer steps per rollout")
    parser.add_argument("--steps", type=int, default=3, help="RL steps per point")
    parser.add_argument("--skip-first", type=int, default=1)
    parser.add_argument("--work-dir", default="runs/bench/scaling")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    work = Path(args.work_dir)
    model_dir = forced_length_model(work)
    print(f"model {model_dir}; B={args.B}, M={args.M}, {args.steps} steps per point (first {args.skip_first} "
          f"untimed); {machine()['cores']} CPU cores", flush=True)
    results = {}
    if "length" in args.sweep:
        results["length"] = []
        for T in args.lengths:
            p = run_point(model_dir, args.B, args.G, T, args.M, args.steps, args.skip_first, work / f"T{T}")
            results["length"].append(p)
            print(f"  T={T}: {p['step_s']:.2f} s/step", flush=True)
        print_sweep(f"completion length (B={args.B}, G={args.G})", "T", results["length"])
    if "group" in args.sweep:
        results["group"] = []
        for G in args.groups:
            p = run_point(model_dir, args.B, G, args.T, args.M, args.steps, args.skip_first, work / f"G{G}")
            results["group"].append(p)
            print(f"  G={G}: {p['step_s']:.2f} s/step", flush=True)
        print_sweep(f"group size (B={args.B}, T={args.T})", "G", results["group"])
    path = write_result("scaling", {"settings": vars(args), "results": results}, args.out)
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
