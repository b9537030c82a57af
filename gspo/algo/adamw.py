"""AdamW with its two moments stored in a lower precision than the weights (bfloat16 moments for float32 weights).

torch's AdamW keeps both moments in the parameter's dtype: for a float32 model that is 8 bytes per trained
parameter, twice the weights (SmolLM2-135M: 1.0 GiB of a full fine-tuning run's peak). Here the moments live in
`state_dtype`; each step reads them into float32, does the update in float32 (the same arithmetic as
`torch.optim.AdamW`: decoupled weight decay, bias correction, eps added after the square root) and stores them
back. The weights stay float32. What bfloat16's 8-bit mantissa does to learning is measured in
docs/benchmarks.md, section 13.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

CHUNK = 1 << 20  # elements per piece of a large tensor: its float32 temporaries stay at a few MB


def adamw_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int, lr: float,
                 beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step on one tensor, in place. `step` counts from 1 (this step); the moments keep their dtype,
    the arithmetic is float32 (or the parameter's dtype where that is wider). A contiguous tensor larger than
    CHUNK elements is updated a piece at a time (the same values: every operation is elementwise), so the float32
    copies of its moments never exist whole (SmolLM2's embedding: 4 x 113 MB at once otherwise).

    m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2;
    p = p (1 - lr wd) - lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)"""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if param.numel() > CHUNK and all(t.is_contiguous() for t in tensors):
        for pieces in zip(*(t.view(-1).split(CHUNK) for t in tensors)):  # views: the updates land in place
            _update(*pieces, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        return
    _update(*tensors, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)


def _update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int, lr: float,
            beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    wide = torch.promote_types(param.dtype, torch.float32)
    g = grad.to(wide)  # (*param)
    m = exp_avg.to(wide).mul_(beta1).add_(g, alpha=1 - beta1)  # (*param)
    v = exp_avg_sq.to(wide).mul_(beta2).addcmul_(g, g, value=1 - beta2)  # (*param)
    denom = v.sqrt().div_(math.sqrt(1 - beta2 ** step)).add_(eps)  # (*param)
    if weight_decay:
        param.mul_(1 - lr * weight_decay)
    param.addcdiv_(m.to(param.dtype), denom.to(param.dtype), value=-lr / (1 - beta1 ** step))
    exp_avg.copy_(m)  # rounded to the moment's dtype (round to nearest)
    exp_avg_sq.copy_(v)


class LowPrecisionAdamW(torch.optim.Optimizer):
    """`torch.optim.AdamW`'s update with both moments stored as `state_dtype` (torch.bfloat16 by default).

    A torch `Optimizer` (the learning-rate schedulers and checkpoints take it as one); the state per parameter is
    `step` (a float32 scalar tensor, as torch's AdamW keeps it), `exp_avg` and `exp_avg_sq`. A state dict loaded
    into it (torch casts floating state to the parameter's dtype on load) goes back to `state_dtype` at the next
    step, exactly: a bfloat16 value survives the float32 round trip."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, state_dtype: torch.dtype = torch.bfloat16):
        if not state_dtype.is_floating_point:
            raise ValueError(f"LowPrecisionAdamW: state_dtype must be a floating dtype, got {state_dtype}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LowPrecisionAdamW does not take sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                for key in ("exp_avg", "exp_avg_sq"):  # after load_state_dict torch hands them back as p.dtype
                    if state[key].dtype != self.state_dtype:
                        state[key] = state[key].to(self.state_dtype)
                state["step"] += 1
                adamw_update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], step=int(state["step"].item()),
                             lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                             weight_decay=group["weight_decay"])
        return loss
