"""A value model for PPO: a causal LM's decoder with a scalar head, one value per completion token.

The value at completion token t estimates the return from t on, given the prompt and tokens
before t: it is read from the hidden state at position P + t - 1, the one whose logits predict
token t (as `gspo.algo.logprobs.completion_logprobs` reads log-probs). By default the decoder starts as
a copy of the policy's (InstructGPT, TRL's PPO: the critic shares the policy's architecture and
initial weights), the head at zero, so every value starts at 0. The trainer plug that computes
values once per rollout and trains the critic is `gspo.plugs.baselines.CriticBaseline`.

On disk (`save_value_model`, the `critic` folder of a PPO run): the decoder as `save_pretrained`
writes it, and the head in `value_head.safetensors`; `load_value_model` reads that folder back, or
takes the decoder of any causal LM checkpoint with a fresh zero head.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import Tensor, nn

from gspo.algo.logprobs import packed_layout, position_ids_from_mask

HEAD_FILE = "value_head.safetensors"


class ValueModel(nn.Module):
    """decoder (a HF base model: hidden states (N, L, H)) + head Linear(H, 1)."""

    def __init__(self, decoder: nn.Module, hidden_size: int):
        super().__init__()
        self.decoder = decoder
        dtype = next(decoder.parameters()).dtype
        with torch.random.fork_rng(devices=[]):  # building the head must not move the run's random stream
            self.head = nn.Linear(hidden_size, 1, dtype=dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def get_decoder(self) -> nn.Module:
        """The decoder (its `.layers` are what fsdp shards one by one)."""
        return self.decoder

    def forward(self, input_ids: Tensor, attention_mask: Tensor, packed: bool = False) -> Tensor:
        """(N, L) float32 values of every position (from its hidden state; the head computed in float32).

        `packed`: the decoder runs on the padding-free rows of a rollout's layout (gspo.algo.logprobs.packed_layout;
        padded where the rows' real tokens are not contiguous); the values at padding are then the head's bias.
        """
        layout = packed_layout(attention_mask) if packed else None
        if layout is not None:
            rows = self.decoder(**layout.inputs(input_ids, attention_mask)).last_hidden_state  # (R, C, H)
            hidden = layout.unpack(rows)  # (N, L, H), 0 at padding
        else:
            hidden = self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids_from_mask(attention_mask),
                                  use_cache=False).last_hidden_state  # (N, L, H)
        weight, bias = self.head.weight.float(), self.head.bias.float()
        return nn.functional.linear(hidden.float(), weight, bias).squeeze(-1)  # (N, L)


def value_model_from(policy) -> ValueModel:
    """A critic with the policy's decoder (a copy of its current weights) and a zero head."""
    decoder = getattr(policy, "get_decoder", lambda: None)()
    if decoder is None:
        raise ValueError(f"critic: {type(policy).__name__} has no decoder to copy (get_decoder); give a value "
                         "model of your own")
    config = policy.config.get_text_config()
    critic = ValueModel(copy.deepcopy(decoder), config.hidden_size)
    return critic.to(next(policy.parameters()).device)


def load_value_model(name_or_path: str, *, dtype: torch.dtype, device, trust_remote_code: bool = False
                     ) -> ValueModel:
    """A critic from a folder or hub name: a gspo `critic` folder (decoder + value head), or any
    causal LM's decoder (`AutoModel`, which drops an LM head) with a zero head."""
    from transformers import AutoModel

    try:
        with torch.random.fork_rng(devices=[]):
            decoder = AutoModel.from_pretrained(name_or_path, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ValueError(f"critic_model {name_or_path!r}: could not load a decoder ({err})") from err
    if not hasattr(decoder, "layers"):
        decoder = getattr(decoder, "get_decoder", lambda: decoder)()  # an encoder-decoder or wrapper: its decoder
    critic = ValueModel(decoder, decoder.config.get_text_config().hidden_size)
    head = Path(name_or_path) / HEAD_FILE
    if head.is_file():
        from safetensors.torch import load_file

        saved = load_file(str(head))
        if set(saved) != {"weight", "bias"} or saved["weight"].shape != critic.head.weight.shape:
            raise ValueError(f"critic_model: {head} does not fit the decoder (hidden size "
                             f"{critic.head.weight.shape[1]}): {({k: tuple(v.shape) for k, v in saved.items()})}")
        with torch.no_grad():
            critic.head.load_state_dict(saved)
    return critic.to(device)


def save_value_model(critic: ValueModel, path, state_dict: dict | None = None) -> None:
    """Write `critic` as `load_value_model` reads it: the decoder's `save_pretrained` and the head.

    `state_dict`: the critic's full weights (fsdp gathers them), else the module's own.
    """
    from safetensors.torch import save_file

    from gspo.checkpoint import umask_modes

    state = critic.state_dict() if state_dict is None else state_dict
    path = Path(path)
    decoder = {k[len("decoder."):]: v for k, v in state.items() if k.startswith("decoder.")}
    critic.decoder.save_pretrained(path, state_dict=decoder)
    save_file({k: state[f"head.{k}"].detach().cpu().contiguous() for k in ("weight", "bias")}, str(path / HEAD_FILE))
    umask_modes(path)  # safetensors writes its files 0600 whatever the umask


def completion_values(critic: ValueModel, input_ids: Tensor, attention_mask: Tensor, completion_len: int,
                      packed: bool = False) -> Tensor:
    """(N, T) values of the completion tokens: token t's from position P + t - 1. input_ids (N, P+T);
    `packed`: the critic's forward padding-free (`ValueModel.forward`)."""
    if completion_len < 1 or input_ids.shape[1] <= completion_len:
        raise ValueError(f"completion_len={completion_len} must be in [1, {input_ids.shape[1] - 1}]")
    values = critic(input_ids, attention_mask, packed=packed)  # (N, P+T)
    P = input_ids.shape[1] - completion_len
    return values[:, P - 1 : -1]  # (N, T)


def terminal_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """(N, T) per-token rewards: each sequence's scalar reward (N,) on its last masked token (an episode's last
    model token), 0 elsewhere."""
    mask = mask.bool()
    last = mask.shape[1] - 1 - mask.flip(-1).int().argmax(-1)  # (N,) index of the last masked token
    out = torch.zeros(mask.shape, dtype=rewards.dtype if rewards.is_floating_point() else torch.float32)
    out = out.to(rewards.device)  # (N, T)
    out[torch.arange(mask.shape[0], device=rewards.device), last] = rewards.to(out.dtype)
    return torch.where(mask, out, torch.zeros_like(out))
