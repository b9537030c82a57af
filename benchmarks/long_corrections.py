"""Do the rollout corrections collapse on long answers? Weights of mu != pi_old at T = 128, 512 and 1024.

    python benchmarks/long_corrections.py --threads 1
    python benchmarks/long_corrections.py --threads 1 --models --task add3x3 \
        --trained runs/lab-part4-length/coldstart/moe-L4-add3x3-len160/model

A sequence's importance weight W = prod_t pi_old(y_t) / mu(y_t) multiplies one small per-token
mismatch per token, so log W's spread grows with the length (like sqrt(T) for independent tokens):
at some length almost every answer's W is far from 1, and a sequence-level correction (seq_tis,
seq_mis) truncates or drops nearly everything, while token-level ones (token_tis, token_mis) and the
length-normalised filter (geo_mis) see the per-token mismatch only.

For each model (tiny-dense and tiny-moe, random init, seed 0, max_position_embeddings 2048; and with
`--trained DIR`, a model trained before, e.g. a lab's SFT cold start, on its task's prompts: a trained
model's sharper distributions round differently) and each sampler, with EOS turned off so that every
row runs 1024 tokens, one rollout of 4 prompts x 8 answers by gspo's
decode loop with mu kept, pi_old recomputed by the float32 policy, and the first T tokens of each
answer taken as a T-token answer (a prefix of a 1024-token rollout is a T-token rollout when nothing
stops early). Samplers:

  bf16      a bfloat16 copy of the policy (sampler_dtype: bfloat16, an inference engine's numerics)
  fp16      a float16 copy (sampler_dtype: float16)
  stale2    the policy's float32 weights two updates behind (max_staleness 2): the policy then takes
            two AdamW steps (lr 1e-4, the lab's) of a policy-gradient loss on the rollout with +-1
            advantages, a stand-in for two real updates
  bf16+stale2  both

Per T: ESS of the sequence weights ((mean W)^2 / mean W^2, gspo's mismatch/ess), the spread of log W,
the fraction of answers with W < 1e-3, and what each correction of gspo.algo.correction (its default
thresholds) truncates or drops: the fraction of tokens (token_*) or answers (seq_*, geo_mis).
Measures the weights only; learning under each correction is the lab's to measure.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, write_result  # noqa: E402

LENGTHS = (128, 512, 1024)
SAMPLERS = ("bf16", "fp16", "stale2", "bf16+stale2")
CORRECTIONS = ("token_tis", "token_mis", "seq_tis", "seq_mis", "geo_mis")


def stale_update(model, rollout_ids, mask, completion_len: int, steps: int, lr: float, seed: int) -> None:
    """`steps` AdamW steps of -A * log pi(y) (token mean) with +-1 advantages per answer: the policy moves on."""
    import torch

    from gspo.algo.logprobs import completion_logprobs

    gen = torch.Generator().manual_seed(seed)
    advantages = torch.randint(0, 2, (rollout_ids.shape[0], 1), generator=gen).float() * 2 - 1  # (N, 1)
    cmask = mask[:, -completion_len:].float()  # (N, T)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        logp, _ = completion_logprobs(model, rollout_ids, mask, completion_len)  # (N, T)
        loss = -(advantages * logp * cmask).sum() / cmask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def weights_at(old, mu, mask, T: int) -> dict:
    """The mismatch of the first T tokens of every answer: ESS, log W's spread, and what each correction cuts."""
    import torch

    from gspo.algo.correction import behaviour_weights, mismatch_metrics, mismatch_moments

    old, mu, mask = old[:, :T], mu[:, :T], mask[:, :T]  # (N, T)
    metrics = mismatch_metrics(mismatch_moments(old, mu, mask)[0])
    log_w = torch.where(mask.bool(), old - mu, torch.zeros_like(old)).double()  # (N, T)
    seq = log_w.sum(-1)  # (N,) log W
    out = {"ess": metrics["mismatch/ess"], "kl_token": metrics["mismatch/kl"],
           "log_w_token_std": float(log_w[mask.bool()].std()), "log_W_std": float(seq.std()),
           "log_W_mean": float(seq.mean()), "W_below_1e-3": float((seq < math.log(1e-3)).double().mean())}
    for mode in CORRECTIONS:
        _, stats = behaviour_weights(old, mu, mask, mode)
        out[mode] = float(next(iter(stats.values())))
    return out


def measure(model_name: str, sampler: str, seed: int, prompts: list[str], G: int, T: int) -> dict:
    """{T: weights_at(...)} for one model and sampler: `model_name` a preset (random init) or a directory."""
    import torch

    from gspo.algo.logprobs import completion_logprobs
    from gspo.models import load_model
    from gspo.rollout.decode import sample

    preset = not Path(model_name).exists()
    overrides = {"max_position_embeddings": 2048} if preset else None
    policy, tokenizer = load_model(model_name, seed=seed, overrides=overrides)
    policy.eval()
    ids, pmask = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").values()
    ids, pmask = ids.repeat_interleave(G, 0), pmask.repeat_interleave(G, 0)  # (N, P)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(sampler.split("+")[0])
    mu_model = copy.deepcopy(policy).to(dtype).eval() if dtype is not None else copy.deepcopy(policy).eval()
    never = [len(tokenizer) + 7]  # no EOS: every row runs T tokens
    torch.manual_seed(seed)
    completion, mu = sample(mu_model, ids, pmask, max_new_tokens=T, eos_token_ids=never,
                            pad_token_id=tokenizer.pad_token_id, with_logprobs=True)  # (N, T), (N, T)
    input_ids = torch.cat([ids, completion], 1)  # (N, P+T)
    mask = torch.cat([pmask, torch.ones_like(completion)], 1)  # (N, P+T)
    if sampler.endswith("stale2"):
        stale_update(policy, input_ids, mask, T, steps=2, lr=1e-4, seed=seed)
    with torch.no_grad():
        old, _ = completion_logprobs(policy, input_ids, mask, T)  # (N, T) pi_old, float32
    cmask = torch.ones_like(old)  # (N, T)
    return {str(t): weights_at(old, mu.float(), cmask, t) for t in LENGTHS if t <= T}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="*", default=["tiny-dense", "tiny-moe"], help="presets, random init")
    parser.add_argument("--trained", nargs="*", default=[], help="model directories (a lab's cold start)")
    parser.add_argument("--task", default="add3", help="built-in task whose training prompts the trained models get")
    parser.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=SAMPLERS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--T", type=int, default=max(LENGTHS), help="answer length sampled (prefixes give the rest)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from gspo.tasks import get_task

    random_prompts = ["12+34=", "567+89=", "3+4+5=", "100+200+300="]
    task_prompts = [r["prompt"] for r in get_task(args.task).dataset("train", 4, 0)]
    results, rows = {}, []
    for model_name in args.models + args.trained:
        prompts = random_prompts if model_name in args.models else task_prompts
        for sampler in args.samplers:
            by_T = measure(model_name, sampler, args.seed, prompts, 8, args.T)
            results[f"{model_name}/{sampler}"] = by_T
            for T, r in by_T.items():
                rows.append([model_name, sampler, T, f"{r['ess']:.3f}", f"{r['log_W_std']:.2f}",
                             f"{r['W_below_1e-3']:.2f}", *(f"{r[m]:.4f}" for m in CORRECTIONS)])
            print(rows[-1], flush=True)
    print(table(["model", "sampler", "T", "ESS", "std log W", "W<1e-3", *CORRECTIONS], rows))
    print(write_result("long_corrections", {"args": vars(args), "results": results}, args.out))


if __name__ == "__main__":
    main()
