"""Policy objectives for group-based RL: GRPO, GSPO, GSPO-token, CISPO, SAPO, PG, GMPO, KL-Cov, LUSPO and VESPO,
by name.

Everything here is a pure function of tensors. Shapes:
    logprobs, old_logprobs, ref_logprobs, mask: (N, T) over completion tokens
    advantages: (N,) per sequence, or (N, T) per token where the objective allows it

The loss is minimised; it is the negative of the paper's objective. Padded positions
(mask == 0) never influence the loss or its gradient, whatever values they hold.

Each objective is one pure function of the prepared `LossInputs`, registered with its defaults; its
keyword-only parameters are its options (a run sets them with `objective_options`):

    @register_objective("mine", default_clip=(0.2, 0.2), default_aggregation="token_mean")
    def mine(x: LossInputs, *, temperature: float = 1.0) -> tuple[Tensor, dict]: ...

`policy_loss(..., objective="mine", options={"temperature": 2.0})` then runs it, and the config accepts
`objective: mine` (OBJECTIVES, DEFAULT_CLIP and DEFAULT_AGGREGATION are read from the registry,
gspo/algo/objective_registry.py; aggregations and KL estimators: gspo/algo/aggregation.py).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import torch
from torch import Tensor

from gspo.algo.aggregation import AGGREGATIONS, KL_ESTIMATORS, aggregate, kl_penalty, masked_frac, ratio_stats
from gspo.algo.objective_registry import (
    DEFAULT_AGGREGATION,
    DEFAULT_CLIP,
    OBJECTIVES,
    LossInputs,
    Objective,
    get_objective,
    objective_options,
    register_objective,
    registered_objective,
    unregister_objective,
)

__all__ = ["AGGREGATIONS", "DEFAULT_AGGREGATION", "DEFAULT_CLIP", "KL_ESTIMATORS", "OBJECTIVES", "LossInputs",
           "Objective", "check_aggregation", "check_clip", "check_correction", "check_loss_options", "get_objective",
           "kl_penalty", "objective_options", "policy_loss", "register_objective", "registered_objective",
           "stat_units", "unregister_objective"]


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    objective: str = "gspo",
    clip_low: float | None = None,
    clip_high: float | None = None,
    aggregation: str | None = None,
    norm_length: int | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    options: Mapping | None = None,
    correction_weight: torch.Tensor | None = None,
    validate: bool = True,
    **deprecated,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss for one minibatch.

    logprobs (N, T) log pi_theta of the completion tokens (carries the gradient); old_logprobs (N, T) log
    pi_old (constants); advantages (N,) per sequence or (N, T) per token (not for gspo); mask (N, T) 1 on
    completion tokens, 0 on padding, a token in every row. objective: a registered one (OBJECTIVES).
    clip_low, clip_high: ratio clipped to [1 - clip_low, 1 + clip_high]; None: the objective's (DEFAULT_CLIP).
    aggregation: one of AGGREGATIONS; None: DEFAULT_AGGREGATION[objective]. norm_length: the constant divisor
    of seq_mean_token_sum_norm (Dr. GRPO: the maximum completion length). ref_logprobs (N, T) log pi_ref,
    needed when kl_coef > 0, the weight of the KL to it by kl_estimator "k1", "k2" or "k3" (DeepSeekMath
    eq. (4)). options: the objective's options by name (OBJECTIVES[objective].options has them with their
    defaults), e.g. {"sapo_tau_pos": 2.0}; given as keywords (sapo_tau_pos=2.0) they are deprecated.
    correction_weight (N, T): a rollout correction's factor on each token's term (constants); None: none.
    validate: check the options (`check_loss_options`) and the tensors' values (0/1 mask, a token in every
    row, finite on completion tokens: each a device sync). The trainer checks its options once when it is
    built and passes False; a non-finite value then reaches the non-finite guard.

    Returns (loss, stats): the scalar loss and detached 0-d tensors `loss/policy`, `loss/kl`,
    `ratio/{mean,std,min,max}`, `clip/{low,high}_frac`, `kl/approx` (k3 estimate of KL(pi_old || pi_theta)
    per token) and the objective's own.

    Example: with logprobs == old_logprobs (on-policy) GSPO and GRPO give the same gradient.
    """
    spec = get_objective(objective)
    aggregation = spec.default_aggregation if aggregation is None else aggregation
    options = _with_deprecated(objective, options, deprecated)
    _check_shapes(logprobs, old_logprobs, advantages, mask, ref_logprobs)
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs: required when kl_coef > 0")
    if validate:
        check_loss_options(objective, aggregation, norm_length, kl_coef, kl_estimator, clip_low, clip_high, options)
        _check_values(logprobs, old_logprobs, advantages, mask, ref_logprobs)
    check_correction(objective, correction_weight, tuple(logprobs.shape))
    x = _prepare(spec, logprobs, old_logprobs, advantages, mask, correction_weight,
                 (clip_low, clip_high), aggregation, norm_length)
    policy, stats = spec.loss(x, **{**spec.options, **(options or {})})
    kl_value = _kl_term(x, ref_logprobs, kl_estimator, spec.length_neutral)
    loss = policy + kl_coef * kl_value if ref_logprobs is not None and kl_coef else policy

    # k3 estimate of KL(pi_old || pi_theta) from samples of pi_old, per token.
    approx = (x.log_ratio.exp() - 1.0 - x.log_ratio).detach()  # (N, T)
    stats["kl/approx"] = (approx * x.maskf).sum() / x.maskf.sum()
    stats["loss/policy"] = policy.detach()
    stats["loss/kl"] = kl_value.detach()
    return loss, {k: v.detach() for k, v in stats.items()}


