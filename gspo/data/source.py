"""The prompt-source plug: where a step's prompts come from, how they are scored and evaluated.

`SingleTask` (one task or dataset, its reward functions) and `gspo.data.mixture.TaskMixture`
(several tasks drawn by weight) answer the same calls: `next(n)` rows, `score(...)` rewards,
`observe(...)` per-task metrics (and dynamic weights), `evaluate(...)`, and a `state_dict` that
is part of a checkpoint.
"""

from __future__ import annotations

import torch

from gspo.data.evaluation import evaluate
from gspo.data.mixture import TaskMixture
from gspo.data.rewards import get_reward_fn, score_completions
from gspo.data.rows import PromptSampler, chat_prompts, check_prompt_lengths, columns_of, load_splits


def prompt_source(cfg, tokenizer, num_train: int):
    """`TaskMixture` for a config with `tasks`, else `SingleTask`; every prompt is length-checked now."""
    source = TaskMixture.from_config(cfg, tokenizer, num_train) if cfg.tasks else SingleTask.from_config(
        cfg, tokenizer, num_train)
    # Every prompt of every task, train and held-out, is checked now, not when first drawn.
    for rows in [*source.train_rows, *source.eval_rows]:
        check_prompt_lengths(rows, tokenizer, cfg.max_prompt_length, cfg.truncate_prompts)
    return source


class SingleTask:
    """One task's shuffled training rows, its reward functions and its held-out rows."""

    def __init__(self, train_rows: list[dict], eval_rows: list[dict], reward_fns: list, reward_weights,
                 seed: int):
        self.sampler = PromptSampler(train_rows, seed)
        self.held_out = eval_rows
        self.reward_fns, self.reward_weights = reward_fns, reward_weights

    @classmethod
    def from_config(cls, cfg, tokenizer, num_train: int) -> "SingleTask":
        train_rows, eval_rows = load_splits(cfg, tokenizer, num_train=num_train)
        reward_fns = [get_reward_fn(spec, sandbox=cfg.sandbox) for spec in cfg.reward_funcs]
        return cls(train_rows, eval_rows, reward_fns, cfg.reward_weights, cfg.seed)

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
              completion_ids: list[list[int]] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Rewards (N,) and each function's raw values (N,) of `rows`' completions (G per row, in order)."""
        return score_completions(self.reward_fns, self.reward_weights, prompts, completions,
                                 columns_of(rows, group_size), drop_bad=drop_bad, timeout_s=timeout_s,
                                 chat=chat_prompts(rows, group_size), completion_ids=completion_ids)

    def observe(self, rewards: torch.Tensor, valid: torch.Tensor, group_size: int) -> dict[str, float]:
        return {}  # one task: nothing per task to report or reweigh

    def evaluate(self, model, tokenizer, cfg) -> dict[str, float]:
        return evaluate(model, tokenizer, self.held_out, cfg)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
