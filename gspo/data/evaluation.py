"""Held-out evaluation with the run's own reward functions: greedy accuracy and reward, sampled mean@k / pass@k.

Success (accuracy, mean@k, pass@k) is decided by one reward, the first function by default (open-r1 lists
its accuracy reward first), at 1 (eval_accuracy_reward, eval_success_threshold): a weighted total of a mix
with a length or format reward cannot reach full marks, so accuracy by the total read 0 whatever was right.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gspo.config import EpisodeSettings, EvalSettings, RewardSettings, SamplingSettings
from gspo.data.reward_scoring import reward_names
from gspo.data.rewards import get_reward_fn, reward_options, score_completions
from gspo.data.rows import chat_prompts, columns_of, episode_columns
from gspo.rollout import generate, policy_backend, row_seeds

EVAL_STEP = 0
"""The step whose row seeds a seeded evaluation samples with (`row_seeds`): rollouts are steps 1.., so an evaluation
never repeats their draws, and every evaluation of a run draws the same noise (common random numbers)."""


TOTAL = "total"
"""eval_accuracy_reward's name for the weighted total of the reward functions (the rule before that field)."""


def success_threshold(weights: list[float] | None, num_fns: int, threshold: float | None = None) -> float:
    """The total reward at which a completion succeeds: `threshold`, or full marks: the sum of the positive
    weights (every reward in [0, 1] at 1, every penalty at 0). Example: weights [1, 0.5, -0.2]: 1.5."""
    if threshold is not None:
        return float(threshold)
    return float(sum(w for w in (weights or [1.0] * num_fns) if w > 0))


def success_rule(settings: EvalSettings, names: list[str], weights: list[float] | None) -> tuple[str, float]:
    """(the value that decides a held-out completion's success, the value at which it succeeds): the reward named
    by eval_accuracy_reward among `names` (the functions' value names, reward_names), by default the first, at
    eval_success_threshold, by default 1 (a 0/1 reward right); or TOTAL, the weighted total, by default at full
    marks (success_threshold). Example: names [accuracy, format, tag_count]: ("accuracy", 1.0)."""
    wanted, threshold = settings.eval_accuracy_reward, settings.eval_success_threshold
    if wanted == TOTAL:
        return TOTAL, success_threshold(weights, len(names), threshold)
    if wanted is not None and wanted not in names:
        raise ValueError(f"eval_accuracy_reward={wanted!r} names none of the reward functions evaluated "
                         f"({', '.join(names)}); name one of them, {TOTAL} (their weighted total), or null (the first)")
    return (names[0] if wanted is None else wanted), (1.0 if threshold is None else float(threshold))


@dataclass(frozen=True)
class Evaluation:
    """How a run evaluates held-out rows: its evaluation settings, its rewards and the sampling options its
    training uses. `Evaluation.of(...)` builds it from those sections."""

    settings: EvalSettings
    rewards: RewardSettings
    sampling: SamplingSettings  # max_completion_length, prompt limits, seeded_sampling, generation_backend
    seed: int
    episodes: EpisodeSettings = field(default_factory=EpisodeSettings)  # an environment: multi-turn episodes
    template_kwargs: dict | None = None  # what chat messages of an environment are rendered with

    @classmethod
    def of(cls, settings: EvalSettings, rewards: RewardSettings, sampling: SamplingSettings, *, seed: int,
           template_kwargs: dict | None = None, episodes: EpisodeSettings | None = None) -> Evaluation:
        """The builder. `template_kwargs`: DataSettings.chat_template_kwargs, to which the built-in tool
        environment of `episodes` adds its tools. A run without a sampling section (SFT) passes
        SamplingSettings(max_completion_length=...): the defaults otherwise."""
        from gspo.env import chat_template_kwargs

        episodes = EpisodeSettings() if episodes is None else episodes
        return cls(settings, rewards, sampling, seed, episodes, chat_template_kwargs(template_kwargs, episodes))


def episode_runner(model, tokenizer, plan: Evaluation):
    """With an environment, a stand-in for `generate` that runs each completion as an episode (greedy or
    sampled as asked, the run's limits), its Rollout carrying the episodes; None without one."""
    from gspo.env import environment_factory
    from gspo.rollout import GENERATORS, pick_generator
    from gspo.rollout.agents import agent_of, agent_runner
    from gspo.rollout.episodes import EpisodeLimits, sample_episodes

    agent = agent_of(plan.episodes)
    if agent is not None:  # agent episodes on an endpoint of their own, sampling as the evaluation says
        return agent_runner(*agent, model, tokenizer, plan.episodes, plan.sampling, plan.template_kwargs)
    make_env = environment_factory(plan.episodes, plan.rewards.sandbox)
    if make_env is None:
        return None
    limits = EpisodeLimits.of(plan.episodes, plan.sampling.max_completion_length)

    def run(prompts, copies, *, rows, greedy=False, temperature=1.0, row_seeds=None, max_new_tokens,
            max_prompt_length, truncate_prompts, backend):  # max_new_tokens: the limits' max_turn_tokens
        episode_rows = [row for row in rows for _ in range(copies)]
        rollout, _ = sample_episodes(GENERATORS[pick_generator(model, backend)], model, model, tokenizer,
                                     [make_env() for _ in episode_rows], episode_rows, limits, greedy=greedy,
                                     max_prompt_length=max_prompt_length, truncate_prompts=truncate_prompts,
                                     seeds=row_seeds, temperature=temperature, top_p=1.0, top_k=0, min_p=0.0,
                                     repetition_penalty=1.0, chat_template_kwargs=plan.template_kwargs)
        return rollout

    return run


