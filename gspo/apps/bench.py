"""`gspo bench`: what a few RL steps of a config cost on this machine, by phase, and how much of the
device's measured matmul peak they use.

    gspo bench --config my_run.yaml [key=value ...] [--steps 4] [--skip-first 1]

Runs the config for `--steps` steps into a temporary folder (evaluation, samples and checkpoints
reduced to the minimum, nothing kept), from the trainer's own clocks in metrics.jsonl: per timed
step the sampling (`time/generate_s`), the rest of the rollout (rewards, pi_old / pi_ref
log-probs, advantages: `time/rollout_s` minus sampling) and the updates (`time/train_s`), and
completion tokens per second (`throughput/tokens_per_s`).

Utilisation: model FLOPs per phase over its seconds, against the median FLOP/s of large matmuls in
the dtype the phase computes in (`compute_dtypes`: the autocast's under bf16/fp16, else the weights'; sampling
from a `sampler_dtype` copy: that dtype) on its device, measured right before and right after the run (a shared
machine changes speed: the larger is the reference); the whole step against the phases' peaks, each weighted by
its seconds. Sampling is often bound by memory, not FLOPs: beside its FLOP figure stands a bandwidth roofline,
the least bytes it must read (`sampling_read_bytes`: every forward reads the weights as stored, each decode step
every real token's keys and values so far) over the device's read bandwidth (`read_bandwidths`, a large
buffer summed, before and after the run like the peaks); "of roofline" is that time over the measured one.
Where its FLOPs at the peak take longer than its bytes (many rows decoded at once: SmolLM2's 32 rows on a CPU),
sampling is compute-bound, and `of_bound` (the larger of the two times over the measured one) says how near it is.
Model FLOPs of a sequence of l real tokens, forward:
2 * P_mm * l + layers * 4 * heads * head_dim * l (l + 1) / 2 (P_mm: the parameters of every matmul,
decoder layers and output head; padding is not useful work and is not counted, MFU convention,
PaLM appendix B). Sampling = one forward of every final sequence (the KV cache) less the prompt's forward of
all but one row of each group (`sampling_flops`: a repeated prompt needs one prefill), the rollout's rest =
the pi_old forwards ((M-1)/M of a forward where the first minibatch's pi_old is its own training
forward) plus one pi_ref forward with a KL term, the updates = 3 forwards per epoch. Counted: the
policy's forwards only (a PPO critic, the SFT term and the routing-drift forwards are not), with
each step's mean prompt and completion lengths (the attention term of the mean: a lower bound).
"""

from __future__ import annotations

import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gspo.config import TrainConfig, make_config, to_dict

__all__ = ["bench", "compute_dtypes", "cpu_name", "format_bench", "forward_flops", "matmul_params",
           "peak_matmul_rates", "read_bandwidths", "sampling_read_bytes"]

# A run's settings that only cost time outside the phases measured here (or would keep files)
_QUIET = dict(eval_steps=0, eval_num_prompts=1, eval_k=1, save_steps=0, save_total_limit=1, log_samples_steps=0,
              progress=False, tensorboard=False, wandb=False, overwrite_output_dir=True, resume_from_checkpoint=None)


def matmul_params(model) -> int:
    """Parameters used in matmuls: 2-D weights except the input embedding, plus the output head (once if tied)."""
    head = model.get_output_embeddings().weight
    embed = model.get_input_embeddings().weight
    body = sum(p.numel() for p in model.parameters() if p.dim() == 2 and p is not head and p is not embed)
    return body + head.numel()


def forward_flops(lengths, p_mm: int, layers: int, heads: int, head_dim: int) -> float:
    """Model FLOPs of one forward over sequences of these real-token lengths (causal attention)."""
    return sum(2 * p_mm * l + layers * 4 * heads * head_dim * l * (l + 1) / 2 for l in lengths)


