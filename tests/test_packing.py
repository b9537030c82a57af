"""Padding-free training forwards (gspo/logprobs.py `packed`, config padding_free): sequences packed several
to a row with per-sequence position ids give the padded layout's log-probs, entropies and gradients;
where the layout is not a rollout's, or routing hooks read (N, L) batches, the padded path runs.

Tolerance: the packed forward multiplies other matrix shapes, so float sums may differ in the last bits;
measured on these models: log-probs and entropy identical, gradients <= 1.1e-6 of a largest entry ~7.
We allow 1e-5 (absolute, on values of order 1-10)."""

import pytest
import torch

from conftest import SMALL, SMALL_MOE, read_metrics, starts_with_digit, tiny_cfg
from gspo.logprobs import completion_logprobs, pack_rows
from gspo.models import load_model
from gspo.routing import MoERouting, NoRouting
from gspo.step import logprob_options
from gspo.trainer import train


def ragged(N: int = 6, P: int = 7, T: int = 9, seed: int = 0):
    """A rollout's layout: left-padded prompts, right-padded completions of different lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 80, (N, P + T), generator=g)  # (N, P+T)
    mask = torch.ones_like(ids)
    for i in range(N):
        mask[i, : i % 3] = 0  # left padding
        mask[i, P + T - 2 * (i % 4):] = 0  # right padding: completions of 9, 7, 5, 3 tokens
    return ids, mask, T


def values_and_grads(model, ids, mask, T, packed: bool):
    model.zero_grad(set_to_none=True)
    logp, ent = completion_logprobs(model, ids, mask, T, with_entropy=True, packed=packed)  # (N, T)
    scored = mask[:, -T:].bool()
    ((logp * scored).sum() + 0.1 * (ent * scored).sum()).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return (logp * scored).detach(), (ent * scored).detach(), grads


def test_pack_rows_first_fit_decreasing_by_hand():
    # capacity 5: 5 -> row 0; 4 -> row 1; 3 -> row 2 (rows 0, 1 full or short); 2 -> row 2 at 3; 1 -> row 1 at 4
    assert pack_rows([5, 3, 2, 4, 1]) == ([0, 2, 2, 1, 1], [0, 0, 3, 0, 4], 3)
    assert pack_rows([4, 4, 4]) == ([0, 1, 2], [0, 0, 0], 3)  # nothing to gain: the padded layout


@pytest.mark.parametrize("preset, overrides", [("tiny-dense", SMALL), ("tiny-moe", SMALL_MOE)])
def test_packed_values_and_gradients_equal_the_padded_path(preset, overrides):
    model, _ = load_model(preset, overrides=overrides)
    model.train()
    ids, mask, T = ragged()
    padded = values_and_grads(model, ids, mask, T, packed=False)
    packed = values_and_grads(model, ids, mask, T, packed=True)
    for a, b in zip(packed, padded):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert padded[2].abs().max() > 1  # real gradients, not zeros
    logp, _ = completion_logprobs(model, ids, mask, T, packed=True)
    assert torch.equal(logp[~mask[:, -T:].bool()], torch.zeros(int((mask[:, -T:] == 0).sum())))  # padded slots: 0


def test_a_layout_with_holes_takes_the_padded_path():
    model, _ = load_model("tiny-dense", overrides=SMALL)
    ids, mask, T = ragged()
    mask[1, 8] = 0  # a hole inside row 1: not a rollout's layout
    with torch.no_grad():
        a, _ = completion_logprobs(model, ids, mask, T, packed=True)
        b, _ = completion_logprobs(model, ids, mask, T, packed=False)
    assert torch.equal(a, b)


def test_routing_hooks_keep_the_forwards_padded(tmp_path):
    cfg = tiny_cfg(tmp_path)
    assert cfg.padding_free and logprob_options(cfg, NoRouting().packs)["packed"]
    moe, _ = load_model("tiny-moe", overrides=SMALL_MOE)
    assert not logprob_options(cfg, MoERouting(moe, "none", drift=True).packs)["packed"]
    assert not logprob_options(tiny_cfg(tmp_path, padding_free=False))["packed"]


def test_a_padding_free_run_learns_what_the_padded_run_learns(tmp_path):
    runs = {}
    for packed in (True, False):
        train(tiny_cfg(tmp_path / str(packed), reward_funcs=[starts_with_digit], padding_free=packed, max_steps=3))
        runs[packed] = [r for r in read_metrics(tmp_path / str(packed) / "run") if r["step"] > 0]
    for a, b in zip(runs[True], runs[False]):
        assert a["reward/mean"] == b["reward/mean"] and a["completion/mean_len"] == b["completion/mean_len"]
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], rel=1e-4, abs=1e-7)
        assert a["grad/norm"] == pytest.approx(b["grad/norm"], rel=1e-4)
