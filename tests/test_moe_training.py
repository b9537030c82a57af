"""MoE routing replay and the routing-drift metric inside the training loop (tiny Qwen3-MoE, no downloads)."""

import dataclasses
import math

import pytest
import torch

import gspo.models
import gspo.trainer
from conftest import SMALL, SMALL_MOE, changed, no_hooks, perturb_routers, read_metrics, tiny_cfg
from gspo.config import TrainConfig, make_config
from gspo.models import load_model
from gspo.plugs.moe import expert_change_frac, find_routers, record_routing
from gspo.plugs.routing import free_routing, minibatch_logprobs_and_routing
from gspo.rollout import generate
from gspo.tasks import get_task
from gspo.trainer import train

DRIFT_KEYS = ["moe/expert_change_frac", "moe/expert_change_frac/layer_0", "moe/expert_change_frac/layer_1"]


def text_hash(prompts, completions, **_):
    # Spread within every group of distinct completions, so every step updates (answer_match is 0
    # for a random model, and even starts_with_digit is often 0 for a whole small batch).
    return [sum(map(ord, c)) % 5 / 4 for c in completions]


# tiny_cfg's run on tiny-moe (SMALL_MOE: 2 Qwen3-MoE layers, 8 experts, top-2): shorter, at a high rate.
MOE_RUN = dict(model="tiny-moe", model_overrides=SMALL_MOE, max_steps=2, max_completion_length=6, learning_rate=1e-2,
               reward_funcs=[text_hash], eval_num_prompts=1, eval_k=1, log_samples_steps=0)


def moe_cfg(tmp_path, **kw):
    return tiny_cfg(tmp_path, **{**MOE_RUN, **kw})


@pytest.fixture
def loaded(monkeypatch):
    """Captures the model `train` loads (it is trained in place) and a copy of its initial weights."""
    seen = {}

    def capture(*args, **kwargs):
        model, tok = load_model(*args, **kwargs)
        seen["model"] = model
        seen["initial"] = {k: v.clone() for k, v in model.state_dict().items()}
        return model, tok

    monkeypatch.setattr(gspo.models, "load_model", capture)
    return seen


def tiny_rollout(model, tok, prompts=3, G=4, **kw):
    rows = get_task("add3").dataset("train", prompts, 0)
    torch.manual_seed(0)
    return generate(model, tok, [r["prompt"] for r in rows], G, max_new_tokens=8, **kw)


# ----------------------------------------------------------------------------- training runs

@pytest.mark.parametrize("objective", ["gspo", "grpo"])
@pytest.mark.parametrize("mode", ["none", "old_policy", "rollout"])
def test_training_with_each_replay_mode_moves_weights_and_logs_drift(tmp_path, loaded, mode, objective):
    # old_policy with 2 epochs: the reshuffled minibatches of epoch 2 replay the full-width record
    cfg = moe_cfg(tmp_path, routing_replay=mode, objective=objective, num_epochs=2 if mode == "old_policy" else 1)
    train(cfg)
    model, initial = loaded["model"], loaded["initial"]
    moved = changed(initial, model.state_dict())
    assert len(moved) > len(initial) // 2, "most parameters should move"
    routers = [r.name + ".weight" for r in find_routers(model)]
    assert len(routers) == 2 and set(routers) <= set(moved), "replay must still train the routers"
    assert no_hooks(model)
    rows = read_metrics(tmp_path / "run")[1:]
    assert [r["step"] for r in rows] == [1, 2]  # the loop below checks every step, and there are steps
    for r in rows:
        for key in DRIFT_KEYS:
            assert math.isfinite(r[key]) and 0 <= r[key] <= 1, (key, r[key])
        # lr 1e-2 on random weights moves the routing a lot (about half the choices in practice)
        assert r["moe/expert_change_frac"] > 0.01
        # every layer counts the same tokens, so the overall fraction is the mean of the layers'
        assert r["moe/expert_change_frac"] == pytest.approx((r[DRIFT_KEYS[1]] + r[DRIFT_KEYS[2]]) / 2, abs=1e-6)
        if mode == "none":
            assert "moe/replay_mismatch_frac" not in r
        else:
            assert 0 <= r["moe/replay_mismatch_frac"] <= 1


@pytest.mark.parametrize("mode", ["old_policy", "rollout"])
def test_single_minibatch_under_replay_is_exactly_on_policy(tmp_path, mode):
    train(moe_cfg(tmp_path, routing_replay=mode, num_minibatches=1))
    rows = read_metrics(tmp_path / "run")[1:]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["ratio/min"] == 1.0 and r["ratio/max"] == 1.0 and r["kl/approx"] == 0.0
        if mode == "old_policy":  # pi_old's own free choices are replayed at the same weights
            assert r["moe/replay_mismatch_frac"] == 0.0


