"""What a sampler that is not the policy costs (gspo/hf backends): keeping mu, a bf16 copy, a stale copy.

    python benchmarks/sampler_copies.py --threads 1

For the demo model (tiny-dense, 0.6M) and a ~50M dense model built from config, one rollout of
16 prompts x 8 completions, up to 48 tokens, by gspo's decode loop: the policy itself (mu not kept:
the default), the policy with mu (log_mismatch), a bfloat16 copy (sampler_dtype) and a copy one
rollout behind (sampler_lag=1); the push after each step's updates; the rollout's mismatch/kl.
Variants alternate within each repeat (a shared machine's load hits them alike); medians.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODEL_50M, median, table, write_result

MODELS = {"demo (0.6M)": {}, "50M": MODEL_50M}
VARIANTS = {"policy": {}, "policy + mu": {"log_mismatch": True}, "bf16 copy": {"sampler_dtype": "bfloat16"},
            "lag 1 copy": {"sampler_lag": 1}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    from gspo.algo.correction import mismatch_metrics, mismatch_moments
    from gspo.algo.logprobs import completion_logprobs
    from gspo.config import TrainConfig, make_config
    from gspo.models import count_parameters, seeded_model
    from gspo.rollout import Sampler, sampler_sections

    torch.set_num_threads(args.threads)
    prompts = [f"{100 + 37 * i}+{205 + 11 * i}=" for i in range(16)]
    rows, results = [], {}
    for model_name, overrides in MODELS.items():
        base = {"model": "tiny-dense", "model_overrides": overrides or None, "task": "add3", "num_generations": 8,
                "per_device_batch_size": 16, "max_completion_length": 48, "generation_backend": "gspo",
                "seeded_sampling": True, "output_dir": tempfile.mkdtemp(), "device": "cpu"}
        cfg = make_config(TrainConfig, base)
        _, model, tokenizer = seeded_model(cfg)
        params = count_parameters(model)
        generators = {name: Sampler(model, tokenizer, *sampler_sections(make_config(TrainConfig, {**base, **kw})),
                                    seeded=True) for name, kw in VARIANTS.items()}
        times = {name: [] for name in VARIANTS}
        pushes = {name: [] for name in VARIANTS}
        tokens, kl = {}, {}
        for r in range(args.repeats + 1):  # repeat 0 warms up
            for name, generator in generators.items():
                t0 = time.perf_counter()
                rollout = generator.sample(prompts, r, 0)
                seconds = time.perf_counter() - t0
                push = generator.sync(model)["time/sync_s"]
                if r:
                    times[name].append(seconds)
                    pushes[name].append(push)
                tokens[name] = int(rollout.completion_mask.sum())
                if rollout.sampler_logprobs is not None:
                    with torch.no_grad():
                        old, _ = completion_logprobs(model, rollout.input_ids, rollout.attention_mask,
                                                     rollout.completion_len)
                    kl[name] = mismatch_metrics(mismatch_moments(old, rollout.sampler_logprobs,
                                                                 rollout.completion_mask)[0])["mismatch/kl"]
        for name in VARIANTS:
            s = median(times[name])
            results[f"{model_name}/{name}"] = {"params": params, "rollout_s": s, "tokens": tokens[name],
                                               "push_s": median(pushes[name]), "mismatch_kl": kl.get(name)}
            rows.append([model_name, name, f"{s:.2f}", f"{tokens[name] / s:.0f}", f"{median(pushes[name]) * 1e3:.1f}",
                         "-" if name not in kl else f"{kl[name]:.1e}"])
    print(table(["model", "sampler", "rollout s", "tokens/s", "push ms", "mismatch/kl"], rows))
    print(write_result("sampler_copies", {"args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
