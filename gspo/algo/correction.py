"""The sampler-trainer mismatch: metrics of mu != pi_old and the rollout corrections (TIS / MIS).

mu is the distribution that sampled a rollout (an inference engine's numerics, a low-precision
copy, stale weights); pi_old the trainer's own likelihood of it before the updates. Both are
given as per-token log-probs of the sampled tokens; everything here is a pure function of them.
Shapes: old_logprobs, sampler_logprobs, mask (N, T) over completion tokens.

Behaviour weight: the token weight w_t = pi_old(y_t) / mu(y_t), the sequence weight
W_i = prod_t w_t (the importance weight of the whole answer) and its geometric mean
exp(mean_t log w_t). A correction turns them into a detached (N, T) factor on each token's
(or sequence's) term of the objective:

    none       no factor
    token_tis  min(w_t, high)                          truncated IS (Yao et al. 2025)
    seq_tis    min(W_i, high) on every token of i
    token_mis  w_t if low <= w_t <= high, else 0        masked IS: the token is dropped
    seq_mis    W_i if low <= W_i <= high, else 0        the whole answer is dropped
    geo_mis    1 if low <= exp(mean_t log w_t) <= high, else 0   (a filter on the per-token
               mismatch that does not grow with length; no weight)

Where mu == pi_old every factor is exactly 1, so a corrected loss equals the uncorrected one
bit for bit. A dropped token keeps its place in the aggregation's denominators (its term is 0).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

CORRECTIONS = ("none", "token_tis", "seq_tis", "token_mis", "seq_mis", "geo_mis")
DEFAULT_THRESHOLDS = {  # (low, high); our defaults: IS weights truncated / kept within a factor of 2
    "token_tis": (None, 2.0), "seq_tis": (None, 2.0),
    "token_mis": (0.5, 2.0), "seq_mis": (0.5, 2.0),
    "geo_mis": (0.99, 1.01),  # a geometric mean: 1% per token on average
}
SEQUENCE_LEVEL = ("seq_tis", "seq_mis", "geo_mis")  # one decision per sequence: stats count sequences
_MAX_LOG = 80.0  # |log W| beyond 80 saturates (exp(80) ~ 5.5e34; float32 holds up to 3.4e38)


def thresholds(mode: str, low: float | None = None, high: float | None = None) -> tuple[float | None, float | None]:
    """The (low, high) a correction uses: the given values, else DEFAULT_THRESHOLDS; checked.

    TIS truncates at `high` and takes no `low`; MIS keeps weights in [low, high], which must
    contain 1 (so that mu == pi_old keeps everything).
    """
    if mode not in CORRECTIONS:
        raise ValueError(f"rollout_correction: unknown {mode!r}; choose one of {', '.join(CORRECTIONS)}")
    if mode == "none":
        if low is not None or high is not None:
            raise ValueError("rollout_correction_low/high: set without a rollout_correction; choose one or unset them")
        return None, None
    default_low, default_high = DEFAULT_THRESHOLDS[mode]
    if mode.endswith("_tis") and low is not None:
        raise ValueError(f"rollout_correction_low: {mode} only truncates at rollout_correction_high; unset low")
    low = default_low if low is None else low
    high = default_high if high is None else high
    for name, value in (("rollout_correction_low", low), ("rollout_correction_high", high)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value!r} must be a finite number > 0")
    if mode.endswith("_tis") and high < 1:
        raise ValueError(f"rollout_correction_high={high!r}: truncating below 1 would shrink even matching tokens")
    if mode.endswith("_mis") and not low <= 1.0 <= high:
        raise ValueError(f"rollout_correction_low/high=({low!r}, {high!r}) must contain 1: with mu == pi_old "
                         "everything must be kept")
    return low, high


def behaviour_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, mode: str,
                      low: float | None = None, high: float | None = None) -> tuple[Tensor | None, dict[str, Tensor]]:
    """The correction's factor on each token's term, (N, T) detached (None for "none"), and its stats.

    stats: `mismatch/clipped_frac` (TIS: tokens or sequences whose weight was truncated) or
    `mismatch/masked_frac` (MIS: tokens or sequences dropped), over tokens for token_* modes and
    over sequences for the others.
    """
    low, high = thresholds(mode, low, high)
    if mode == "none":
        return None, {}
    mask = mask.bool()
    maskf = mask.to(old_logprobs.dtype)  # (N, T)
    log_w = torch.where(mask, old_logprobs.detach() - sampler_logprobs.detach(), torch.zeros_like(maskf))  # (N, T)
    if mode.startswith("token_"):
        w = log_w.exp()  # (N, T)
        if mode == "token_tis":
            factor, hit = w.clamp(max=high), w > high  # (N, T)
            name = "mismatch/clipped_frac"
        else:
            keep = (w >= low) & (w <= high)  # (N, T)
            factor, hit = torch.where(keep, w, torch.zeros_like(w)), ~keep
            name = "mismatch/masked_frac"
        frac = ((hit & mask).to(maskf.dtype).sum() / maskf.sum())
        return torch.where(mask, factor, torch.zeros_like(factor)), {name: frac}
    seq_log_w = log_w.sum(-1)  # (N,) log W_i
    if mode == "seq_tis":
        factor = seq_log_w.clamp(max=math.log(high)).exp()  # (N,) min(W_i, high)
        hit, name = seq_log_w > math.log(high), "mismatch/clipped_frac"
    elif mode == "seq_mis":
        W = seq_log_w.clamp(max=_MAX_LOG).exp()  # (N,)
        keep = (W >= low) & (W <= high)
        factor, hit, name = torch.where(keep, W, torch.zeros_like(W)), ~keep, "mismatch/masked_frac"
    else:  # geo_mis
        geo = (seq_log_w / maskf.sum(-1)).exp()  # (N,) exp(mean_t log w_t)
        keep = (geo >= low) & (geo <= high)
        factor, hit, name = keep.to(maskf.dtype), ~keep, "mismatch/masked_frac"
    return factor[:, None] * maskf, {name: hit.to(maskf.dtype).mean()}


def correction_units(mode: str) -> dict[str, str]:
    """What the stats of `behaviour_weights` average over ("tokens" or "sequences"), for recombining ranks."""
    unit = "sequences" if mode in SEQUENCE_LEVEL else "tokens"
    return {"mismatch/clipped_frac": unit, "mismatch/masked_frac": unit}


# ----------------------------------------------------------------------------------- metrics
def mismatch_moments(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> tuple[dict, dict]:
    """Means (float64) from which `mismatch_metrics` finishes, and what each averages over.

    Near mu == pi_old the weights are ~1: the moments hold w^2 - 1 and W - 1 (expm1), not w^2, so
    the divergences keep their digits even after a float32 reduction across ranks.

    Every entry is a mean over tokens or over sequences (or a `/max`), so that the moments of
    several ranks recombine by a weighted mean: `Topology.reduce(*mismatch_moments(...))`
    needs the counts, which the second dict names ("tokens" / "sequences").
    """
    mask = mask.bool()
    m = mask.double()  # (N, T)
    n_tok = m.sum()
    old = torch.where(mask, old_logprobs.detach().double(), torch.zeros_like(m))  # (N, T)
    mu = torch.where(mask, sampler_logprobs.detach().double(), torch.zeros_like(m))  # (N, T)
    log_w = old - mu  # (N, T) log pi_old/mu, 0 on padding
    w = log_w.exp()
    p, q = old.exp() * m, mu.exp() * m  # (N, T) token probabilities under pi_old and mu
    seq_log_w = log_w.sum(-1)  # (N,)

    def tok(v: Tensor) -> Tensor:  # a mean over completion tokens
        return (v * m).sum() / n_tok

    moments = {
        "tok/k3": tok(w - 1.0 - log_w),  # KL(mu || pi_old) from samples of mu: E_mu[r - 1 - log r], r = pi_old/mu
        "tok/w2m1": tok(torch.expm1(2 * log_w)),  # w^2 - 1: no cancellation near 1
        "tok/absdiff": tok(log_w.abs()),
        "tok/absdiff/max": (log_w.abs() * m).max(),
        "tok/p": tok(p), "tok/q": tok(q), "tok/pp": tok(p * p), "tok/qq": tok(q * q), "tok/pq": tok(p * q),
        "seq/Wm1": torch.expm1(seq_log_w.clamp(-_MAX_LOG, _MAX_LOG)).mean(),  # W - 1
        "seq/W2m1": torch.expm1(2 * seq_log_w.clamp(-_MAX_LOG, _MAX_LOG)).mean(),  # W^2 - 1
        # the ESS in log space, for where the two above lose it: every W far below 1 (long answers, a stale
        # sampler) makes 1 + W2m1 round to 0 in float64
        "seq/ess_log": (2 * torch.logsumexp(seq_log_w, 0) - torch.logsumexp(2 * seq_log_w, 0)
                        - math.log(seq_log_w.numel())).exp(),
    }
    units = {k: "sequences" if k.startswith("seq/") else "tokens" for k in moments}
    return moments, units


def mismatch_metrics(moments: dict) -> dict[str, float]:
    """`mismatch/*` from `mismatch_moments` (of one rank, or recombined over ranks).

    kl: k3 estimate of KL(mu || pi_old) per token; chi2_token: E_mu[w_t^2] - 1 and chi2_seq:
    E_mu[W_i^2] - 1 (chi-square divergences of pi_old from mu, per token and per sequence);
    ess: (mean W)^2 / mean W^2 in (0, 1], the normalised effective sample size of the sequence
    weights (1: all equal); where mean W^2 is below 1e-6 (every answer's W far below 1: long answers, a
    stale sampler; the W - 1 moments have lost its digits) it is computed in log space, on one rank
    exactly, over several the mean of the ranks' own; abs_logp_diff_mean/_max: |log pi_old - log mu| over tokens;
    prob_pearson: Pearson correlation of the tokens' probabilities under pi_old and mu (NaN when
    either is constant).
    """
    g = {k: float(v) for k, v in moments.items()}
    var_p, var_q = g["tok/pp"] - g["tok/p"] ** 2, g["tok/qq"] - g["tok/q"] ** 2
    cov = g["tok/pq"] - g["tok/p"] * g["tok/q"]
    pearson = max(-1.0, min(1.0, cov / math.sqrt(var_p * var_q))) if var_p > 0 and var_q > 0 else math.nan
    return {
        "mismatch/kl": g["tok/k3"],
        "mismatch/chi2_token": g["tok/w2m1"],
        "mismatch/chi2_seq": g["seq/W2m1"],
        "mismatch/ess": ((1.0 + g["seq/Wm1"]) ** 2 / (1.0 + g["seq/W2m1"]) if 1.0 + g["seq/W2m1"] > 1e-6
                         else g["seq/ess_log"]),
        "mismatch/abs_logp_diff_mean": g["tok/absdiff"],
        "mismatch/abs_logp_diff_max": g["tok/absdiff/max"],
        "mismatch/prob_pearson": pearson,
    }