def sampling_flops(n: int, group: int, prompt: float, completion: float, *shape) -> float:
    """Model FLOPs of sampling n sequences of `prompt` + `completion` real tokens, `group` per prompt: one forward
    of every sequence (its KV cache), less the prompt's forward of all but one of each group's rows (a repeated
    prompt needs one prefill: gspo's loop runs it once). `shape`: forward_flops' (p_mm, layers, heads, head_dim)."""
    return forward_flops([prompt + completion] * n, *shape) - (n - n // group) * forward_flops([prompt], *shape)


def peak_matmul_rates(n: int, seconds: float, *, device="cpu", dtype=torch.float32, windows: int = 5) -> list[float]:
    """FLOP/s of `windows` timing windows of back-to-back (n, n) @ (n, n) matmuls, `seconds` in all."""
    device = torch.device(device)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return _rates(lambda: torch.mm(a, b), 2 * n**3, seconds, device, windows)


def read_bandwidths(nbytes: int, seconds: float, *, device="cpu", windows: int = 5) -> list[float]:
    """Bytes/s of `windows` timing windows of summing a float32 buffer of `nbytes` (read once per sum), `seconds`
    in all: the rate at which this device reads memory that no cache holds (pick nbytes well above the caches)."""
    a = torch.ones(max(nbytes // 4, 1), device=torch.device(device))  # (nbytes / 4,)
    return _rates(a.sum, a.numel() * 4, seconds, torch.device(device), windows)


def _rates(work, units: float, seconds: float, device: torch.device, windows: int) -> list[float]:
    """`units` per second of `work()` run back to back, in `windows` windows of `seconds` in all (one warm-up call,
    one call to size the windows)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    work()  # warm-up: kernels chosen, pages touched
    sync()
    t0 = time.perf_counter()
    work()
    sync()
    reps = max(1, int(seconds / windows / max(time.perf_counter() - t0, 1e-6)))
    rates = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(reps):
            work()
        sync()
        rates.append(units * reps / (time.perf_counter() - t0))
    return rates


def compute_dtypes(cfg: TrainConfig, weights: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype each phase's matmuls compute in: bf16/fp16 autocast's where on (every policy forward runs under
    it, sampling included), else the weights' (`weights`), sampling from a sampler_dtype copy in that dtype."""
    from gspo.models import DTYPES

    autocast = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else None
    sampler = DTYPES[cfg.sampler_dtype] if cfg.sampler_dtype else weights
    return {"generate": autocast or sampler, "rewards + pi_old/pi_ref + advantages": autocast or weights,
            "train (updates)": autocast or weights}


def sampling_read_bytes(sequences: int, prompt: float, completion: float, forwards: int, *, weight_bytes: int,
                        layers: int, kv_heads: int, head_dim: int, kv_itemsize: int) -> float:
    """The least bytes one rollout's sampling reads: the weights once per forward (`forwards`: the prefill and one
    per later token, as many as the longest completion needs), and at each decode step every sequence's keys and
    values of its tokens so far (`prompt` + t, mean lengths; t = 1 .. completion - 1)."""
    decode = max(completion - 1.0, 0.0)
    kv_tokens = sequences * (decode * prompt + decode * (decode + 1) / 2)  # sum over decode steps of tokens seen
    return forwards * weight_bytes + kv_tokens * 2 * layers * kv_heads * head_dim * kv_itemsize


def bench(cfg: TrainConfig, steps: int = 4, skip_first: int = 1, peak_seconds: float = 5.0,
          matmul_n: int | None = None) -> dict:
    """Run `cfg` for `steps` steps in a temporary folder; per-phase seconds, tokens/s and utilisation of the
    steps after the first `skip_first` (warm-up), as a dict (`format_bench` prints it)."""
    if steps < 1 or not 0 <= skip_first < steps:
        raise ValueError(f"bench: need steps >= 1 and 0 <= skip_first < steps; got steps={steps}, "
                         f"skip_first={skip_first}")
    from gspo.models import DTYPES, resolve_device, seeded_model
    from gspo.trainer import train

    device = resolve_device(cfg.device)
    with tempfile.TemporaryDirectory(prefix="gspo-bench-") as tmp:
        run_cfg = make_config(TrainConfig, {**to_dict(cfg, keep_secrets=True), **_QUIET, "max_steps": steps,
                                            "output_dir": tmp})
        _, model, _ = seeded_model(run_cfg)  # the policy as trained: its shape and dtype
        dtype, shape = next(model.parameters()).dtype, _shape(model)
        text = model.config.get_text_config()
        kv = {"layers": shape[1], "kv_heads": getattr(text, "num_key_value_heads", None) or shape[2],
              "head_dim": shape[3]}  # for sampling_read_bytes
        dtypes = compute_dtypes(cfg, dtype)
        sampler_weights = DTYPES[cfg.sampler_dtype] if cfg.sampler_dtype else dtype  # as stored (autocast casts)
        weight_bytes = shape[0] * sampler_weights.itemsize
        del model
        n = matmul_n or (8192 if device.type == "cuda" else 2048)
        nbytes = 1 << 30 if device.type == "cuda" else 256 << 20

        def limits() -> tuple[dict, float]:
            peaks = {d: statistics.median(peak_matmul_rates(n, peak_seconds, device=device, dtype=d))
                     for d in dict.fromkeys(dtypes.values())}
            return peaks, statistics.median(read_bandwidths(nbytes, peak_seconds, device=device))

        peaks_before, bandwidth_before = limits()
        started = time.perf_counter()
        train(run_cfg)
        seconds = time.perf_counter() - started
        peaks_after, bandwidth_after = limits()
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r.get("step", 0) > skip_first and "time/train_s" in r]
    peaks = {d: max(peaks_before[d], peaks_after[d]) for d in peaks_before}
    bandwidth = max(bandwidth_before, bandwidth_after)
    N = cfg.per_device_batch_size * cfg.num_generations  # per rank
    forwards = _forwards_per_phase(cfg)
    phases = {}
    for phase, seconds_of in (("generate", lambda r: r["time/generate_s"]),
                              ("rewards + pi_old/pi_ref + advantages",
                               lambda r: r["time/rollout_s"] - r["time/generate_s"]),
                              ("train (updates)", lambda r: r["time/train_s"]),
                              ("whole step", lambda r: r["time/rollout_s"] + r["time/train_s"])):
        flops = [_phase_flops(phase, r, N, cfg.num_generations, forwards, shape) for r in timed]
        secs = [seconds_of(r) for r in timed]
        rate = statistics.median(f / s for f, s in zip(flops, secs)) if all(s > 0 for s in secs) else float("nan")
        phases[phase] = {"s_per_step": statistics.median(secs), "model_gflop_per_step": statistics.median(flops) / 1e9,
                         "gflop_per_s": rate / 1e9}
        if phase in dtypes:
            phases[phase]["dtype"] = str(dtypes[phase]).removeprefix("torch.")
            phases[phase]["of_peak"] = rate / peaks[dtypes[phase]]
    # the whole step: its FLOPs over what the phases' peaks allow in their seconds
    reachable = sum(phases[p]["s_per_step"] * peaks[dtypes[p]] for p in dtypes)
    phases["whole step"]["dtype"] = "/".join(dict.fromkeys(phases[p]["dtype"] for p in dtypes))
    phases["whole step"]["of_peak"] = phases["whole step"]["model_gflop_per_step"] * 1e9 / reachable
    read = [sampling_read_bytes(N, r["prompt/mean_len"], r["completion/mean_len"], int(r["completion/max_len"]),
                                weight_bytes=weight_bytes, kv_itemsize=dtypes["generate"].itemsize, **kv)
            for r in timed]
    generate = phases["generate"]
    generate["gb_read_per_step"] = statistics.median(read) / 1e9
    generate["roofline_s"] = statistics.median(read) / bandwidth
    generate["of_roofline"] = generate["roofline_s"] / generate["s_per_step"]
    # the roofline proper: whichever of the bytes and the FLOPs takes longer at this machine's rates bounds it
    generate["compute_s"] = generate["model_gflop_per_step"] * 1e9 / peaks[dtypes["generate"]]
    generate["bound"] = "memory" if generate["roofline_s"] >= generate["compute_s"] else "compute"
    generate["of_bound"] = max(generate["roofline_s"], generate["compute_s"]) / generate["s_per_step"]
    return {
        "model": cfg.model, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "cpu": cpu_name(),
        "settings": {"sequences_per_step": N, "max_completion_length": cfg.max_completion_length,
                     "num_minibatches": cfg.num_minibatches, "num_epochs": cfg.num_epochs,
                     "padding_free": cfg.padding_free},
        "steps": steps, "timed_steps": len(timed), "run_seconds": seconds,
        "tokens_per_s": statistics.median(r["throughput/tokens_per_s"] for r in timed),
        "mean_completion_len": statistics.median(r["completion/mean_len"] for r in timed),
        "mean_prompt_len": statistics.median(r["prompt/mean_len"] for r in timed),
        "peak_matmul_gflop_per_s": {str(d).removeprefix("torch."): {"before": peaks_before[d] / 1e9,
                                                                     "after": peaks_after[d] / 1e9} for d in peaks},
        "matmul_n": n, "sampler_weights_dtype": str(sampler_weights).removeprefix("torch."),
        "read_gb_per_s": {"before": bandwidth_before / 1e9, "after": bandwidth_after / 1e9, "nbytes": nbytes},
        "phases": phases,
    }


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo) and whether it has AVX-512, or the platform's word for it."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.machine())
    return f"{name}, {'AVX-512' if ' avx512f' in info else 'AVX2' if ' avx2' in info else 'no AVX2'}"


def _shape(model) -> tuple[int, int, int, int]:
    """(P_mm, layers, heads, head_dim) for `forward_flops`."""
    c = model.config.get_text_config()
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return matmul_params(model), c.num_hidden_layers, heads, head_dim


def _phase_flops(phase: str, row: dict, n: int, group: int, forwards: dict, shape: tuple) -> float:
    """Model FLOPs of one phase in one step's metrics `row`: sampling by `sampling_flops`, the others as `forwards`
    of every sequence, the whole step as their sum."""
    prompt, completion = row["prompt/mean_len"], row["completion/mean_len"]
    if phase == "whole step":
        return sum(_phase_flops(p, row, n, group, forwards, shape) for p in forwards if p != "whole step")
    if phase == "generate":
        return sampling_flops(n, group, prompt, completion, *shape)
    return forwards[phase] * forward_flops([prompt + completion] * n, *shape)


def _forwards_per_phase(cfg: TrainConfig) -> dict[str, float]:
    """Policy forwards (in units of one forward of every sequence) each phase runs."""
    M = cfg.num_minibatches
    # as step.prepare decides
    reuses_first = not (cfg.use_sampler_logprobs or cfg.routing_replay == "old_policy" or cfg.kl_in_reward)
    pi_old = 0.0 if cfg.use_sampler_logprobs else (M - 1) / M if reuses_first else 1.0
    pi_ref = 1.0 if cfg.kl_coef > 0 else 0.0
    out = {"generate": 1.0, "rewards + pi_old/pi_ref + advantages": pi_old + pi_ref,
           "train (updates)": 3.0 * cfg.num_epochs}
    out["whole step"] = sum(out.values())
    return out


def format_bench(result: dict) -> str:
    """The table `gspo bench` prints."""
    s = result["settings"]
    peaks = "; ".join(f"{d} {v['before']:.1f} before, {v['after']:.1f} after"
                      for d, v in result["peak_matmul_gflop_per_s"].items())
    read = result["read_gb_per_s"]
    generate = result["phases"]["generate"]
    lines = [
        f"{result['model']} on {result['device']} ({result['cpu']}, torch threads {result['threads']}, "
        f"{result['dtype']}): "
        f"{result['timed_steps']} timed steps of {s['sequences_per_step']} sequences, mean prompt "
        f"{result['mean_prompt_len']:.1f} + completion {result['mean_completion_len']:.1f} tokens "
        f"(max {s['max_completion_length']}), {s['num_minibatches']} minibatches x {s['num_epochs']} epochs, "
        f"padding_free={s['padding_free']}",
        f"completion tokens/s: {result['tokens_per_s']:,.0f}; peak matmul GFLOP/s ({result['matmul_n']}^3): {peaks}; "
        f"memory read: {read['before']:.1f} GB/s before, {read['after']:.1f} after",
        f"sampling reads >= {generate['gb_read_per_step']:.3f} GB per step (weights as "
        f"{result['sampler_weights_dtype']}, KV cache): {generate['roofline_s']:.3f} s at that bandwidth, "
        f"{generate['of_roofline']:.1%} of the bandwidth roofline; its FLOPs at the {generate['dtype']} peak "
        f"{generate['compute_s']:.3f} s: {generate['bound']}-bound, at {generate['of_bound']:.1%} of that bound",
        "",
        f"{'phase':<40}{'s/step':>9}{'share':>8}{'model GFLOP':>13}{'GFLOP/s':>10}{'dtype':>18}{'of peak':>9}",
    ]
    whole = result["phases"]["whole step"]["s_per_step"]
    for phase, v in result["phases"].items():
        lines.append(f"{phase:<40}{v['s_per_step']:>9.3f}{v['s_per_step'] / whole:>8.0%}"
                     f"{v['model_gflop_per_step']:>13.2f}{v['gflop_per_s']:>10.2f}{v['dtype']:>18}{v['of_peak']:>9.1%}")
    return "\n".join(lines)
