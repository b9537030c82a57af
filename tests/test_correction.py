"""Sampler-trainer mismatch (gspo/algo/correction.py): hand-derived weights, masks and metrics, the
objectives with a correction's factor, and the no-op case (mu == pi_old: bit for bit)."""

import math

import numpy as np
import pytest
import torch

from gspo.algo.correction import (
    CORRECTIONS,
    behaviour_weights,
    mismatch_metrics,
    mismatch_moments,
    thresholds,
)
from gspo.algo.objectives import OBJECTIVES, policy_loss, registered_objective
from gspo.config import TrainConfig, make_config

# Two sequences: row 0 has token weights pi_old/mu = (2, 0.5, 4), row 1 two tokens with mu == pi_old.
OLD = torch.log(torch.tensor([[0.2, 0.2, 0.2], [0.3, 0.6, 1.0]]))  # (2, 3); [1, 2] is padding
MU = torch.log(torch.tensor([[0.1, 0.4, 0.05], [0.3, 0.6, 0.7]]))  # (2, 3)
MASK = torch.tensor([[True, True, True], [True, True, False]])


def weights(mode, low=None, high=None):
    return behaviour_weights(OLD, MU, MASK, mode, low, high)


def test_token_tis_truncates_each_token():
    w, stats = weights("token_tis")  # high 2.0
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 2.0], [1.0, 1.0, 0.0]]))
    assert stats["mismatch/clipped_frac"].item() == pytest.approx(1 / 5)  # the token of weight 4


def test_token_mis_drops_tokens_outside_the_band():
    w, stats = weights("token_mis", 0.6, 3.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))  # 0.5 < 0.6, 4 > 3
    assert stats["mismatch/masked_frac"].item() == pytest.approx(2 / 5)


def test_sequence_modes_use_the_product_of_the_token_weights():
    # W_0 = 2 * 0.5 * 4 = 4, W_1 = 1
    w, stats = weights("seq_tis", high=3.0)
    torch.testing.assert_close(w, torch.tensor([[3.0, 3.0, 3.0], [1.0, 1.0, 0.0]]))
    assert stats["mismatch/clipped_frac"].item() == pytest.approx(1 / 2)
    w, stats = weights("seq_mis", 0.5, 5.0)
    torch.testing.assert_close(w, torch.tensor([[4.0, 4.0, 4.0], [1.0, 1.0, 0.0]]))
    assert stats["mismatch/masked_frac"].item() == 0.0
    w, stats = weights("seq_mis")  # [0.5, 2]: row 0 dropped whole
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert stats["mismatch/masked_frac"].item() == pytest.approx(1 / 2)


def test_geo_mis_filters_on_the_geometric_mean():
    # row 0: exp(mean log w) = 4 ** (1/3) = 1.587; row 1: 1
    w, stats = weights("geo_mis", 0.5, 1.6)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))
    w, stats = weights("geo_mis", 0.5, 1.58)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert stats["mismatch/masked_frac"].item() == pytest.approx(1 / 2)


@pytest.mark.parametrize("mode", CORRECTIONS[1:])
def test_every_factor_is_exactly_one_where_mu_is_pi_old(mode):
    old = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)) - 2
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False
    w, stats = behaviour_weights(old, old.clone(), mask, mode)
    assert torch.equal(w, mask.float())
    assert all(v.item() == 0.0 for v in stats.values())


def test_none_gives_no_factor():
    assert weights("none") == (None, {})


@pytest.mark.parametrize("mode", CORRECTIONS[1:])
@pytest.mark.parametrize("objective", ["gspo", "grpo", "gspo_token", "cispo", "sapo", "pg", "gmpo", "kl_cov"])
def test_unit_factor_leaves_loss_and_gradient_bitwise_unchanged(objective, mode):
    g = torch.Generator().manual_seed(1)
    old = torch.randn(4, 5, generator=g) - 1
    logp = (old + 1e-4 * torch.randn(4, 5, generator=g)).requires_grad_()
    adv, mask = torch.randn(4, generator=g), torch.ones(4, 5, dtype=torch.bool)
    mask[2, 3:] = False
    w, _ = behaviour_weights(old, old, mask, mode)
    plain, _ = policy_loss(logp, old, adv, mask, objective=objective)
    (grad_plain,) = torch.autograd.grad(plain, logp)
    corrected, _ = policy_loss(logp, old, adv, mask, objective=objective, correction_weight=w)
    (grad_corrected,) = torch.autograd.grad(corrected, logp)
    assert torch.equal(plain, corrected) and torch.equal(grad_plain, grad_corrected)


