"""A value model for PPO: a causal LM's decoder with a scalar head, one value per completion token.

The value at completion token t estimates the return from t on, given the prompt and tokens
before t: it is read from the hidden state at position P + t - 1, the one whose logits predict
token t (as `gspo.logprobs.completion_logprobs` reads log-probs). By default the decoder starts as
a copy of the policy's (InstructGPT, TRL's PPO: the critic shares the policy's architecture and
initial weights), the head at zero, so every value starts at 0.

Not yet a trainer plug: the critic's place in the loop (values once per rollout, trained on the
same minibatches, checkpointed) is the rest of issue 17.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from gspo.logprobs import position_ids_from_mask


class ValueModel(nn.Module):
    """decoder (a HF base model: hidden states (N, L, H)) + head Linear(H, 1)."""

    def __init__(self, decoder: nn.Module, hidden_size: int):
        super().__init__()
        self.decoder = decoder
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(N, L) values of every position (from its hidden state)."""
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids_from_mask(attention_mask), use_cache=False)
        hidden = out.last_hidden_state  # (N, L, H)
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)  # (N, L)


def value_model_from(policy) -> ValueModel:
    """A critic with the policy's decoder (a copy of its current weights) and a zero head."""
    decoder = getattr(policy, "get_decoder", lambda: None)()
    if decoder is None:
        raise ValueError(f"critic: {type(policy).__name__} has no decoder to copy (get_decoder); give a value "
                         "model of your own")
    config = policy.config.get_text_config()
    critic = ValueModel(copy.deepcopy(decoder), config.hidden_size)
    return critic.to(next(policy.parameters()).device)


def completion_values(critic: ValueModel, input_ids: Tensor, attention_mask: Tensor, completion_len: int) -> Tensor:
    """(N, T) values of the completion tokens: token t's from position P + t - 1. input_ids (N, P+T)."""
    if completion_len < 1 or input_ids.shape[1] <= completion_len:
        raise ValueError(f"completion_len={completion_len} must be in [1, {input_ids.shape[1] - 1}]")
    values = critic(input_ids, attention_mask)  # (N, P+T)
    P = input_ids.shape[1] - completion_len
    return values[:, P - 1 : -1]  # (N, T)


def terminal_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """(N, T) per-token rewards: each sequence's scalar reward (N,) on its last completion token, 0 elsewhere."""
    mask = mask.bool()
    last = mask.long().sum(-1).clamp(min=1) - 1  # (N,) index of the last real token
    out = torch.zeros(mask.shape, dtype=rewards.dtype if rewards.is_floating_point() else torch.float32)
    out = out.to(rewards.device)  # (N, T)
    out[torch.arange(mask.shape[0], device=rewards.device), last] = rewards.to(out.dtype)
    return torch.where(mask, out, torch.zeros_like(out))
