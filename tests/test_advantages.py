import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo.algo.advantages import (
    ESTIMATORS,
    gae,
    group_advantages,
    group_stats,
    register_estimator,
    unregister_estimator,
    whiten,
)
from gspo.config import TrainConfig, make_config


def test_one_right_of_four():
    # mean 0.25, population std sqrt(0.1875) = 0.4330127; (1 - 0.25) / (0.4330127 + 1e-4) = 1.7316...
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4)
    std = math.sqrt(0.1875)
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-4)
    assert torch.allclose(adv, expected, atol=1e-6)
    assert adv[0].item() == pytest.approx(1.7316, abs=1e-4)
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-6)


def test_groups_are_independent_and_equal_rewards_give_zero():
    # group 0 all equal -> exactly zero (no NaN); group 1: [2, 4] mean 3 std 1 -> [-1, 1] / (1 + 1e-4)
    adv = group_advantages(torch.tensor([5.0, 5.0, 2.0, 4.0]), 2)
    assert torch.equal(adv[:2], torch.zeros(2))
    assert torch.allclose(adv[2:], torch.tensor([-1.0, 1.0]) / 1.0001, atol=1e-7)
    assert torch.isfinite(adv).all()


def test_estimators_none_and_batch():
    r = torch.tensor([1.0, 0.0, 3.0, 3.0])
    # none: only centring, group means 0.5 and 3
    assert torch.allclose(group_advantages(r, 2, estimator="none"), torch.tensor([0.5, -0.5, 0.0, 0.0]))
    # batch: centred by group, divided by the std of all rewards: mean 1.75,
    # var = (0.5625 + 3.0625 + 1.5625 + 1.5625) / 4 = 1.6875
    std = math.sqrt(1.6875)
    expected = torch.tensor([0.5, -0.5, 0.0, 0.0]) / (std + 1e-4)
    assert torch.allclose(group_advantages(r, 2, estimator="batch"), expected, atol=1e-6)


def test_group_stats():
    # groups: [1, 1] (agree), [0, 1] (std 0.5), [0, 0] (agree)
    stats = group_stats(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2)
    assert stats["groups/zero_std_frac"] == pytest.approx(2 / 3)
    assert stats["groups/reward_std_mean"] == pytest.approx(0.5 / 3)


@pytest.mark.parametrize(
    "rewards, group_size, estimator, message",
    [
        (torch.ones(5), 2, "group", "not a positive multiple of group_size 2"),
        (torch.ones(4), 0, "group", "group_size: must be a positive int"),
        (torch.ones(4), 2, "rank", "estimator: unknown 'rank'"),
        (torch.tensor([1.0, float("nan")]), 2, "group", "rewards: non-finite value at index 1"),
        (torch.ones(2, 2), 2, "group", "rewards: expected a 1-D tensor"),
    ],
)
def test_bad_input(rewards, group_size, estimator, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, group_size, estimator=estimator)


