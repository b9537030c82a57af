"""bf16 mixed precision and gradient checkpointing (gspo/plugs/precision.py): the training forward's gradients
against the plain float32 path, on dense and MoE models, with routing replay; runs that use them train.

Tolerances: gradient checkpointing recomputes the same float32 ops, so its gradients equal the plain
path's (atol 1e-6; measured: identical, on both presets). bf16 autocast rounds every matmul's inputs to
8 mantissa bits: the whole gradient vector stays within 3% relative (L2) of the float32 one, with cosine
above 0.999 (measured: 0.76% / 0.99998 on tiny-dense, 0.82% / 1.00000 on tiny-moe). fp16 autocast rounds to 11
significant bits: 0.099% on tiny-dense, 0.087% on tiny-moe (8-9x below bf16; the test asks for 3x)."""

import contextlib

import pytest
import torch

from conftest import (
    SMALL,
    SMALL_MOE,
    changed,
    final_weights,
    initial_weights,
    read_metrics,
    starts_with_digit,
    tiny_cfg,
)
from gspo.algo.logprobs import completion_logprobs
from gspo.models import load_model
from gspo.plugs.moe import record_routing, replay_routing
from gspo.plugs.precision import enable_gradient_checkpointing, forward_precision
from gspo.trainer import train


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 80, (4, 14), generator=g)  # (N, P+T)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    advantages = torch.randn(4, generator=g)  # (N,)
    return ids, mask, advantages


FLOAT32 = forward_precision(False, "cpu")  # the plain float32 forward: a null context


def gradients(model, *, autocast=FLOAT32, record=None) -> torch.Tensor:
    """The flat gradient of a policy-gradient loss through the training forward (chunked log-probs)."""
    ids, mask, adv = batch()
    model.train()
    model.zero_grad(set_to_none=True)
    with replay_routing(model, record) if record is not None else torch.enable_grad():
        with autocast():
            logp, _ = completion_logprobs(model, ids, mask, 6, chunk_size=16)  # (N, T)
        assert logp.dtype == torch.float32
        loss = -(logp.sum(-1) * adv).mean()
        loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(g.dtype == torch.float32 for g in grads)  # float32 masters: gradients in float32 too
    return torch.cat([g.reshape(-1) for g in grads])


@pytest.mark.parametrize("preset, overrides", [("tiny-dense", SMALL), ("tiny-moe", SMALL_MOE)])
def test_gradient_checkpointing_gives_the_plain_gradients(preset, overrides):
    plain = gradients(load_model(preset, overrides=overrides)[0])
    model, _ = load_model(preset, overrides=overrides)
    enable_gradient_checkpointing(model, True)
    assert model.is_activation_checkpointing
    torch.testing.assert_close(gradients(model), plain, rtol=0, atol=1e-6)


def test_gradient_checkpointing_gives_the_plain_gradients_of_lora_adapters(tmp_path):
    """Only the adapters require grad (a frozen base: what the reentrant variant would get wrong)."""
    pytest.importorskip("peft")
    from gspo.plugs.lora import attach_adapters

    def lora_model(checkpointing: bool):
        model, _ = load_model("tiny-dense", overrides=SMALL)
        enable_gradient_checkpointing(model, checkpointing)
        policy = attach_adapters(model, tiny_cfg(tmp_path, lora_r=4))
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)  # B != 0: A gets gradients too
        return policy

    plain = gradients(lora_model(False))
    assert plain.numel() == sum(p.numel() for n, p in lora_model(False).named_parameters() if "lora_" in n)
    torch.testing.assert_close(gradients(lora_model(True)), plain, rtol=0, atol=1e-6)


def test_gradient_checkpointing_recomputes_under_routing_replay():
    """The backward's recompute runs inside replay_routing: the replayed experts again, not free ones."""
    model, _ = load_model("tiny-moe", overrides=SMALL_MOE)
    ids, mask, _ = batch()
    with torch.no_grad(), record_routing(model) as recorder:
        completion_logprobs(model, ids, mask, 6)
    record = recorder.record()
    record.indices[:] = (record.indices + 1) % 8  # other experts than the free routing picks (8 in the preset)
    plain = gradients(load_model("tiny-moe", overrides=SMALL_MOE)[0], record=record)
    free = gradients(load_model("tiny-moe", overrides=SMALL_MOE)[0])
    assert (plain - free).abs().max() > 1e-4  # the replayed record matters to the gradient
    enable_gradient_checkpointing(model, True)
    torch.testing.assert_close(gradients(model, record=record), plain, rtol=0, atol=1e-6)


@pytest.mark.parametrize("preset, overrides", [("tiny-dense", SMALL), ("tiny-moe", SMALL_MOE)])
def test_bf16_autocast_gradients_are_close_to_float32(preset, overrides):
    plain = gradients(load_model(preset, overrides=overrides)[0])
    model, _ = load_model(preset, overrides=overrides)
    mixed = gradients(model, autocast=forward_precision(True, "cpu"))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the weights were never cast
    relative = float((mixed - plain).norm() / plain.norm())
    cosine = float(torch.nn.functional.cosine_similarity(mixed, plain, dim=0))
    assert relative < 0.03 and cosine > 0.999, (relative, cosine)
    assert relative > 1e-4  # bf16 really ran: a float32 path would be exact


