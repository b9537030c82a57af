"""AdamW with bfloat16 moments (gspo.algo.adamw): hand-derived steps, torch's AdamW where the moments are float32,
exact resume from a checkpoint, and the setting in a run."""

import pytest
import torch

from conftest import changed, final_weights, initial_weights, read_metrics, starts_with_digit, tiny_cfg
from gspo.algo.adamw import LowPrecisionAdamW, adamw_update
from gspo.trainer import train


def two_steps(state_dtype, weight_decay=0.0):
    """p = 1, lr 0.1, betas (0.9, 0.99), gradients +1 then -1: (p after step 1, p after step 2, moments)."""
    p = torch.ones(1)
    m, v = torch.zeros(1, dtype=state_dtype), torch.zeros(1, dtype=state_dtype)
    after = []
    for step, g in ((1, 1.0), (2, -1.0)):
        adamw_update(p, torch.tensor([g]), m, v, step=step, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8,
                     weight_decay=weight_decay)
        after.append(p.item())
    return after[0], after[1], m, v


def test_two_float32_steps_by_hand():
    # step 1: m = 0.1, v = 0.01; m_hat = 0.1 / 0.1 = 1, v_hat = 0.01 / 0.01 = 1: p = 1 - 0.1 * 1 / (1 + 1e-8)
    # step 2: m = 0.09 - 0.1 = -0.01, v = 0.0099 + 0.01 = 0.0199; m_hat = -0.01 / 0.19, v_hat = 0.0199 / 0.0199 = 1
    #         p = 0.9 + 0.1 * 0.01 / 0.19 = 0.90526316
    p1, p2, m, v = two_steps(torch.float32)
    assert p1 == pytest.approx(0.9, abs=1e-7) and p2 == pytest.approx(0.90526316, abs=1e-7)
    assert m.item() == pytest.approx(-0.01, abs=1e-8) and v.item() == pytest.approx(0.0199, abs=1e-8)
    # decoupled weight decay 0.5: p = 1 * (1 - 0.1 * 0.5) - 0.1 = 0.85 after step 1
    assert two_steps(torch.float32, weight_decay=0.5)[0] == pytest.approx(0.85, abs=1e-7)


def test_two_bfloat16_steps_by_hand():
    # step 1 computes in float32 (p = 0.9 as above), then stores m = bf16(0.1) = 1.6015625 * 2^-4 = 0.10009765625
    # (0.6 of the mantissa to the nearest 1/128: 77/128) and v = bf16(0.01) = 1.28125 * 2^-7 = 0.010009765625
    # step 2 from the stored moments: m = 0.9 * 0.10009765625 - 0.1 = -0.009912109375,
    #   v = 0.99 * 0.010009765625 + 0.01 = 0.01990966796875;
    #   p = 0.9 + 0.1 * (0.009912109375 / 0.19) / sqrt(0.01990966796875 / 0.0199) = 0.90521563
    #   stored: bf16(m) = -0.0098876953125, bf16(v) = 0.0198974609375
    p1, p2, m, v = two_steps(torch.bfloat16)
    assert p1 == pytest.approx(0.9, abs=1e-7) and p2 == pytest.approx(0.90521563, abs=1e-7)
    assert m.dtype == v.dtype == torch.bfloat16
    assert m.item() == -0.0098876953125 and v.item() == 0.0198974609375


def random_problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(7, 5, generator=g), torch.randn(5, generator=g)]
    grads = [[torch.randn(w.shape, generator=g) for w in weights] for _ in range(6)]
    return weights, grads


def run(optimizer_of, weights, grads):
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = optimizer_of(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return params, opt


def test_with_float32_moments_it_is_torchs_adamw():
    weights, grads = random_problem()
    kw = dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    ours, _ = run(lambda ps: LowPrecisionAdamW(ps, state_dtype=torch.float32, **kw), weights, grads)
    theirs, _ = run(lambda ps: torch.optim.AdamW(ps, **kw), weights, grads)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-7)
    # bfloat16 moments: the same direction, not the same numbers
    low, opt = run(lambda ps: LowPrecisionAdamW(ps, **kw), weights, grads)
    assert all(s[k].dtype == torch.bfloat16 for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    for a, b, w in zip(low, theirs, weights):
        assert not torch.equal(a, b)
        torch.testing.assert_close(a - w, b - w, rtol=0.05, atol=5e-4)


def test_a_large_tensor_updated_in_pieces_is_updated_as_a_whole(monkeypatch):
    import gspo.algo.adamw as adamw

    weights, grads = random_problem(2)  # 35 and 5 elements
    make = lambda ps: LowPrecisionAdamW(ps, lr=0.01, weight_decay=0.1)  # noqa: E731
    whole, _ = run(make, weights, grads)
    monkeypatch.setattr(adamw, "CHUNK", 4)  # the 35-element matrix in 9 pieces, the 5-element bias in 2
    pieces, _ = run(make, weights, grads)
    assert all(torch.equal(a, b) for a, b in zip(whole, pieces))
    assert not torch.equal(whole[0], weights[0])


def test_a_loaded_state_resumes_exactly():
    weights, grads = random_problem(1)
    make = lambda ps: LowPrecisionAdamW(ps, lr=0.01, weight_decay=0.1)  # noqa: E731
    whole, _ = run(make, weights, grads)
    half, opt = run(make, weights, grads[:3])
    saved = opt.state_dict()
    params = [torch.nn.Parameter(p.detach().clone()) for p in half]
    resumed = make(params)
    resumed.load_state_dict(saved)
    assert resumed.state[params[0]]["exp_avg"].dtype == torch.float32  # torch casts floating state on load
    for step_grads in grads[3:]:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        resumed.step()
    assert resumed.state[params[0]]["exp_avg"].dtype == torch.bfloat16  # back, exactly
    assert all(torch.equal(a, b) for a, b in zip(whole, params))


def test_a_run_with_bfloat16_moments_trains_and_resumes(tmp_path):
    def cfg(name, **kw):
        return tiny_cfg(tmp_path / name, reward_funcs=[starts_with_digit], adam_state_dtype="bfloat16", max_steps=3,
                        save_steps=1, eval_num_prompts=0, **kw)

    train(cfg("whole"))
    rows = [r for r in read_metrics(tmp_path / "whole" / "run") if r["step"] > 0]
    assert len(rows) == 3 and all(r["grad/norm"] > 0 for r in rows)
    whole = final_weights(tmp_path / "whole" / "run")
    assert changed(initial_weights(cfg("whole")), whole)
    state = torch.load(tmp_path / "whole" / "run" / "checkpoint-3" / "optimizer.pt", weights_only=True)
    assert {t.dtype for s in state["state"].values() for k, t in s.items() if k != "step"} == {torch.bfloat16}
    train(cfg("parts"), callbacks=[lambda step, metrics: "stop" if step == 1 else None])
    train(cfg("parts", resume_from_checkpoint="latest"))
    parts = final_weights(tmp_path / "parts" / "run")
    assert all(torch.equal(whole[k], parts[k]) for k in whole)


def test_the_setting_names_its_choices(tmp_path):
    with pytest.raises(ValueError, match="adam_state_dtype='float16' is not one of float32, bfloat16"):
        tiny_cfg(tmp_path, adam_state_dtype="float16")
    with pytest.raises(ValueError, match="adam_state_dtype='bfloat16' with distributed=fsdp is not supported"):
        tiny_cfg(tmp_path, adam_state_dtype="bfloat16", distributed="fsdp")
