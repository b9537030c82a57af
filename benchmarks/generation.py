"""Generation throughput of the three generators on CPU: vLLM (an engine in this process), gspo's own
decode loop and HF `generate`; and what the engine costs besides: its start-up and the weight push.

    .venv-vllm/bin/python benchmarks/generation.py --threads 1      # the venv `make test-vllm` builds

Models, built from config (nothing downloaded), float32, with the add3 task's character tokenizer:
the demo's (tiny-dense, 0.6M; its head_dim is 32, which vLLM's CPU attention takes) and a ~50M
Qwen3-style dense model (8 layers, hidden 640, head_dim 64). One rollout = B prompts x G completions
of up to T tokens at temperature 1, the sampler's log-probs (mu) kept by every backend (a vllm run
always keeps them). Completion tokens per second count the tokens actually sampled (rows stop at
EOS); backends alternate within each repeat (a shared machine's load hits them alike); medians.
The push is `Sampler.sync` after a nudge of every weight: reload, MoE repacking (none here),
prefix-cache reset and the probe check, which is also timed alone.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODEL_50M, machine, median, table, write_result

# name: (model_overrides of tiny-dense, prompts B, completions per prompt G, max new tokens T)
CASES = {
    "demo": ({}, 16, 8, 48),  # the demo's RL rollout (gspo/apps/demo.py: DEMO_RL)
    "50M": (MODEL_50M, 16, 8, 48),
    "50M-long": (MODEL_50M, 4, 8, 128),
}
BACKENDS = ("vllm", "gspo", "hf")


def run_case(name: str, backends: list[str], repeats: int, out_dir: str) -> dict:
    import torch

    from gspo.algo.logprobs import completion_logprobs
    from gspo.config import TrainConfig, make_config
    from gspo.models import count_parameters, load_model
    from gspo.rollout import GENERATORS, Sampler, generate, sampler_sections
    from gspo.tasks import get_task

    overrides, B, G, T = CASES[name]
    model, tokenizer = load_model("tiny-dense", seed=0, overrides=overrides)
    prompts = [r["prompt"] for r in get_task("add3").dataset("train", B, 0)]
    cannot = {b: GENERATORS[b].unsupported(model) for b in backends}
    backends = [b for b in backends if cannot[b] is None]
    result = {"case": name, "parameters": count_parameters(model), "B": B, "G": G, "T": T,
              "unsupported": {b: why for b, why in cannot.items() if why is not None}}
    generator = None
    if "vllm" in backends:
        cfg = make_config(TrainConfig, {"model": "tiny-dense", "model_overrides": overrides, "task": "add3",
                                        "generation_backend": "vllm", "per_device_batch_size": B,
                                        "num_generations": G, "max_completion_length": T, "max_prompt_length": 32,
                                        "device": "cpu", "progress": False, "output_dir": out_dir})
        generator = Sampler(model, tokenizer, *sampler_sections(cfg), seeded=False)

    def sample(backend: str, step: int):
        if backend == "vllm":
            return generator.sample(prompts, step, 0)
        return generate(model, tokenizer, prompts, G, max_new_tokens=T, max_prompt_length=32, with_logprobs=True,
                        backend=backend)

    for backend in backends:  # warm-up: first calls allocate caches and pick kernels
        sample(backend, 0)
    seconds = {b: [] for b in backends}
    tokens = {b: [] for b in backends}
    push_s, check_s = [], []
    g = torch.Generator().manual_seed(0)
    for r in range(repeats):
        k = r % len(backends)
        for backend in backends[k:] + backends[:k]:
            t0 = time.perf_counter()
            rollout = sample(backend, r + 1)
            seconds[backend].append(time.perf_counter() - t0)
            tokens[backend].append(int(rollout.completion_mask.sum()))
        if generator is None:
            continue
        with torch.no_grad():  # a stand-in for the step's updates: the engine must take new weights
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 1e-3)
        push_s.append(generator.sync(model)["time/sync_s"])
        t0 = time.perf_counter()
        generator.sampler.check(model, "in the benchmark")
        check_s.append(time.perf_counter() - t0)
    result["tokens_per_s"] = {b: median([n / s for n, s in zip(tokens[b], seconds[b])]) for b in backends}
    result["mean_len"] = {b: median(tokens[b]) / (B * G) for b in backends}
    result["seconds"] = seconds
    if generator is not None:
        rollout = generator.sample(prompts, repeats + 1, 0)
        with torch.no_grad():
            own, _ = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.completion_len)
        generator.sampler.close()
        result.update(push_s=median(push_s), check_s=median(check_s), start_s=generator.sampler.start_s,
                      max_abs_mu_minus_pi_old=float((own - rollout.sampler_logprobs)[rollout.completion_mask]
                                                    .abs().max()))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    import importlib.util

    import torch

    torch.set_num_threads(args.threads)
    load_before = machine()["load_average"]
    backends, version, import_s = list(args.backends), None, None
    if "vllm" in backends and importlib.util.find_spec("vllm") is None:
        backends.remove("vllm")  # the main venv: run the vllm venv for that column
    if "vllm" in backends:
        from gspo.rollout.vllm_engine import _import_vllm

        t0 = time.perf_counter()
        version = _import_vllm().__version__
        import_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as out_dir:
        results = [run_case(name, backends, args.repeats, out_dir) for name in args.cases]
    info = machine()

    def cell(r: dict, key: str, backend: str | None = None):
        value = r.get(key) if backend is None else r.get(key, {}).get(backend)
        return "n/a" if value is None else value

    rows = []
    for r in results:
        rate = r["tokens_per_s"]
        ratio = {b: rate["vllm"] / rate[b] if "vllm" in rate and b in rate else "n/a" for b in ("gspo", "hf")}
        rows.append([r["case"], f"{r['parameters'] / 1e6:.1f}M", f"{r['B']}x{r['G']}, {r['T']}",
                     *(cell(r, "tokens_per_s", b) for b in BACKENDS), ratio["gspo"], ratio["hf"],
                     "/".join(f"{r['mean_len'][b]:.0f}" if b in r["mean_len"] else "-" for b in BACKENDS),
                     cell(r, "push_s"), cell(r, "check_s"), cell(r, "start_s"),
                     f"{r['max_abs_mu_minus_pi_old']:.1e}" if "max_abs_mu_minus_pi_old" in r else "n/a"])
    print(f"CPU: {info['cpu']} ({', '.join(info['cpu_flags']) or 'no AVX2/AVX-512'}), {info['cores']} cores, "
          f"{args.threads} thread(s); load average {load_before} before, {info['load_average']} after; "
          f"torch {info['torch']}, transformers {info.get('transformers')}, vllm {version}"
          + (f" (import {import_s:.1f} s)" if import_s is not None else ""))
    print(table(["model", "params", "BxG, T", "vLLM tok/s", "gspo tok/s", "hf tok/s", "vLLM/gspo", "vLLM/hf",
                 "mean len v/g/h", "push s", "probe s", "start-up s", "max|mu-pi_old|"], rows))
    for r in results:
        for backend, why in r["unsupported"].items():
            print(f"{r['case']}: {backend} n/a: {why}")
    if args.out:
        write_result("generation", {"threads": args.threads, "repeats": args.repeats, "vllm": version,
                                    "vllm_import_s": import_s, "load_average_before": load_before,
                                    "results": results}, args.out)


if __name__ == "__main__":
    main()
