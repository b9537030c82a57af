"""What bf16 autocast costs on this CPU: one forward and backward of SmolLM2-135M-Instruct on 8 x 62 tokens, float32
against bf16 autocast, alternating (fp32, bf16, fp32), one thread. Needs the packaged model (`make demo-real`).

    python benchmarks/bf16_cpu.py

Prints the CPU capability torch sees, whether oneDNN has a native bfloat16 path (what `gspo demo --model
--precision auto` asks, gspo/apps/demo_real.py:native_bf16), and the seconds of each pass.
"""

from __future__ import annotations

import time

import torch

from gspo.apps.demo_real import native_bf16
from gspo.models import load_model


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, _ = load_model("smollm2")
    ids = torch.randint(0, 1000, (8, 62))  # (B, L)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, native bf16: {native_bf16()}")
    for mode in ("fp32", "bf16", "fp32"):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = model(ids).logits.float().logsumexp(-1).mean()
        forward = time.perf_counter() - start
        loss.backward()
        print(f"{mode}: forward {forward:.2f} s, forward + backward {time.perf_counter() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main()
