"""Mixed precision and gradient checkpointing for the policy's forwards.

    autocast = forward_precision(cfg.bf16, device, cfg.fp16)  # a context factory: bf16/fp16 autocast, or nothing
    with autocast():
        logp, _ = completion_logprobs(model, ...)   # matmuls in bf16, log-softmax in fp32, weights fp32

Autocast keeps the float32 weights as masters: the optimizer, its state and the gradients stay
float32 and only the forward's matmuls run in bfloat16 (or float16). The trainer opens the same context
around every policy forward (sampling, pi_old, pi_ref, training, evaluation), so pi_old and pi_theta
share their numerics and the on-policy ratio stays exactly 1. float16 has 3 more mantissa bits than
bfloat16 (a smaller rounding error, arXiv 2510.26788) and a far smaller range: its backward runs on a
dynamically scaled loss (`loss_scaler`), so that small gradients do not underflow.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch


def forward_precision(bf16: bool, device: torch.device, fp16: bool = False):
    """A zero-argument context factory: torch.autocast(bfloat16) (`bf16`) or torch.autocast(float16)
    (`fp16`) on `device`, or a null context.

    A ValueError names the device where that autocast is not available (a GPU without bf16, a
    device type torch cannot autocast).
    """
    if bf16 and fp16:
        raise ValueError("bf16 and fp16: choose one autocast precision")
    if not (bf16 or fp16):
        return contextlib.nullcontext
    name = "bf16" if bf16 else "fp16"
    kind = torch.device(device).type
    if not torch.amp.is_autocast_available(kind):
        raise ValueError(f"{name}: torch cannot autocast on device type {kind!r}; set {name}=false")
    if bf16 and kind == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ValueError(f"bf16: this GPU ({torch.cuda.get_device_name(device)}) has no bfloat16 support; "
                         "set bf16=false")
    return partial(torch.autocast, kind, dtype=torch.bfloat16 if bf16 else torch.float16)


def current_autocast(device):
    """A zero-argument context factory of the autocast this thread runs under on `device`'s type now (its dtype), or
    a null context: for an engine built here whose generator calls run on a thread of its own (autocast is per
    thread), so that they run in the precision of the forwards around it."""
    kind = torch.device(device).type
    if not torch.is_autocast_enabled(kind):
        return contextlib.nullcontext
    return partial(torch.autocast, kind, dtype=torch.get_autocast_dtype(kind))


def loss_scaler(fp16: bool, device) -> torch.amp.GradScaler | None:
    """fp16's dynamic loss scale: torch's GradScaler on `device` (the loss times the scale before the backward,
    the gradients divided by it before their norm; an overflow skips the step and halves the scale, 2000
    finite steps in a row double it). None without fp16: the steps are the optimizer's own."""
    return torch.amp.GradScaler(torch.device(device).type) if fp16 else None


def enable_gradient_checkpointing(model, enabled: bool) -> None:
    """Recompute each decoder layer in the backward (HF's non-reentrant checkpointing) when `enabled`.

    HF checkpoints only in train mode, so sampling (eval mode) keeps its KV cache. A ValueError
    names a model that does not support it.
    """
    if not enabled:
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"gradient_checkpointing: {type(model).__name__} does not support it; "
                         "set gradient_checkpointing=false")
    kwargs = {"use_reentrant": False}  # non-reentrant: frozen inputs (LoRA's base) and hooks (replay) work
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.24's name
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
