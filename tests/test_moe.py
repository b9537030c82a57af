"""Routing record / replay on tiny MoE models built from config (no downloads)."""

import copy
import math

import pytest
import torch

from conftest import no_hooks, perturb_routers, qwen3
from gspo.plugs.moe import (
    RoutingRecord,
    expert_change_frac,
    find_routers,
    gate_weights,
    record_routing,
    replay_routing,
    require_replay_support,
)

V = 50  # vocab
COMMON = dict(
    vocab_size=V, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    num_experts_per_tok=2, max_position_embeddings=64,
)


def qwen3_moe(norm_topk_prob=True, **overrides):
    return qwen3(moe=True, **{**COMMON, "num_hidden_layers": 3, "head_dim": 16, "moe_intermediate_size": 32,
                              "num_experts": 8, "norm_topk_prob": norm_topk_prob, **overrides}).eval()


def qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(**COMMON, num_hidden_layers=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                         num_experts=8, norm_topk_prob=False)
    return Qwen2MoeForCausalLM(cfg).eval()


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(**COMMON, num_hidden_layers=2, num_local_experts=8)).eval()


def olmoe():
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(0)
    return OlmoeForCausalLM(OlmoeConfig(**COMMON, num_hidden_layers=2, num_experts=8)).eval()


def experts_used(model, input_ids):
    """(R, N, L, k) expert indices the experts modules actually receive in a free forward."""
    seen, handles = [], []
    for r in find_routers(model):
        handles.append(r.block.experts.register_forward_pre_hook(lambda m, a: seen.append(a[1].clone())))
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in handles:
            h.remove()
    n, length = input_ids.shape
    return torch.stack([s.reshape(n, length, -1) for s in seen])


def ids(n=3, length=6, seed=0):
    return torch.randint(0, V, (n, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- pure pieces

def test_gate_weights_hand_values():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]]).log()  # softmax -> [0.1, 0.2, 0.3, 0.4]
    idx = torch.tensor([[3, 1]])
    torch.testing.assert_close(gate_weights(logits, idx, normalize=False), torch.tensor([[0.4, 0.2]]))
    # renormalised: 0.4 / 0.6 and 0.2 / 0.6
    torch.testing.assert_close(gate_weights(logits, idx, normalize=True), torch.tensor([[2 / 3, 1 / 3]]))


def test_expert_change_frac_hand_count():
    base = torch.tensor([0, 1]).expand(2, 2, 3, 2).clone()  # R=2 routers, N=2, L=3, k=2: all pick {0, 1}
    before = RoutingRecord(base, (0, 1))
    assert expert_change_frac(before, before) == (0.0, [0.0, 0.0])
    swapped = base.clone()
    swapped[0, 0, 0] = torch.tensor([0, 5])  # router 0, token (0, 0): one of two experts replaced
    swapped[1, 1, 2] = torch.tensor([1, 0])  # reordering only: no change
    after = RoutingRecord(swapped, (0, 1))
    frac, per_layer = expert_change_frac(before, after)
    assert frac == pytest.approx(1 / (2 * 6 * 2))  # 1 changed slot of layers*tokens*k = 24
    assert per_layer == pytest.approx([1 / 12, 0.0])
    mask = torch.ones(2, 3)
    mask[0, 0] = 0  # hide the changed token: 0 of 2*5*2 slots change
    assert expert_change_frac(before, after, mask) == (0.0, [0.0, 0.0])
    mask = torch.zeros(2, 3)
    mask[0, :2] = 1  # only tokens (0,0) and (0,1): layer 0 has 1 of 4 slots changed
    frac, per_layer = expert_change_frac(before, after, mask)
    assert frac == pytest.approx(1 / 8) and per_layer == pytest.approx([1 / 4, 0.0])
    both_changed = swapped.clone()
    both_changed[1, 0, 1] = torch.tensor([6, 7])  # router 1, token (0, 1): both experts new
    assert expert_change_frac(before, RoutingRecord(both_changed, (0, 1)))[1] == pytest.approx([1 / 12, 2 / 12])
    with pytest.raises(ValueError, match="mask must have shape"):
        expert_change_frac(before, after, torch.ones(3, 2))
    with pytest.raises(ValueError, match="equal layers"):
        expert_change_frac(before, RoutingRecord(base[:, :1].clone(), (0, 1)))


def test_free_positions_are_not_counted():
    before = RoutingRecord(torch.tensor([0, 1]).expand(1, 1, 2, 2).clone(), (0,))
    after = before.indices.clone()
    after[0, 0, 1] = torch.tensor([4, 5])
    padded = before.indices.clone()
    padded[0, 0, 1] = -1  # "route freely" token: excluded
    assert expert_change_frac(RoutingRecord(padded, (0,)), RoutingRecord(after, (0,)))[0] == 0.0
    assert expert_change_frac(before, RoutingRecord(after, (0,)))[0] == 0.5


