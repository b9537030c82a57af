"""Bytes and seconds of one weight push to a rollout worker (issue 51): the four phases over HTTP, the tensors over
the authenticated wire, the probe checked; for the tiny demo model and SmolLM2-135M-Instruct on CPU.

    python benchmarks/weight_sync.py --threads 1                      # tiny-dense and smollm2, 5 pushes each
    python benchmarks/weight_sync.py --models smollm2 --pushes 3 --lora

A worker (`rollout_workers: 1`, a gspo serve endpoint on loopback) is started from the model, then the model's
weights are changed and pushed `--pushes` times; each push's `time/sync_s` (gathering, sending, loading in the
endpoint's model, the probe on both sides) and `async/sync_bytes` are taken from the sampler's own stats, the first
push (every parameter, at start) separately from later ones (what the optimizer changes: all of them, or with
--lora the adapters). The worker's start (a process importing torch, loading its copy) is `start_s`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median, table, write_result  # noqa: E402


def measure(name: str, pushes: int, lora: bool) -> dict:
    import dataclasses

    import torch

    from gspo.config import TrainConfig, make_config
    from gspo.models import load_model
    from gspo.plugs.lora import attach_adapters
    from gspo.rollout.endpoint.rollouts import EndpointSampler
    from gspo.rollout.sampling import sampler_sections

    overrides = {"model_overrides": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                                     "num_attention_heads": 2}} if name == "tiny-dense" else {}
    settings = {"model": name, **overrides, "rollout_workers": 1, "device": "cpu", "progress": False}
    if lora:
        settings.update(lora_r=8, lora_alpha=16.0)
    cfg = make_config(TrainConfig, settings)
    model, tokenizer = load_model(name, overrides=overrides.get("model_overrides"))
    if lora:
        from gspo.config import LoraSettings, section

        model = attach_adapters(model, dataclasses.replace(section(cfg, LoraSettings)))
    t0 = time.perf_counter()
    sampler = EndpointSampler(model, tokenizer, *sampler_sections(cfg), seeded=True)
    start_s = time.perf_counter() - t0
    first = sampler.pushed
    seconds, sent = [], []
    try:
        for _ in range(pushes):
            with torch.no_grad():
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(torch.randn_like(p) * 1e-3)  # an update
            stats = sampler.sync(model)
            seconds.append(stats["time/sync_s"])
            sent.append(stats["async/sync_bytes"])
    finally:
        sampler.close()
    return {"model": name, "lora": lora, "parameters": sum(p.numel() for p in model.parameters()),
            "start_s": start_s, "first_push": first, "push_s": seconds, "push_bytes": sent,
            "push_s_median": median(seconds), "mib_per_s": median(sent) / 2**20 / median(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-dense", "smollm2"])
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--lora", action="store_true", help="LoRA adapters (r 8): later pushes carry them only")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="the result's JSON path (default benchmarks/results/weight_sync.json)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    results = [measure(name, args.pushes, args.lora) for name in args.models]
    rows = [[r["model"] + (" (LoRA)" if r["lora"] else ""), f"{r['parameters'] / 1e6:.2f}M",
             f"{r['first_push']['bytes'] / 2**20:.1f} MiB / {r['first_push']['seconds']:.3f} s",
             f"{median(r['push_bytes']) / 2**20:.2f} MiB", f"{r['push_s_median']:.3f} s ({min(r['push_s']):.3f}-"
             f"{max(r['push_s']):.3f})", f"{r['mib_per_s']:.0f}", f"{r['start_s']:.1f} s"] for r in results]
    print(table(["model", "params", "first push", "push bytes", "push s (median, range)", "MiB/s", "start"], rows))
    write_result("weight_sync", {"machine": machine(), "results": results}, args.out)


if __name__ == "__main__":
    main()