def test_grpo_token_terms_are_weighted_hand_gradient():
    # On-policy (ratio 1, no clip): loss = -1/N sum_i 1/L_i sum_t w_t A_i, so d loss / d logp_t = -w_t A_i / (N L_i).
    logp = OLD.clone().requires_grad_()
    adv = torch.tensor([1.0, -2.0])
    w = torch.tensor([[2.0, 0.5, 3.0], [1.0, 0.0, 0.0]])
    loss, _ = policy_loss(logp, OLD, adv, MASK, objective="grpo", correction_weight=w)
    loss.backward()
    expected = torch.tensor([[-2.0 / 6, -0.5 / 6, -3.0 / 6], [2.0 / 4, 0.0, 0.0]])
    torch.testing.assert_close(logp.grad, expected)
    assert loss.item() == pytest.approx(-(1.0 * (2 + 0.5 + 3) / 3 + -2.0 * 1 / 2) / 2)


def test_gspo_sequence_term_is_weighted_by_its_mean_factor():
    # On-policy s_i = 1: loss = -1/N sum_i wbar_i A_i, d loss / d logp_t = -wbar_i A_i / (N L_i).
    logp = OLD.clone().requires_grad_()
    adv = torch.tensor([1.0, -2.0])
    w = torch.tensor([[2.0, 0.5, 3.5], [1.0, 0.0, 0.0]])  # wbar = (2, 0.5)
    loss, _ = policy_loss(logp, OLD, adv, MASK, objective="gspo", correction_weight=w)
    loss.backward()
    assert loss.item() == pytest.approx(-(2.0 * 1.0 + 0.5 * -2.0) / 2)
    torch.testing.assert_close(logp.grad, torch.tensor([[-2 / 6, -2 / 6, -2 / 6], [0.5 / 2, 0.5 / 2, 0.0]]))


def test_objective_without_correction_support_is_refused():
    def plain(x):
        return -(x.log_ratio.exp() * x.adv_t).sum() / x.maskf.sum(), {}

    with registered_objective("plain_pg", plain, default_clip=(0.2, 0.2), default_aggregation="token_mean"):
        assert not OBJECTIVES["plain_pg"].corrects
        with pytest.raises(ValueError, match="does not apply a correction"):
            policy_loss(OLD, OLD, torch.ones(2), MASK, objective="plain_pg", correction_weight=torch.ones(2, 3))


# ------------------------------------------------------------------------------ metrics
def metrics(old=OLD, mu=MU, mask=MASK):
    return mismatch_metrics(mismatch_moments(old, mu, mask)[0])


def test_mismatch_metrics_hand_values():
    m = metrics()
    # k3 per token: w - 1 - log w over w = (2, 0.5, 4, 1, 1): (3.5 - 2 ln 2) / 5
    assert m["mismatch/kl"] == pytest.approx((3.5 - 2 * math.log(2)) / 5)
    assert m["mismatch/chi2_token"] == pytest.approx((4 + 0.25 + 16 + 1 + 1) / 5 - 1)  # 3.45
    assert m["mismatch/chi2_seq"] == pytest.approx((16 + 1) / 2 - 1)  # W = (4, 1): 7.5
    assert m["mismatch/ess"] == pytest.approx(2.5**2 / 8.5)
    assert m["mismatch/abs_logp_diff_mean"] == pytest.approx(4 * math.log(2) / 5)
    assert m["mismatch/abs_logp_diff_max"] == pytest.approx(math.log(4))
    p, q = [0.2, 0.2, 0.2, 0.3, 0.6], [0.1, 0.4, 0.05, 0.3, 0.6]
    assert m["mismatch/prob_pearson"] == pytest.approx(np.corrcoef(p, q)[0, 1])


def test_mismatch_metrics_where_mu_is_pi_old():
    m = metrics(mu=OLD)
    assert m["mismatch/kl"] == 0 and m["mismatch/chi2_token"] == 0 and m["mismatch/chi2_seq"] == 0
    assert m["mismatch/ess"] == 1 and m["mismatch/abs_logp_diff_max"] == 0
    assert m["mismatch/prob_pearson"] == pytest.approx(1.0)


