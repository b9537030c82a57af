"""Advantages: group-relative (GRPO / GSPO), leave-one-out (RLOO), GAE over tokens (PPO), and
group statistics. Pure functions.

Sequence-level estimators are registered by name (`register_estimator`); `advantage_estimator` in
the config picks one, and `group_advantages` checks the inputs and dispatches to it. `gae` works
per token from a critic's values (N, T) and is not a registered sequence estimator; the config's
choices are `estimator_choices()`: the registry's names and "gae".

Rewards arrive as a flat (N,) tensor, N = B * G, ordered group by group: the G
completions of prompt 0, then the G of prompt 1, and so on.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {}
"""The registry, name -> estimator(rewards, group_size, eps, valid) -> (N,) advantages; config's
`advantage_estimator`."""
TOKEN_ESTIMATORS = ("gae",)
"""Estimators that need a critic and give one advantage per token (gspo/plugs/baselines.py)."""


def estimator_choices() -> tuple[str, ...]:
    """Every value `advantage_estimator` accepts: the registered sequence estimators, then gae."""
    return (*ESTIMATORS, *TOKEN_ESTIMATORS)


def register_estimator(name: str):
    """Decorator: register `estimator(rewards (N,), group_size, eps, valid) -> advantages (N,)` as `name`.

    `valid` is None when every sample counts, else an (N,) bool tensor with at least one False; a
    sample marked False gets advantage 0 and is left out of every mean and std. `group_advantages`
    has checked the inputs before an estimator runs.
    """
    if name in ESTIMATORS:
        raise ValueError(f"advantage estimator {name!r} is already registered")

    def add(estimator):
        ESTIMATORS[name] = estimator
        return estimator

    return add


def unregister_estimator(name: str) -> None:
    """Remove estimator `name` from the registry (e.g. one a test registered)."""
    if ESTIMATORS.pop(name, None) is None:
        raise ValueError(f"advantage estimator {name!r} is not registered")


def group_advantages(rewards: torch.Tensor, group_size: int, estimator: str = "group", eps: float = 1e-4,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """A_i = (r_i - mean of its group) / (std + eps). rewards: (N,) -> advantages (N,).

    estimator: a registered estimator (ESTIMATORS). "group" divides by the group's std (DeepSeekMath
    sec. 4.1.2, GSPO eq. (6)); "batch" by the std of the whole batch (REINFORCE++-baseline); "none" only
    centres (Dr. GRPO argues the std division biases toward easy or hard prompts); "rloo" subtracts
    the mean of the other samples; "reinforce_pp" uses no group at all (the batch's mean and std).
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
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator: unknown {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
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
    return ESTIMATORS[estimator](rewards, group_size, eps, None if valid.all() else valid)


@register_estimator("group")
def group_scaled(rewards: torch.Tensor, group_size: int, eps: float, valid: torch.Tensor | None) -> torch.Tensor:
    """GRPO: centred within the group, divided by the group's population std (+ eps)."""
    r, centred, count = _centred(rewards, group_size, valid)  # (B, G), (B, G), (B, 1) or None
    if valid is None:
        std = r.std(dim=1, unbiased=False, keepdim=True)  # (B, 1)
    else:
        std = ((centred**2).sum(dim=1, keepdim=True) / count).sqrt()  # (B, 1) population std of the valid
    return _flat(centred / (std + eps), rewards)  # (N,)


@register_estimator("batch")
def batch_scaled(rewards: torch.Tensor, group_size: int, eps: float, valid: torch.Tensor | None) -> torch.Tensor:
    """Centred within the group, divided by the population std of the whole batch (+ eps)."""
    _, centred, _ = _centred(rewards, group_size, valid)  # (B, G)
    if valid is None:
        std = rewards.double().std(unbiased=False).expand(1, 1)  # (1, 1)
    else:
        flat = torch.where(valid, rewards, 0).double()  # (N,)
        n = valid.sum().clamp(min=1)
        std = (((flat - flat.sum() / n) ** 2 * valid).sum() / n).sqrt().expand(1, 1)  # (1, 1)
    return _flat(centred / (std + eps), rewards)  # (N,)


@register_estimator("none")
def centred_only(rewards: torch.Tensor, group_size: int, eps: float, valid: torch.Tensor | None) -> torch.Tensor:
    """Dr. GRPO: centred within the group, not divided by any std."""
    return _flat(_centred(rewards, group_size, valid)[1], rewards)  # (N,)


@register_estimator("rloo")
def leave_one_out(rewards: torch.Tensor, group_size: int, eps: float, valid: torch.Tensor | None) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, "Back to Basics"): r_i minus the mean of the other valid rewards of
    its group, not divided by any std; 0 for a sample with no valid sibling. With k valid samples,
    r_i - mean_{j != i} r_j = k / (k - 1) * (r_i - mean_j r_j), which is how it is computed."""
    _, centred, count = _centred(rewards, group_size, valid)  # (B, G), (B, G), (B, 1) or None
    k = torch.full((centred.shape[0], 1), float(group_size), dtype=centred.dtype) if count is None else count
    return _flat(torch.where(k > 1, centred * k / (k - 1).clamp(min=1), torch.zeros_like(centred)), rewards)  # (N,)


@register_estimator("reinforce_pp")
def batch_normalised(rewards: torch.Tensor, group_size: int, eps: float, valid: torch.Tensor | None) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025): (r_i - batch mean) / (batch std + eps) over the valid samples, with no
    per-prompt baseline (the groups are ignored); dropped samples get 0."""
    keep = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    r = torch.where(keep, rewards, 0).double()  # (N,)
    n = keep.sum().clamp(min=1)
    mean = r.sum() / n
    std = ((torch.where(keep, r - mean, 0.0) ** 2).sum() / n).sqrt()
    return _flat(torch.where(keep, (r - mean) / (std + eps), 0.0), rewards)  # (N,)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the model's tokens (Schulman et al. 2016, eq. (16)).

    rewards, values, mask: (N, T); mask True on the tokens the model sampled: each row's first L_i tokens
    for single completions, or with holes where an episode's observations are (gspo/rollout/episodes.py).
    values[:, t] is the critic's estimate of the return from token t on. The recursion runs over the masked
    tokens only, in order: the next state after a model token is the next model token (an observation in
    between is part of the transition, as the prompt is), and after a row's last one the value is 0 (the
    episode ends there). With delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next; returns
    A + V. Unmasked tokens hold anything (even NaN), never change a masked token's advantage, and get 0.
    Returns (advantages (N, T), returns (N, T)), float32 computed in float64.

    Example: rewards [0, 0, 0, 1], values [0.5, 0.4, 0.6, 0.7], gamma 0.9, lam 0.8:
    A = [0.0883264, 0.31712, 0.246, 0.3]; with an observation token between the second and the third
    (mask [1, 1, 0, 1, 1]) the model's four tokens get the same four advantages.
    """
    if not 0 <= gamma <= 1 or not 0 <= lam <= 1:
        raise ValueError(f"gae: gamma={gamma!r} and lam={lam!r} must be in [0, 1]")
    if rewards.shape != values.shape or rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(f"gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask "
                         f"{tuple(mask.shape)} must be the same (N, T)")
    mask = mask.bool()
    r = torch.where(mask, rewards.double(), 0.0)  # (N, T)
    v = torch.where(mask, values.detach().double(), 0.0)  # (N, T)
    advantages = torch.zeros_like(r)  # (N, T)
    running = torch.zeros_like(r[:, 0])  # (N,) A of the next model token (0 past a row's last)
    following = torch.zeros_like(running)  # (N,) V of the next model token (0 past a row's last)
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * following - v[:, t]  # (N,)
        here = mask[:, t]  # (N,) an unmasked token passes both on unchanged
        running = torch.where(here, delta + gamma * lam * running, running)  # (N,)
        following = torch.where(here, v[:, t], following)  # (N,)
        advantages[:, t] = torch.where(here, running, 0.0)
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return advantages.to(dtype), torch.where(mask, advantages + v, 0.0).to(dtype)


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, shift_mean: bool = True) -> torch.Tensor:
    """(N, T) values normalised over the masked tokens: (x - mean) / std (population), 0 on padding.

    shift_mean=False only divides by the std (the mean stays), as PPO implementations do for returns."""
    mask = mask.bool()
    x = torch.where(mask, values.double(), 0.0)  # (N, T)
    n = mask.sum().clamp(min=1)
    mean = x.sum() / n
    std = ((torch.where(mask, x - mean, 0.0) ** 2).sum() / n).sqrt()
    out = ((x - mean) if shift_mean else x) / (std + eps)
    return torch.where(mask, out, 0.0).to(values.dtype)


def _centred(rewards: torch.Tensor, group_size: int, valid: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(B, G) rewards in float64, minus their group's mean of the valid ones (dropped samples: 0),
    and (B, 1) valid counts (None when `valid` is None: every sample counts)."""
    if valid is None:
        r = rewards.double().view(-1, group_size)  # (B, G)
        return r, r - r.mean(dim=1, keepdim=True), None
    keep = valid.view(-1, group_size).double()  # (B, G)
    r = torch.where(valid, rewards, 0).double().view(-1, group_size)  # (B, G)
    count = keep.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    return r, (r - (r * keep).sum(dim=1, keepdim=True) / count) * keep, count  # dropped samples: 0


