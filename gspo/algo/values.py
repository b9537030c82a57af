"""The critic's side of PPO: the clipped value loss and explained variance. Pure functions.

Shapes: values, old_values, returns, mask (N, T) over completion tokens; padding may hold
anything and never changes a result. old_values are the critic's values when the rollout was
made (computed once, like pi_old); returns the targets (GAE's A + V: gspo.algo.advantages.gae).
"""

from __future__ import annotations

import torch
from torch import Tensor


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip: float | None = 0.2) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss, a token mean: 0.5 * max((V - R)^2, (V_clip - R)^2), with
    V_clip = V_old + clamp(V - V_old, -clip, clip) (the critic may move at most `clip` from its
    rollout-time estimate before the loss stops pulling it further); clip=None: 0.5 * (V - R)^2.

    Returns (loss, stats): `loss/value`, `value/clip_frac` (tokens where the clipped term was the
    larger, i.e. its gradient is cut), `value/mean` (of V over tokens).

    Example: V = 1.5, V_old = 1.0, R = 2.0, clip 0.2: unclipped 0.5 * 0.25 = 0.125, V_clip = 1.2,
    clipped 0.5 * 0.64 = 0.32: the loss is 0.32 and its gradient in V is 0 (the clipped side).
    """
    shape = tuple(values.shape)
    if values.dim() != 2 or any(tuple(t.shape) != shape for t in (old_values, returns, mask)):
        raise ValueError(f"value_loss: values {shape}, old_values {tuple(old_values.shape)}, returns "
                         f"{tuple(returns.shape)} and mask {tuple(mask.shape)} must be the same (N, T)")
    if clip is not None and not clip > 0:
        raise ValueError(f"value_clip: must be > 0 (or null for no clipping), got {clip!r}")
    mask = mask.bool()
    if not mask.any():
        raise ValueError("value_loss: the mask holds no completion token")
    maskf = mask.to(values.dtype)  # (N, T)
    v = torch.where(mask, values, torch.zeros_like(values))  # (N, T) carries the gradient
    old = torch.where(mask, old_values.detach().to(values.dtype), torch.zeros_like(values))  # (N, T)
    target = torch.where(mask, returns.detach().to(values.dtype), torch.zeros_like(values))  # (N, T)
    unclipped = (v - target).square()  # (N, T)
    if clip is None:
        per_token, clipped_more = unclipped, torch.zeros_like(mask)
    else:
        moved = v - old  # (N, T)
        clipped = (old + moved.clamp(-clip, clip) - target).square()  # (N, T)
        # inside the band V_clip is V up to rounding (old + (V - old) need not be V bit for bit): only a
        # value moved beyond `clip` can have the larger, gradient-free clipped term
        clipped_more = (moved.abs() > clip) & (clipped > unclipped)  # (N, T)
        per_token = torch.where(clipped_more, clipped, unclipped)  # (N, T) = max of the two
    n = maskf.sum()
    loss = 0.5 * (per_token * maskf).sum() / n
    stats = {"loss/value": loss.detach(), "value/clip_frac": (clipped_more & mask).to(values.dtype).sum() / n,
             "value/mean": (v.detach() * maskf).sum() / n}
    return loss, stats


def token_moments(mask: Tensor, **tensors: Tensor) -> dict[str, float]:
    """Means over the masked tokens of each (N, T) tensor and of its square, in float64:
    {name: mean, name_sq: mean of squares}. Weighted by their token counts they recombine across
    ranks (`Topology.reduce`); NaN where the mask is empty."""
    mask = mask.bool()
    n = float(mask.sum())
    out = {}
    for name, t in tensors.items():
        x = torch.where(mask, t.detach().double(), 0.0)  # (N, T)
        out[name] = float(x.sum()) / n if n else float("nan")
        out[f"{name}_sq"] = float(x.square().sum()) / n if n else float("nan")
    return out


def explained_variance_of(moments: dict) -> float:
    """1 - Var(R - V) / Var(R) from `token_moments(mask, ret=R, err=R - V)` (population variances)."""
    var_r = float(moments["ret_sq"]) - float(moments["ret"]) ** 2
    var_err = float(moments["err_sq"]) - float(moments["err"]) ** 2
    return 1.0 - var_err / var_r if var_r > 1e-12 else float("nan")


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens: 1 a perfect critic, 0 no better than the
    mean return, negative worse than it; NaN when the returns do not vary."""
    return explained_variance_of(token_moments(mask, ret=returns, err=returns - values.detach()))
