"""What LoRA, bf16 autocast and gradient checkpointing cost and save: peak memory and seconds per RL step.

    python benchmarks/finetune_costs.py --threads 1            # ~11 min on 2 cores
    python benchmarks/finetune_costs.py --device cuda --length 1024 --batch 8   # on a GPU

Each variant is one `gspo train` run (the Python API) in a fresh process, on the ~50M dense model
(MODEL_50M) with a length reward: B prompts x 4 completions of up to --length tokens (a random model
rarely stops early, so rows run near full length), 2 minibatches, 3 steps. Measured per run: the peak
memory the run added (CPU: VmHWM growth over the process's RSS before train(), from
/proc/self/status; CUDA: torch.cuda.max_memory_allocated), the trainable parameters, and the
median of steps 2-3 of `time/train_s` (pi_old forwards, updates) and `time/rollout_s` (sampling).
Variants alternate within each repeat; medians over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODEL_50M, machine, median, served_as_worker, status_kib, table, worker_result, write_result

VARIANTS = {
    "full fp32": {},
    "full + gradient checkpointing": {"gradient_checkpointing": True},
    "full + bf16 autocast": {"bf16": True},
    "LoRA r=16": {"lora_r": 16},
    "LoRA r=16 + gradient checkpointing": {"lora_r": 16, "gradient_checkpointing": True},
    "LoRA r=16 + bf16 autocast": {"lora_r": 16, "bf16": True},
    "LoRA r=16 on a bf16 base (dtype: bfloat16)": {"lora_r": 16, "dtype": "bfloat16"},
    "full + KL (frozen reference copy)": {"kl_coef": 0.01},
    "LoRA r=16 + KL (adapters off)": {"lora_r": 16, "kl_coef": 0.01},
}


def length_reward(completions, **kwargs):
    return [len(c) / 100 for c in completions]


def worker(spec: dict) -> dict:
    import torch

    from gspo.config import TrainConfig, make_config
    from gspo.models import load_model
    from gspo.plugs.lora import attach_adapters
    from gspo.tracking import read_jsonl
    from gspo.trainer import train

    torch.set_num_threads(spec["threads"])
    out = Path(spec["output_dir"])
    cfg = make_config(TrainConfig, {
        "model": "tiny-dense", "model_overrides": MODEL_50M, "task": "add3", "reward_funcs": [length_reward],
        "per_device_batch_size": spec["batch"], "num_generations": 4, "num_minibatches": 2,
        "max_completion_length": spec["length"], "max_steps": 3, "learning_rate": 1e-5, "eval_num_prompts": 1,
        "eval_k": 1, "log_samples_steps": 0, "progress": False, "device": spec["device"], "output_dir": str(out),
        **spec["settings"]})
    cuda = cfg.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # the peak RSS restarts from the RSS now
        base = status_kib("VmRSS") * 1024
    train(cfg)
    peak = torch.cuda.max_memory_allocated() if cuda else status_kib("VmHWM") * 1024
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if r["step"] >= 2]
    model = attach_adapters(load_model("tiny-dense", overrides=MODEL_50M)[0], cfg)  # after the peak: what trained
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"peak_growth_mib": (peak - base) / 2**20, "train_s": median([r["time/train_s"] for r in rows]),
            "rollout_s": median([r["time/rollout_s"] for r in rows]),
            "mean_len": median([r["completion/mean_len"] for r in rows]), "trainable": trainable}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--length", type=int, default=128, help="max_completion_length")
    parser.add_argument("--batch", type=int, default=2, help="prompts per step (x 4 completions)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if served_as_worker(args.worker, worker):
        return

    runs = {name: [] for name in args.variants}
    tmp = Path(tempfile.mkdtemp(prefix="finetune_costs_"))
    for rep in range(args.repeats):
        for name in args.variants:
            spec = {"settings": VARIANTS[name], "threads": args.threads, "length": args.length, "batch": args.batch,
                    "device": args.device, "output_dir": str(tmp / f"{len(runs[name])}_{abs(hash(name))}")}
            r = worker_result([sys.executable, __file__, "--worker", json.dumps(spec)], name,
                              env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            runs[name].append(r)
            print(f"  rep {rep} {name:44s} peak +{r['peak_growth_mib']:7.0f} MiB  train {r['train_s']:6.2f} s  "
                  f"rollout {r['rollout_s']:6.2f} s  len {r['mean_len']:.0f}", flush=True)
    full = runs.get("full fp32")
    results = []
    for name, rs in runs.items():
        row = {"variant": name, "settings": VARIANTS[name], "trainable": rs[0]["trainable"],
               **{k: median([r[k] for r in rs]) for k in ("peak_growth_mib", "train_s", "rollout_s", "mean_len")},
               "runs": rs}
        if full:
            row["peak_vs_full"] = row["peak_growth_mib"] / median([r["peak_growth_mib"] for r in full])
            row["train_vs_full"] = row["train_s"] / median([r["train_s"] for r in full])
        results.append(row)
    headers = ["variant", "trainable params", "peak memory added (MiB)", "vs full", "train s/step", "vs full",
               "rollout s/step", "mean length"]
    print(table(headers, [[r["variant"], f"{r['trainable'] / 1e6:.2f}M", r["peak_growth_mib"],
                           r.get("peak_vs_full", float("nan")), r["train_s"], r.get("train_vs_full", float("nan")),
                           r["rollout_s"], r["mean_len"]] for r in results]))
    name = "finetune_costs" if args.device == "cpu" else f"finetune_costs_{args.device.split(':')[0]}"
    path = write_result(name, {"settings": {"model": "50M (MODEL_50M)", "batch": args.batch, "num_generations": 4,
                                            "max_completion_length": args.length, "num_minibatches": 2,
                                            "threads": args.threads, "repeats": args.repeats, "device": args.device},
                               "results": results}, args.out)
    print(f"wrote {path}; machine: {machine()['cpu']} {machine()['cpu_flags']}")


if __name__ == "__main__":
    main()
