"""Policy objectives for group-based RL: GRPO, GSPO, GSPO-token, CISPO, SAPO, PG, GMPO and KL-Cov, by name.

Everything here is a pure function of tensors. Shapes:
    logprobs, old_logprobs, ref_logprobs, mask: (N, T) over completion tokens
    advantages: (N,) per sequence, or (N, T) per token where the objective allows it

The loss is minimised; it is the negative of the paper's objective. Padded positions
(mask == 0) never influence the loss or its gradient, whatever values they hold.

Each objective is one pure function of the prepared `LossInputs`, registered with its defaults:

    @register_objective("mine", default_clip=(0.2, 0.2), default_aggregation="token_mean")
    def mine(x: LossInputs) -> tuple[Tensor, dict]: ...

`policy_loss(..., objective="mine")` then runs it, and the config accepts `objective: mine`
(OBJECTIVES, DEFAULT_CLIP and DEFAULT_AGGREGATION are read from the registry).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True)
class LossInputs:
    """What every objective receives, prepared once by `policy_loss`: padding is already zeroed."""

    logp: Tensor  # (N, T) log pi_theta (carries the gradient), 0 on padding
    log_ratio: Tensor  # (N, T) log pi_theta - log pi_old, 0 on padding
    adv: Tensor  # (N,) or (N, T) advantages as given (detached)
    adv_t: Tensor  # (N, T) advantage of every token, 0 on padding
    mask: Tensor  # (N, T) bool, True on completion tokens
    maskf: Tensor  # (N, T) the mask in the log-probs' dtype
    lengths: Tensor  # (N,) completion tokens per sequence
    low: float | None  # ratio clipped to [1 - low, 1 + high]; None for an objective without a hard clip
    high: float | None
    aggregation: str  # one of AGGREGATIONS
    norm_length: int | None  # the constant divisor of seq_mean_token_sum_norm
    weight: Tensor | None = None  # (N, T) detached factor of a rollout correction (algo/correction.py), 0 on padding

    def weigh(self, per_tok: Tensor) -> Tensor:
        """(N, T) per-token terms times the rollout correction's factor (as they are without one)."""
        return per_tok if self.weight is None else per_tok * self.weight

    def weigh_seq(self, per_seq: Tensor) -> Tensor:
        """(N,) per-sequence terms times the correction's factor averaged over each sequence's tokens."""
        return per_seq if self.weight is None else per_seq * (self.weight.sum(-1) / self.lengths)  # 0 on padding


@dataclass(frozen=True)
class Objective:
    """A registered objective: its loss function and what the config needs to know of it."""

    loss: Callable[..., tuple[Tensor, dict[str, Tensor]]]  # (LossInputs, **options) -> (policy loss, stats)
    default_clip: tuple[float | None, float | None]  # (clip_low, clip_high); (None, None): no hard clip
    default_aggregation: str  # one of AGGREGATIONS
    length_neutral: bool  # a sequence-level objective: only seq_mean_token_mean keeps long answers from weighing more
    options: tuple[str, ...]  # the keyword-only parameters of `loss`, passed through from `policy_loss`
    ratio_unit: str = "tokens"  # what its `ratio/*` and `clip/*` stats average over: "tokens" or "sequences"
    corrects: bool = False  # applies a rollout correction's factor (LossInputs.weigh / weigh_seq) to its terms
    token_advantages: bool = True  # accepts (N, T) per-token advantages (GAE's) as well as (N,)
    log_clip: bool = False  # clip_low/clip_high bound the log-ratio to [-clip_low, clip_high] (gmpo)


OBJECTIVES: dict[str, Objective] = {}
"""The registry, name -> Objective, in registration order; the config's allowed `objective` values."""