def test_dropped_samples_get_zero_advantage_and_leave_the_group_stats():
    # Group 0: [1, NaN(dropped), 0, 0] -> valid [1, 0, 0]: mean 1/3, population std sqrt(2)/3 = 0.4714
    # A = (2/3) / 0.4715 = 1.4139, (-1/3) / 0.4715 = -0.7070. Group 1 all valid: [1, 1, 0, 0] -> +-1/(0.5+eps).
    rewards = torch.tensor([1.0, float("nan"), 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    valid = torch.isfinite(rewards)
    adv = group_advantages(rewards, 4, valid=valid)
    expected = torch.tensor([1.4139, 0.0, -0.7070, -0.7070, 0.9998, 0.9998, -0.9998, -0.9998])
    assert torch.allclose(adv, expected, atol=2e-4)
    assert torch.equal(adv[4:], group_advantages(rewards[4:], 4))  # untouched group: same as without a mask
    # estimator="none" centres on the valid mean only; a group with no valid sample is all zero.
    assert torch.allclose(group_advantages(rewards, 4, estimator="none", valid=valid)[:4],
                          torch.tensor([2 / 3, 0.0, -1 / 3, -1 / 3]))
    none_valid = torch.tensor([False] * 4 + [True] * 4)
    assert torch.equal(group_advantages(rewards, 4, valid=none_valid)[:4], torch.zeros(4))
    with pytest.raises(ValueError, match="non-finite value at index 1"):
        group_advantages(rewards, 4)  # without the mask a NaN is an error
    with pytest.raises(ValueError, match="valid: expected a bool tensor"):
        group_advantages(rewards, 4, valid=valid.float())


def test_group_stats_ignore_dropped_samples():
    # Group 0 valid [1, 1] (NaN dropped): zero spread. Group 1 [1, 0, 0]: std sqrt(2)/3 = 0.4714.
    rewards = torch.tensor([1.0, float("nan"), 1.0, float("nan"), 1.0, 0.0, 0.0, float("nan")])
    stats = group_stats(rewards, 4, valid=torch.isfinite(rewards))
    assert stats["groups/zero_std_frac"] == 0.5
    assert stats["groups/reward_std_mean"] == pytest.approx(math.sqrt(2) / 3 / 2)


def test_a_registered_estimator_is_dispatched_and_accepted_by_the_config():
    calls = []

    def sign(rewards, group_size, eps, valid):  # the sign of the centred reward
        calls.append(valid)
        r = rewards.view(-1, group_size)
        return (r - r.mean(dim=1, keepdim=True)).sign().view(-1)

    register_estimator("sign")(sign)
    try:
        # groups (1, 0) and (0.5, 0.5): centred (0.5, -0.5) and (0, 0) -> signs (1, -1), (0, 0)
        signs = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), 2, estimator="sign")
        assert signs.tolist() == [1.0, -1.0, 0.0, 0.0]
        assert calls == [None]  # every sample valid
        assert make_config(TrainConfig, {"advantage_estimator": "sign"}).advantage_estimator == "sign"
        assert make_config(TrainConfig, {"advantage_scale": "sign"}).advantage_estimator == "sign"  # the old name
    finally:
        unregister_estimator("sign")
    assert list(ESTIMATORS) == ["group", "batch", "none", "rloo", "reinforce_pp"]
    with pytest.raises(ValueError, match="advantage_estimator='sign' is not one of group, batch, none, rloo, "
                                         "reinforce_pp, gae"):
        make_config(TrainConfig, {"advantage_scale": "sign"})
    with pytest.raises(ValueError, match="'advantage_scale' is the old name of 'advantage_estimator'"):
        make_config(TrainConfig, {"advantage_scale": "group", "advantage_estimator": "rloo"})


def test_reinforce_pp_hand_values():
    # REINFORCE++: rewards (1, 0, 0, 0, 2, 2, 0, 4) over the whole batch, groups ignored: mean 9/8,
    # population variance (1/8)(sum r^2) - mean^2 = 25/8 - 81/64 = 119/64, std = sqrt(119)/8 = 1.36358
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 0.0, 4.0])
    adv = group_advantages(rewards, 4, estimator="reinforce_pp", eps=1e-9)
    std = 119**0.5 / 8
    expected = [(r - 9 / 8) / std for r in rewards.tolist()]
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-6, rtol=0)
    assert abs(expected[0] - (-0.0917)) < 1e-3  # (1 - 1.125) / 1.36358
    assert adv[0].item() == pytest.approx(-0.09167, abs=1e-5)  # the code's own output against the hand value
    # a dropped sample: out of the mean and std, advantage 0; rewards (1, NaN | 0, 3): mean 4/3, var 14/9
    valid = torch.tensor([True, False, True, True])
    adv = group_advantages(torch.tensor([1.0, float("nan"), 0.0, 3.0]), 2, estimator="reinforce_pp", eps=1e-9,
                           valid=valid)
    s = (14 / 9) ** 0.5
    torch.testing.assert_close(adv, torch.tensor([(1 - 4 / 3) / s, 0.0, (0 - 4 / 3) / s, (3 - 4 / 3) / s]),
                               atol=1e-6, rtol=0)