def _kl_term(x: LossInputs, ref_logprobs: torch.Tensor | None, estimator: str, length_neutral: bool) -> torch.Tensor:
    """0-d estimate of KL(pi_theta || pi_ref), aggregated as the policy term; 0 without ref_logprobs."""
    if ref_logprobs is None:
        return torch.zeros((), dtype=x.logp.dtype)
    ref = torch.where(x.mask, ref_logprobs.detach(), torch.zeros_like(x.logp))  # (N, T)
    kl_tok = kl_penalty(x.logp, ref, estimator)  # (N, T)
    # KL is a per-token quantity: average it within each sequence, then over sequences, so
    # that it is length-neutral like the policy term of the sequence-level objectives.
    return aggregate(kl_tok, x.maskf, "seq_mean_token_mean" if length_neutral else x.aggregation, x.norm_length)


def _prepare(spec: Objective, logprobs, old_logprobs, advantages, mask, correction_weight, clip: tuple,
             aggregation: str, norm_length: int | None) -> LossInputs:
    """The objective's inputs, computed once: padding zeroed, the clip range resolved."""
    mask = mask if mask.dtype == torch.bool else mask.bool()  # (N, T)
    low, high = (default if value is None else value for value, default in zip(clip, spec.default_clip))
    maskf = mask.to(logprobs.dtype)  # (N, T)
    # Padding may hold anything (even inf/NaN): zero it before any arithmetic so that no
    # NaN can leak into the loss or, through 0 * inf, into the gradient.
    logp = torch.where(mask, logprobs, torch.zeros_like(logprobs))  # (N, T)
    old = torch.where(mask, old_logprobs.detach(), torch.zeros_like(logprobs))  # (N, T)
    adv = advantages.detach().to(logprobs.dtype)
    adv_t = adv if adv.dim() == 2 else adv[:, None].expand_as(logp)  # (N, T)
    adv_t = torch.where(mask, adv_t, torch.zeros_like(adv_t))
    log_ratio = logp - old  # (N, T), 0 on padding
    lengths = maskf.sum(-1)  # (N,)
    weight = None if correction_weight is None else torch.where(
        mask, correction_weight.detach().to(logprobs.dtype), torch.zeros_like(logprobs))  # (N, T)
    return LossInputs(logp, log_ratio, adv, adv_t, mask, maskf, lengths, low, high, aggregation, norm_length, weight)


