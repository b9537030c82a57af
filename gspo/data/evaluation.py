"""Held-out evaluation: greedy accuracy and sampled mean@k / pass@k."""

from __future__ import annotations

import torch

from gspo.data.rewards import answer_match, get_reward_fn, score_completions
from gspo.data.rows import chat_prompts, columns_of
from gspo.rollout import generate, policy_backend


@torch.no_grad()
def evaluate(model, tokenizer, rows: list[dict], cfg, *, sampled: bool = True) -> dict[str, float]:
    """Greedy accuracy, and mean@k / pass@k of `cfg.eval_k` samples at `cfg.eval_temperature`.

    Sampled with the policy itself (never a stale or low-precision copy, nor an engine).

    Correctness is the `answer_match` reward, so rows need an `answer` column; without one
    the mean total reward of `cfg.reward_funcs` is reported instead (`eval/reward`).
    """
    if not rows:
        return {}
    prompts = [r["prompt"] for r in rows]
    columns = columns_of(rows)
    k = cfg.eval_k
    limit = getattr(cfg, "max_prompt_length", 512)
    common = dict(max_new_tokens=cfg.max_completion_length, max_prompt_length=limit,
                  truncate_prompts=getattr(cfg, "truncate_prompts", "error"),
                  backend=policy_backend(getattr(cfg, "generation_backend", "auto")))
    runs = {"greedy": generate(model, tokenizer, prompts, 1, greedy=True, **common)}
    if sampled:
        runs["sampled"] = generate(model, tokenizer, prompts, k, temperature=cfg.eval_temperature, **common)
    if "answer" in columns:
        out = {"eval/accuracy": float(torch.tensor(answer_match(prompts, runs["greedy"].completions, **columns)).mean())}
        if sampled:
            right = torch.tensor(answer_match(runs["sampled"].prompts, runs["sampled"].completions,
                                              **columns_of(rows, k))).view(-1, k)  # (n, k)
            out["eval/mean_at_k"] = right.mean().item()
            out["eval/pass_at_k"] = (right.max(dim=1).values > 0).float().mean().item()
        return out
    reward_fns = [get_reward_fn(s, sandbox=cfg.sandbox) for s in cfg.reward_funcs]
    score = dict(timeout_s=cfg.reward_timeout_s)
    weights = getattr(cfg, "reward_weights", None)
    out = {"eval/reward": score_completions(reward_fns, weights, prompts, runs["greedy"].completions, columns,
                                            chat=chat_prompts(rows), **score)[0].mean().item()}
    if sampled:
        r, _ = score_completions(reward_fns, weights, runs["sampled"].prompts, runs["sampled"].completions,
                                 columns_of(rows, k), chat=chat_prompts(rows, k), **score)
        out["eval/sampled_reward"] = r.mean().item()
    return out