def _flat(adv: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """(B, G) -> (N,) in the rewards' float dtype (float32 for integer rewards)."""
    return adv.view(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def informative_groups(rewards: torch.Tensor, group_size: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) bool: True for a group whose valid rewards do not all agree (at least two valid, max > min), the groups a
    group baseline gives a non-zero advantage. rewards: (N,) with N = B * group_size; valid: (N,) bool or None."""
    if rewards.dim() != 1 or rewards.numel() == 0 or rewards.numel() % group_size:
        raise ValueError(f"rewards: length {rewards.numel()} is not a positive multiple of group_size {group_size}")
    keep = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    r = rewards.double().view(-1, group_size)  # (B, G)
    ok = keep.view(-1, group_size)  # (B, G)
    hi = torch.where(ok, r, -math.inf).max(dim=1).values  # (B,)
    lo = torch.where(ok, r, math.inf).min(dim=1).values  # (B,)
    return (hi > lo) & (ok.sum(dim=1) >= 2)  # (B,)


def fill_groups(informative: torch.Tensor, wanted: int) -> torch.Tensor:
    """Dynamic sampling's choice: the first `wanted` informative groups in the order drawn, topped up with the
    first others where fewer were drawn; their indices in the order drawn. informative: (K,) bool, K >= wanted.

    Example: informative [F, T, F, T, T], wanted 2 -> [1, 3]; wanted 4 -> [0, 1, 3, 4]."""
    if not 0 < wanted <= len(informative):
        raise ValueError(f"fill_groups: {wanted} groups wanted of {len(informative)} drawn")
    order = torch.argsort((~informative).int(), stable=True)  # (K,) informative first, each kind in drawn order
    return order[:wanted].sort().values  # (wanted,)


def zeroes_agreeing_groups(estimator: str) -> bool:
    """Whether registered estimator `estimator` gives every sample of a group whose rewards agree advantage 0 (a
    group baseline does; batch-normalised ones and gae do not): asked of the estimator itself, on two groups."""
    if estimator not in ESTIMATORS:
        return False
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])  # groups of 2: (1, 1) agree, (0, 1) do not
    return bool((group_advantages(rewards, 2, estimator)[:2] == 0).all())


def group_stats(rewards: torch.Tensor, group_size: int, valid: torch.Tensor | None = None) -> dict[str, float]:
    """Statistics of the reward groups. rewards: (N,); valid: optional (N,) bool (False: dropped sample).

    `groups/zero_std_frac`: fraction of groups whose (valid) rewards all agree; their
    advantages are zero, so they carry no learning signal.
    `groups/reward_std_mean`: mean within-group reward std (population std of the valid rewards).
    """
    zero_std = float((~informative_groups(rewards, group_size, valid)).double().mean())  # checks the length too
    r = rewards.double().view(-1, group_size)  # (B, G)
    if valid is not None and not valid.all():
        keep = valid.view(-1, group_size)  # (B, G)
        count = keep.sum(dim=1).clamp(min=1)  # (B,)
        mean = torch.where(keep, r, 0).sum(dim=1) / count  # (B,)
        std = (torch.where(keep, r - mean[:, None], 0) ** 2).sum(dim=1).div(count).sqrt()  # (B,)
    else:
        std = r.std(dim=1, unbiased=False)  # (B,)
    return {"groups/zero_std_frac": zero_std, "groups/reward_std_mean": float(std.mean())}
