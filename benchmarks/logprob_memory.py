"""Peak memory of per-token log-probs + entropy, forward and backward: chunked vs full logits.

    python benchmarks/logprob_memory.py                       # 4 x 1024 tokens, Qwen's vocabulary 151,936
    python benchmarks/logprob_memory.py --L 2048 --paths chunked

Compares `gspo.algo.logprobs.completion_logprobs` (backbone once, output head on `chunk_size` rows
at a time, each chunk checkpointed) with `naive_completion_logprobs` (full (N, L, V) fp32
logits) on a Qwen3 model with a tiny body (2 layers, hidden 128) and the real vocabulary, so
the output head dominates as it does in RL on long completions.

Each measurement runs in a fresh subprocess. After the model and inputs exist, the process
resets its peak RSS (`echo 5 > /proc/self/clear_refs`), runs forward + backward of
`sum(logp * mask) + 0.01 * sum(entropy * mask)`, and reports the growth of the peak resident
set (VmHWM) over the resident set at the reset. torch's CPU allocator returns freed blocks to
the OS, so RSS tracks live tensors. Values (log-probs, entropy, gradients) of every path are
compared with the naive ones; a repetition count gives the median peak.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median, served_as_worker, status_kib, table, worker_result, write_result  # noqa: E402
from gspo.algo.logprobs import default_chunk_rows  # noqa: E402


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def build(spec: dict):
    """A Qwen3 with a tiny body and the full vocabulary, and one batch (N, L): P prompt + T completion tokens."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=spec["vocab"], hidden_size=spec["hidden"], num_hidden_layers=spec["layers"],
                         num_attention_heads=4, num_key_value_heads=2, head_dim=spec["hidden"] // 4,
                         intermediate_size=2 * spec["hidden"], max_position_embeddings=max(4096, spec["L"]),
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    N, L, P = spec["N"], spec["L"], spec["P"]
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, spec["vocab"], (N, L), generator=g)  # (N, L)
    attention_mask = torch.ones(N, L, dtype=torch.long)  # (N, L)
    # ragged completions: row i stops after T - 37 * i tokens (right padding), as in a rollout
    T = L - P
    lengths = torch.tensor([max(1, T - 37 * i) for i in range(N)])  # (N,)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()  # (N, T)
    attention_mask[:, P:] = mask.long()
    return model, input_ids, attention_mask, mask


def worker(spec: dict) -> dict:
    """One path, in this process: peak RSS growth of forward + backward, and its values."""
    import torch

    from gspo.algo.logprobs import completion_logprobs, naive_completion_logprobs

    torch.set_num_threads(spec["threads"]) if spec.get("threads") else None
    model, input_ids, attention_mask, mask = build(spec)
    fn = naive_completion_logprobs if spec["path"] == "naive" else completion_logprobs
    T = spec["L"] - spec["P"]
    # Reset the peak RSS to the current RSS: everything that exists before the call is baseline.
    Path("/proc/self/clear_refs").write_text("5")
    base = status_kib("VmRSS")
    t0 = time.perf_counter()
    logp, entropy = fn(model, input_ids, attention_mask, T, with_entropy=True, chunk_size=spec["chunk_size"] or None)
    loss = (logp * mask).sum() + 0.01 * (entropy * mask).sum()
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = status_kib("VmHWM")
    out = {"path": spec["path"], "chunk_size": spec["chunk_size"], "peak_growth_mib": (peak - base) / 1024,
           "baseline_rss_mib": base / 1024, "seconds": seconds}
    if spec.get("values"):
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        torch.save({"logp": (logp * mask).detach(), "entropy": (entropy * mask).detach(),
                    "grads": {k: grads[k] for k in sorted(grads)}}, spec["values"])
    return out


