"""Schedules: hand-derived values of the learning-rate and SFT-coefficient schedules."""

import math

import pytest
import torch

from gspo.algo.schedules import SCHEDULES, lr_schedule, schedule


def test_warmup_then_cosine_by_hand():
    # warmup 2 of 6 steps: (i + 1) / 2 for i < 2; then frac = (i - 2) / 4 and 0.5 * (1 + cos(pi frac)):
    # frac 0, 1/4, 1/2, 3/4, 1 -> 1, (2 + sqrt 2) / 4, 1/2, (2 - sqrt 2) / 4, 0; past the end it stays 0
    f = lr_schedule("cosine", 2, 6)
    assert [f(0), f(1), f(2)] == [0.5, 1.0, 1.0]
    assert f(3) == pytest.approx((2 + math.sqrt(2)) / 4, abs=1e-15)
    assert f(4) == pytest.approx(0.5, abs=1e-15)
    assert f(5) == pytest.approx((2 - math.sqrt(2)) / 4, abs=1e-15)
    assert [f(6), f(9)] == [0.0, 0.0]


def test_warmup_then_linear_and_constant_by_hand():
    # linear, warmup 1 of 5: 1/1; then 1 - (i - 1) / 4: 1, 0.75, 0.5, 0.25, 0, and never below 0
    f = lr_schedule("linear", 1, 5)
    assert [f(i) for i in range(8)] == [1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0]
    # constant with warmup 4 (gspo sft's schedule): 1/4, 2/4, 3/4, then 1
    g = lr_schedule("constant", 4, 100)
    assert [g(i) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [lr_schedule("constant", 0, 3)(i) for i in range(4)] == [1.0] * 4


def test_peak_scales_the_schedule():
    # the SFT coefficient: peak 0.5, linear over 4 steps, no warmup: 0.5 * (1 - i / 4)
    assert [schedule("linear", i, 4, peak=0.5) for i in range(5)] == [0.5, 0.375, 0.25, 0.125, 0.0]
    assert schedule("cosine", 2, 4, peak=0.5) == pytest.approx(0.25, abs=1e-15)
    assert schedule("constant", 7, 4, peak=0.3) == 0.3
    assert schedule("linear", 0, 4, warmup=2, peak=0.5) == 0.25  # warmup ramps to the peak too


def test_lambda_lr_follows_the_schedule_and_keeps_it_out_of_its_state():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule("linear", 1, 5))
    lrs = [sched.get_last_lr()[0]]
    for _ in range(5):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    assert lrs == pytest.approx([0.1, 0.1, 0.075, 0.05, 0.025, 0.0], abs=1e-15)
    assert sched.state_dict()["lr_lambdas"] == [None]  # a plain function: checkpoints hold no closure state


def test_unknown_schedule_is_refused():
    assert SCHEDULES == ("constant", "linear", "cosine")
    with pytest.raises(ValueError, match="schedule='step' is not one of constant, linear, cosine"):
        schedule("step", 0, 4)
    with pytest.raises(ValueError, match="lr_scheduler='step' is not one of"):
        lr_schedule("step", 0, 4)