@torch.no_grad()
def evaluate(model, tokenizer, rows: list[dict], plan: Evaluation, *, reward_fns: list | None = None,
             reward_weights: list[float] | None = None, sampled: bool = True) -> dict[str, float]:
    """Held-out scores of `rows`, each completion scored as training scores it: the total reward of `reward_fns`
    with `reward_weights` (None: built from the plan's reward_funcs and reward_weights).

    Greedy: eval/reward (mean total reward) and eval/accuracy (the share of prompts that succeed: whose value of
    the deciding reward reaches its threshold, `success_rule`). Sampled (eval_k per prompt at
    eval_temperature): eval/sampled_reward, eval/mean_at_k (the share of samples that succeed) and
    eval/pass_at_k (of prompts with at least one). Sampled with the policy itself (never a stale or
    low-precision copy, nor an engine), eval_batch_size prompts per generate call; with seeded_sampling
    every completion has its own seed, so the numbers do not depend on that size.
    """
    if not rows:
        return {}
    if reward_fns is None:
        reward_fns = [get_reward_fn(s, **reward_options(plan.rewards)) for s in plan.rewards.reward_funcs]
        reward_weights = plan.rewards.reward_weights
    run_episodes = episode_runner(model, tokenizer, plan)  # an environment, an agent: every completion an episode
    try:
        return _evaluate(model, tokenizer, rows, plan, run_episodes, reward_fns, reward_weights, sampled)
    finally:
        getattr(run_episodes, "close", lambda: None)()  # an agents' endpoint


def _evaluate(model, tokenizer, rows: list[dict], plan: Evaluation, run_episodes, reward_fns: list,
              reward_weights: list[float] | None, sampled: bool) -> dict[str, float]:
    """`evaluate` with its reward functions and episode runner (None: single completions) in hand."""
    settings, sampling = plan.settings, plan.sampling
    decider, threshold = success_rule(settings, reward_names(reward_fns), reward_weights)
    k, size, n = settings.eval_k, settings.eval_batch_size, len(rows)
    seeded = sampling.seeded_sampling
    common = dict(max_new_tokens=sampling.max_completion_length, max_prompt_length=sampling.max_prompt_length,
                  truncate_prompts=sampling.truncate_prompts, backend=policy_backend(sampling.generation_backend))
    starts = range(0, n, size)

    def run(prompts: list[str], copies: int, *, rows: list[dict], **options):
        return (run_episodes(prompts, copies, rows=rows, **options) if run_episodes is not None
                else generate(model, tokenizer, prompts, copies, **options))

    def score(runs: list, copies: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunks' completions' total rewards and deciding values, (n * copies,) each; NaN where dropped."""
        episodes = None if runs[0].episodes is None else [e for r in runs for e in r.episodes]
        rewards, raw = score_completions(
            reward_fns, reward_weights, [p for r in runs for p in r.prompts], [c for r in runs for c in r.completions],
            {**columns_of(rows, copies), **episode_columns(episodes)}, drop_bad=plan.rewards.drop_bad_rewards,
            timeout_s=plan.rewards.reward_timeout_s, chat=chat_prompts(rows, copies),
            completion_ids=[ids for r in runs for ids in r.completion_token_ids()])
        return rewards, rewards if decider == TOTAL else raw[decider].masked_fill(rewards.isnan(), float("nan"))

    def succeeded(value: torch.Tensor) -> torch.Tensor:  # float32 values: a weighted sum may miss by a rounding
        return (value >= threshold - 1e-6 * max(1.0, abs(threshold))).float()

    greedy_runs = [run([r["prompt"] for r in rows[i : i + size]], 1, greedy=True, **common,
                       rows=rows[i : i + size]) for i in starts]
    greedy, deciding = score(greedy_runs, 1)  # (n,) each
    out = {"eval/accuracy": succeeded(deciding).mean().item(), "eval/reward": greedy.nanmean().item()}
    if greedy_runs[0].episodes is not None:  # how often the greedy episodes call a tool at all
        calls = [e["tool_calls"] for r in greedy_runs for e in r.episodes]
        out["eval/tool_call_rate"] = sum(c > 0 for c in calls) / len(calls)
    if sampled:
        runs = [run([r["prompt"] for r in rows[i : i + size]], k, rows=rows[i : i + size],
                         temperature=settings.eval_temperature, **common,  # seeds by global row number: chunk-free
                         row_seeds=row_seeds(plan.seed, EVAL_STEP, i * k, len(rows[i : i + size]) * k) if seeded
                         else None) for i in starts]
        total, deciding = score(runs, k)
        total, success = total.view(n, k), succeeded(deciding).view(n, k)  # (n, k) each
        out.update({"eval/mean_at_k": success.mean().item(), "eval/pass_at_k": success.amax(dim=1).mean().item(),
                    "eval/sampled_reward": total.nanmean().item()})
    return out
