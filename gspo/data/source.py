"""The prompt-source plug: where a step's prompts come from, how they are scored and evaluated.

`SingleTask` (one task or dataset, its reward functions) and `gspo.data.mixture.TaskMixture`
(several tasks drawn by weight) answer the same calls: `next(n)` rows, `score(...)` rewards,
`observe(...)` per-task metrics (and dynamic weights), `evaluate(...)`, and a `state_dict` that
is part of a checkpoint, as are its `fingerprints` ({data file: rows and hash}, checked at resume).
"""

from __future__ import annotations

import torch

from gspo.config import RewardSettings, section
from gspo.data.evaluation import Evaluation, evaluate
from gspo.data.mixture import TaskMixture
from gspo.data.rewards import get_reward_fn, reward_options, score_completions
from gspo.data.rows import PromptSampler, chat_prompts, columns_of, config_splits, episode_columns, stderr_line


def prompt_source(cfg, tokenizer, num_train: int, given: dict | None = None, note=stderr_line):
    """`TaskMixture` for a config with `tasks`, else `SingleTask`; every row is checked now, not when first drawn:
    its prompt and length (`load_splits`), and the columns a reward function reads, where it has a
    `check_rows(rows)` (code_tests: its tests). `given`: in-memory data by the names the config's dataset
    settings hold (gspo.Trainer; see `load_rows`). `note`: where the held-out split is said (`load_splits`)."""
    source = TaskMixture.from_config(cfg, tokenizer, num_train, given, note) if cfg.tasks else SingleTask.from_config(
        cfg, tokenizer, num_train, given, note)
    fns_per_task = source.reward_fns if cfg.tasks else [source.reward_fns]
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
    def from_config(cls, cfg, tokenizer, num_train: int, given: dict | None = None, note=stderr_line) -> SingleTask:
        fingerprints = {}
        train_rows, eval_rows = config_splits(cfg, tokenizer, num_train, fingerprints=fingerprints, given=given,
                                              note=note)
        reward_fns = [get_reward_fn(spec, **reward_options(section(cfg, RewardSettings))) for spec in cfg.reward_funcs]
        return cls(train_rows, eval_rows, reward_fns, cfg.reward_weights, cfg.seed, fingerprints, Evaluation.of(cfg))

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