@pytest.mark.parametrize("mode", ["none", "old_policy"])
def test_drift_is_exactly_zero_when_weights_do_not_move(tmp_path, loaded, mode):
    # lr=0 is refused by config validation; set it past validation: AdamW then leaves every weight as is
    cfg = dataclasses.replace(moe_cfg(tmp_path, routing_replay=mode, max_steps=1), learning_rate=0.0)
    train(cfg)
    model, initial = loaded["model"], loaded["initial"]
    assert changed(initial, model.state_dict()) == []
    r = read_metrics(tmp_path / "run")[1]
    assert [r[k] for k in DRIFT_KEYS] == [0.0, 0.0, 0.0]


def test_dense_model_with_replay_is_a_clear_error_and_logs_no_moe_keys(tmp_path):
    for mode in ("old_policy", "rollout"):
        with pytest.raises(ValueError, match="routing replay needs a Mixture-of-Experts model"):
            train(moe_cfg(tmp_path, model="tiny-dense", model_overrides=SMALL, routing_replay=mode))
        assert not (tmp_path / "run" / "metrics.jsonl").exists()  # raised before anything ran
    train(moe_cfg(tmp_path, model="tiny-dense", model_overrides=SMALL, max_steps=1))
    r = read_metrics(tmp_path / "run")[1]
    assert math.isfinite(r["loss/policy"]) and not [k for k in r if k.startswith("moe/")]


def test_drift_logging_can_be_turned_off(tmp_path):
    train(moe_cfg(tmp_path, routing_replay="rollout", log_routing_drift=False, max_steps=1))
    r = read_metrics(tmp_path / "run")[1]
    assert [k for k in r if k.startswith("moe/")] == ["moe/replay_mismatch_frac"]


def test_old_policy_replay_needs_the_pi_old_forward():
    with pytest.raises(ValueError, match="routing_replay=old_policy .* use_sampler_logprobs"):
        make_config(TrainConfig, dict(task="add3", routing_replay="old_policy", use_sampler_logprobs=True))


# ----------------------------------------------------------------------------- records and replay, directly

def test_generation_record_replayed_in_pi_old_forward_reproduces_the_sampler():
    model, tok = load_model("tiny-moe", overrides=SMALL_MOE)
    rollout = tiny_rollout(model, tok, routing_recorder=record_routing(model), with_logprobs=True)
    rec, mask = rollout.routing, rollout.attention_mask.bool()  # (R, N, P+T, k), (N, P+T)
    assert rec.shape == tuple(rollout.input_ids.shape) and rec.layers == (0, 1) and rec.top_k == 2
    assert (rec.indices[:, :, -1] == -1).all() and (rec.indices[:, :, :-1] >= 0).all()  # last token never fed back
    minibatches = torch.randperm(12, generator=torch.Generator().manual_seed(0)).chunk(2)
    with torch.no_grad():
        old, _ = minibatch_logprobs_and_routing(model, rollout, minibatches, {"temperature": 1.0, "chunk_size": 1024},
                                                replay=True)
    cmask = rollout.completion_mask
    torch.testing.assert_close(old[cmask], rollout.sampler_logprobs[cmask], rtol=0, atol=1e-5)
    # Rollout.select trims the record's columns exactly as it trims input_ids
    idx = minibatches[0]
    left, cut, _ = rollout.trim(idx)
    mb = rollout.select(idx)
    assert mb.routing.shape == tuple(mb.input_ids.shape) == (6, cut - left)
    assert torch.equal(mb.routing.indices, rec.indices[:, idx, left:cut])

    perturb_routers(model)  # the policy moved: free routing now disagrees with the sampler's
    with torch.no_grad():
        _, replayed = minibatch_logprobs_and_routing(model, rollout, minibatches, {}, replay=True, record=True)
        _, free = minibatch_logprobs_and_routing(model, rollout, minibatches, {}, record=True)
    real = mask.clone()
    real[:, -1] = False  # the last column routes freely under replay
    assert torch.equal(replayed.indices[:, real], rec.indices[:, real])  # every real position, every layer
    assert expert_change_frac(rec, free, real)[0] > 0.3


def test_old_policy_record_is_full_width_and_replays_in_other_minibatches():
    model, tok = load_model("tiny-moe", overrides=SMALL_MOE)
    rollout = tiny_rollout(model, tok)
    first = torch.randperm(12, generator=torch.Generator().manual_seed(0)).chunk(3)
    with torch.no_grad():
        old, rec = minibatch_logprobs_and_routing(model, rollout, first, {}, record=True)
    assert rec.shape == tuple(rollout.input_ids.shape)
    for idx in first:
        left, cut, _ = rollout.trim(idx)
        outside = torch.ones(rollout.input_ids.shape[1], dtype=torch.bool)
        outside[left:cut] = False
        assert (rec.indices[:, idx][:, :, outside] == -1).all()  # trimmed away: route freely
        assert torch.equal(rec.indices[:, idx, left:cut], free_routing(model, rollout.select(idx)).indices)
    real = rollout.attention_mask.bool()  # (N, P+T)
    assert (rec.indices[:, real] >= 0).all()  # every real token lies inside its minibatch's trim
    # A later epoch: other minibatches (other trims) select and replay the record. With unchanged
    # weights the log-probs agree up to float noise from the other padding widths ...
    later = torch.randperm(12, generator=torch.Generator().manual_seed(1)).chunk(2)
    rollout.routing = rec
    with torch.no_grad():
        again, _ = minibatch_logprobs_and_routing(model, rollout, later, {}, replay=True)
    cmask = rollout.completion_mask
    torch.testing.assert_close(again[cmask], old[cmask], rtol=0, atol=1e-5)
    # ... and after the routers moved, the experts used are still pi_old's at every real token.
    perturb_routers(model, seed=2)
    with torch.no_grad():
        _, used = minibatch_logprobs_and_routing(model, rollout, later, {}, replay=True, record=True)
        _, free = minibatch_logprobs_and_routing(model, rollout, later, {}, record=True)
    assert torch.equal(used.indices[:, real], rec.indices[:, real])
    assert expert_change_frac(rec, free, real)[0] > 0.3