def _with_deprecated(objective: str, options: Mapping | None, deprecated: dict) -> Mapping | None:
    """`options` with those given as keywords (`sapo_tau_pos=...`, deprecated) added: as before, a keyword the
    objective does not take is ignored; a name no registered objective takes is a TypeError, as Python's."""
    if not deprecated:
        return options
    known = {name for spec in OBJECTIVES.values() for name in spec.options}
    for name in deprecated:
        if name not in known:
            raise TypeError(f"policy_loss() got an unexpected keyword argument {name!r}")
        if name in (options or {}):
            raise ValueError(f"options: {name!r} given twice, in options and as a keyword; give it in options only")
    given = ", ".join(f"{k}={v!r}" for k, v in deprecated.items())
    warnings.warn(f"policy_loss({given}): objective options as keywords are deprecated; pass them as "
                  f"options={{{', '.join(f'{k!r}: {v!r}' for k, v in deprecated.items())}}}",
                  DeprecationWarning, stacklevel=3)
    taken = get_objective(objective).options
    return {**(options or {}), **{k: v for k, v in deprecated.items() if k in taken}}


# ------------------------------------------------------------------------------- the objectives
@register_objective("gspo", default_clip=(3e-4, 4e-4),  # GSPO paper, sec. 5.1: sequence ratios live near 1
                    default_aggregation="seq_mean_token_mean", length_neutral=True,  # GSPO eq. (5): 1/G sum_i
                    ratio_unit="sequences", corrects=True, token_advantages=False)
