"""Hardware utilisation of an RL step: model FLOPs per phase over its time, against measured peak matmul FLOP/s.

    python benchmarks/utilisation.py                    # the demo model (0.6M) and a ~50M Qwen3
    python benchmarks/utilisation.py --models demo --steps 4

Peak: the median FLOP/s of a loop of large fp32 matmuls (`--matmul-n`, 2 n^3 FLOPs each),
measured in the same process right before and right after the training runs (the machine is
shared, so both are reported and the larger one is the reference).

Model FLOPs of a sequence of l real tokens (padding is not useful work and is not counted),
forward: 2 * P_mm * l + layers * 4 * heads * head_dim * l (l + 1) / 2, where P_mm counts
the parameters of every matmul (decoder linear layers and the output head; the input
embedding is a lookup). Per RL step: generation = one forward of every final sequence (the KV
cache makes each position attend to its prefix once), pi_old = one forward of the sequences
outside the first minibatch ((M-1)/M of a forward: the first minibatch's pi_old is its own
training forward), training = M minibatches of forward + backward = 3 forwards of every
sequence (`num_epochs` 1). The output
head recomputation of the checkpointed log-prob chunks is hardware work, not model work, and is
not counted (MFU convention, PaLM appendix B).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median, table, write_result  # noqa: E402
from gspo.apps.bench import forward_flops, matmul_params, peak_matmul_rates  # noqa: E402

# ~50M parameters: 16 layers of hidden 512 (8 query / 4 kv heads of 64, MLP 1536) on the character vocabulary
LARGE = dict(hidden_size=512, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             intermediate_size=1536, max_position_embeddings=1024)
MODELS = {
    # the demo's RL settings (gspo/apps/demo.py DEMO_RL) on the tiny-dense preset
    "demo": dict(overrides=None, B=16, G=8, M=4, T=48),
    "50m": dict(overrides=LARGE, B=4, G=4, M=4, T=64),
}


def peak_matmul_flops(n: int, seconds: float, windows: int = 5) -> dict:
    """Median FLOP/s of `windows` timing windows of back-to-back (n, n) @ (n, n) fp32 matmuls."""
    rates = peak_matmul_rates(n, seconds, windows=windows)
    return {"median": median(rates), "max": max(rates), "windows": rates, "n": n}


def run_model(name: str, steps: int, skip_first: int, work_dir: Path) -> dict:
    """A few RL steps of `name`; per-step phase times and model FLOPs."""
    import gspo.trainer as trainer
    from gspo.config import TrainConfig, make_config
    from gspo.models import count_parameters

    m = MODELS[name]
    cfg = make_config(TrainConfig, dict(
        model="tiny-dense", model_overrides=m["overrides"], task="add3", seed=0, max_steps=steps,
        per_device_batch_size=m["B"], num_generations=m["G"], num_minibatches=m["M"], max_completion_length=m["T"],
        learning_rate=1e-4, eval_num_prompts=4, eval_k=1, log_samples_steps=0, progress=False,
        overwrite_output_dir=True, device="cpu", output_dir=str(work_dir / name)))
    captured = {}
    from gspo.rollout import Sampler  # the trainer's rollout sampler (evaluation samples elsewhere)

    original = Sampler.sample

    def generate(self, prompts, *args, **kwargs):
        model = self.model
        t0 = time.perf_counter()
        rollout = original(self, prompts, *args, **kwargs)
        P = rollout.input_ids.shape[1] - rollout.completion_len
        lengths = (rollout.attention_mask[:, :P].sum(1) + rollout.completion_mask.sum(1)).tolist()  # (N,) real tokens
        captured.setdefault("gen", []).append((time.perf_counter() - t0, lengths))
        captured["model"] = model
        return rollout

    Sampler.sample = generate
    try:
        import gspo.tracking as tracking

        records, original_log = {}, tracking.MetricsLogger.log

        def log(self, step, metrics):
            records[step] = dict(metrics)
            return original_log(self, step, metrics)

        tracking.MetricsLogger.log = log
        trainer.train(cfg)
    finally:
        Sampler.sample = original
        tracking.MetricsLogger.log = original_log
    model = captured["model"]
    c = model.config
    p_mm = matmul_params(model)
    per_step = []
    for step in range(1, steps + 1):
        gen_s, lengths = captured["gen"][step - 1]
        fwd = forward_flops(lengths, p_mm, c.num_hidden_layers, c.num_attention_heads, c.head_dim)
        rec = records[step]
        per_step.append({"step": step, "generate_s": gen_s, "pi_old_s": rec["time/rollout_s"] - gen_s,
                         "train_s": rec["time/train_s"], "forward_flops": fwd, "tokens": sum(lengths),
                         "mean_completion_len": rec["completion/mean_len"]})
    return {"name": name, "params": count_parameters(model), "matmul_params": p_mm,
            "settings": {k: m[k] for k in ("B", "G", "M", "T")}, "overrides": m["overrides"], "steps": per_step,
            "timed_steps": [s for s in per_step if s["step"] > skip_first]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["demo", "50m"], choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=4, help="RL steps per model (the first is warm-up)")
    parser.add_argument("--skip-first", type=int, default=1)
    parser.add_argument("--matmul-n", type=int, default=2048)
    parser.add_argument("--matmul-seconds", type=float, default=10.0)
    parser.add_argument("--work-dir", default="runs/bench/utilisation")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    peak_before = peak_matmul_flops(args.matmul_n, args.matmul_seconds)
    print(f"peak fp32 matmul ({args.matmul_n}^3): {peak_before['median'] / 1e9:.1f} GFLOP/s "
          f"(median of {len(peak_before['windows'])} windows); {machine()['cores']} CPU cores", flush=True)
    runs = [run_model(name, args.steps, args.skip_first, Path(args.work_dir)) for name in args.models]
    peak_after = peak_matmul_flops(args.matmul_n, args.matmul_seconds)
    peak = max(peak_before["median"], peak_after["median"])
    print(f"peak after the runs: {peak_after['median'] / 1e9:.1f} GFLOP/s; reference {peak / 1e9:.1f} GFLOP/s\n")
    rows = []
    for run in runs:
        phases, M = {}, run["settings"]["M"]
        old = (M - 1) / M  # forwards of pi_old per sequence (the first minibatch reuses its training forward)
        for phase, factor, key in (("generation", 1, "generate_s"), ("pi_old forward", old, "pi_old_s"),
                                   ("training (fwd+bwd)", 3, "train_s")):
            rates = [factor * s["forward_flops"] / s[key] for s in run["timed_steps"]]
            phases[phase] = {"flops_per_step": median(factor * s["forward_flops"] for s in run["timed_steps"]),
                             "seconds": median(s[key] for s in run["timed_steps"]),
                             "flops_per_s": median(rates), "mfu": median(rates) / peak}
        step_rates = [(4 + old) * s["forward_flops"] / (s["generate_s"] + s["pi_old_s"] + s["train_s"])
                      for s in run["timed_steps"]]
        phases["whole RL step"] = {"flops_per_step": median((4 + old) * s["forward_flops"] for s in run["timed_steps"]),
                                   "seconds": median(s["generate_s"] + s["pi_old_s"] + s["train_s"]
                                                     for s in run["timed_steps"]),
                                   "flops_per_s": median(step_rates), "mfu": median(step_rates) / peak}
        run["phases"] = phases
        for phase, v in phases.items():
            rows.append([f"{run['name']} ({run['params'] / 1e6:.1f}M)", phase, f"{v['flops_per_step'] / 1e9:.2f}",
                         v["seconds"], f"{v['flops_per_s'] / 1e9:.2f}", f"{v['mfu']:.1%}"])
    print(table(["model", "phase", "model GFLOP/step", "s/step", "GFLOP/s", "of peak"], rows))
    path = write_result("utilisation", {"peak_matmul": {"before": peak_before, "after": peak_after, "reference": peak},
                                        "models": runs}, args.out)
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