def test_record_helpers():
    idx = torch.arange(2 * 3 * 2 * 2).reshape(2, 3, 2, 2)  # R=2, N=3, L=2, k=2
    rec = RoutingRecord(idx, (0, 2))
    assert rec.shape == (3, 2) and rec.top_k == 2
    assert torch.equal(rec.select(torch.tensor([2, 0])).indices, idx[:, [2, 0]])
    assert torch.equal(rec.select(slice(1, 3)).indices, idx[:, 1:3])
    assert torch.equal(rec.select(torch.tensor([True, False, True])).indices, idx[:, [0, 2]])
    padded = rec.pad_to(4)
    assert padded.shape == (3, 4) and (padded.indices[:, :, 2:] == -1).all()
    assert torch.equal(padded.indices[:, :, :2], idx)
    assert torch.equal(RoutingRecord.cat([rec.select([0]), rec.select([1, 2])], dim=0).indices, idx)
    assert torch.equal(RoutingRecord.cat([rec, rec], dim=1).indices, torch.cat([idx, idx], dim=2))
    with pytest.raises(ValueError, match="length must be"):
        rec.pad_to(1)
    with pytest.raises(ValueError, match="dim must be"):
        RoutingRecord.cat([rec], dim=2)
    with pytest.raises(ValueError, match="int64"):
        RoutingRecord(idx.int(), (0, 2))
    with pytest.raises(ValueError, match="layers has 1"):
        RoutingRecord(idx, (0,))


# ----------------------------------------------------------------------------- discovery

def test_find_routers_skips_dense_layers():
    model = qwen3_moe(mlp_only_layers=[1])
    routers = find_routers(model)
    assert [r.layer for r in routers] == [0, 2]
    assert routers[1].module is model.model.layers[2].mlp.gate and routers[1].block is model.model.layers[2].mlp
    assert require_replay_support(model) == routers
    with torch.no_grad(), record_routing(model) as rec:
        model(ids())
    assert rec.record().layers == (0, 2) and rec.record().indices.shape == (2, 3, 6, 2)


def test_dense_and_unsupported_models_raise():
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    dense = qwen3(**COMMON, num_hidden_layers=1, head_dim=16)
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model; Qwen3ForCausalLM has no MoE router"):
        require_replay_support(dense)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM has no MoE router"):
        with record_routing(dense):
            pass
    granite = GraniteMoeForCausalLM(GraniteMoeConfig(**{**COMMON, "num_hidden_layers": 1, "num_local_experts": 4}))
    with pytest.raises(ValueError, match="'granitemoe' architecture .*supported: qwen3_moe, qwen2_moe, mixtral, olmoe"):
        require_replay_support(granite)
    assert no_hooks(dense) and no_hooks(granite)


# ----------------------------------------------------------------------------- record / replay

def test_record_matches_router_logits_topk():
    model = qwen3_moe()
    x = ids()
    with torch.no_grad(), record_routing(model) as rec:
        out = model(x, output_router_logits=True)
    # independent reference: top-k of the router logits the model itself returns (softmax is monotone)
    ref = torch.stack([logits.topk(2, dim=-1).indices for logits in out.router_logits]).reshape(3, 3, 6, 2)
    assert torch.equal(rec.record().indices, ref)
    assert torch.equal(rec.record().indices, experts_used(model, x))
    assert no_hooks(model)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replay_at_unchanged_weights_is_exact(norm_topk_prob):
    model = qwen3_moe(norm_topk_prob)
    x = ids()
    with torch.no_grad(), record_routing(model) as rec:
        free_logits = model(x).logits
    with torch.no_grad(), replay_routing(model, rec.record()) as rp:
        replayed_logits = model(x).logits
    assert torch.equal(replayed_logits, free_logits)
    assert expert_change_frac(rec.record(), rp.free_record()) == (0.0, [0.0, 0.0, 0.0])