def test_ess_where_every_sequence_weight_is_far_below_one():
    # 1024-token answers from a stale sampler: log W around -300 (W ~ 1e-130, W^2 underflows the W - 1 moments)
    # raised ZeroDivisionError; the ESS is scale-free, so it is the ESS of log W + 300
    log_w = torch.tensor([-300.0, -301.0, -303.0, -310.0])  # (N,)
    old = torch.stack([log_w / 4] * 4, 1) - 1.0  # (N, 4): four tokens each
    mu = torch.full_like(old, -1.0)
    W = (log_w + 300).exp()
    expected = float(W.mean() ** 2 / W.square().mean())  # 0.49
    m = metrics(old, mu, torch.ones_like(old, dtype=torch.bool))
    assert m["mismatch/ess"] == pytest.approx(expected, rel=1e-6) and 0.4 < expected < 0.6
    # one sequence near 1 keeps the W - 1 moments' value (the same ESS either way, to float precision)
    near = torch.tensor([0.0, -0.5, -1.0, -2.0])
    m = metrics(torch.stack([near / 4] * 4, 1) - 1.0, mu, torch.ones_like(old, dtype=torch.bool))
    W = near.double().exp()
    assert m["mismatch/ess"] == pytest.approx(float(W.mean() ** 2 / W.square().mean()), rel=1e-6)


def test_k3_estimates_the_exact_kl_from_samples_of_mu():
    mu = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    pi_old = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1])
    exact = float((mu * (mu / pi_old).log()).sum())  # KL(mu || pi_old) = 0.1339
    tokens = torch.multinomial(mu, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    tokens = tokens.view(2000, 100)  # (N, T)
    m = metrics(pi_old.log()[tokens], mu.log()[tokens], torch.ones_like(tokens, dtype=torch.bool))
    assert m["mismatch/kl"] == pytest.approx(exact, rel=0.02)
    exact_chi2 = float((pi_old.square() / mu).sum() - 1)  # chi2(pi_old || mu) = E_mu[w^2] - 1
    assert m["mismatch/chi2_token"] == pytest.approx(exact_chi2, rel=0.02)


def test_moments_of_two_halves_recombine_into_the_whole():
    g = torch.Generator().manual_seed(3)
    old, mu = torch.randn(6, 5, generator=g) - 2, torch.randn(6, 5, generator=g) * 0.1 - 2
    mask = torch.rand(6, 5, generator=g) > 0.3
    mask[:, 0] = True
    whole = metrics(old, mu, mask)
    halves = [mismatch_moments(old[s], mu[s], mask[s]) for s in (slice(0, 2), slice(2, 6))]
    counts = [{"tokens": float(mask[s].sum()), "sequences": float(len(old[s]))} for s in (slice(0, 2), slice(2, 6))]
    joined = {}
    for key, unit in halves[0][1].items():
        values = [h[0][key] for h in halves]
        w = [c[unit] for c in counts]
        joined[key] = max(values) if key.endswith("/max") else sum(v * c for v, c in zip(values, w)) / sum(w)
    for key, value in mismatch_metrics(joined).items():
        assert value == pytest.approx(whole[key], rel=1e-9), key


# ------------------------------------------------------------------------------ thresholds and config
def test_thresholds_defaults_and_refusals():
    assert thresholds("token_tis") == (None, 2.0)
    assert thresholds("seq_mis", 0.8) == (0.8, 2.0)
    assert thresholds("geo_mis") == (0.99, 1.01)
    for args, message in [(("token_tis", 0.5), "only truncates"), (("token_mis", 1.2, 2.0), "must contain 1"),
                          (("seq_tis", None, 0.9), "below 1"), (("seq_mis", 0.0), "> 0"),
                          (("none", None, 2.0), "without a rollout_correction"), (("tis",), "unknown 'tis'")]:
        with pytest.raises(ValueError, match=message):
            thresholds(*args)


@pytest.mark.parametrize("overrides, message", [
    ({"rollout_correction": "token_tis", "use_sampler_logprobs": True}, "pi_old = mu"),
    ({"rollout_correction": "seq_is"}, "rollout_correction"),
    ({"rollout_correction": "token_mis", "rollout_correction_low": 1.5}, "must contain 1"),
    ({"sampler_dtype": "auto"}, "sampler_dtype"),
    ({"sampler_dtype": "fp8"}, "sampler_dtype"),
    ({"sampler_lag": -1}, "sampler_lag"),
    ({"vllm_gpu_memory_utilization": 1.5}, "vllm_gpu_memory_utilization"),
])
def test_config_refuses(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_config(TrainConfig, overrides)
