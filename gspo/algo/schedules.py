"""Schedules of a coefficient over a run: the learning rate (`lr_scheduler`) and the SFT term
(`sft_schedule`, see gspo/plugs/supervised.py). Pure functions of the step number.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")
"""The shapes after warmup: constant, linear to 0, cosine to 0 (config's lr_scheduler and sft_schedule)."""


def schedule(kind: str, step: int, total: int, warmup: int = 0, peak: float = 1.0) -> float:
    """The value at `step` (0-based) of a run of `total` steps that starts with `warmup` of them.

    Warmup (step < warmup): peak * (step + 1) / warmup, a linear ramp that reaches peak on the
    last warmup step. After it, with frac = min(1, (step - warmup) / (total - warmup)):
    constant: peak; linear: peak * (1 - frac); cosine: peak * (1 + cos(pi frac)) / 2.
    Example: linear, total 4, no warmup: 1, 0.75, 0.5, 0.25 at steps 0..3, and 0 from step 4.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"schedule={kind!r} is not one of {', '.join(SCHEDULES)}")
    if warmup and step < warmup:
        return peak * ((step + 1) / warmup)
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "linear":
        return peak * (1.0 - frac)
    if kind == "cosine":
        return peak * 0.5 * (1.0 + math.cos(math.pi * frac))
    return peak


def lr_schedule(kind: str, warmup: int, total: int):
    """The factor of the peak learning rate after `i` optimizer steps, for `torch.optim.lr_scheduler.LambdaLR`.

    A plain function (not a callable object), so LambdaLR keeps it out of the scheduler's state_dict.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"lr_scheduler={kind!r} is not one of {', '.join(SCHEDULES)}")

    def factor(i: int) -> float:
        return schedule(kind, i, total, warmup)

    return factor
