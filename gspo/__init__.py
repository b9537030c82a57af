"""gspo: stable RL post-training of language models (GSPO, GRPO, MoE routing replay)."""

__version__ = "0.1.0"

from gspo.api import GRPOTrainer, GSPOTrainer, Trainer  # noqa: E402  (light: torch loads when training starts)
from gspo.config import TrainConfig  # noqa: E402

__all__ = ["GRPOTrainer", "GSPOTrainer", "TrainConfig", "Trainer"]