def test_a_bf16_and_checkpointed_run_trains_with_float32_weights(tmp_path):
    cfg = tiny_cfg(tmp_path, reward_funcs=[starts_with_digit], bf16=True, gradient_checkpointing=True,
                   log_mismatch=True, max_steps=3)
    train(cfg)
    rows = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert all(r["grad/norm"] > 0 for r in rows)
    # the sampler (decode loop, KV cache) and pi_old (one full forward) both ran under autocast: close
    assert all(0 <= r["mismatch/kl"] < 1e-4 for r in rows), [r["mismatch/kl"] for r in rows]
    weights = final_weights(tmp_path / "run")
    assert changed(initial_weights(cfg), weights) and all(t.dtype == torch.float32 for t in weights.values())


def test_the_current_autocast_carries_to_another_thread():
    import threading

    from gspo.plugs.precision import current_autocast

    def on_a_thread(factory):
        seen = []

        def run():
            with factory():
                seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        return seen[0]

    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = current_autocast("cpu")
        assert on_a_thread(contextlib.nullcontext)[0] is False  # autocast is per thread
    assert on_a_thread(inside) == (True, torch.bfloat16)
    assert on_a_thread(current_autocast("cpu"))[0] is False


def test_bf16_and_checkpointing_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="float32 master weights, but dtype='bfloat16'"):
        tiny_cfg(tmp_path, bf16=True, dtype="bfloat16")
    with pytest.raises(ValueError, match="cannot autocast on device type 'meta'"):
        forward_precision(True, "meta")
    with pytest.raises(ValueError, match="Linear does not support it"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2), True)


# ---------------------------------------------------------------------------------------------- fp16
@pytest.mark.parametrize("preset, overrides", [("tiny-dense", SMALL), ("tiny-moe", SMALL_MOE)])
def test_fp16_autocast_gradients_are_closer_to_float32_than_bf16(preset, overrides):
    # float16 keeps 10 mantissa bits to bfloat16's 7: its rounding error, and the gradient's, is ~8x smaller
    plain = gradients(load_model(preset, overrides=overrides)[0])
    errors = {}
    for name, autocast in (("bf16", forward_precision(True, "cpu")), ("fp16", forward_precision(False, "cpu", True))):
        errors[name] = float((gradients(load_model(preset, overrides=overrides)[0], autocast=autocast) - plain).norm()
                             / plain.norm())
    assert 1e-5 < errors["fp16"] < errors["bf16"] / 3, errors


def test_fp16_loss_scaling_keeps_gradients_that_would_underflow():
    # a loss 1e-7 times the usual one: its float16 activation gradients fall below float16's smallest
    # subnormal (6e-8) and vanish; scaled by 2^16 before the backward and unscaled after, they survive
    from gspo.plugs.precision import loss_scaler

    def grads(scaler):
        model, _ = load_model("tiny-dense", overrides=SMALL)
        ids, mask, adv = batch()
        with forward_precision(False, "cpu", True)():
            logp, _ = completion_logprobs(model, ids, mask, 6, chunk_size=16)  # (N, T)
        loss = -1e-7 * (logp.sum(-1) * adv).mean()
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(optimizer := torch.optim.SGD(model.parameters(), lr=0.0))
            assert not sum(v.item() for v in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
                           .values())
        return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])

    reference = 1e-7 * gradients(load_model("tiny-dense", overrides=SMALL)[0])  # float32: no underflow
    unscaled, scaled = grads(None), grads(loss_scaler(True, "cpu"))
    error = lambda g: float((g - reference).norm() / reference.norm())  # noqa: E731
    assert error(unscaled) > 0.5 and error(scaled) < 0.01, (error(unscaled), error(scaled))  # measured: 1.04, 0.0027


@pytest.mark.slow
def test_an_fp16_run_trains_and_resumes_with_its_loss_scale(tmp_path):
    from conftest import final_weights as weights_of

    def cfg(name, **kw):
        return tiny_cfg(tmp_path / name, reward_funcs=[starts_with_digit], fp16=True, max_steps=3, save_steps=1,
                        eval_num_prompts=0, **kw)

    train(cfg("whole"))
    rows = [r for r in read_metrics(tmp_path / "whole" / "run") if r["step"] > 0]
    assert all(r["precision/loss_scale"] > 0 and r["grad/norm"] > 0 for r in rows)
    weights = weights_of(tmp_path / "whole" / "run")
    assert changed(initial_weights(cfg("whole")), weights) and all(t.dtype == torch.float32 for t in weights.values())
    train(cfg("parts"), callbacks=[lambda step, metrics: "stop" if step == 1 else None])
    state = __import__("json").loads((tmp_path / "parts" / "run" / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["guard"]["loss_scale"]["scale"] == rows[0]["precision/loss_scale"]
    train(cfg("parts", resume_from_checkpoint="latest"))
    whole, parts = weights, weights_of(tmp_path / "parts" / "run")
    assert all(torch.equal(whole[k], parts[k]) for k in whole)


def test_fp16_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="bf16 and fp16 are two autocast precisions"):
        tiny_cfg(tmp_path, bf16=True, fp16=True)
    with pytest.raises(ValueError, match="fp16 mixed precision keeps float32 master weights"):
        tiny_cfg(tmp_path, fp16=True, dtype="float16")
    with pytest.raises(ValueError, match="fp16 with distributed=fsdp is not supported yet"):
        tiny_cfg(tmp_path, fp16=True, distributed="fsdp")
    with pytest.raises(ValueError, match="would backpropagate unscaled"):
        tiny_cfg(tmp_path, fp16=True, advantage_estimator="gae", objective="grpo")
    with pytest.raises(ValueError, match="fp16: torch cannot autocast on device type 'meta'"):
        forward_precision(False, "meta", True)
