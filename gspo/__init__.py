"""gspo: stable RL post-training of language models (GSPO, GRPO, MoE routing replay)."""

__version__ = "0.1.0"