def test_rloo_hand_values():
    # group (1, 0, 0, 0): 1 - 0 = 1, 0 - 1/3; group (2, 2, 0, 4): 2 - 2, 2 - 2, 0 - 8/3, 4 - 4/3
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 0.0, 4.0]), 4, estimator="rloo")
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 0.0, 0.0, -8 / 3, 8 / 3]))
    # dropped samples are no one's baseline; a sample with no valid sibling gets 0
    valid = torch.tensor([True, True, False, False, True, False, False, False])
    adv = group_advantages(torch.tensor([1.0, 0.0, 9.0, 9.0, 5.0, 0.0, 0.0, 0.0]), 4, estimator="rloo", valid=valid)
    assert adv.tolist() == [1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def gae_case():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 2.0, math.nan, 7.0]])  # row 1: 2 tokens, then padding
    values = torch.tensor([[0.5, 0.4, 0.6, 0.7], [1.0, 0.5, math.inf, -3.0]])
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    return rewards, values, mask


def test_gae_hand_values():
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72); delta_t = r_t + 0.9 V_{t+1} - V_t, V after the last token = 0
    # row 0: deltas (-0.14, 0.14, 0.03, 0.3) -> A_3 = 0.3, A_2 = 0.03 + 0.72 * 0.3 = 0.246,
    #        A_1 = 0.14 + 0.72 * 0.246 = 0.31712, A_0 = -0.14 + 0.72 * 0.31712 = 0.0883264
    # row 1: deltas (0.9 * 0.5 - 1 = -0.55, 2 - 0.5 = 1.5) -> A_1 = 1.5, A_0 = -0.55 + 0.72 * 1.5 = 0.53
    advantages, returns = gae(*gae_case(), gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, torch.tensor([[0.0883264, 0.31712, 0.246, 0.3], [0.53, 1.5, 0.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.5883264, 0.71712, 0.846, 1.0], [1.53, 2.0, 0.0, 0.0]]))


def test_gae_with_gamma_lambda_one_and_zero_values_gives_the_terminal_reward_everywhere():
    rewards, _, mask = gae_case()
    advantages, returns = gae(rewards, torch.zeros(2, 4), mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 0.0, 0.0]]))
    torch.testing.assert_close(returns, advantages)


def test_gae_skips_an_episodes_observation_tokens():
    # row 0 of gae_case with an observation token (reward 5, value NaN: both ignored) between its second and
    # third model tokens: the recursion runs over the model's tokens, so they keep their four hand values
    rewards = torch.tensor([[0.0, 0.0, 5.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.4, math.nan, 0.6, 0.7]])
    mask = torch.tensor([[True, True, False, True, True]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, torch.tensor([[0.0883264, 0.31712, 0.0, 0.246, 0.3]]))
    torch.testing.assert_close(returns, torch.tensor([[0.5883264, 0.71712, 0.0, 0.846, 1.0]]))


@settings(max_examples=40)
@given(st.integers(0, 2**31 - 1), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.sampled_from([0.0, math.nan, 1e9]))
def test_gae_padding_never_changes_a_real_token(seed, gamma, lam, pad_value):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 6, (3,), generator=g)
    mask = torch.arange(6)[None, :] < lengths[:, None]  # (3, 6) right-padded
    rewards, values = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    a, r = gae(rewards, values, mask, gamma, lam)
    filled = [torch.where(mask, t, torch.full_like(t, pad_value)) for t in (rewards, values)]
    b, s = gae(*filled, mask, gamma, lam)
    assert torch.equal(a, b) and torch.equal(r, s) and not a[~mask].any()
    wider = [torch.cat([t, torch.full((3, 2), pad_value)], 1) for t in (rewards, values)]
    c, _ = gae(*wider, torch.cat([mask, torch.zeros(3, 2, dtype=torch.bool)], 1), gamma, lam)
    assert torch.equal(c[:, :6], a)


def test_whiten_over_the_masked_tokens():
    x = torch.tensor([[1.0, 3.0, math.nan], [5.0, 7.0, 2.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    # tokens 1, 3, 5, 7: mean 4, population std sqrt(5)
    torch.testing.assert_close(whiten(x, mask), torch.tensor([[-3, -1, 0], [1, 3, 0]]) / math.sqrt(5), atol=1e-6,
                               rtol=0)
    torch.testing.assert_close(whiten(x, mask, shift_mean=False), torch.tensor([[1, 3, 0], [5, 7, 0]]) / math.sqrt(5),
                               atol=1e-6, rtol=0)
