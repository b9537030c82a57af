"""Padding-free training forwards (gspo/algo/logprobs.py `packed`, config padding_free): sequences packed several
to a row with per-sequence position ids give the padded layout's log-probs, entropies and gradients, also
under MoE routing replay (records packed into the rows and back: gspo/plugs/routing.py `to_layout`); where the
layout is not a rollout's, or the model has no separable backbone and head, the padded path runs.

Tolerance: the packed forward multiplies other matrix shapes, so float sums may differ in the last bits;
measured on these models: log-probs and entropy identical, gradients <= 1.1e-6 of a largest entry ~7.
We allow 1e-5 (absolute, on values of order 1-10)."""

import pytest
import torch

from conftest import SMALL, SMALL_MOE, random_record, read_metrics, starts_with_digit, tiny_cfg
from gspo.algo.logprobs import completion_logprobs, pack_rows, packed_layout, padding_free_layout
from gspo.models import load_model
from gspo.plugs.critic import completion_values, value_model_from
from gspo.plugs.moe import RoutingRecord, record_routing, replay_routing
from gspo.plugs.routing import MoERouting, from_layout, to_layout
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


def values_and_grads(model, ids, mask, T, packed: bool, record: RoutingRecord | None = None):
    """Scored log-probs, entropies and the parameters' gradients of one forward and backward; with `record`
    (padded layout) the experts replayed, packed into the rows where the forward packs."""
    model.zero_grad(set_to_none=True)
    layout = padding_free_layout(model, mask, T) if packed else None
    with replay_routing(model, to_layout(record, layout)) if record is not None else torch.enable_grad():
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


def test_a_critic_packed_gives_the_padded_values_and_gradients():
    critic = value_model_from(load_model("tiny-dense", overrides=SMALL)[0])
    torch.nn.init.normal_(critic.head.weight, std=0.5, generator=torch.Generator().manual_seed(0))  # zero at start
    ids, mask, T = ragged()
    scored = mask[:, -T:].bool()
    results = []
    for packed in (False, True):
        critic.zero_grad(set_to_none=True)
        values = completion_values(critic, ids, mask, T, packed=packed)  # (N, T)
        (values * scored).square().sum().backward()
        results.append(((values * scored).detach(), torch.cat([p.grad.reshape(-1) for p in critic.parameters()])))
    (padded, g_padded), (packed, g_packed) = results
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)
    scale = float(g_padded.abs().max())  # ~1.8e3 (a squared loss); measured differences <= 2.7e-7 of it
    torch.testing.assert_close(g_packed, g_padded, rtol=0, atol=2e-6 * scale)
    assert padded.abs().max() > 0.1 and scale > 1  # real values, real gradients


def test_packed_layout_by_hand():
    mask = torch.tensor([[0, 1, 1, 1, 0],   # 3 tokens
                         [1, 1, 1, 1, 1],   # 5: a row of its own
                         [0, 0, 1, 1, 0]])  # 2: after the first
    layout = packed_layout(mask)
    assert (layout.rows, layout.capacity) == (2, 5)
    assert layout.slots.tolist() == [[-1, 5, 6, 7, -1], [0, 1, 2, 3, 4], [-1, -1, 8, 9, -1]]
    x = torch.arange(15).view(3, 5) + 100  # (N, L)
    packed = layout.pack(x, fill=-1)  # (2, 5)
    assert packed.tolist() == [[105, 106, 107, 108, 109], [101, 102, 103, 112, 113]]
    assert layout.unpack(packed, fill=0).tolist() == [[0, 101, 102, 103, 0], [105, 106, 107, 108, 109],
                                                       [0, 0, 112, 113, 0]]
    inputs = layout.inputs(x, mask)
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]  # restarting per sequence


