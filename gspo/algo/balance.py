"""The MoE router's auxiliary load-balancing loss, as a pure function of the routers' logits.

Switch Transformer's loss (arXiv 2101.03961, eq. (4)-(6)) in the form Hugging Face's MoE models add to their
loss, scaled by their `router_aux_loss_coef` (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE: `load_balancing_loss_func`),
so that a model's own coefficient means here what it meant in its pre-training:

    loss = E * sum_e f_e * P_e

over every router and every real token together: f_e the number of the tokens' top-k choices that went to
expert e over the number of (router, token) pairs (so sum_e f_e = k), P_e the mean router probability of
expert e over the same pairs. Perfectly balanced routing gives k; all tokens on the same k experts give up to E.
Only P carries a gradient (the choices are discrete): the loss pulls probability toward the experts chosen
least. The top-k is the logits' own, also where routing replay overrules them (Hugging Face's does the same).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def load_balance_loss(router_logits: Sequence[Tensor], top_k: int, mask: Tensor | None = None) -> Tensor:
    """0-d float32 load-balancing loss of `router_logits`, one (M, E) tensor per router over the same M token
    rows; `mask` (M,) 1 on the rows that count (real tokens), 0 on padding; None: every row counts."""
    if not router_logits:
        raise ValueError("router_logits: no router's logits (no forward ran through an MoE layer)")
    rows, experts = router_logits[0].shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be in [1, {experts}] (the experts)")
    weight = (torch.ones(rows, device=router_logits[0].device) if mask is None
              else mask.to(device=router_logits[0].device, dtype=torch.float32).reshape(-1))  # (M,)
    if weight.shape[0] != rows:
        raise ValueError(f"mask: {weight.shape[0]} rows for router logits of {rows}")
    counts = torch.zeros(experts, device=weight.device)  # (E,) top-k choices per expert
    probs = torch.zeros(experts, device=weight.device)  # (E,) summed router probabilities
    for logits in router_logits:  # (M, E) each
        p = torch.softmax(logits.float(), dim=-1)  # (M, E)
        chosen = torch.zeros_like(p).scatter_(1, p.topk(top_k, dim=-1).indices, 1.0)  # (M, E) 0/1
        counts = counts + (chosen * weight[:, None]).sum(0)  # (E,)
        probs = probs + (p * weight[:, None]).sum(0)  # (E,)
    pairs = weight.sum() * len(router_logits)  # (router, real token) pairs
    return experts * (counts / pairs * probs / pairs).sum()