def test_replay_forces_recorded_experts_after_perturbation():
    model = qwen3_moe()
    x = ids()
    with torch.no_grad(), record_routing(model) as rec:
        model(x)
    old = rec.record()
    perturb_routers(model)
    free_now = experts_used(model, x)
    drift, _ = expert_change_frac(old, RoutingRecord(free_now, old.layers))
    assert drift > 0.3  # free routing really changed
    seen, handles = [], []
    for r in find_routers(model):  # what the experts modules actually consume
        handles.append(r.block.experts.register_forward_pre_hook(lambda m, a: seen.append(a[1].clone())))
    with torch.no_grad(), replay_routing(model, old) as rp, record_routing(model) as inner:
        model(x)
    for h in handles:
        h.remove()
    assert torch.equal(torch.stack(seen).reshape(old.indices.shape), old.indices)
    assert torch.equal(inner.record().indices, old.indices)  # recording inside replay sees the replayed experts
    # the replayer also reports the routers' own choices: in layer 0 (upstream untouched) they
    # equal free routing exactly
    assert torch.equal(rp.free_record().indices[0], free_now[0])
    assert expert_change_frac(old, rp.free_record())[1][0] == expert_change_frac(
        old, RoutingRecord(free_now, old.layers))[1][0]
    assert no_hooks(model)


def test_free_marked_tokens_route_freely():
    model = qwen3_moe()
    x = ids()
    with torch.no_grad(), record_routing(model) as rec:
        model(x)
    old = rec.record()
    perturb_routers(model)
    partial = old.indices.clone()
    partial[:, 1] = -1  # sequence 1 routes freely
    with torch.no_grad(), record_routing(model) as inner, replay_routing(model, RoutingRecord(partial, old.layers)):
        model(x)
    got, free_now = inner.record().indices, experts_used(model, x)
    # rows don't interact (causal attention within a row), so row 1 equals free routing, rows 0, 2 are replayed
    assert torch.equal(got[:, 1], free_now[:, 1])
    assert torch.equal(got[:, [0, 2]], old.indices[:, [0, 2]])
    assert not torch.equal(got[:, 1], old.indices[:, 1])


def test_router_gradient_under_replay_matches_hand_reference():
    model = qwen3_moe(norm_topk_prob=True)
    x = ids()
    with torch.no_grad(), record_routing(model) as rec:
        model(x)
    old = rec.record()
    perturb_routers(model, std=0.3)
    gate0 = model.model.layers[0].mlp.gate
    captured = {}
    h1 = gate0.register_forward_pre_hook(lambda m, a: captured.__setitem__("x", a[0].detach()))

    def grab_weights(m, a):
        a[2].retain_grad()
        captured["w"] = a[2]

    h2 = model.model.layers[0].mlp.experts.register_forward_pre_hook(grab_weights)
    with replay_routing(model, old):
        logp = torch.log_softmax(model(x).logits, -1)  # (N, L, V)
        loss = -logp[..., 7].mean()
        loss.backward()
    h1.remove(), h2.remove()
    grad = gate0.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    # hand reference for layer 0: w = renormalised softmax(x W^T) gathered at the recorded experts;
    # the gate weight reaches the loss only through w, so dL/dW = (dw/dW)^T dL/dw.
    weight = gate0.weight.detach().clone().requires_grad_(True)
    probs = torch.softmax(captured["x"] @ weight.T, dim=-1)  # (T, E)
    w = probs.gather(-1, old.indices[0].reshape(-1, 2))  # (T, 2)
    w = w / w.sum(-1, keepdim=True)
    torch.testing.assert_close(w, captured["w"].detach())
    (w * captured["w"].grad).sum().backward()
    torch.testing.assert_close(grad, weight.grad, rtol=1e-5, atol=1e-7)


def test_context_exit_restores_free_routing():
    model = qwen3_moe()
    untouched = copy.deepcopy(model)
    x = ids()
    with torch.no_grad(), record_routing(model) as rec:
        model(x)
    old = rec.record()
    perturb_routers(model)
    perturb_routers(untouched)
    with torch.no_grad():
        reference = untouched(x).logits
        with replay_routing(model, old):
            replayed = model(x).logits
        assert no_hooks(model)
        assert torch.equal(model(x).logits, reference)
        assert not torch.allclose(replayed, reference)
        with pytest.raises(RuntimeError, match="boom"):
            with replay_routing(model, old), record_routing(model):
                model(x)
                raise RuntimeError("boom")
        assert no_hooks(model)
        assert torch.equal(model(x).logits, reference)
        # a shape mismatch raises inside the forward and still leaves nothing behind
        with pytest.raises(ValueError, match=r"\(N, L\) = \(3, 5\) but the record is for \(3, 6\)"):
            with replay_routing(model, old):
                model(x[:, :5])
        assert no_hooks(model)
        # and replay can be entered again afterwards
        with replay_routing(model, old):
            assert torch.equal(model(x).logits, replayed)


