"""Group-relative advantages (GRPO / GSPO) and group statistics. Pure functions.

Rewards arrive as a flat (N,) tensor, N = B * G, ordered group by group: the G
completions of prompt 0, then the G of prompt 1, and so on.
"""

from __future__ import annotations

import math

import torch

SCALES = ("group", "batch", "none")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """A_i = (r_i - mean of its group) / (std + eps). rewards: (N,) -> advantages (N,).

    scale: "group" divides by the group's std (DeepSeekMath sec. 4.1.2, GSPO eq. (6));
    "batch" by the std of the whole batch (as in REINFORCE++); "none" only centres
    (Dr. GRPO argues the std division biases toward easy or hard prompts).
    The std is the population std (divide by G), so a group whose rewards all agree gets
    exactly zero advantage and never NaN.
    valid: optional (N,) bool; samples marked False (a dropped reward, possibly NaN) get
    advantage 0 and are left out of every mean and std.

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
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    elif valid.shape != rewards.shape or valid.dtype != torch.bool:
        raise ValueError(f"valid: expected a bool tensor of shape {tuple(rewards.shape)}, got {valid.dtype} "
                         f"{tuple(valid.shape)}")
    bad = valid & ~torch.isfinite(rewards)
    if bad.any():
        raise ValueError(f"rewards: non-finite value at index {int(bad.nonzero()[0, 0])}")
    if eps <= 0:
        raise ValueError(f"eps: must be > 0, got {eps}")
    if valid.all():
        return _advantages(rewards, group_size, scale, eps)
    keep = valid.view(-1, group_size).double()  # (B, G)
    r = torch.where(valid, rewards, 0).double().view(-1, group_size)  # (B, G)
    count = keep.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    centred = (r - (r * keep).sum(dim=1, keepdim=True) / count) * keep  # (B, G) dropped samples: 0
    if scale == "group":
        std = ((centred**2).sum(dim=1, keepdim=True) / count).sqrt()  # (B, 1) population std of the valid
    elif scale == "batch":
        flat = torch.where(valid, rewards, 0).double()  # (N,)
        n = valid.sum().clamp(min=1)
        std = (((flat - flat.sum() / n) ** 2 * valid).sum() / n).sqrt().expand(1, 1)  # (1, 1)
    else:
        return centred.view(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)
    adv = centred / (std + eps)  # (B, G)
    return adv.view(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def _advantages(rewards: torch.Tensor, group_size: int, scale: str, eps: float) -> torch.Tensor:
    """group_advantages when every sample is valid."""
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


def group_stats(rewards: torch.Tensor, group_size: int, valid: torch.Tensor | None = None) -> dict[str, float]:
    """Statistics of the reward groups. rewards: (N,); valid: optional (N,) bool (False: dropped sample).

    `groups/zero_std_frac`: fraction of groups whose (valid) rewards all agree; their
    advantages are zero, so they carry no learning signal.
    `groups/reward_std_mean`: mean within-group reward std (population std of the valid rewards).
    """
    if rewards.dim() != 1 or rewards.numel() == 0 or rewards.numel() % group_size:
        raise ValueError(f"rewards: length {rewards.numel()} is not a positive multiple of group_size {group_size}")
    if valid is not None and not valid.all():
        keep = valid.view(-1, group_size)  # (B, G)
        r = rewards.double().view(-1, group_size)  # (B, G)
        hi = torch.where(keep, r, -math.inf).max(dim=1).values  # (B,)
        lo = torch.where(keep, r, math.inf).min(dim=1).values  # (B,)
        count = keep.sum(dim=1).clamp(min=1)  # (B,)
        mean = torch.where(keep, r, 0).sum(dim=1) / count  # (B,)
        std = (torch.where(keep, r - mean[:, None], 0) ** 2).sum(dim=1).div(count).sqrt()  # (B,)
        return {"groups/zero_std_frac": float(((hi <= lo) | (keep.sum(dim=1) < 2)).double().mean()),
                "groups/reward_std_mean": float(std.mean())}
    r = rewards.double().view(-1, group_size)  # (B, G)
    std = r.std(dim=1, unbiased=False)  # (B,)
    return {
        "groups/zero_std_frac": float((r.max(dim=1).values == r.min(dim=1).values).double().mean()),
        "groups/reward_std_mean": float(std.mean()),
    }
