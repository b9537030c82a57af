"""The prompt-source plug: where a step's prompts come from, how they are scored and evaluated.

`SingleTask` (one task or dataset, its reward functions) and `gspo.data.mixture.TaskMixture`
(several tasks drawn by weight) answer the same calls: `next(n)` rows, `score(...)` rewards,
`observe(...)` per-task metrics (and dynamic weights), `evaluate(...)`, and a `state_dict` that
is part of a checkpoint, as are its `fingerprints` ({data file: rows and hash}, checked at resume).
"""

from __future__ import annotations

import dataclasses

import torch

from gspo.config import DataSettings, EpisodeSettings, EvalSettings, RewardSettings, SamplingSettings, TaskSettings
from gspo.data.evaluation import Evaluation, evaluate
from gspo.data.mixture import TaskMixture
from gspo.data.rewards import get_reward_fn, reward_options, score_completions
from gspo.data.rows import PromptSampler, SplitLoader, chat_prompts, columns_of, episode_columns, stderr_line


def prompt_source(tokenizer, num_train: int, *, data: DataSettings, rewards: RewardSettings, evals: EvalSettings,
                  sampling: SamplingSettings, tasks: TaskSettings, episodes: EpisodeSettings, seed: int,
                  given: dict | None = None, note=stderr_line):
    """`TaskMixture` for `tasks.tasks`, else `SingleTask`, built from these sections and the run's `seed`. Every row
    is checked now, not when first drawn: its prompt and its length against sampling's max_prompt_length
    (`load_splits`), and the columns a reward function reads, where it has a `check_rows(rows)` (code_tests: its
    tests). `num_train`: the rows a built-in task generates. `given`: in-memory data by the names `data` holds
    (gspo.Trainer; see `load_rows`). `note`: where the held-out split is said (`load_splits`)."""
    evaluation = Evaluation.of(evals, rewards, sampling, seed=seed, template_kwargs=data.chat_template_kwargs,
                               episodes=episodes)
    # the tool environment's tools, shown by a template that shows tools (as evaluation renders them)
    data = dataclasses.replace(data, chat_template_kwargs=evaluation.template_kwargs)
    load = SplitLoader(tokenizer, num_train, evals.eval_num_prompts, seed, sampling.max_prompt_length,
                       sampling.truncate_prompts, given, note)
    if tasks.tasks:
        source = TaskMixture.build(tasks, data, rewards, load, seed=seed, evaluation=evaluation)
        fns_per_task = source.reward_fns
    else:
        source = SingleTask.build(data, rewards, load, seed=seed, evaluation=evaluation)
        fns_per_task = [source.reward_fns]
    for fns, train, held_out in zip(fns_per_task, source.train_rows, source.eval_rows, strict=True):
        for check in filter(None, (getattr(fn, "check_rows", None) for fn in fns)):
            check(train)
            check(held_out)
    return source


class SingleTask:
    """One task's shuffled training rows, its reward functions and its held-out rows."""

    def __init__(self, train_rows: list[dict], eval_rows: list[dict], reward_fns: list, reward_weights,
                 seed: int, fingerprints: dict | None = None, evaluation: Evaluation | None = None):
        self.sampler = PromptSampler(train_rows, seed)
        self.evaluation = evaluation  # how `evaluate` samples and scores (None: a source that is never evaluated)
        self.held_out = eval_rows
        self.reward_fns, self.reward_weights = reward_fns, reward_weights
        self.fingerprints = fingerprints or {}  # {data file: data_fingerprint}, recorded in checkpoints

    @classmethod
    def build(cls, data: DataSettings, rewards: RewardSettings, load: SplitLoader, *, seed: int,
              evaluation: Evaluation | None = None) -> SingleTask:
        """The task or dataset of `data`, its rows loaded by `load`, scored by the reward functions of `rewards`."""
        train_rows, eval_rows = load(data)
        reward_fns = [get_reward_fn(spec, **reward_options(rewards)) for spec in rewards.reward_funcs]
        return cls(train_rows, eval_rows, reward_fns, rewards.reward_weights, seed, load.fingerprints, evaluation)

    @property
    def train_rows(self) -> list[list[dict]]:
        return [self.sampler.rows]

    @property
    def eval_rows(self) -> list[list[dict]]:
        return [self.held_out]

    def next(self, n: int) -> list[dict]:
        return self.sampler.next(n)

    def score(self, rows: list[dict], prompts: list[str], completions: list[str], group_size: int, *,
              drop_bad: bool = False, offset: int = 0, timeout_s: float | None = None,
              completion_ids: list[list[int]] | None = None,
              episodes: list[dict] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Rewards (N,) and each function's raw values (N,) of `rows`' completions (G per row, in order);
        multi-turn `episodes` (Rollout.episodes) add their columns (episode_columns)."""
        return score_completions(self.reward_fns, self.reward_weights, prompts, completions,
                                 {**columns_of(rows, group_size), **episode_columns(episodes)}, drop_bad=drop_bad,
                                 timeout_s=timeout_s,
                                 chat=chat_prompts(rows, group_size), completion_ids=completion_ids)

    def observe(self, rewards: torch.Tensor, valid: torch.Tensor, group_size: int) -> dict[str, float]:
        return {}  # one task: nothing per task to report or reweigh

    def evaluate(self, model, tokenizer) -> dict[str, float]:
        return evaluate(model, tokenizer, self.held_out, self.evaluation, reward_fns=self.reward_fns,
                        reward_weights=self.reward_weights)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict, past_end: bool = False) -> None:
        self.sampler.load_state_dict(state, past_end)
