"""The MoE router's load-balancing loss (gspo.algo.balance): hand-derived values and gradients, and Hugging
Face's own function on the same logits (the coefficient a model was trained with must mean the same here)."""

import math

import pytest
import torch

from gspo.algo.balance import load_balance_loss


def test_load_balance_loss_by_hand():
    # One router, E = 2, k = 1. Both rows prefer expert 0 (p = [3/4, 1/4]): f = [1, 0], P = [3/4, 1/4],
    # loss = 2 * (1 * 3/4) = 1.5. Only P_0 counts (f_1 = 0): d loss / d P_0 = E f_0 = 2, P_0 the mean of the rows'
    # p_0, and d p_0 / d z = p_0 (onehot_0 - p) = [3/16, -3/16]: each row's gradient 2 * 1/2 * [3/16, -3/16].
    z = torch.tensor([[math.log(3.0), 0.0], [math.log(3.0), 0.0]], requires_grad=True)
    loss = load_balance_loss([z], top_k=1)
    assert loss.item() == pytest.approx(1.5)
    loss.backward()
    assert torch.allclose(z.grad, torch.tensor([[3 / 16, -3 / 16]] * 2))
    # balanced: one row on each expert, mirror probabilities: f = P = [1/2, 1/2], loss 2 * (1/4 + 1/4) = 1 = k
    balanced = torch.tensor([[math.log(3.0), 0.0], [0.0, math.log(3.0)]])
    assert load_balance_loss([balanced], top_k=1).item() == pytest.approx(1.0)
    # a padded row counts for nothing: the second row masked out leaves row 0 alone, f = [1, 0], P = [3/4, 1/4]
    assert load_balance_loss([balanced], top_k=1, mask=torch.tensor([1, 0])).item() == pytest.approx(1.5)
    # two routers count together: (router, token) pairs pooled before the product, as Hugging Face's
    # counts [2, 0] over 2 pairs (f = [1, 0]) and P = [3/4, 1/4]: 1.5 again; with the balanced router, pooled
    # f = [3/4, 1/4], P = [5/8, 3/8]: 2 * (15/32 + 3/32) = 9/8
    assert load_balance_loss([balanced, z.detach()], top_k=1).item() == pytest.approx(9 / 8)
    # top-2 of 2 experts: every expert chosen by every row, f = [1, 1], sum P = 1: loss = 2 * 1 = k
    assert load_balance_loss([z.detach()], top_k=2).item() == pytest.approx(2.0)


def test_load_balance_loss_is_hugging_faces():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(2 * 5, 8, generator=g) for _ in range(3)]  # 3 routers, 2 rows of 5 tokens, 8 experts
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])  # left and right padding
    ours = load_balance_loss(logits, top_k=2, mask=mask.reshape(-1))
    theirs = load_balancing_loss_func(tuple(logits), num_experts=8, top_k=2, attention_mask=mask)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    assert load_balance_loss(logits, top_k=2).item() == pytest.approx(
        load_balancing_loss_func(tuple(logits), num_experts=8, top_k=2).item(), rel=1e-6)


def test_load_balance_loss_errors():
    with pytest.raises(ValueError, match="no router's logits"):
        load_balance_loss([], top_k=1)
    with pytest.raises(ValueError, match=r"top_k=3 must be in \[1, 2\]"):
        load_balance_loss([torch.zeros(4, 2)], top_k=3)
    with pytest.raises(ValueError, match="mask: 3 rows for router logits of 4"):
        load_balance_loss([torch.zeros(4, 2)], top_k=1, mask=torch.ones(3))