def test_replayed_experts_in_packed_rows_give_the_padded_values_and_gradients():
    model, _ = load_model("tiny-moe", overrides=SMALL_MOE)
    model.train()
    ids, mask, T = ragged()
    record = random_record(model, ids)
    padded = values_and_grads(model, ids, mask, T, packed=False, record=record)
    packed = values_and_grads(model, ids, mask, T, packed=True, record=record)
    for a, b in zip(packed, padded):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    free = values_and_grads(model, ids, mask, T, packed=True)
    assert (free[0] - packed[0]).abs().max() > 1e-2  # the replay changed the values: a mapping error would show
    # what a packed forward records, unpacked, is the padded forward's record at every real token
    layout = padding_free_layout(model, mask, T)
    with torch.no_grad(), record_routing(model) as rec_packed:
        completion_logprobs(model, ids, mask, T, packed=True)
    with torch.no_grad(), record_routing(model) as rec_padded:
        completion_logprobs(model, ids, mask, T, packed=False)
    back, real = from_layout(rec_packed.record(), layout), mask.bool()
    assert torch.equal(back.indices[:, real], rec_padded.record().indices[:, real])
    assert (back.indices[:, ~real] == -1).all()


def test_a_wrapped_model_trains_padded_and_its_routing_records_stay_padded():
    moe, _ = load_model("tiny-moe", overrides=SMALL_MOE)
    _, mask, T = ragged()
    wrapper = torch.nn.Module()  # like DDP: no get_decoder / get_output_embeddings, so the forward runs padded
    assert padding_free_layout(wrapper, mask, T) is None and padding_free_layout(moe, mask, T) is not None

    class Minibatch:
        attention_mask, completion_len = mask, T

    routing = MoERouting(moe, "none", drift=True, packed=True)
    assert routing.watch(Minibatch(), model=wrapper).layout is None
    assert routing.watch(Minibatch(), model=moe).layout is not None
    assert MoERouting(moe, "none", drift=True, packed=False).watch(Minibatch(), model=moe).layout is None


def test_a_padding_free_run_learns_what_the_padded_run_learns(tmp_path):
    runs = {}
    for packed in (True, False):
        train(tiny_cfg(tmp_path / str(packed), reward_funcs=[starts_with_digit], padding_free=packed, max_steps=3))
        runs[packed] = [r for r in read_metrics(tmp_path / str(packed) / "run") if r["step"] > 0]
    assert [r["step"] for r in runs[True]] == [r["step"] for r in runs[False]] == [1, 2, 3]  # zip compares them all
    for a, b in zip(runs[True], runs[False]):
        assert a["reward/mean"] == b["reward/mean"] and a["completion/mean_len"] == b["completion/mean_len"]
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], rel=1e-4, abs=1e-7)
        assert a["grad/norm"] == pytest.approx(b["grad/norm"], rel=1e-4)


def text_hash(prompts, completions, **_):
    """Rewards spread within every group (a random model's starts_with_digit is often 0 for a whole batch)."""
    return [sum(map(ord, c)) % 5 / 4 for c in completions]


MOE_RUN = dict(model="tiny-moe", model_overrides=SMALL_MOE, max_steps=3, learning_rate=1e-2, eval_num_prompts=1,
               eval_k=1, log_samples_steps=0, reward_funcs=[text_hash], num_minibatches=2, num_epochs=2)


@pytest.mark.slow
@pytest.mark.parametrize("replay", ["old_policy", "rollout", "none"])
def test_a_padding_free_moe_run_replays_and_measures_drift_as_the_padded_run(tmp_path, replay):
    """Routing replay and the drift meter on padding-free forwards: the same run as the padded one (2 epochs:
    a later epoch's minibatches replay records taken in other rows)."""
    runs = {}
    for packed in (True, False):
        train(tiny_cfg(tmp_path / str(packed), **MOE_RUN, routing_replay=replay, padding_free=packed))
        runs[packed] = [r for r in read_metrics(tmp_path / str(packed) / "run") if r["step"] > 0]
    assert [r["step"] for r in runs[True]] == [r["step"] for r in runs[False]] == [1, 2, 3]  # zip compares them all
    for a, b in zip(runs[True], runs[False]):
        assert a["reward/mean"] == b["reward/mean"] and a["completion/mean_len"] == b["completion/mean_len"]
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], rel=1e-4, abs=1e-7)
        assert a["grad/norm"] == pytest.approx(b["grad/norm"], rel=1e-4)
        assert a["moe/expert_change_frac"] == pytest.approx(b["moe/expert_change_frac"], abs=1e-3)
        if replay != "none":
            assert a["moe/replay_mismatch_frac"] == pytest.approx(b["moe/replay_mismatch_frac"], abs=1e-3)
    assert max(r["moe/expert_change_frac"] for r in runs[True]) > 0  # the meter measured something