def register_objective(name: str, *, default_clip: tuple[float | None, float | None], default_aggregation: str,
                       length_neutral: bool = False, ratio_unit: str = "tokens", corrects: bool = False,
                       token_advantages: bool = True, log_clip: bool = False):
    """Decorator: register `loss(x: LossInputs, **options) -> (policy loss, stats)` as objective `name`.

    default_clip: (clip_low, clip_high) when the config leaves them unset; (None, None) for an objective
    without a hard clip (clip values are then refused); a default clip_low >= 1 means "no lower bound"
    and allows clip_low up to it. length_neutral: only seq_mean_token_mean is accepted (and the KL term is
    averaged the same way), so no sequence weighs more for being longer. `stats` holds 0-d tensors
    (`ratio/*`, `clip/*`); policy_loss adds `loss/*` and `kl/approx`. ratio_unit: what those stats
    average over ("tokens", or "sequences" for one ratio per sequence), so ranks can recombine them.
    corrects: the loss multiplies its per-token terms by `x.weigh(...)` (or per-sequence terms by
    `x.weigh_seq(...)`), so a rollout correction (rollout_correction) can be used with it.
    token_advantages: the loss takes (N, T) advantages too (`x.adv_t`), so advantage_estimator=gae
    (a critic's per-token advantages) can be used with it; False for one advantage per sequence.
    log_clip: clip_low/clip_high bound the log-ratio, [-clip_low, clip_high] (any values >= 0 mean something).
    """
    if name in OBJECTIVES:
        raise ValueError(f"objective {name!r} is already registered")
    if default_aggregation not in AGGREGATIONS:
        raise ValueError(f"default_aggregation: unknown {default_aggregation!r}; "
                         f"choose one of {', '.join(AGGREGATIONS)}")
    if length_neutral and default_aggregation != "seq_mean_token_mean":
        raise ValueError("default_aggregation: a length-neutral objective aggregates with seq_mean_token_mean")
    if ratio_unit not in ("tokens", "sequences"):
        raise ValueError(f"ratio_unit: {ratio_unit!r} is not 'tokens' or 'sequences'")

    def add(loss):
        options = tuple(p.name for p in inspect.signature(loss).parameters.values() if p.kind is p.KEYWORD_ONLY)
        OBJECTIVES[name] = Objective(loss, tuple(default_clip), default_aggregation, length_neutral, options,
                                     ratio_unit, corrects, token_advantages, log_clip)
        return loss

    return add


def unregister_objective(name: str) -> None:
    """Remove objective `name` from the registry (e.g. one a test registered)."""
    if OBJECTIVES.pop(name, None) is None:
        raise ValueError(f"objective {name!r} is not registered")


@contextmanager
def registered_objective(name: str, loss, **spec) -> Iterator[Objective]:
    """`register_objective(name, **spec)(loss)` for the duration of a `with` block, then unregistered."""
    register_objective(name, **spec)(loss)
    try:
        yield OBJECTIVES[name]
    finally:
        OBJECTIVES.pop(name, None)


class _Column(Mapping):
    """Read-only view name -> one field of every registered objective (always in step with OBJECTIVES)."""

    def __init__(self, field: str):
        self._field = field

    def __getitem__(self, name: str):
        return getattr(OBJECTIVES[name], self._field)

    def __iter__(self):
        return iter(OBJECTIVES)

    def __len__(self) -> int:
        return len(OBJECTIVES)

    def __repr__(self) -> str:
        return repr(dict(self))


DEFAULT_CLIP = _Column("default_clip")
"""name -> (clip_low, clip_high) defaults: the ratio is clipped to [1 - low, 1 + high]."""
DEFAULT_AGGREGATION = _Column("default_aggregation")
"""name -> the aggregation used when `aggregation` is None."""


