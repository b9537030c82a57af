"""The cost of sampling through gspo's OpenAI-compatible endpoint (HTTP on 127.0.0.1, the openai client) against
calling the same engine directly, per call: median seconds, completion tokens/s, and the difference.

    OMP_NUM_THREADS=1 python benchmarks/endpoint_overhead.py --rounds 20

Both sides sample the same request (the same prompt, n completions, max_tokens, seed: the same tokens) with
gspo's decode loop on the tiny-dense model; calls alternate, direct then HTTP, so load drifts hit both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--n", type=int, default=8, help="completions per call")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default="tiny-dense")
    parser.add_argument("--out", default="benchmarks/results/endpoint_overhead.json")
    args = parser.parse_args()

    import openai

    from gspo.models import load_model
    from gspo.rollout.endpoint.engine import Engine, Job
    from gspo.rollout.endpoint.server import Endpoint, Server
    from gspo.rollout.registry import GENERATORS

    torch.manual_seed(0)
    model, tok = load_model(args.model, seed=0)
    engine = Engine(GENERATORS["gspo"], model, model, tok, window_s=0.0)
    prompt = tok("123+456=")["input_ids"]
    server, stop = Server(Endpoint(engine, tok)), threading.Event()
    thread = threading.Thread(target=engine.serve, args=(stop, 0.01), daemon=True)
    thread.start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)

    def direct() -> int:
        (samples,) = engine.sample([Job(list(prompt), n=args.n, max_tokens=args.max_tokens, seeds=list(range(args.n)))])
        return sum(len(s.token_ids) for s in samples)

    def http() -> int:
        r = client.completions.create(model="m", prompt=prompt, n=args.n, max_tokens=args.max_tokens, seed=0)
        return r.usage.completion_tokens

    times = {"direct": [], "http": []}
    tokens = {}
    for call in (direct, http):  # warm-up
        call()
    for _ in range(args.rounds):
        for name, call in (("direct", direct), ("http", http)):
            t0 = time.perf_counter()
            tokens[name] = call()
            times[name].append(time.perf_counter() - t0)
    stop.set()
    thread.join()
    server.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"rounds": args.rounds, "n": args.n, "max_tokens": args.max_tokens, "model": args.model,
           "completion_tokens": tokens, "median_s": {k: round(v, 4) for k, v in med.items()},
           "tokens_per_s": {k: round(tokens[k] / med[k], 1) for k in med},
           "overhead_ms_per_call": round(1000 * (med["http"] - med["direct"]), 2),
           "overhead_frac": round(med["http"] / med["direct"] - 1, 4), "threads": torch.get_num_threads(),
           "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor()
           or platform.machine(), "load": os.getloadavg()}
    print(json.dumps(out, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