def gspo(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: one length-normalised ratio per sequence, clipped, times the sequence's advantage."""
    if x.adv.dim() == 2:
        raise ValueError("advantages: objective 'gspo' takes one advantage per sequence (N,); "
                         "use objective='gspo_token' for per-token advantages")
    per_seq, stats = _clipped_sequence_terms(x)  # (N,)
    return x.weigh_seq(per_seq).mean(), stats


def _clipped_sequence_terms(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO's term of each sequence, -min(s_i A_i, clip(s_i) A_i) (N,), with its ratio and clip statistics
    (gspo, luspo)."""
    # GSPO eq. (7): s_i = (pi_theta(y_i|x) / pi_old(y_i|x)) ^ (1/|y_i|)
    seq_log_ratio = x.log_ratio.sum(-1) / x.lengths  # (N,)
    ratio = seq_log_ratio.exp()  # (N,)
    clipped = ratio.clamp(1.0 - x.low, 1.0 + x.high)  # (N,)
    # GSPO eq. (5): -min(s_i A_i, clip(s_i) A_i), one term per sequence
    per_seq = -torch.minimum(ratio * x.adv, clipped * x.adv)  # (N,)
    stats = ratio_stats(ratio.detach(), None)
    low_hit = (ratio < 1.0 - x.low) & (x.adv < 0)  # (N,) clipping zeroes these gradients
    high_hit = (ratio > 1.0 + x.high) & (x.adv > 0)
    stats["clip/low_frac"] = low_hit.float().mean()
    stats["clip/high_frac"] = high_hit.float().mean()
    return per_seq, stats


@register_objective("grpo", default_clip=(0.2, 0.2),  # DeepSeekMath / PPO epsilon; DAPO's clip-higher: (0.2, 0.28)
                    default_aggregation="seq_mean_token_mean",  # DeepSeekMath eq. (3): 1/G sum_i 1/|o_i| sum_t
                    corrects=True)
def grpo(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO / PPO: a clipped ratio per token."""
    # DeepSeekMath eq. (3) / PPO: token ratio w_t = pi_theta / pi_old
    ratio = x.log_ratio.exp()  # (N, T)
    clipped = ratio.clamp(1.0 - x.low, 1.0 + x.high)
    per_tok = -torch.minimum(ratio * x.adv_t, clipped * x.adv_t)  # (N, T)
    policy = aggregate(x.weigh(per_tok), x.maskf, x.aggregation, x.norm_length)
    stats = ratio_stats(ratio.detach(), x.mask)
    stats["clip/low_frac"] = masked_frac((ratio < 1.0 - x.low) & (x.adv_t < 0), x.mask)
    stats["clip/high_frac"] = masked_frac((ratio > 1.0 + x.high) & (x.adv_t > 0), x.mask)
    return policy, stats


@register_objective("gspo_token", default_clip=(3e-4, 4e-4), default_aggregation="seq_mean_token_mean",
                    length_neutral=True, ratio_unit="sequences",  # GSPO eq. (13): 1/G sum_i 1/|y_i| sum_t
                    corrects=True)
def gspo_token(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token: the sequence ratio's value with a per-token gradient (and optionally per-token advantages)."""
    # GSPO eq. (14): s_{i,t} = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)]; equal to s_i in
    # value, but each token carries its own gradient and may carry its own advantage.
    seq_log_ratio = (x.log_ratio.sum(-1) / x.lengths).detach()  # (N,)
    tok_log_ratio = seq_log_ratio[:, None] + x.logp - x.logp.detach()  # (N, T)
    ratio = tok_log_ratio.exp()  # (N, T)
    clipped = ratio.clamp(1.0 - x.low, 1.0 + x.high)
    # GSPO eq. (13): token term -min(s_{i,t} A_{i,t}, clip(s_{i,t}) A_{i,t})
    per_tok = -torch.minimum(ratio * x.adv_t, clipped * x.adv_t)  # (N, T)
    policy = aggregate(x.weigh(per_tok), x.maskf, x.aggregation, x.norm_length)
    seq_ratio = seq_log_ratio.exp()  # (N,)
    stats = ratio_stats(seq_ratio, None)
    # Clip fractions per sequence (token mean, then sequence mean): equal to GSPO's
    # sequence fractions when the advantage is constant within each sequence.
    low_hit = ((seq_ratio[:, None] < 1.0 - x.low) & (x.adv_t < 0)).to(x.maskf.dtype)
    high_hit = ((seq_ratio[:, None] > 1.0 + x.high) & (x.adv_t > 0)).to(x.maskf.dtype)
    stats["clip/low_frac"] = aggregate(low_hit, x.maskf, "seq_mean_token_mean", None)
    stats["clip/high_frac"] = aggregate(high_hit, x.maskf, "seq_mean_token_mean", None)
    return policy, stats


@register_objective("cispo", default_clip=(1.0, 0.28),  # MiniMax-M1: no lower bound (1 - 1.0 = 0), tuned upper
                    default_aggregation="token_mean",  # MiniMax-M1 eq. (4): 1/sum_i|o_i| sum_i sum_t
                    corrects=True)
def cispo(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE on log pi_theta with a truncated, constant importance weight per token."""
    # MiniMax-M1 eq. (4): -sg(clip(w_t)) * A * log pi_theta(y_t). The weight is truncated,
    # never zeroed, so every token keeps a gradient.
    ratio = x.log_ratio.detach().exp()  # (N, T)
    weight = ratio.clamp(1.0 - x.low, 1.0 + x.high)  # (N, T), constant
    per_tok = -weight * x.adv_t * x.logp  # (N, T)
    policy = aggregate(x.weigh(per_tok), x.maskf, x.aggregation, x.norm_length)
    stats = ratio_stats(ratio, x.mask)
    stats["clip/low_frac"] = masked_frac(ratio < 1.0 - x.low, x.mask)
    stats["clip/high_frac"] = masked_frac(ratio > 1.0 + x.high, x.mask)
    return policy, stats


def _check_sapo(*, sapo_tau_pos: float, sapo_tau_neg: float) -> None:
    if sapo_tau_pos <= 0 or sapo_tau_neg <= 0:
        raise ValueError(f"sapo_tau_pos/sapo_tau_neg: must be > 0, got {sapo_tau_pos}, {sapo_tau_neg}")


@register_objective("sapo", default_clip=(None, None),  # soft gate, no hard clip
                    default_aggregation="seq_mean_token_mean",  # SAPO: 1/G sum_i 1/|y_i| sum_t
                    corrects=True, check_options=_check_sapo)
def sapo(x: LossInputs, *, sapo_tau_pos: float = 1.0, sapo_tau_neg: float = 1.05) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO: a soft sigmoid gate on the token ratio instead of a hard clip; options: its temperatures for A > 0
    (sapo_tau_pos) and A < 0 (sapo_tau_neg), each > 0 (checked by policy_loss and the config: _check_sapo)."""
    # SAPO (arXiv 2511.20347): soft gate f(r) = sigmoid(tau (r - 1)) * 4 / tau replaces the
    # hard clip; its gradient weight 4 sigmoid (1 - sigmoid) r is 1 at r = 1 and decays smoothly.
    ratio = x.log_ratio.exp()  # (N, T)
    tau = torch.where(x.adv_t > 0, torch.full_like(x.adv_t, sapo_tau_pos), torch.full_like(x.adv_t, sapo_tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau  # (N, T)
    per_tok = -gate * x.adv_t  # (N, T)
    policy = aggregate(x.weigh(per_tok), x.maskf, x.aggregation, x.norm_length)
    stats = ratio_stats(ratio.detach(), x.mask)
    return policy, stats


@register_objective("pg", default_clip=(None, None),  # no clip: Qwen's on-policy baseline (arXiv 2512.01374)
                    default_aggregation="seq_mean_token_mean",  # GRPO's, so that a comparison isolates the clip
                    corrects=True)
def pg(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy gradient with the unclipped token ratio pi_theta / pi_old: REINFORCE's gradient at pi_theta = pi_old
    (one update per rollout), importance-weighted after it. Its importance sampling correction for the sampler
    (pi_old / mu) is `rollout_correction` (tis, mis): with it, the on-policy "PG + IS" of arXiv 2512.01374."""
    ratio = x.log_ratio.exp()  # (N, T)
    per_tok = -ratio * x.adv_t  # (N, T): gradient -A * ratio * grad log pi_theta
    policy = aggregate(x.weigh(per_tok), x.maskf, x.aggregation, x.norm_length)
    return policy, ratio_stats(ratio.detach(), x.mask)


@register_objective("gmpo", default_clip=(0.4, 0.4),  # GMPO: a wider range, in log space: log ratio in [-0.4, 0.4]
                    default_aggregation="seq_mean_token_mean", length_neutral=True,  # a mean over sequences
                    ratio_unit="sequences", corrects=True, token_advantages=False, log_clip=True)
def gmpo(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (arXiv 2507.20673): the geometric mean of the token ratios, each clipped pessimistically in log space
    to [-clip_low, clip_high] (the side the advantage pushes toward is held, the other left free), times the
    sequence's advantage."""
    if x.adv.dim() == 2:
        raise ValueError("advantages: objective 'gmpo' takes one advantage per sequence (N,)")
    sign = torch.sign(x.adv)[:, None]  # (N, 1)
    bounded = x.log_ratio.clamp(-x.low, x.high)  # (N, T)
    # the pessimistic side: min(sign * r, sign * clip(r)) * sign, per token in log space
    log_ratio = sign * torch.minimum(sign * x.log_ratio, sign * bounded)  # (N, T), 0 on padding
    ratio = (log_ratio.sum(-1) / x.lengths).exp()  # (N,) prod_t r_t^(1/|y|)
    per_seq = -x.adv * ratio  # (N,)
    policy = x.weigh_seq(per_seq).mean()
    stats = ratio_stats(ratio.detach(), None)
    stats["clip/low_frac"] = masked_frac((x.log_ratio < -x.low) & (x.adv_t < 0), x.mask)
    stats["clip/high_frac"] = masked_frac((x.log_ratio > x.high) & (x.adv_t > 0), x.mask)
    return policy, stats


def _check_kl_cov(*, kl_cov_ratio: float, kl_cov_coef: float) -> None:
    if not 0 < kl_cov_ratio <= 1 or kl_cov_coef < 0:
        raise ValueError(f"kl_cov_ratio must be in (0, 1] and kl_cov_coef >= 0; got {kl_cov_ratio}, {kl_cov_coef}")


@register_objective("kl_cov", default_clip=(None, None),  # KL-Cov: no clip; a KL on the chosen tokens instead
                    default_aggregation="token_mean", corrects=True, check_options=_check_kl_cov)
def kl_cov(x: LossInputs, *, kl_cov_ratio: float = 2e-4, kl_cov_coef: float = 1.0) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (arXiv 2505.22617), an entropy-collapse control: the unclipped policy gradient, plus kl_cov_coef *
    |log pi_theta - log pi_old| on the tokens of the largest covariance between log-prob and advantage (the top
    kl_cov_ratio of this minibatch's tokens, at least one), which drive the entropy down the most. Options
    checked by policy_loss and the config (_check_kl_cov): kl_cov_ratio in (0, 1], kl_cov_coef >= 0."""
    ratio = x.log_ratio.exp()  # (N, T)
    count = x.maskf.sum()
    logp = x.logp.detach()
    centred_logp = logp - (logp * x.maskf).sum() / count  # (N, T)
    centred_adv = x.adv_t - (x.adv_t * x.maskf).sum() / count  # (N, T)
    cov = torch.where(x.mask, centred_logp * centred_adv, -torch.inf)  # (N, T), padding never chosen
    k = max(int(kl_cov_ratio * float(count)), 1)
    chosen = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    chosen[cov.flatten().topk(k).indices] = True
    chosen = chosen.view_as(cov) & x.mask  # (N, T)
    per_tok = -ratio * x.adv_t + kl_cov_coef * chosen * x.log_ratio.abs()  # (N, T)
    policy = aggregate(x.weigh(per_tok), x.maskf, x.aggregation, x.norm_length)
    stats = ratio_stats(ratio.detach(), x.mask)
    stats["kl_cov/token_frac"] = masked_frac(chosen, x.mask)
    return policy, stats


@register_objective("luspo", default_clip=(3e-4, 4e-4),  # GSPO's: luspo vs gspo then differs in the length weight only
                    default_aggregation="seq_mean_token_sum",  # LUSPO: each sequence's term times |y_i|
                    ratio_unit="sequences", corrects=True, token_advantages=False)
def luspo(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """LUSPO (arXiv 2602.05261): GSPO's clipped sequence term, counted once per token of the sequence, so a
    sequence weighs |y_i| times as much (GSPO's mean over sequences gives every token of a long answer a smaller
    share of the gradient, which the paper finds drives answers shorter). With seq_mean_token_mean it is GSPO."""
    if x.adv.dim() == 2:
        raise ValueError("advantages: objective 'luspo' takes one advantage per sequence (N,)")
    per_seq, stats = _clipped_sequence_terms(x)  # (N,)
    # LUSPO: 1/G sum_i |y_i| * term_i, which is the token sum of the term repeated on every token
    per_tok = per_seq[:, None].expand_as(x.logp)  # (N, T)
    return aggregate(x.weigh(per_tok), x.maskf, x.aggregation, x.norm_length), stats


VESPO_LOG_RATIO_BOUND = 20.0
"""VESPO's clamp on each token's log-ratio and on the sequence's sum (the authors' code and TRL's): W <= e^20."""
VESPO_MIN_WEIGHT = 1e-8
"""VESPO's floor on the sequence weight W (the same sources), so log W >= log(1e-8)."""


def _check_vespo(*, vespo_k_pos: float, vespo_lambda_pos: float, vespo_k_neg: float,
                 vespo_lambda_neg: float) -> None:
    for name, value in (("vespo_k_pos", vespo_k_pos), ("vespo_k_neg", vespo_k_neg)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}={value!r}: the kernel's power must be a finite number >= 0")
    for name, value in (("vespo_lambda_pos", vespo_lambda_pos), ("vespo_lambda_neg", vespo_lambda_neg)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}={value!r}: the kernel's decay must be a finite number > 0")


@register_objective("vespo", default_clip=(None, None),  # a smooth kernel on the whole-sequence weight, no clip
                    default_aggregation="token_mean",  # the authors' (verl's token-mean) and TRL's
                    ratio_unit="sequences", token_advantages=False, check_options=_check_vespo)
def vespo(x: LossInputs, *, vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0,
          vespo_lambda_neg: float = 2.0) -> tuple[Tensor, dict[str, Tensor]]:
    """VESPO (arXiv 2602.10693): REINFORCE on log pi_theta, each sequence weighted by a constant
    phi(W) = W^k exp(lambda (1 - W)) of its whole-sequence ratio W = pi_theta(y|x) / pi_old(y|x) (a product of
    token ratios, not length-normalised); phi(1) = 1, so on-policy it is plain REINFORCE. k and lambda for
    A >= 0 (vespo_k_pos, vespo_lambda_pos) and A < 0 (vespo_k_neg, vespo_lambda_neg); the weight peaks at
    W = k / lambda and decays to 0 on both sides. Its off-policy correction is the kernel itself: for a
    sampler's mismatch use pi_old = mu (use_sampler_logprobs), not rollout_correction."""
    if x.adv.dim() == 2:
        raise ValueError("advantages: objective 'vespo' takes one advantage per sequence (N,)")
    bound = VESPO_LOG_RATIO_BOUND
    log_w = x.log_ratio.detach().clamp(-bound, bound).sum(-1)  # (N,), 0 on padding
    log_w = log_w.clamp(math.log(VESPO_MIN_WEIGHT), bound)  # (N,)
    positive = x.adv >= 0  # (N,)
    k = torch.where(positive, torch.full_like(log_w, vespo_k_pos), torch.full_like(log_w, vespo_k_neg))  # (N,)
    lam = torch.where(positive, torch.full_like(log_w, vespo_lambda_pos),
                      torch.full_like(log_w, vespo_lambda_neg))  # (N,)
    # log phi(W) = k log W + lambda (1 - W): finite for every W in [1e-8, e^20]
    phi = (k * log_w + lam * (1.0 - log_w.exp())).exp()  # (N,), a constant
    per_tok = -phi[:, None] * x.adv_t * x.logp  # (N, T): gradient -phi(W) A grad log pi_theta
    policy = aggregate(per_tok, x.maskf, x.aggregation, x.norm_length)
    stats = ratio_stats(log_w.exp(), None)  # W, the whole-sequence ratio
    phi_t = phi[:, None].expand_as(x.logp)  # (N, T)
    stats["vespo/phi_mean"] = (phi_t * x.maskf).sum() / x.maskf.sum()  # a token mean
    stats["vespo/phi_small_frac"] = masked_frac(phi_t < 1e-3, x.mask)  # tokens whose sequence phi all but drops
    return policy, stats


def check_clip(objective: str, clip_low: float | None, clip_high: float | None) -> None:
    """ValueError unless the clip range means something for `objective` (None: its default).

    The ratio is clipped to [1 - clip_low, 1 + clip_high]. A ratio is never below 0, so clip_low
    >= 1 leaves no lower bound: meaningless for grpo/gspo/gspo_token, allowed up to 1 for cispo (its
    default 1.0 means "no lower bound"). sapo, pg and kl_cov have no hard clip: no clip values. gmpo's
    bound the log-ratio (`log_clip`): any finite value >= 0.
    """
    spec = get_objective(objective)
    default_low, default_high = spec.default_clip
    if default_low is None and default_high is None:
        if clip_low is not None or clip_high is not None:
            raise ValueError(f"clip_low/clip_high: {objective} has no hard clip; leave them unset")
        return
    for name, value in (("clip_low", clip_low), ("clip_high", clip_high)):
        if value is not None and (not math.isfinite(value) or value < 0):
            raise ValueError(f"{name}={value!r} must be a finite number >= 0")
    if clip_low is not None and not spec.log_clip:  # in log space every bound >= 0 is a bound
        top = default_low if default_low is not None and default_low >= 1 else None  # "no lower bound" allowed
        if (top is None and clip_low >= 1) or (top is not None and clip_low > top):
            raise ValueError(f"clip_low={clip_low!r} puts the lower clip 1 - clip_low at or below 0, which no ratio "
                             f"reaches, so {objective} would have no lower clip; use a value below 1"
                             + (f" (or {top}, {objective}'s 'no lower bound')" if top else ""))


def check_correction(objective: str, weight: torch.Tensor | None, shape: tuple) -> None:
    """ValueError unless a rollout correction's factor (N, T) can be applied to `objective`."""
    if weight is None:
        return
    if not get_objective(objective).corrects:
        raise ValueError(f"rollout_correction: objective {objective!r} does not apply a correction's factor to its "
                         "terms (register it with corrects=True and use LossInputs.weigh); use rollout_correction=none")
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != shape:
        raise ValueError(f"correction_weight: expected a tensor of shape {shape}, got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")


def check_aggregation(objective: str, aggregation: str) -> None:
    """ValueError unless `aggregation` is known and, for a length-neutral objective, seq_mean_token_mean.

    Sequence-level objectives (gspo, gspo_token): any aggregation but a plain mean over sequences would
    give a long answer more weight than a short one (TRL's GSPO does this unless told otherwise).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation: unknown {aggregation!r}; choose one of {', '.join(AGGREGATIONS)}")
    if get_objective(objective).length_neutral and aggregation != "seq_mean_token_mean":
        raise ValueError(f"aggregation: {aggregation!r} would weight {objective} sequences by length; GSPO averages "
                         "over sequences, so use 'seq_mean_token_mean' (the default)")


def check_loss_options(objective: str, aggregation: str | None, norm_length: int | None, kl_coef: float,
                       kl_estimator: str, clip_low: float | None = None, clip_high: float | None = None,
                       options: Mapping | None = None) -> None:
    """ValueError unless `policy_loss`'s options make sense together (aggregation None: the objective's;
    options: the objective's own, `objective_options`)."""
    aggregation = get_objective(objective).default_aggregation if aggregation is None else aggregation
    check_aggregation(objective, aggregation)
    if aggregation == "seq_mean_token_sum_norm" and (norm_length is None or norm_length <= 0):
        raise ValueError("norm_length: seq_mean_token_sum_norm needs a positive constant (e.g. max completion length)")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator: unknown {kl_estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")
    if not math.isfinite(kl_coef) or kl_coef < 0:
        raise ValueError(f"kl_coef: must be a finite number >= 0, got {kl_coef!r}")
    check_clip(objective, clip_low, clip_high)
    objective_options(objective, options)


def _check_shapes(logprobs, old_logprobs, advantages, mask, ref_logprobs) -> None:
    """Types and shapes (no device sync)."""
    for name, t in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages), ("mask", mask)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs: expected shape (N, T), got {tuple(logprobs.shape)}")
    if not logprobs.is_floating_point():
        raise ValueError(f"logprobs: expected a floating-point tensor, got {logprobs.dtype}")
    shape = tuple(logprobs.shape)
    if tuple(old_logprobs.shape) != shape:
        raise ValueError(f"old_logprobs: shape {tuple(old_logprobs.shape)} does not match logprobs {shape}")
    if tuple(mask.shape) != shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} does not match logprobs {shape}")
    if shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"logprobs: empty batch of shape {shape}")
    if tuple(advantages.shape) not in ((shape[0],), shape):
        raise ValueError(f"advantages: expected shape ({shape[0]},) or {shape}, got {tuple(advantages.shape)}")
    if ref_logprobs is not None and tuple(ref_logprobs.shape) != shape:
        raise ValueError(f"ref_logprobs: shape {tuple(ref_logprobs.shape)} does not match logprobs {shape}")


def _check_values(logprobs, old_logprobs, advantages, mask, ref_logprobs) -> None:
    """A 0/1 mask with a token in every row, values finite on completion tokens (each check a device sync)."""
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("mask: values must be 0 or 1")
        mask = mask.bool()
    empty = (~mask.any(-1)).nonzero()
    if empty.numel():
        raise ValueError(f"mask: row {int(empty[0, 0])} has no completion tokens; drop empty sequences first")
    # Only real tokens must be finite; padding is ignored whatever it holds.
    named = [("logprobs", logprobs), ("old_logprobs", old_logprobs)]
    if ref_logprobs is not None:
        named.append(("ref_logprobs", ref_logprobs))
    for name, t in named:
        bad = ~torch.isfinite(t.detach()) & mask
        if bad.any():
            i, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"{name}: non-finite value {t[i, j].item()} at [{i}, {j}] on a completion token")
    adv_bad = ~torch.isfinite(advantages.detach())
    if advantages.dim() == 2:
        adv_bad = adv_bad & mask
    if adv_bad.any():
        raise ValueError(f"advantages: non-finite value at {tuple(int(x) for x in adv_bad.nonzero()[0])}")


def stat_units(objective: str, aggregation: str | None = None) -> dict[str, str]:
    """What each statistic of `policy_loss` averages over ("sequences" or "tokens"), so that values
    computed on parts of a minibatch (ranks) can be recombined by weight.

    `ratio/*` and `clip/*` follow the objective's ratio_unit; the losses their aggregation
    (token_mean: tokens; the others are means over sequences); `kl/approx` is a token mean.
    """
    spec = get_objective(objective)
    loss = "tokens" if (aggregation or spec.default_aggregation) == "token_mean" else "sequences"
    return {"loss/policy": loss, "loss/kl": loss, "kl/approx": "tokens",
            **{f"ratio/{k}": spec.ratio_unit for k in ("mean", "std", "min", "max")},
            "clip/low_frac": spec.ratio_unit, "clip/high_frac": spec.ratio_unit}