# ----------------------------------------------------------------------------- the routers' load-balancing loss

def test_router_aux_loss_is_hugging_faces_over_the_real_tokens_padded_and_packed():
    from gspo.algo.logprobs import completion_logprobs
    from gspo.plugs.routing import build_routing

    model, tok = load_model("tiny-moe", overrides=SMALL_MOE)
    rollout = tiny_rollout(model, tok)  # left-padded prompts, right-padded completions
    assert not rollout.attention_mask.all()
    out = model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask, output_router_logits=True)
    expected = out.aux_loss.item()  # Hugging Face's own, over the same real tokens (8 experts, top-2: in [2, 8])
    assert 2.0 <= expected <= 8.0
    seen = []
    for packed in (False, True):
        routing = build_routing(model, "none", False, packed, aux_coef=0.5)
        watch = routing.watch(rollout)
        assert (watch.layout is not None) == packed
        with watch.recording():
            logp, _ = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.completion_len,
                                          packed=packed)
        term, stats = watch.router_loss()
        assert term.item() == pytest.approx(0.5 * stats["moe/aux_loss"].item())
        assert stats["moe/aux_loss"].item() == pytest.approx(expected, rel=1e-5)
        seen.append(term)
        assert no_hooks(model)
    # the term trains the routers: its gradient reaches every router's weight
    seen[1].backward()
    assert all(r.module.weight.grad is not None and r.module.weight.grad.abs().sum() > 0 for r in find_routers(model))


def test_router_aux_loss_in_a_run_is_logged_and_trains_the_routers(tmp_path, loaded):
    routers = {}
    for coef in (0.0, 1.0):
        train(moe_cfg(tmp_path / str(coef), router_aux_loss_coef=coef, log_routing_drift=False, max_steps=1))
        routers[coef] = [r.module.weight.detach().clone() for r in find_routers(loaded["model"])]
        assert no_hooks(loaded["model"])
    on, off = (read_metrics(tmp_path / str(coef) / "run")[1] for coef in (1.0, 0.0))
    assert 2.0 <= on["moe/aux_loss"] <= 8.0 and "moe/aux_loss" not in off  # top-2 of 8 experts; the default: none
    assert on["reward/mean"] == off["reward/mean"]  # the same samples (seeded), then other updates of the routers
    assert all(not torch.equal(a, b) for a, b in zip(routers[0.0], routers[1.0]))


def test_the_drift_meter_logs_the_balance_and_leaves_the_update_alone(tmp_path, loaded):
    """At coefficient 0 the drift meter also logs the routers' load-balancing loss: the same weights and metrics as
    a run without it, plus moe/aux_loss, which equals what the loss's own run measured at its first minibatch."""
    weights = {}
    for name, drift in (("meter", True), ("plain", False)):
        train(moe_cfg(tmp_path / name, log_routing_drift=drift, max_steps=1))
        weights[name] = [p.detach().clone() for p in loaded["model"].parameters()]
    meter, plain = (read_metrics(tmp_path / name / "run")[1] for name in ("meter", "plain"))
    assert 2.0 <= meter["moe/aux_loss"] <= 8.0 and "moe/aux_loss" not in plain  # top-2 of 8 experts
    assert meter["loss/policy"] == plain["loss/policy"] and meter["grad/norm"] == plain["grad/norm"]
    assert all(torch.equal(a, b) for a, b in zip(weights["meter"], weights["plain"]))
    train(moe_cfg(tmp_path / "on", router_aux_loss_coef=1e-6, log_routing_drift=False, max_steps=1))
    on = read_metrics(tmp_path / "on" / "run")[1]
    assert meter["moe/aux_loss"] == pytest.approx(on["moe/aux_loss"], rel=1e-4)  # the same samples, a tiny push


def test_router_aux_loss_needs_an_moe_model_and_a_coefficient_at_least_0(tmp_path):
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.001: the routers' load-balancing loss needs a "
                                         r"Mixture-of-Experts model; Qwen3ForCausalLM has no MoE router; use "
                                         r"router_aux_loss_coef: 0"):
        train(moe_cfg(tmp_path, model="tiny-dense", model_overrides=SMALL, router_aux_loss_coef=0.001))
    with pytest.raises(ValueError, match=r"config: router_aux_loss_coef=-0.1 must be >= 0"):
        make_config(TrainConfig, dict(task="add3", router_aux_loss_coef=-0.1))
