"""Held-out evaluation with the run's own reward functions: greedy accuracy and reward, sampled mean@k / pass@k."""

from __future__ import annotations

import torch

from gspo.data.rewards import get_reward_fn, reward_options, score_completions
from gspo.data.rows import chat_prompts, columns_of
from gspo.rollout import generate, policy_backend, row_seeds

EVAL_STEP = 0
"""The step whose row seeds a seeded evaluation samples with (`row_seeds`): rollouts are steps 1.., so an evaluation
never repeats their draws, and every evaluation of a run draws the same noise (common random numbers)."""


def success_threshold(weights: list[float] | None, num_fns: int, threshold: float | None = None) -> float:
    """The total reward at which a completion succeeds: `threshold`, or full marks: the sum of the positive
    weights (every reward in [0, 1] at 1, every penalty at 0). Example: weights [1, 0.5, -0.2]: 1.5."""
    if threshold is not None:
        return float(threshold)
    return float(sum(w for w in (weights or [1.0] * num_fns) if w > 0))


@torch.no_grad()
def evaluate(model, tokenizer, rows: list[dict], cfg, *, reward_fns: list | None = None,
             reward_weights: list[float] | None = None, sampled: bool = True) -> dict[str, float]:
    """Held-out scores of `rows`, each completion scored as training scores it: the total reward of `reward_fns`
    with `reward_weights` (None: built from `cfg.reward_funcs` and `cfg.reward_weights`).

    Greedy: eval/reward (mean total reward) and eval/accuracy (the share of prompts whose total reward reaches
    `success_threshold`, cfg.eval_success_threshold or full marks). Sampled (`cfg.eval_k` per prompt at
    `cfg.eval_temperature`): eval/sampled_reward, eval/mean_at_k (the share of samples that succeed) and
    eval/pass_at_k (of prompts with at least one). Sampled with the policy itself (never a stale or
    low-precision copy, nor an engine), `cfg.eval_batch_size` prompts per generate call; with
    `cfg.seeded_sampling` every completion has its own seed, so the numbers do not depend on that size.
    """
    if not rows:
        return {}
    if reward_fns is None:
        reward_fns = [get_reward_fn(s, **reward_options(cfg)) for s in cfg.reward_funcs]
        reward_weights = getattr(cfg, "reward_weights", None)
    threshold = success_threshold(reward_weights, len(reward_fns), getattr(cfg, "eval_success_threshold", None))
    k, size, n = cfg.eval_k, cfg.eval_batch_size, len(rows)
    seeded = getattr(cfg, "seeded_sampling", False)
    common = dict(max_new_tokens=cfg.max_completion_length, max_prompt_length=getattr(cfg, "max_prompt_length", 512),
                  truncate_prompts=getattr(cfg, "truncate_prompts", "error"),
                  backend=policy_backend(getattr(cfg, "generation_backend", "auto")))
    starts = range(0, n, size)

    def score(runs: list, copies: int) -> torch.Tensor:  # total rewards (n * copies,) of the chunks' completions
        rewards, _ = score_completions(
            reward_fns, reward_weights, [p for r in runs for p in r.prompts], [c for r in runs for c in r.completions],
            columns_of(rows, copies), drop_bad=getattr(cfg, "drop_bad_rewards", False),
            timeout_s=cfg.reward_timeout_s, chat=chat_prompts(rows, copies),
            completion_ids=[ids for r in runs for ids in r.completion_token_ids()])
        return rewards

    def succeeded(total: torch.Tensor) -> torch.Tensor:  # float32 totals: a weighted sum may miss by a rounding
        return (total >= threshold - 1e-6 * max(1.0, abs(threshold))).float()

    greedy = score([generate(model, tokenizer, [r["prompt"] for r in rows[i : i + size]], 1, greedy=True, **common)
                    for i in starts], 1)  # (n,)
    out = {"eval/accuracy": succeeded(greedy).mean().item(), "eval/reward": greedy.nanmean().item()}
    if sampled:
        runs = [generate(model, tokenizer, [r["prompt"] for r in rows[i : i + size]], k,
                         temperature=cfg.eval_temperature, **common,  # seeds by global row number: chunk-free
                         row_seeds=row_seeds(cfg.seed, EVAL_STEP, i * k, len(rows[i : i + size]) * k) if seeded
                         else None) for i in starts]
        total = score(runs, k).view(n, k)  # (n, k)
        success = succeeded(total)  # (n, k)
        out.update({"eval/mean_at_k": success.mean().item(), "eval/pass_at_k": success.amax(dim=1).mean().item(),
                    "eval/sampled_reward": total.nanmean().item()})
    return out