def test_nested_replay_and_bad_records_raise():
    model = qwen3_moe()
    x = ids()
    with torch.no_grad(), record_routing(model) as rec:
        model(x)
    old = rec.record()
    with replay_routing(model, old):
        with pytest.raises(ValueError, match="already active"):
            with replay_routing(model, old):
                pass
    with pytest.raises(ValueError, match=r"router layers \(0, 1\)"):
        with replay_routing(model, RoutingRecord(old.indices[:2], (0, 1))):
            pass
    with pytest.raises(ValueError, match="top_k=1"):
        with replay_routing(model, RoutingRecord(old.indices[..., :1].clone(), old.layers)):
            pass
    with pytest.raises(ValueError, match="expert 8"):
        with replay_routing(model, RoutingRecord(old.indices.clamp(max=8).fill_(8), old.layers)):
            pass
    with pytest.raises(ValueError, match="no forward pass"):
        with record_routing(model) as empty:
            pass
        empty.record()
    assert no_hooks(model)


def test_record_across_generate_replays_in_full_forward():
    """R3 / rollout mode: experts recorded while generating are replayed in one full forward."""
    model = qwen3_moe()
    prompt = ids(n=2, length=4)
    torch.manual_seed(0)
    with torch.no_grad(), record_routing(model) as rec:
        out = model.generate(prompt, max_new_tokens=5, do_sample=True, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    seq = out.sequences  # (2, 9)
    gen = rec.record()
    assert seq.shape == (2, 9) and gen.shape == (2, 8)  # last token never fed back
    perturb_routers(model)  # a training step moved the routers
    full = gen.pad_to(seq.shape[1])
    with torch.no_grad(), record_routing(model) as inner, replay_routing(model, full):
        model(seq)
    assert torch.equal(inner.record().indices[:, :, :8], gen.indices)
    assert expert_change_frac(gen, RoutingRecord(experts_used(model, seq)[:, :, :8], gen.layers))[0] > 0.3
    # and with the rollout weights the full forward reproduces generate's per-step logits
    model2 = qwen3_moe()
    with torch.no_grad(), replay_routing(model2, full):
        logits = model2(seq).logits
    step_logits = torch.stack(out.logits, dim=1)  # (2, 5, V): predictions for positions 4..8
    torch.testing.assert_close(logits[:, 3:8], step_logits, rtol=1e-5, atol=1e-5)


def test_record_across_generate_that_stops_early():
    model = qwen3_moe()
    prompt = ids(n=2, length=4)
    with torch.no_grad(), record_routing(model) as rec:
        seq = model.generate(prompt, max_new_tokens=5, do_sample=False, eos_token_id=list(range(V)), pad_token_id=0)
    assert seq.shape == (2, 5)  # every token is EOS: stops after one new token, only the prefill ran
    gen = rec.record()
    assert gen.shape == (2, 4)
    with torch.no_grad(), record_routing(model) as free:
        model(prompt)
    assert torch.equal(gen.indices, free.record().indices)


# ----------------------------------------------------------------------------- other architectures

@pytest.mark.parametrize("build", [qwen2_moe, mixtral, olmoe], ids=["qwen2_moe", "mixtral", "olmoe"])
def test_record_replay_other_architectures(build):
    model = build()
    x = ids(n=2, length=5)
    with torch.no_grad(), record_routing(model) as rec:
        free_logits = model(x).logits
    old = rec.record()
    assert old.indices.shape == (2, 2, 5, 2)
    with torch.no_grad(), replay_routing(model, old):
        assert torch.equal(model(x).logits, free_logits)
    perturb_routers(model)
    assert expert_change_frac(old, RoutingRecord(experts_used(model, x), old.layers))[0] > 0.2
    seen = []
    handles = [r.block.experts.register_forward_pre_hook(lambda m, a: seen.append(a[1].clone()))
               for r in find_routers(model)]
    with replay_routing(model, old):
        model(x).logits.sum().backward()
    for h in handles:
        h.remove()
    assert torch.equal(torch.stack(seen).reshape(old.indices.shape), old.indices)
    assert all(r.module.weight.grad.abs().sum() > 0 for r in find_routers(model))
    assert no_hooks(model)


def test_drift_is_nan_without_counted_tokens():
    rec = RoutingRecord(torch.zeros(1, 1, 2, 2, dtype=torch.long), (0,))
    frac, per_layer = expert_change_frac(rec, rec, torch.zeros(1, 2))
    assert math.isnan(frac) and math.isnan(per_layer[0])


def test_replay_with_gradient_checkpointing_gives_same_gradients():
    model = qwen3_moe()
    x = ids()
    with torch.no_grad(), record_routing(model) as rec:
        model(x)
    perturb_routers(model)
    model.train()

    def grads(checkpointing):
        model.zero_grad()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
        with replay_routing(model, rec.record()):  # backward inside: the recompute replays too
            model(x, use_cache=False).logits.logsumexp(-1).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys() and "model.layers.2.mlp.gate.weight" in plain
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7)
