"""SFTConfig: cold-start supervised fine-tuning (gspo sft), from the shared sections and fields of its own."""

from __future__ import annotations

from dataclasses import dataclass, field

from gspo.config.machinery import check_positive, checks, coerce_fields
from gspo.config.shared import (
    DataSettings,
    EvalSettings,
    ModelSettings,
    OutputSettings,
    ProgressSettings,
    RewardSettings,
)


@dataclass
class SFTConfig(ProgressSettings, RewardSettings, EvalSettings, DataSettings, OutputSettings, ModelSettings):
    """Cold-start supervised fine-tuning on prompt/answer pairs (loss on answer tokens only)."""

    output_dir: str = "runs/sft"
    """Where metrics and the final model are written."""
    answer_column: str = "solution"
    """Column holding the target completion (built-in tasks: the worked solution)."""
    num_examples: int = 0
    """Demonstrations to train on; 0 uses all of `dataset` (built-in tasks need a number)."""
    max_steps: int = 300
    """Optimizer steps (upper bound when `target_accuracy` stops earlier)."""
    batch_size: int = 32
    """Examples per optimizer step."""
    learning_rate: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    max_length: int = 512
    """Longest prompt+answer in tokens; a longer one is an error."""
    target_accuracy: float | None = None
    """Stop once greedy held-out accuracy reaches this (a deliberately partial cold start)."""
    eval_steps: int = 50
    """Evaluate greedy held-out accuracy every this many steps."""
    reward_funcs: list = field(default_factory=lambda: ["answer_match"])
    """Reward functions scoring held-out answers (success: eval_accuracy_reward >= eval_success_threshold)."""
    max_completion_length: int = 64
    """Maximum new tokens when evaluating."""

    def __post_init__(self):
        coerce_fields(self)


@checks(SFTConfig)
def check_sft(cfg: SFTConfig) -> None:
    """SFT's own fields and the checks across sections (each section's own ran before)."""
    if cfg.task is None and cfg.dataset is None:
        raise ValueError("config: set `task` (a built-in task) or `dataset` (a local data file or folder)")
    check_positive(cfg, "max_steps", "batch_size", "learning_rate", "max_length", "eval_steps",
                   "max_completion_length")
    check_positive(cfg, "num_examples", "warmup_steps", "weight_decay", allow_zero=True)
    if cfg.target_accuracy is not None and not 0 < cfg.target_accuracy <= 1:
        raise ValueError(f"config: target_accuracy={cfg.target_accuracy!r} must be in (0, 1]")
    if cfg.target_accuracy is not None and cfg.eval_num_prompts == 0:
        raise ValueError("config: target_accuracy needs an evaluation; set eval_num_prompts > 0")
    if cfg.task is not None and cfg.dataset is None and cfg.num_examples == 0:
        raise ValueError("config: num_examples must be > 0 for a built-in task (its generator is endless)")
