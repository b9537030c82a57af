"""The critic's losses (gspo/algo/values.py): PPO's clipped value loss and explained variance, by hand."""

import math

import pytest
import torch

from gspo.algo.values import explained_variance, value_loss

MASK = torch.tensor([[True, True], [True, False]])


def test_clipped_value_loss_hand_values_and_gradient():
    # token 0: V 1.5, V_old 1.0, R 2.0: unclipped 0.25, V_clip 1.2 -> 0.64 (clipped side, no gradient)
    # token 1: V 0.9, V_old 1.0, R 0.0: unclipped 0.81, V_clip 0.9 (inside the range) -> 0.81 (gradient 2 * 0.9)
    # token 2: V 0.0, V_old 0.5, R 1.0: unclipped 1.0, V_clip 0.3 -> 0.49: unclipped is larger (gradient -2)
    values = torch.tensor([[1.5, 0.9], [0.0, math.nan]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0], [0.5, 4.0]])
    returns = torch.tensor([[2.0, 0.0], [1.0, -2.0]])
    loss, stats = value_loss(values, old, returns, MASK, clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 1.0) / 3)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.9 / 3], [-1.0 / 3, 0.0]]))
    assert stats["value/clip_frac"].item() == pytest.approx(1 / 3)
    assert stats["value/mean"].item() == pytest.approx(2.4 / 3)


def test_values_inside_the_clip_band_are_never_counted_as_clipped():
    # old + (V - old) is V only up to rounding: with V near 0 and V_old up to 0.15 away, every V_clip
    # differs from V in its last bits and comparing the two squared errors alone counts ~4% of these
    # unclipped tokens as clipped (measured); only a value moved beyond the band may be
    g = torch.Generator().manual_seed(0)
    old = (torch.rand(64, 16, generator=g) - 0.5) * 0.3  # (N, T)
    values = (torch.randn(64, 16, generator=g) * 1e-6).requires_grad_()  # moved < 0.2 from old
    returns = torch.randn(64, 16, generator=g)
    mask = torch.ones(64, 16, dtype=torch.bool)
    assert (values - old).abs().max() < 0.2 and (old + (values - old) != values).float().mean() > 0.9
    loss, stats = value_loss(values, old, returns, mask, clip=0.2)
    assert stats["value/clip_frac"].item() == 0.0
    plain, _ = value_loss(values, old, returns, mask, clip=None)
    assert loss.item() == plain.item()  # the unclipped loss, bit for bit


def test_unclipped_value_loss_is_half_the_mean_squared_error():
    values = torch.tensor([[1.5, 0.9], [0.0, 0.0]])
    loss, stats = value_loss(values, torch.zeros(2, 2), torch.tensor([[2.0, 0.0], [1.0, 5.0]]), MASK, clip=None)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.81 + 1.0) / 3)
    assert stats["value/clip_frac"].item() == 0.0


def test_value_loss_refuses_bad_input():
    with pytest.raises(ValueError, match="must be the same"):
        value_loss(torch.zeros(2, 2), torch.zeros(2, 3), torch.zeros(2, 2), MASK)
    with pytest.raises(ValueError, match="value_clip"):
        value_loss(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), MASK, clip=0.0)
    with pytest.raises(ValueError, match="no completion token"):
        value_loss(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.bool))


def test_explained_variance_by_hand():
    returns = torch.tensor([[1.0, 3.0], [5.0, 100.0]])  # masked tokens 1, 3, 5: variance 8/3
    assert explained_variance(returns, returns, MASK) == 1.0
    assert explained_variance(torch.full((2, 2), 3.0), returns, MASK) == pytest.approx(0.0)  # the mean return
    # errors (0, 1, -1): variance 2/3 -> 1 - (2/3) / (8/3) = 0.75
    assert explained_variance(torch.tensor([[1.0, 2.0], [6.0, 0.0]]), returns, MASK) == pytest.approx(0.75)
    assert math.isnan(explained_variance(returns, torch.ones(2, 2), MASK))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("pad", [0.0, 1e6, math.nan, -math.inf])
def test_padding_never_changes_the_value_loss_or_its_gradient(seed, pad):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(4, 6, generator=g) > 0.3  # (N, T)
    mask[:, 0] = True
    values, old, returns = (torch.randn(4, 6, generator=g) for _ in range(3))
    results = []
    for fill in (0.0, pad):
        v = torch.where(mask, values, fill).requires_grad_()
        loss, stats = value_loss(v, torch.where(mask, old, fill), torch.where(mask, returns, fill), mask, clip=0.2)
        loss.backward()
        results.append((loss.detach(), {k: t.clone() for k, t in stats.items()}, torch.where(mask, v.grad, 0.0)))
    (l0, s0, g0), (l1, s1, g1) = results
    assert torch.equal(l0, l1) and torch.equal(g0, g1) and all(torch.equal(s0[k], s1[k]) for k in s0)
    assert torch.isfinite(g1).all() and l0 > 0