def compare(reference: str, other: str) -> dict:
    import torch

    a, b = torch.load(reference), torch.load(other)
    grad_rel = max(((a["grads"][k] - b["grads"][k]).abs().max() / a["grads"][k].abs().max().clamp(min=1e-30)).item()
                   for k in a["grads"])
    return {"logp_max_abs_diff": (a["logp"] - b["logp"]).abs().max().item(),
            "entropy_max_abs_diff": (a["entropy"] - b["entropy"]).abs().max().item(),
            "grad_max_rel_diff": grad_rel}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--N", type=int, default=4, help="sequences")
    parser.add_argument("--L", type=int, default=1024, help="tokens per sequence (prompt + completion)")
    parser.add_argument("--P", type=int, default=64, help="prompt tokens; the rest are completion tokens")
    parser.add_argument("--vocab", type=int, default=151_936, help="vocabulary (Qwen2.5/Qwen3: 151,936)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[0, 256],
                        help="chunk sizes of the chunked path (rows of the output head at once); 0: the library's "
                             "default (chunk_size=None: gspo.algo.logprobs.default_chunk_rows(V) rows)")
    parser.add_argument("--paths", nargs="+", default=["naive", "chunked"], choices=["naive", "chunked"])
    parser.add_argument("--reps", type=int, default=3, help="fresh-process measurements per path (median)")
    parser.add_argument("--max-fraction", type=float, default=0.6,
                        help="skip the naive path if its estimated peak exceeds this fraction of available RAM")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if served_as_worker(args.worker, worker):
        return

    base = dict(N=args.N, L=args.L, P=args.P, vocab=args.vocab, hidden=args.hidden, layers=args.layers)
    T = args.L - args.P
    full_logits_gib = args.N * args.L * args.vocab * 4 / 2**30
    print(f"N={args.N} L={args.L} (T={T} completion tokens) V={args.vocab}: full fp32 logits "
          f"{full_logits_gib:.2f} GiB; available RAM {mem_available_gib():.1f} GiB; {machine()['cores']} CPU cores")
    jobs = [("naive", 1024)] if "naive" in args.paths else []
    jobs += [("chunked", c) for c in args.chunk_sizes] if "chunked" in args.paths else []
    tmp = Path(tempfile.mkdtemp(prefix="logprob_memory_"))
    results = []
    for path, chunk in jobs:
        if path == "naive" and 5 * full_logits_gib > args.max_fraction * mem_available_gib():
            print(f"skipping naive: about {5 * full_logits_gib:.1f} GiB needed, more than {args.max_fraction:.0%} of "
                  f"the available RAM; lower --L")
            continue
        peaks, seconds = [], []
        for rep in range(args.reps):
            spec = {**base, "path": path, "chunk_size": chunk,
                    "values": str(tmp / f"{path}_{chunk}.pt") if rep == 0 else None}
            r = worker_result([sys.executable, __file__, "--worker", json.dumps(spec)], path)
            peaks.append(r["peak_growth_mib"])
            seconds.append(r["seconds"])
            print(f"  {path:8s} chunk {chunk:5d} rep {rep}: peak +{r['peak_growth_mib']:.0f} MiB, {r['seconds']:.2f} s",
                  flush=True)
        results.append({"path": path, "chunk_size": chunk if path == "chunked" else None,
                        "chunk_rows": (chunk or default_chunk_rows(args.vocab)) if path == "chunked" else None,
                        "peak_growth_mib": median(peaks), "peaks_mib": peaks, "seconds": median(seconds),
                        "values_file": str(tmp / f"{path}_{chunk}.pt")})
    naive = next((r for r in results if r["path"] == "naive"), None)
    files = [r.pop("values_file") for r in results]
    for r, f in zip(results, files):
        if naive is not None:
            r["fraction_of_naive"] = r["peak_growth_mib"] / naive["peak_growth_mib"]
            if r is not naive:
                r.update(compare(files[results.index(naive)], f))
    shutil.rmtree(tmp, ignore_errors=True)
    rows = [[r["path"], "-" if r["chunk_size"] is None else r["chunk_size"] or f"default ({r['chunk_rows']})",
             f"{r['peak_growth_mib']:.0f}", r["seconds"],
             f"{r['fraction_of_naive']:.1%}" if "fraction_of_naive" in r else "-",
             f"{r['logp_max_abs_diff']:.1e}" if "logp_max_abs_diff" in r else "-",
             f"{r['entropy_max_abs_diff']:.1e}" if "entropy_max_abs_diff" in r else "-",
             f"{r['grad_max_rel_diff']:.1e}" if "grad_max_rel_diff" in r else "-"] for r in results]
    print()
    print(table(["path", "chunk", "peak MiB (fwd+bwd)", "s", "of naive", "max |dlogp|", "max |dH|",
                 "max rel. d grad"], rows))
    path = write_result(f"logprob_memory_{args.N}x{args.L}", {
        "settings": {**base, "T": T, "reps": args.reps, "full_logits_gib": full_logits_gib}, "results": results},
        args.out)
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
