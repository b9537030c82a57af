"""How an objective's per-token terms become one loss, the KL estimators, and the ratio statistics.

Pure functions of tensors, shared by the objectives (gspo/algo/objectives.py) and by any objective
registered elsewhere. Shapes: values, maskf, mask (N, T) over completion tokens.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm", "seq_mean_token_sum")
"""seq_mean_token_mean: mean over each sequence's tokens, then over sequences (GRPO, GSPO);
token_mean: mean over all tokens (DAPO); seq_mean_token_sum_norm: each sequence's sum over a constant
norm_length, then the mean over sequences (Dr. GRPO); seq_mean_token_sum: each sequence's sum, then the mean
over sequences (LUSPO: a sequence counts as many times as it has tokens)."""
KL_ESTIMATORS = ("k1", "k2", "k3")


def aggregate(values: torch.Tensor, maskf: torch.Tensor, aggregation: str, norm_length: int | None) -> torch.Tensor:
    """The 0-d loss of per-token `values` (N, T), already zero on padding, by `aggregation` (AGGREGATIONS)."""
    if aggregation == "seq_mean_token_mean":
        return ((values * maskf).sum(-1) / maskf.sum(-1)).mean()
    if aggregation == "token_mean":
        return (values * maskf).sum() / maskf.sum()
    if aggregation == "seq_mean_token_sum":
        return (values * maskf).sum(-1).mean()
    return ((values * maskf).sum(-1) / float(norm_length)).mean()


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta. Shapes (N, T).

    With log_r = log pi_ref - log pi_theta (Schulman, "Approximating KL divergence"):
    k1 = -log_r (unbiased, can be negative), k2 = log_r^2 / 2, k3 = exp(log_r) - 1 - log_r
    (unbiased, non-negative; DeepSeekMath eq. (4)).
    """
    log_r = ref_logprobs - logprobs  # (N, T)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.pow(2)
    if estimator == "k3":
        return log_r.exp() - 1.0 - log_r
    raise ValueError(f"kl_estimator: unknown {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")


def masked_frac(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """0-d share of the completion tokens (`mask`, (N, T) bool) where `flags` (N, T) holds."""
    return (flags & mask).float().sum() / mask.float().sum()


def ratio_stats(ratio: torch.Tensor, mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """`ratio/{mean,std,min,max}` of a (N, T) token ratio on its completion tokens, or of a (N,) one (mask None)."""
    values = ratio if mask is None else ratio[mask]  # (n,)
    std = values.std(unbiased=False) if values.numel() > 1 else torch.zeros((), dtype=values.dtype)
    return {"ratio/mean": values.mean(), "ratio/std": std, "ratio/min": values.min(), "ratio/max": values.max()}
