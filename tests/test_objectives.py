"""Objectives: hand-derived values, autograd identities, length and padding invariance, the registry."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo.algo.objectives import (
    AGGREGATIONS,
    DEFAULT_AGGREGATION,
    DEFAULT_CLIP,
    OBJECTIVES,
    LossInputs,
    kl_penalty,
    policy_loss,
    register_objective,
    registered_objective,
    unregister_objective,
)
from gspo.config import TrainConfig, make_config

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def leaf(x):
    return torch.tensor(x, dtype=D, requires_grad=True)


# ---------------------------------------------------------------- GRPO by hand
# Two sequences, old log-probs 0, so each token ratio w = exp(logp).
# seq 0 (A = +1): w = [1.1, 1.5]      seq 1 (A = -1): w = [0.5, <pad>]
# clip 0.2/0.2 -> [0.8, 1.2]
# token terms -min(wA, clip(w)A):
#   (0,0): -min(1.1, 1.1) = -1.1        (0,1): -min(1.5, 1.2) = -1.2 (clipped)
#   (1,0): -min(-0.5, -0.8) = 0.8 (clipped: the pessimistic branch is the clipped one)
GRPO_LOGP = [[math.log(1.1), math.log(1.5)], [math.log(0.5), 123.0]]
GRPO_MASK = [[1, 1], [1, 0]]
GRPO_ADV = [1.0, -1.0]


@pytest.mark.parametrize(
    "aggregation, norm_length, expected",
    [
        # seq means -1.15 and 0.8, mean over sequences: -0.175
        ("seq_mean_token_mean", None, -0.175),
        # (-1.1 - 1.2 + 0.8) / 3 tokens
        ("token_mean", None, -0.5),
        # Dr. GRPO: token sums / 4: -2.3/4 = -0.575 and 0.8/4 = 0.2, mean -0.1875
        ("seq_mean_token_sum_norm", 4, -0.1875),
        # token sums -2.3 and 0.8, mean over sequences
        ("seq_mean_token_sum", None, -0.75),
    ],
)
def test_grpo_hand_values(aggregation, norm_length, expected):
    logp = leaf(GRPO_LOGP)
    loss, stats = policy_loss(logp, torch.zeros(2, 2, dtype=D), t(GRPO_ADV), t(GRPO_MASK), objective="grpo",
                              clip_low=0.2, clip_high=0.2, aggregation=aggregation, norm_length=norm_length)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    # 1 of 3 tokens clipped high (w = 1.5, A > 0), 1 of 3 clipped low (w = 0.5, A < 0)
    assert stats["clip/high_frac"].item() == pytest.approx(1 / 3)
    assert stats["clip/low_frac"].item() == pytest.approx(1 / 3)
    assert stats["ratio/mean"].item() == pytest.approx((1.1 + 1.5 + 0.5) / 3)
    assert stats["ratio/max"].item() == pytest.approx(1.5)
    assert stats["ratio/min"].item() == pytest.approx(0.5)


def test_grpo_hand_gradient():
    # seq_mean_token_mean: token (0,0) has weight 1/2 * 1/2, d/dlogp (-w A) = -w A = -1.1
    # -> -0.275. Both clipped tokens get 0; the padded one gets 0.
    logp = leaf(GRPO_LOGP)
    loss, _ = policy_loss(logp, torch.zeros(2, 2, dtype=D), t(GRPO_ADV), t(GRPO_MASK), objective="grpo")
    loss.backward()
    assert torch.allclose(logp.grad, t([[-0.275, 0.0], [0.0, 0.0]]), rtol=0, atol=1e-12)


def test_grpo_asymmetric_clip_higher():
    # DAPO clip-higher: clip_high 0.6 lets w = 1.5 through: terms -1.1, -1.5 -> seq mean -1.3,
    # seq 1 still 0.8 -> (-1.3 + 0.8) / 2 = -0.25
    loss, stats = policy_loss(t(GRPO_LOGP), torch.zeros(2, 2, dtype=D), t(GRPO_ADV), t(GRPO_MASK),
                              objective="grpo", clip_low=0.2, clip_high=0.6)
    assert loss.item() == pytest.approx(-0.25)
    assert stats["clip/high_frac"].item() == 0.0


def test_grpo_positive_advantage_below_range_is_not_clipped():
    # A > 0 and w = 0.5 < 0.8: min(0.5, 0.8) = 0.5, the unclipped branch keeps its gradient.
    logp = leaf([[math.log(0.5)]])
    loss, stats = policy_loss(logp, t([[0.0]]), t([2.0]), t([[1]]), objective="grpo")
    assert loss.item() == pytest.approx(-1.0)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-1.0)  # -w A = -0.5 * 2
    assert stats["clip/low_frac"].item() == 0.0


# ---------------------------------------------------------------- GSPO by hand
def test_gspo_hand_values():
    # seq 0: log-ratios [2e-4, 4e-4], mean 3e-4, s = e^3e-4, A = +1, inside [1-3e-4, 1+4e-4]
    #        term -s = -1.000300045
    # seq 1: log-ratio [-1e-3] (+ pad), s = e^-1e-3 = 0.9990005, A = -1, below 1 - 3e-4:
    #        -min(-0.9990005, -0.9997) = 0.9997 (clipped)
    # seq 2: log-ratios [1e-3, 1e-3, 1e-3], s = e^1e-3 = 1.0010005, A = 2, above 1 + 4e-4:
    #        -min(2.002001, 2.0008) = -2.0008 (clipped)
    logp = t([[2e-4, 4e-4, 0.0], [-1e-3, 7.0, 7.0], [1e-3, 1e-3, 1e-3]])
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    loss, stats = policy_loss(logp, torch.zeros(3, 3, dtype=D), t([1.0, -1.0, 2.0]), mask, objective="gspo")
    expected = (-math.exp(3e-4) + 0.9997 - 2.0008) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert stats["clip/low_frac"].item() == pytest.approx(1 / 3)
    assert stats["clip/high_frac"].item() == pytest.approx(1 / 3)
    ratios = [math.exp(3e-4), math.exp(-1e-3), math.exp(1e-3)]
    assert stats["ratio/mean"].item() == pytest.approx(sum(ratios) / 3, abs=1e-12)
    assert stats["ratio/min"].item() == pytest.approx(math.exp(-1e-3), abs=1e-12)


def test_gspo_gradient_matches_eq10():
    # GSPO eq. (10): grad J = 1/N sum_i s_i A_i 1/|y_i| sum_t grad log pi(y_i,t); loss = -J.
    # So d loss / d logp_{i,t} = -s_i A_i / (N |y_i|) on unclipped sequences.
    torch.manual_seed(0)
    N, T = 5, 7
    lengths = torch.tensor([1, 3, 7, 4, 6])
    mask = (torch.arange(T)[None] < lengths[:, None]).to(D)
    old = torch.randn(N, T, dtype=D)
    logp = (old + 1e-3 * torch.randn(N, T, dtype=D)).requires_grad_()
    adv = torch.randn(N, dtype=D)
    loss, stats = policy_loss(logp, old, adv, mask, objective="gspo", clip_low=0.99, clip_high=1.0)
    loss.backward()
    s = (((logp - old) * mask).sum(-1) / lengths).exp().detach()
    expected = -(s * adv / (N * lengths))[:, None] * mask
    assert stats["clip/low_frac"].item() == 0 and stats["clip/high_frac"].item() == 0
    assert torch.allclose(logp.grad, expected, rtol=0, atol=1e-12)


def test_gspo_clipped_sequence_has_no_gradient():
    logp = leaf([[1e-3, 1e-3], [0.0, 0.0]])
    loss, _ = policy_loss(logp, torch.zeros(2, 2, dtype=D), t([1.0, 1.0]), torch.ones(2, 2, dtype=D), objective="gspo")
    loss.backward()
    assert torch.all(logp.grad[0] == 0)  # s = e^1e-3 > 1 + 4e-4 with A > 0: clipped
    assert torch.allclose(logp.grad[1], t([-0.25, -0.25]))  # s = 1: -1 * 1 / (2 * 2)


def _random_batch(seed, N=6, T=9, scale=1e-3, per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(D)
    old = -torch.rand(N, T, generator=g, dtype=D) * 3
    logp = old + scale * torch.randn(N, T, generator=g, dtype=D)
    adv = torch.randn((N, T) if per_token_adv else (N,), generator=g, dtype=D)
    return logp, old, adv, mask


@pytest.mark.parametrize("seed", range(5))
def test_gspo_token_equals_gspo_with_sequence_advantages(seed):
    # GSPO sec. 4.3: with A_{i,t} = A_i, GSPO-token is numerically identical to GSPO in
    # objective, clipping and gradient. Scale 1e-3 puts some sequences on each side of the range.
    logp, old, adv, mask = _random_batch(seed, N=16, scale=1e-3)
    results = {}
    for objective, a in (("gspo", adv), ("gspo_token", adv[:, None].expand_as(logp))):
        x = logp.clone().requires_grad_()
        loss, stats = policy_loss(x, old, a, mask, objective=objective)
        loss.backward()
        results[objective] = (loss.detach(), stats, x.grad)
    (l1, s1, g1), (l2, s2, g2) = results["gspo"], results["gspo_token"]
    assert torch.allclose(l1, l2, rtol=0, atol=1e-14)
    assert torch.allclose(g1, g2, rtol=0, atol=1e-14)
    for key in ("clip/low_frac", "clip/high_frac", "ratio/mean", "ratio/max"):
        assert s1[key].item() == pytest.approx(s2[key].item(), abs=1e-12), key
    assert s1["clip/low_frac"] + s1["clip/high_frac"] > 0, "the batch should exercise clipping"
    assert (g1.abs().sum(-1) > 0).sum() >= 2, "and keep some sequences unclipped"


def test_gspo_token_per_token_advantages_hand():
    # One sequence, log-ratios [0, 0] (s = 1), advantages [2, -1]:
    # token terms -s*A = [-2, 1], token mean -0.5. d/dlogp_t = -s * A_t / |y| = [-1, 0.5].
    logp = leaf([[0.0, 0.0]])
    loss, _ = policy_loss(logp, torch.zeros(1, 2, dtype=D), t([[2.0, -1.0]]), torch.ones(1, 2, dtype=D),
                          objective="gspo_token")
    loss.backward()
    assert loss.item() == pytest.approx(-0.5)
    assert torch.allclose(logp.grad, t([[-1.0, 0.5]]))


@pytest.mark.parametrize("seed", range(3))
def test_on_policy_grpo_and_gspo_gradients_agree(seed):
    # On-policy (old == new) every ratio is 1: GRPO's token weight 1/(N|y_i|) A_i equals
    # GSPO's s_i A_i / (N |y_i|) with s_i = 1.
    logp, _, adv, mask = _random_batch(seed)
    grads = []
    for objective in ("grpo", "gspo", "gspo_token", "sapo"):
        x = logp.clone().requires_grad_()
        loss, stats = policy_loss(x, logp.detach(), adv, mask, objective=objective)
        loss.backward()
        assert stats["ratio/mean"].item() == pytest.approx(1.0)
        grads.append(x.grad)
    for g in grads[1:]:
        assert torch.allclose(grads[0], g, rtol=0, atol=1e-14)


def test_gspo_length_neutral_when_tokens_duplicated():
    # Sequence 0 repeated twice over (same per-token log-ratios) keeps s_0, so the loss and the
    # summed gradient weight of the sequence are unchanged: length does not buy weight.
    short_logp = t([[1e-4, -2e-4, 0.0, 0.0], [3e-4, 0.0, 0.0, 0.0]])
    short_mask = t([[1, 1, 0, 0], [1, 0, 0, 0]])
    long_logp = t([[1e-4, -2e-4, 1e-4, -2e-4], [3e-4, 0.0, 0.0, 0.0]])
    long_mask = t([[1, 1, 1, 1], [1, 0, 0, 0]])
    adv = t([1.0, -0.5])
    out = []
    for lp, m in ((short_logp, short_mask), (long_logp, long_mask)):
        x = lp.clone().requires_grad_()
        loss, _ = policy_loss(x, torch.zeros_like(lp), adv, m, objective="gspo")
        loss.backward()
        out.append((loss.item(), x.grad.sum(-1)))
    assert out[0][0] == pytest.approx(out[1][0], abs=1e-15)
    assert torch.allclose(out[0][1], out[1][1], rtol=0, atol=1e-15)
    # token-mean GRPO, by contrast, doubles the long sequence's share: that is what we refuse for GSPO.
    g = []
    for lp, m in ((short_logp, short_mask), (long_logp, long_mask)):
        x = lp.clone().requires_grad_()
        policy_loss(x, torch.zeros_like(lp), adv, m, objective="grpo", aggregation="token_mean")[0].backward()
        g.append(x.grad.sum(-1)[0].item() / x.grad.sum(-1)[1].item())
    assert g[1] == pytest.approx(2 * g[0], rel=1e-3)


@pytest.mark.parametrize("objective", ["gspo", "gspo_token"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum_norm"])
def test_length_weighting_refused_for_gspo(objective, aggregation):
    logp, old, adv, mask = _random_batch(0)
    with pytest.raises(ValueError, match="would weight .* sequences by length"):
        policy_loss(logp, old, adv, mask, objective=objective, aggregation=aggregation, norm_length=9)


# ---------------------------------------------------------------- CISPO and SAPO
def test_cispo_hand():
    # w = 0.6 / 0.4 = 1.5, truncated to 1 + 0.28 = 1.28 (as a constant); A = 1.
    # loss = -1.28 * log(0.6) = 0.653855...; gradient -1.28 (not zero: CISPO keeps clipped tokens).
    logp = leaf([[math.log(0.6)]])
    loss, stats = policy_loss(logp, t([[math.log(0.4)]]), t([1.0]), t([[1]]), objective="cispo")
    assert loss.item() == pytest.approx(-1.28 * math.log(0.6))
    loss.backward()
    assert logp.grad.item() == pytest.approx(-1.28)
    assert stats["clip/high_frac"].item() == 1.0
    assert stats["ratio/mean"].item() == pytest.approx(1.5)


def test_sapo_hand():
    # seq 0: r = e^0.5, A = +1, tau_pos = 1: gate = sigmoid(e^0.5 - 1) * 4, loss term -gate
    # seq 1: r = 1, A = -2, tau_neg = 1.05: gate = 0.5 * 4 / 1.05, term +2 * gate
    # gradient d(-gate A)/dlogp = -A * 4 sig (1 - sig) * r
    sig = 1 / (1 + math.exp(-(math.exp(0.5) - 1)))
    logp = leaf([[0.5], [0.0]])
    loss, _ = policy_loss(logp, torch.zeros(2, 1, dtype=D), t([1.0, -2.0]), torch.ones(2, 1, dtype=D), objective="sapo")
    expected = (-(sig * 4) + 2 * (0.5 * 4 / 1.05)) / 2
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    g0 = -1.0 * 4 * sig * (1 - sig) * math.exp(0.5) / 2
    g1 = 2.0 * 4 * 0.25 * 1.0 / 2  # at r = 1 the weight is exactly 1, as unclipped PG
    assert torch.allclose(logp.grad, t([[g0], [g1]]))


def test_pg_hand():
    # the unclipped token ratio: seq 0 (A = +1) r = [e^0.5, 1]; seq 1 (A = -2) r = [e^-1, pad]
    # terms -r A: [-e^0.5, -1] and [2 e^-1]; seq_mean_token_mean: ((-e^0.5 - 1) / 2 + 2 e^-1) / 2
    # gradient -A r / |y| / N: [-e^0.5 / 4, -1 / 4], [2 e^-1 / 2]
    logp = leaf([[0.5, 0.0], [-1.0, 7.0]])
    mask = t([[1, 1], [1, 0]])
    loss, stats = policy_loss(logp, torch.zeros(2, 2, dtype=D), t([1.0, -2.0]), mask, objective="pg")
    assert loss.item() == pytest.approx(((-math.exp(0.5) - 1) / 2 + 2 * math.exp(-1)) / 2)
    loss.backward()
    assert torch.allclose(logp.grad, t([[-math.exp(0.5) / 4, -0.25], [math.exp(-1), 0.0]]))
    assert stats["ratio/max"].item() == pytest.approx(math.exp(0.5))
    # with rollout_correction's weight (pi_old / mu, truncated) each term is scaled: "PG + IS"
    weighted, _ = policy_loss(logp.detach(), torch.zeros(2, 2, dtype=D), t([1.0, -2.0]), mask, objective="pg",
                              correction_weight=t([[2.0, 1.0], [0.5, 1.0]]))
    assert weighted.item() == pytest.approx(((-2 * math.exp(0.5) - 1) / 2 + math.exp(-1)) / 2)


def test_luspo_hand():
    # clip 0.5/0.5 -> s in [0.5, 1.5]. seq 0 (A = +1, 2 tokens): log r = [0.1, 0.3] -> s = e^0.2, term -e^0.2,
    #   counted on both tokens: -2 e^0.2. seq 1 (A = -1, 1 token): log r = [0.4] -> s = e^0.4 < 1.5, term +e^0.4.
    # Mean over the two sequences: (-2 e^0.2 + e^0.4) / 2.
    # Gradient: d s_i / d logp_{i,t} = s_i / |y_i|, times |y_i| copies: every token gets A_i s_i * (-1/2)
    #   whatever its sequence's length (GSPO gives seq 0's tokens half of that: -e^0.2 / 4).
    logp = leaf([[0.1, 0.3], [0.4, 9.0]])
    mask = t([[1, 1], [1, 0]])
    loss, stats = policy_loss(logp, torch.zeros(2, 2, dtype=D), t([1.0, -1.0]), mask, objective="luspo",
                              clip_low=0.5, clip_high=0.5)
    assert loss.item() == pytest.approx((-2 * math.exp(0.2) + math.exp(0.4)) / 2)
    loss.backward()
    assert torch.allclose(logp.grad, t([[-math.exp(0.2) / 2, -math.exp(0.2) / 2], [math.exp(0.4) / 2, 0.0]]))
    gspo_logp = leaf([[0.1, 0.3], [0.4, 9.0]])
    gspo_loss, _ = policy_loss(gspo_logp, torch.zeros(2, 2, dtype=D), t([1.0, -1.0]), mask, objective="gspo",
                               clip_low=0.5, clip_high=0.5)
    gspo_loss.backward()
    assert torch.allclose(gspo_logp.grad, t([[-math.exp(0.2) / 4, -math.exp(0.2) / 4], [math.exp(0.4) / 2, 0.0]]))
    # clipped as GSPO: s = e^0.2 > 1 + 0.1 with A > 0 holds the term at -1.1 per token, no gradient
    held = leaf([[0.1, 0.3], [0.4, 9.0]])
    loss, stats = policy_loss(held, torch.zeros(2, 2, dtype=D), t([1.0, -1.0]), mask, objective="luspo",
                              clip_low=0.5, clip_high=0.1)
    assert loss.item() == pytest.approx((-2 * 1.1 + math.exp(0.4)) / 2)
    loss.backward()
    assert held.grad[0].abs().max().item() == 0.0
    assert stats["clip/high_frac"].item() == 0.5 and stats["clip/low_frac"].item() == 0.0
    assert stats["ratio/max"].item() == pytest.approx(math.exp(0.4))
    # token_mean: the same terms over all 3 tokens; seq_mean_token_mean: GSPO's value
    tm, _ = policy_loss(logp.detach(), torch.zeros(2, 2, dtype=D), t([1.0, -1.0]), mask, objective="luspo",
                        clip_low=0.5, clip_high=0.5, aggregation="token_mean")
    assert tm.item() == pytest.approx((-2 * math.exp(0.2) + math.exp(0.4)) / 3)
    assert policy_loss(logp.detach(), torch.zeros(2, 2, dtype=D), t([1.0, -1.0]), mask, objective="luspo",
                       clip_low=0.5, clip_high=0.5, aggregation="seq_mean_token_mean")[0].item() == pytest.approx(
        gspo_loss.item())
    with pytest.raises(ValueError, match="'luspo' takes one advantage per sequence"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1]]), objective="luspo")


def test_vespo_hand():
    # phi(W) = W^k exp(lambda (1 - W)); k, lambda = (2, 3) for A >= 0 and (3, 2) for A < 0. Token mean.
    # seq 0 (A = +1): log r = [0.1, 0.2] -> log W = 0.3: phi0 = exp(2 * 0.3 + 3 (1 - e^0.3)).
    # seq 1 (A = -2, 1 token): log r = [-0.5] -> phi1 = exp(3 * -0.5 + 2 (1 - e^-0.5)).
    # loss = -(phi0 * 1 * (0.1 + 0.2) + phi1 * -2 * -0.5) / 3; phi is a constant, so
    # d loss / d logp = -phi0 / 3 on seq 0's tokens and +2 phi1 / 3 on seq 1's.
    phi0 = math.exp(2 * 0.3 + 3 * (1 - math.exp(0.3)))
    phi1 = math.exp(3 * -0.5 + 2 * (1 - math.exp(-0.5)))
    logp = leaf([[0.1, 0.2], [-0.5, 7.0]])
    mask = t([[1, 1], [1, 0]])
    loss, stats = policy_loss(logp, torch.zeros(2, 2, dtype=D), t([1.0, -2.0]), mask, objective="vespo")
    assert loss.item() == pytest.approx(-(phi0 * 0.3 + phi1 * 1.0) / 3)
    loss.backward()
    assert torch.allclose(logp.grad, t([[-phi0 / 3, -phi0 / 3], [2 * phi1 / 3, 0.0]]))
    assert stats["ratio/max"].item() == pytest.approx(math.exp(0.3))
    assert stats["ratio/min"].item() == pytest.approx(math.exp(-0.5))
    assert stats["vespo/phi_mean"].item() == pytest.approx((2 * phi0 + phi1) / 3)
    assert stats["vespo/phi_small_frac"].item() == 0.0
    # on-policy (W = 1): phi = 1, REINFORCE's gradient -A grad log pi / tokens
    on = leaf([[-1.0, -2.0], [-3.0, 0.0]])
    loss, _ = policy_loss(on, on.detach().clone(), t([1.0, -2.0]), mask, objective="vespo")
    loss.backward()
    assert torch.allclose(on.grad, t([[-1 / 3, -1 / 3], [2 / 3, 0.0]]))
    # the peak: W = k / lambda = 2/3 for A > 0, phi = (2/3)^2 e^(3 * 1/3) = 4e/9 > 1
    peak, stats = policy_loss(t([[math.log(2 / 3)]]), t([[0.0]]), t([1.0]), t([[1]]), objective="vespo")
    assert stats["vespo/phi_mean"].item() == pytest.approx(4 * math.e / 9)
    # the clamps: a token's log-ratio at +-20, the sum at [log 1e-8, 20]; far from 1, phi is ~0
    far, stats = policy_loss(t([[30.0, 30.0], [-30.0, -30.0]]), torch.zeros(2, 2, dtype=D), t([1.0, -1.0]),
                             torch.ones(2, 2, dtype=D), objective="vespo")
    assert stats["ratio/max"].item() == pytest.approx(math.exp(20.0))
    assert stats["ratio/min"].item() == pytest.approx(1e-8)
    assert stats["vespo/phi_small_frac"].item() == 1.0 and math.isfinite(far.item())
    # the options: another kernel, checked
    loss, _ = policy_loss(logp.detach(), torch.zeros(2, 2, dtype=D), t([1.0, -2.0]), mask, objective="vespo",
                          options={"vespo_k_pos": 1.0, "vespo_lambda_pos": 1.0})
    assert loss.item() == pytest.approx(-(math.exp(0.3 + 1 - math.exp(0.3)) * 0.3 + phi1 * 1.0) / 3)
    with pytest.raises(ValueError, match=r"vespo_lambda_neg=0.0: the kernel's decay must be a finite number > 0"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([1.0]), t([[1]]), objective="vespo", options={"vespo_lambda_neg": 0.0})
    with pytest.raises(ValueError, match=r"vespo_k_pos=-1.0: the kernel's power must be a finite number >= 0"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([1.0]), t([[1]]), objective="vespo", options={"vespo_k_pos": -1.0})
    with pytest.raises(ValueError, match="has no hard clip"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([1.0]), t([[1]]), objective="vespo", clip_low=0.2)
    with pytest.raises(ValueError, match="rollout_correction: objective 'vespo' does not apply"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([1.0]), t([[1]]), objective="vespo", correction_weight=t([[1.0]]))


def test_gmpo_hand():
    # clip 0.4 in log space. seq 0 (A = +1): log r = [0.5, -0.1] -> the push-up side held at 0.4, the other free:
    #   [0.4, -0.1], ratio e^0.15, term -e^0.15; gradient only through token 1: -e^0.15 / 2
    # seq 1 (A = -1): log r = [-0.5, 0.1] -> the push-down side held at -0.4: [-0.4, 0.1], ratio e^-0.15,
    #   term +e^-0.15; gradient through token 1 only: +e^-0.15 / 2. Mean over the two sequences.
    logp = leaf([[0.5, -0.1], [-0.5, 0.1]])
    loss, stats = policy_loss(logp, torch.zeros(2, 2, dtype=D), t([1.0, -1.0]), torch.ones(2, 2, dtype=D),
                              objective="gmpo")
    assert loss.item() == pytest.approx((-math.exp(0.15) + math.exp(-0.15)) / 2)
    loss.backward()
    assert torch.allclose(logp.grad, t([[0.0, -math.exp(0.15) / 4], [0.0, math.exp(-0.15) / 4]]))
    assert stats["clip/high_frac"].item() == 0.25 and stats["clip/low_frac"].item() == 0.25
    assert stats["ratio/min"].item() == pytest.approx(math.exp(-0.15))
    # the other side is left free: A = +1 with log r = -0.5 is not held at -0.4 (pessimistic, as PPO's min)
    free, _ = policy_loss(t([[-0.5]]), t([[0.0]]), t([1.0]), t([[1]]), objective="gmpo")
    assert free.item() == pytest.approx(-math.exp(-0.5))
    with pytest.raises(ValueError, match="one advantage per sequence"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1]]), objective="gmpo")
    policy_loss(t([[0.0]]), t([[0.0]]), t([1.0]), t([[1]]), objective="gmpo", clip_low=1.5)  # log space: a bound


def test_kl_cov_hand():
    # logp [[-1, -3], [-2, -5]] (mean -2.75), A = [+1, -1] (mean 0): cov = (logp + 2.75) * A
    #   = [[1.75, -0.25], [-0.75, 2.25]]. One token of four (ratio 2e-4 -> at least 1): (1, 1), cov 2.25.
    # log r = [[0.1, 0], [0, -0.2]]; terms -r A = [[-e^0.1, -1], [1, e^-0.2]], + 1.0 * |-0.2| on (1, 1);
    # token mean over 4. Gradient: -A r, plus coef * sign(log r) on the chosen token, / 4.
    logp = leaf([[-1.0, -3.0], [-2.0, -5.0]])
    old = t([[-1.1, -3.0], [-2.0, -4.8]])
    loss, stats = policy_loss(logp, old, t([1.0, -1.0]), torch.ones(2, 2, dtype=D), objective="kl_cov")
    assert loss.item() == pytest.approx((-math.exp(0.1) - 1 + 1 + math.exp(-0.2) + 0.2) / 4)
    loss.backward()
    assert torch.allclose(logp.grad, t([[-math.exp(0.1), -1.0], [1.0, math.exp(-0.2) - 1.0]]) / 4)
    assert stats["kl_cov/token_frac"].item() == 0.25
    # half the tokens: (1, 1) and (0, 0), cov 1.75 (its |log r| = 0.1)
    two, stats = policy_loss(logp.detach(), old, t([1.0, -1.0]), torch.ones(2, 2, dtype=D), objective="kl_cov",
                             options={"kl_cov_ratio": 0.5, "kl_cov_coef": 2.0})
    assert two.item() == pytest.approx((-math.exp(0.1) - 1 + 1 + math.exp(-0.2) + 2 * (0.2 + 0.1)) / 4)
    assert stats["kl_cov/token_frac"].item() == 0.5
    with pytest.raises(ValueError, match="kl_cov_ratio must be in"):
        policy_loss(logp.detach(), old, t([1.0, -1.0]), torch.ones(2, 2, dtype=D), objective="kl_cov",
                    options={"kl_cov_ratio": 0.0})


# ---------------------------------------------------------------- KL
def test_kl_estimators_hand():
    # log_r = ref - logp = -1.5 - (-1) = -0.5
    logp, ref = t([[-1.0]]), t([[-1.5]])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 0.5)


def test_kl_added_to_loss():
    # on-policy GRPO, A = 1 on one token: policy term -1; k3 = e^-0.5 - 0.5 = 0.10653; coef 0.1
    logp = t([[-1.0]])
    loss, stats = policy_loss(logp, logp, t([1.0]), t([[1]]), objective="grpo", ref_logprobs=t([[-1.5]]), kl_coef=0.1)
    assert stats["loss/policy"].item() == pytest.approx(-1.0)
    assert stats["loss/kl"].item() == pytest.approx(math.exp(-0.5) - 0.5)
    assert loss.item() == pytest.approx(-1.0 + 0.1 * (math.exp(-0.5) - 0.5))


def test_approx_kl_old_new():
    # log-ratio 0.1 on one token, 0 on the other: k3 = (e^0.1 - 1 - 0.1 + 0) / 2
    _, stats = policy_loss(t([[0.1, 0.0]]), torch.zeros(1, 2, dtype=D), t([1.0]), torch.ones(1, 2, dtype=D),
                           objective="grpo")
    assert stats["kl/approx"].item() == pytest.approx((math.exp(0.1) - 1.1) / 2)


# ---------------------------------------------------------------- padding property
def _loss_and_grad(logp, old, adv, mask, ref, objective, aggregation):
    x = logp.clone().requires_grad_()
    loss, stats = policy_loss(x, old, adv, mask, objective=objective, aggregation=aggregation, norm_length=16,
                              ref_logprobs=ref, kl_coef=0.05)
    loss.backward()
    return loss.detach(), x.grad, stats


COMBOS = [(o, a) for o in OBJECTIVES for a in AGGREGATIONS
          if not (OBJECTIVES[o].length_neutral and a != "seq_mean_token_mean")]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    extra=st.integers(1, 4),
    pad_value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e6, -1e6, 0.0])),
    per_token_adv=st.booleans(),
)
def test_padding_never_changes_loss_or_gradient(seed, extra, pad_value, per_token_adv):
    logp, old, adv, mask = _random_batch(seed, N=4, T=5, scale=0.3, per_token_adv=per_token_adv)
    ref = old - 0.1
    pad = lambda x, v: torch.cat([x, torch.full((x.shape[0], extra), v, dtype=x.dtype)], dim=1)  # noqa: E731
    for objective, aggregation in COMBOS:
        a = adv if not (not OBJECTIVES[objective].token_advantages and per_token_adv) else adv[:, 0]
        base = _loss_and_grad(logp, old, a, mask, ref, objective, aggregation)
        a_pad = pad(a, pad_value) if a.dim() == 2 else a
        padded = _loss_and_grad(pad(logp, pad_value), pad(old, pad_value),
                                a_pad, pad(mask, 0.0), pad(ref, pad_value), objective, aggregation)
        # Not bitwise: the wider rows sum in other blocks, so the last bits can move (measured over 1000
        # seeds: 12% of losses differ, by at most 9e-16). Real leaks of the padding are far larger.
        assert torch.allclose(base[0], padded[0], rtol=0, atol=1e-12), (objective, aggregation)
        assert torch.allclose(base[1], padded[1][:, :5], rtol=0, atol=1e-12), (objective, aggregation)
        assert torch.all(padded[1][:, 5:] == 0)
        for key, value in base[2].items():
            assert torch.allclose(value, padded[2][key], rtol=0, atol=1e-12), (objective, key)


# ---------------------------------------------------------------- bad input
def _ok():
    return t([[-1.0, -2.0]]), t([[-1.0, -2.0]]), t([1.0]), t([[1, 1]])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "old_logprobs": t([[-1.0]])}, "old_logprobs: shape"),
        (lambda a: {**a, "mask": t([[1, 1, 1]])}, "mask: shape"),
        (lambda a: {**a, "mask": t([[0, 0]])}, "mask: row 0 has no completion tokens"),
        (lambda a: {**a, "mask": t([[2, 1]])}, "mask: values must be 0 or 1"),
        (lambda a: {**a, "advantages": t([1.0, 2.0])}, "advantages: expected shape"),
        (lambda a: {**a, "logprobs": t([[float("nan"), -2.0]])}, "logprobs: non-finite"),
        (lambda a: {**a, "old_logprobs": t([[float("inf"), -2.0]])}, "old_logprobs: non-finite"),
        (lambda a: {**a, "advantages": t([float("nan")])}, "advantages: non-finite"),
        (lambda a: {**a, "objective": "ppo"}, "objective: unknown 'ppo'"),
        (lambda a: {**a, "aggregation": "sum"}, "aggregation: unknown 'sum'"),
        (lambda a: {**a, "objective": "grpo", "aggregation": "seq_mean_token_sum_norm"}, "norm_length"),
        (lambda a: {**a, "kl_coef": 0.1}, "ref_logprobs: required"),
        (lambda a: {**a, "kl_estimator": "k4", "objective": "grpo"}, "kl_estimator: unknown"),
        (lambda a: {**a, "clip_low": -0.1}, "clip_low=-0.1 must be"),
        (lambda a: {**a, "clip_low": 2.0}, r"clip_low=2.0 puts the lower clip 1 - clip_low at or below 0"),
        (lambda a: {**a, "clip_low": 1.0, "objective": "grpo"}, "grpo would have no lower clip"),
        (lambda a: {**a, "clip_low": 1.5, "objective": "cispo"}, "cispo's 'no lower bound'"),
        (lambda a: {**a, "clip_high": 0.2, "objective": "sapo"}, "sapo has no hard clip"),
        (lambda a: {**a, "advantages": t([[1.0, 1.0]])}, "use objective='gspo_token'"),
        (lambda a: {**a, "logprobs": t([-1.0, -2.0]), "old_logprobs": t([-1.0, -2.0]), "mask": t([1, 1])},
         "logprobs: expected shape"),
    ],
)
def test_bad_input_names_the_problem(change, message):
    lp, old, adv, mask = _ok()
    args = change({"logprobs": lp, "old_logprobs": old, "advantages": adv, "mask": mask, "objective": "gspo"})
    with pytest.raises(ValueError, match=message):
        policy_loss(args.pop("logprobs"), args.pop("old_logprobs"), args.pop("advantages"), args.pop("mask"), **args)


def test_nan_on_padding_is_accepted():
    loss, _ = policy_loss(t([[-1.0, float("nan")]]), t([[-1.0, float("inf")]]), t([1.0]), t([[1, 0]]), objective="grpo")
    assert loss.item() == pytest.approx(-1.0)


# ---------------------------------------------------------------- the registry
def reinforce(x: LossInputs):
    """Plain REINFORCE, -A log pi: token mean within each sequence, then the mean over sequences."""
    per_seq = (-x.adv_t * x.logp * x.maskf).sum(-1) / x.lengths  # (N,)
    return per_seq.mean(), {"ratio/mean": x.log_ratio.exp()[x.mask].mean()}


def test_a_registered_objective_is_run_by_policy_loss_and_accepted_by_the_config():
    # p = 1/2, 1/4 (A = +1) and 1/2 | pad (A = -1): loss = ((ln 2 + ln 4) / 2 - ln 2) / 2 = ln 2 / 4;
    # d loss / d logp = -A / (2 |y_i|): -1/4, -1/4 and +1/2, 0 on the padding
    logp = leaf([[math.log(0.5), math.log(0.25)], [math.log(0.5), 99.0]])
    mask, adv = t([[1, 1], [1, 0]]), t([1.0, -1.0])
    with registered_objective("reinforce", reinforce, default_clip=(None, None), default_aggregation="token_mean"):
        assert "reinforce" in OBJECTIVES and list(OBJECTIVES)[:2] == ["gspo", "grpo"]
        assert DEFAULT_AGGREGATION["reinforce"] == "token_mean" and DEFAULT_CLIP["reinforce"] == (None, None)
        loss, stats = policy_loss(logp, logp.detach(), adv, mask, objective="reinforce")
        assert loss.item() == pytest.approx(math.log(2) / 4, abs=1e-12)
        loss.backward()
        assert torch.allclose(logp.grad, t([[-0.25, -0.25], [0.5, 0.0]]), atol=1e-12)
        assert stats["ratio/mean"].item() == 1.0 and stats["loss/kl"].item() == 0.0
        cfg = make_config(TrainConfig, {"objective": "reinforce"})
        assert cfg.objective == "reinforce"
        with pytest.raises(ValueError, match="config: clip_low/clip_high: reinforce has no hard clip"):
            make_config(TrainConfig, {"objective": "reinforce", "clip_low": 0.1})
        with pytest.raises(ValueError, match="'reinforce' is already registered"):
            register_objective("reinforce", default_clip=(0.2, 0.2), default_aggregation="token_mean")(reinforce)
    assert "reinforce" not in OBJECTIVES and "reinforce" not in DEFAULT_AGGREGATION
    with pytest.raises(ValueError, match="objective='reinforce' is not one of gspo, grpo"):
        make_config(TrainConfig, {"objective": "reinforce"})
    with pytest.raises(ValueError, match="objective: unknown 'reinforce'"):
        policy_loss(logp, logp.detach(), adv, mask, objective="reinforce")


def test_the_length_rule_is_read_from_the_registry():
    register_objective("seq_reinforce", default_clip=(0.2, 0.2), default_aggregation="seq_mean_token_mean",
                       length_neutral=True)(reinforce)
    try:
        lp, old, adv, mask = _ok()
        with pytest.raises(ValueError, match="would weight seq_reinforce sequences by length"):
            policy_loss(lp, old, adv, mask, objective="seq_reinforce", aggregation="token_mean")
        with pytest.raises(ValueError, match="config: aggregation: 'token_mean' would weight seq_reinforce sequences"):
            make_config(TrainConfig, {"objective": "seq_reinforce", "aggregation": "token_mean"})
        with pytest.raises(ValueError, match="length-neutral objective aggregates with seq_mean_token_mean"):
            register_objective("bad", default_clip=(0.2, 0.2), default_aggregation="token_mean", length_neutral=True)
    finally:
        unregister_objective("seq_reinforce")
    assert "seq_reinforce" not in OBJECTIVES
    with pytest.raises(ValueError, match="'seq_reinforce' is not registered"):
        unregister_objective("seq_reinforce")


def test_built_in_registrations():
    assert list(OBJECTIVES) == ["gspo", "grpo", "gspo_token", "cispo", "sapo", "pg", "gmpo", "kl_cov", "luspo",
                                "vespo"]
    assert dict(DEFAULT_CLIP) == {"gspo": (3e-4, 4e-4), "grpo": (0.2, 0.2), "gspo_token": (3e-4, 4e-4),
                                  "cispo": (1.0, 0.28), "sapo": (None, None), "pg": (None, None),
                                  "gmpo": (0.4, 0.4), "kl_cov": (None, None), "luspo": (3e-4, 4e-4),
                                  "vespo": (None, None)}
    assert [o for o, spec in OBJECTIVES.items() if spec.length_neutral] == ["gspo", "gspo_token", "gmpo"]
    assert dict(OBJECTIVES["kl_cov"].options) == {"kl_cov_ratio": 2e-4, "kl_cov_coef": 1.0}
    assert DEFAULT_AGGREGATION["cispo"] == "token_mean"
    assert dict(OBJECTIVES["sapo"].options) == {"sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05}
    assert [o for o, spec in OBJECTIVES.items() if spec.options] == ["sapo", "kl_cov", "vespo"]  # gmpo: its clip
    assert dict(OBJECTIVES["vespo"].options) == {"vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0,
                                                 "vespo_lambda_neg": 2.0}
    assert DEFAULT_AGGREGATION["luspo"] == "seq_mean_token_sum" and DEFAULT_AGGREGATION["vespo"] == "token_mean"