def _objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise ValueError(f"objective: unknown {name!r}; choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


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
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    kl_cov_ratio: float = 2e-4,
    kl_cov_coef: float = 1.0,
    correction_weight: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss for one minibatch.

    Args:
        logprobs: (N, T) log pi_theta of the completion tokens (carries the gradient).
        old_logprobs: (N, T) log pi_old of the same tokens (treated as constants).
        advantages: (N,) per sequence, or (N, T) per token (not for `gspo`).
        mask: (N, T) 1 on completion tokens, 0 on padding; every row needs a token.
        objective: a registered objective (OBJECTIVES).
        clip_low, clip_high: ratio clipped to [1 - clip_low, 1 + clip_high]; None takes
            the objective's default (DEFAULT_CLIP).
        aggregation: one of AGGREGATIONS; None takes DEFAULT_AGGREGATION[objective].
        norm_length: the constant divisor of `seq_mean_token_sum_norm` (Dr. GRPO uses
            the maximum completion length).
        ref_logprobs: (N, T) log pi_ref; needed when kl_coef > 0.
        kl_coef: weight of the KL penalty to the reference policy.
        kl_estimator: "k1", "k2" or "k3" (k3 is DeepSeekMath's eq. (4)).
        sapo_tau_pos, sapo_tau_neg: SAPO gate temperatures for A > 0 and A < 0.
        kl_cov_ratio, kl_cov_coef: KL-Cov's share of tokens given the KL term, and its weight.
        correction_weight: (N, T) factor of a rollout correction on each token's term
            (`gspo.algo.correction.behaviour_weights`), treated as a constant; None: no correction.
        validate: check the options (`check_loss_options`) and the tensors' values (0/1 mask, a token in
            every row, finite on completion tokens: each a device sync). The trainer checks its options once
            when it is built and passes False; a non-finite value then reaches the non-finite guard.

    Returns:
        (loss, stats): scalar loss, and a dict of detached 0-d tensors named
        `loss/policy`, `loss/kl`, `ratio/{mean,std,min,max}`, `clip/{low,high}_frac`,
        `kl/approx` (k3 estimate of KL(pi_old || pi_theta) per token).

    Example: with logprobs == old_logprobs (on-policy) GSPO and GRPO give the same gradient.
    """
    spec = _objective(objective)
    aggregation = spec.default_aggregation if aggregation is None else aggregation
    _check_shapes(logprobs, old_logprobs, advantages, mask, ref_logprobs)
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs: required when kl_coef > 0")
    if validate:
        check_loss_options(objective, aggregation, norm_length, kl_coef, kl_estimator, clip_low, clip_high)
        _check_values(logprobs, old_logprobs, advantages, mask, ref_logprobs)
    mask = mask if mask.dtype == torch.bool else mask.bool()  # (N, T)
    default_low, default_high = spec.default_clip
    low = default_low if clip_low is None else clip_low
    high = default_high if clip_high is None else clip_high
    check_correction(objective, correction_weight, tuple(logprobs.shape))

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
    inputs = LossInputs(logp, log_ratio, adv, adv_t, mask, maskf, lengths, low, high, aggregation, norm_length,
                        weight)
    options = {"sapo_tau_pos": sapo_tau_pos, "sapo_tau_neg": sapo_tau_neg, "kl_cov_ratio": kl_cov_ratio,
               "kl_cov_coef": kl_cov_coef}
    policy, stats = spec.loss(inputs, **{k: v for k, v in options.items() if k in spec.options})

    loss = policy
    kl_value = torch.zeros((), dtype=logprobs.dtype)
    if ref_logprobs is not None:
        ref = torch.where(mask, ref_logprobs.detach(), torch.zeros_like(logprobs))  # (N, T)
        kl_tok = kl_penalty(logp, ref, kl_estimator)  # (N, T)
        # KL is a per-token quantity: average it within each sequence, then over sequences, so
        # that it is length-neutral like the policy term of the sequence-level objectives.
        kl_agg = "seq_mean_token_mean" if spec.length_neutral else aggregation
        kl_value = _aggregate(kl_tok, maskf, kl_agg, norm_length)
        if kl_coef:
            loss = loss + kl_coef * kl_value

    # k3 estimate of KL(pi_old || pi_theta) from samples of pi_old, per token.
    approx = (log_ratio.exp() - 1.0 - log_ratio).detach()  # (N, T)
    stats["kl/approx"] = (approx * maskf).sum() / maskf.sum()
    stats["loss/policy"] = policy.detach()
    stats["loss/kl"] = kl_value.detach()
    return loss, {k: v.detach() for k, v in stats.items()}


# ------------------------------------------------------------------------------- the objectives
@register_objective("gspo", default_clip=(3e-4, 4e-4),  # GSPO paper, sec. 5.1: sequence ratios live near 1
                    default_aggregation="seq_mean_token_mean", length_neutral=True,  # GSPO eq. (5): 1/G sum_i
                    ratio_unit="sequences", corrects=True, token_advantages=False)
def gspo(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: one length-normalised ratio per sequence, clipped, times the sequence's advantage."""
    if x.adv.dim() == 2:
        raise ValueError("advantages: objective 'gspo' takes one advantage per sequence (N,); "
                         "use objective='gspo_token' for per-token advantages")
    # GSPO eq. (7): s_i = (pi_theta(y_i|x) / pi_old(y_i|x)) ^ (1/|y_i|)
    seq_log_ratio = x.log_ratio.sum(-1) / x.lengths  # (N,)
    ratio = seq_log_ratio.exp()  # (N,)
    clipped = ratio.clamp(1.0 - x.low, 1.0 + x.high)  # (N,)
    # GSPO eq. (5): -min(s_i A_i, clip(s_i) A_i), one term per sequence
    per_seq = -torch.minimum(ratio * x.adv, clipped * x.adv)  # (N,)
    policy = x.weigh_seq(per_seq).mean()
    stats = _ratio_stats(ratio.detach(), None)
    low_hit = (ratio < 1.0 - x.low) & (x.adv < 0)  # (N,) clipping zeroes these gradients
    high_hit = (ratio > 1.0 + x.high) & (x.adv > 0)
    stats["clip/low_frac"] = low_hit.float().mean()
    stats["clip/high_frac"] = high_hit.float().mean()
    return policy, stats


@register_objective("grpo", default_clip=(0.2, 0.2),  # DeepSeekMath / PPO epsilon; DAPO's clip-higher: (0.2, 0.28)
                    default_aggregation="seq_mean_token_mean",  # DeepSeekMath eq. (3): 1/G sum_i 1/|o_i| sum_t
                    corrects=True)
def grpo(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO / PPO: a clipped ratio per token."""
    # DeepSeekMath eq. (3) / PPO: token ratio w_t = pi_theta / pi_old
    ratio = x.log_ratio.exp()  # (N, T)
    clipped = ratio.clamp(1.0 - x.low, 1.0 + x.high)
    per_tok = -torch.minimum(ratio * x.adv_t, clipped * x.adv_t)  # (N, T)
    policy = _aggregate(x.weigh(per_tok), x.maskf, x.aggregation, x.norm_length)
    stats = _ratio_stats(ratio.detach(), x.mask)
    stats["clip/low_frac"] = _masked_frac((ratio < 1.0 - x.low) & (x.adv_t < 0), x.mask)
    stats["clip/high_frac"] = _masked_frac((ratio > 1.0 + x.high) & (x.adv_t > 0), x.mask)
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
    policy = _aggregate(x.weigh(per_tok), x.maskf, x.aggregation, x.norm_length)
    seq_ratio = seq_log_ratio.exp()  # (N,)
    stats = _ratio_stats(seq_ratio, None)
    # Clip fractions per sequence (token mean, then sequence mean): equal to GSPO's
    # sequence fractions when the advantage is constant within each sequence.
    low_hit = ((seq_ratio[:, None] < 1.0 - x.low) & (x.adv_t < 0)).to(x.maskf.dtype)
    high_hit = ((seq_ratio[:, None] > 1.0 + x.high) & (x.adv_t > 0)).to(x.maskf.dtype)
    stats["clip/low_frac"] = _aggregate(low_hit, x.maskf, "seq_mean_token_mean", None)
    stats["clip/high_frac"] = _aggregate(high_hit, x.maskf, "seq_mean_token_mean", None)
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
    policy = _aggregate(x.weigh(per_tok), x.maskf, x.aggregation, x.norm_length)
    stats = _ratio_stats(ratio, x.mask)
    stats["clip/low_frac"] = _masked_frac(ratio < 1.0 - x.low, x.mask)
    stats["clip/high_frac"] = _masked_frac(ratio > 1.0 + x.high, x.mask)
    return policy, stats


@register_objective("sapo", default_clip=(None, None),  # soft gate, no hard clip
                    default_aggregation="seq_mean_token_mean",  # SAPO: 1/G sum_i 1/|y_i| sum_t
                    corrects=True)
def sapo(x: LossInputs, *, sapo_tau_pos: float = 1.0, sapo_tau_neg: float = 1.05) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO: a soft sigmoid gate on the token ratio instead of a hard clip (temperatures for A > 0 and A < 0)."""
    if sapo_tau_pos <= 0 or sapo_tau_neg <= 0:
        raise ValueError(f"sapo_tau_pos/sapo_tau_neg: must be > 0, got {sapo_tau_pos}, {sapo_tau_neg}")
    # SAPO (arXiv 2511.20347): soft gate f(r) = sigmoid(tau (r - 1)) * 4 / tau replaces the
    # hard clip; its gradient weight 4 sigmoid (1 - sigmoid) r is 1 at r = 1 and decays smoothly.
    ratio = x.log_ratio.exp()  # (N, T)
    tau = torch.where(x.adv_t > 0, torch.full_like(x.adv_t, sapo_tau_pos), torch.full_like(x.adv_t, sapo_tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau  # (N, T)
    per_tok = -gate * x.adv_t  # (N, T)
    policy = _aggregate(x.weigh(per_tok), x.maskf, x.aggregation, x.norm_length)
    stats = _ratio_stats(ratio.detach(), x.mask)
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
    policy = _aggregate(x.weigh(per_tok), x.maskf, x.aggregation, x.norm_length)
    return policy, _ratio_stats(ratio.detach(), x.mask)


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
    stats = _ratio_stats(ratio.detach(), None)
    stats["clip/low_frac"] = _masked_frac((x.log_ratio < -x.low) & (x.adv_t < 0), x.mask)
    stats["clip/high_frac"] = _masked_frac((x.log_ratio > x.high) & (x.adv_t > 0), x.mask)
    return policy, stats


@register_objective("kl_cov", default_clip=(None, None),  # KL-Cov: no clip; a KL on the chosen tokens instead
                    default_aggregation="token_mean", corrects=True)
def kl_cov(x: LossInputs, *, kl_cov_ratio: float = 2e-4, kl_cov_coef: float = 1.0) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (arXiv 2505.22617), an entropy-collapse control: the unclipped policy gradient, plus kl_cov_coef *
    |log pi_theta - log pi_old| on the tokens of the largest covariance between log-prob and advantage (the top
    kl_cov_ratio of this minibatch's tokens, at least one), which drive the entropy down the most."""
    if not 0 < kl_cov_ratio <= 1 or kl_cov_coef < 0:
        raise ValueError(f"kl_cov_ratio must be in (0, 1] and kl_cov_coef >= 0; got {kl_cov_ratio}, {kl_cov_coef}")
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
    policy = _aggregate(x.weigh(per_tok), x.maskf, x.aggregation, x.norm_length)
    stats = _ratio_stats(ratio.detach(), x.mask)
    stats["kl_cov/token_frac"] = _masked_frac(chosen, x.mask)
    return policy, stats


# ------------------------------------------------------------------------------- helpers and checks
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


def _aggregate(values: torch.Tensor, maskf: torch.Tensor, aggregation: str, norm_length: int | None) -> torch.Tensor:
    # values are already zero on padding
    if aggregation == "seq_mean_token_mean":
        return ((values * maskf).sum(-1) / maskf.sum(-1)).mean()
    if aggregation == "token_mean":
        return (values * maskf).sum() / maskf.sum()
    return ((values * maskf).sum(-1) / float(norm_length)).mean()


def _masked_frac(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (flags & mask).float().sum() / mask.float().sum()


def _ratio_stats(ratio: torch.Tensor, mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    values = ratio if mask is None else ratio[mask]  # (n,)
    std = values.std(unbiased=False) if values.numel() > 1 else torch.zeros((), dtype=values.dtype)
    return {"ratio/mean": values.mean(), "ratio/std": std, "ratio/min": values.min(), "ratio/max": values.max()}


def check_clip(objective: str, clip_low: float | None, clip_high: float | None) -> None:
    """ValueError unless the clip range means something for `objective` (None: its default).

    The ratio is clipped to [1 - clip_low, 1 + clip_high]. A ratio is never below 0, so clip_low
    >= 1 leaves no lower bound: meaningless for grpo/gspo/gspo_token, allowed up to 1 for cispo (its
    default 1.0 means "no lower bound"). sapo, pg and kl_cov have no hard clip: no clip values. gmpo's
    bound the log-ratio (`log_clip`): any finite value >= 0.
    """
    spec = _objective(objective)
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
    if not _objective(objective).corrects:
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
    if _objective(objective).length_neutral and aggregation != "seq_mean_token_mean":
        raise ValueError(f"aggregation: {aggregation!r} would weight {objective} sequences by length; GSPO averages "
                         "over sequences, so use 'seq_mean_token_mean' (the default)")


def check_loss_options(objective: str, aggregation: str | None, norm_length: int | None, kl_coef: float,
                       kl_estimator: str, clip_low: float | None = None, clip_high: float | None = None) -> None:
    """ValueError unless `policy_loss`'s options make sense together (aggregation None: the objective's)."""
    aggregation = _objective(objective).default_aggregation if aggregation is None else aggregation
    check_aggregation(objective, aggregation)
    if aggregation == "seq_mean_token_sum_norm" and (norm_length is None or norm_length <= 0):
        raise ValueError("norm_length: seq_mean_token_sum_norm needs a positive constant (e.g. max completion length)")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator: unknown {kl_estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")
    if not math.isfinite(kl_coef) or kl_coef < 0:
        raise ValueError(f"kl_coef: must be a finite number >= 0, got {kl_coef!r}")
    check_clip(objective, clip_low, clip_high)


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
    spec = _objective(objective)
    loss = "tokens" if (aggregation or spec.default_aggregation) == "token_mean" else "sequences"
    return {"loss/policy": loss, "loss/kl": loss, "kl/approx": "tokens",
            **{f"ratio/{k}": spec.ratio_unit for k in ("mean", "std", "min", "max")},
            "clip/low_frac": spec.ratio_unit, "clip/high_frac": spec.ratio_unit}
