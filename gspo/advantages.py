"""Group-relative advantages (GRPO / GSPO) and group statistics. Pure functions.

Rewards arrive as a flat (N,) tensor, N = B * G, ordered group by group: the G
completions of prompt 0, then the G of prompt 1, and so on.
"""

from __future__ import annotations

import torch

SCALES = ("group", "batch", "none")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """A_i = (r_i - mean of its group) / (std + eps). rewards: (N,) -> advantages (N,).

    scale: "group" divides by the group's std (DeepSeekMath sec. 4.1.2, GSPO eq. (6));
    "batch" by the std of the whole batch (as in REINFORCE++); "none" only centres
    (Dr. GRPO argues the std division biases toward easy or hard prompts).
    The std is the population std (divide by G), so a group whose rewards all agree gets
    exactly zero advantage and never NaN.

    Example: rewards [1, 0, 0, 0], G = 4: mean 0.25, std sqrt(3)/4 = 0.4330,
    A = [1.7317, -0.5772, -0.5772, -0.5772] (eps 1e-4).
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        raise ValueError(f"rewards: expected a 1-D tensor (N,), got {getattr(rewards, 'shape', type(rewards))}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: must be a positive int, got {group_size!r}")
    if rewards.numel() == 0 or rewards.numel() % group_size:
        raise ValueError(f"rewards: length {rewards.numel()} is not a positive multiple of group_size {group_size}")
    if scale not in SCALES:
        raise ValueError(f"scale: unknown {scale!r}; choose one of {', '.join(SCALES)}")
    if not torch.isfinite(rewards).all():
        raise ValueError(f"rewards: non-finite value at index {int((~torch.isfinite(rewards)).nonzero()[0, 0])}")
    if eps <= 0:
        raise ValueError(f"eps: must be > 0, got {eps}")
    r = rewards.double().view(-1, group_size)  # (B, G)
    centred = r - r.mean(dim=1, keepdim=True)  # (B, G)
    if scale == "group":
        std = r.std(dim=1, unbiased=False, keepdim=True)  # (B, 1)
    elif scale == "batch":
        std = rewards.double().std(unbiased=False).expand(1, 1)  # (1, 1)
    else:
        return centred.view(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)
    adv = centred / (std + eps)  # (B, G)
    return adv.view(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def group_stats(rewards: torch.Tensor, group_size: int) -> dict[str, float]:
    """Statistics of the reward groups. rewards: (N,).

    `groups/zero_std_frac`: fraction of groups whose rewards all agree; their
    advantages are zero, so they carry no learning signal.
    `groups/reward_std_mean`: mean within-group reward std.
    """
    if rewards.dim() != 1 or rewards.numel() == 0 or rewards.numel() % group_size:
        raise ValueError(f"rewards: length {rewards.numel()} is not a positive multiple of group_size {group_size}")
    r = rewards.double().view(-1, group_size)  # (B, G)
    std = r.std(dim=1, unbiased=False)  # (B,)
    return {
        "groups/zero_std_frac": float((r.max(dim=1).values == r.min(dim=1).values).double().mean()),
        "groups/reward_std_mean": float(std.mean()),
    }
