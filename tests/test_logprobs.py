import math

import pytest
import torch

from conftest import qwen3
from gspo.algo.logprobs import completion_logprobs, naive_completion_logprobs, position_ids_from_mask

V = 53  # a vocab size no other model dimension shares, so (.., V) tensors are recognisable


def _dense():
    return qwen3(V, seed=0, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False).eval()


def _moe():
    return qwen3(V, seed=1, moe=True, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                 num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, max_position_embeddings=64, tie_word_embeddings=False).eval()


MODELS = {"dense": _dense(), "moe": _moe()}


def _batch(seed=0):
    """N=3 rows of P=4 left-padded prompt + T=5 right-padded completion."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # prompt of 2 tokens
    mask[1, 7:] = 0  # completion of 3 tokens
    mask[2, :1] = 0
    mask[2, 8:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def test_position_ids_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("name", ["dense", "moe"])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 15, 1024, None])  # N*T = 15: 4 and 7 leave a ragged last chunk
@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_equals_naive(name, chunk_size, with_entropy):
    model = MODELS[name]
    ids, mask = _batch()
    with torch.no_grad():
        logp, ent = completion_logprobs(model, ids, mask, 5, chunk_size=chunk_size, with_entropy=with_entropy)
        ref_logp, ref_ent = naive_completion_logprobs(model, ids, mask, 5, with_entropy=with_entropy)
    assert logp.shape == (3, 5) and logp.dtype == torch.float32
    assert torch.isfinite(logp).all()
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    assert (logp <= 0).all()
    if with_entropy:
        assert ent.shape == (3, 5) and ent.dtype == torch.float32
        torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
        assert ((ent >= 0) & (ent <= math.log(V) + 1e-5)).all()
    else:
        assert ent is None and ref_ent is None


def test_default_chunk_rows_follow_the_vocabulary(monkeypatch):
    from gspo.algo import logprobs

    assert logprobs.default_chunk_rows(151_936) == 441  # 2**26 // 151,936: 256 MiB of fp32 logits per chunk
    assert logprobs.default_chunk_rows(81) == 828_504
    assert logprobs.default_chunk_rows(10**9) == 1  # never zero rows
    # With the budget at 4 rows of this V, chunk_size=None runs the head on ceil(15 / 4) = 4 chunks.
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 4 * V)
    model, calls = MODELS["dense"], []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, i, o: calls.append(o.shape[0]))
    try:
        with torch.no_grad():
            completion_logprobs(model, *_batch(), 5)
    finally:
        handle.remove()
    assert calls == [4, 4, 4, 3]


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_chunked_gradients_equal_naive(name):
    model = MODELS[name]
    ids, mask = _batch(seed=3)
    cmask = mask[:, 4:].float()
    grads = []
    for fn in (completion_logprobs, naive_completion_logprobs):
        model.zero_grad(set_to_none=True)
        logp, ent = fn(model, ids, mask, 5, chunk_size=4, with_entropy=True, temperature=0.7)
        ((logp * cmask).sum() + 0.3 * (ent * cmask).sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys()
    assert "lm_head.weight" in grads[0] and "model.embed_tokens.weight" in grads[0]
    for n in grads[1]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-5, rtol=0, msg=n)
    assert grads[0]["lm_head.weight"].abs().sum() > 0


def test_chunked_path_does_not_keep_vocab_sized_tensors_for_backward():
    model = MODELS["dense"]
    ids, mask = _batch()
    for fn, expect_vocab_tensors in ((completion_logprobs, False), (naive_completion_logprobs, True)):
        shapes = []

        def pack(t, shapes=shapes):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(model, ids, mask, 5, chunk_size=4, with_entropy=True)
        saved_logits = [s for s in shapes if len(s) >= 2 and s[-1] == V and s != (64, V)]  # (64, V): head weight
        assert bool(saved_logits) == expect_vocab_tensors, (fn.__name__, saved_logits)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_temperature_matches_naive_and_changes_values(name):
    model = MODELS[name]
    ids, mask = _batch(seed=5)
    with torch.no_grad():
        hot, hot_ent = completion_logprobs(model, ids, mask, 5, temperature=2.5, chunk_size=6, with_entropy=True)
        ref, ref_ent = naive_completion_logprobs(model, ids, mask, 5, temperature=2.5, with_entropy=True)
        cold, _ = completion_logprobs(model, ids, mask, 5, temperature=1.0)
    torch.testing.assert_close(hot, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(hot_ent, ref_ent, atol=1e-5, rtol=0)
    assert (hot - cold).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_left_padding_equals_unpadded_rows(name):
    model = MODELS[name]
    ids, mask = _batch(seed=7)
    T = 5
    with torch.no_grad():
        logp, ent = completion_logprobs(model, ids, mask, T, chunk_size=4, with_entropy=True)
        for i in range(ids.shape[0]):
            real = mask[i].bool()
            row = ids[i, real].unsqueeze(0)  # (1, L_i): no padding at all
            n_comp = int(mask[i, -T:].sum())
            # The row alone: its completion is the last n_comp tokens.
            solo, solo_ent = completion_logprobs(
                model, row, torch.ones_like(row), n_comp, chunk_size=4, with_entropy=True
            )
            torch.testing.assert_close(logp[i, :n_comp], solo[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(ent[i, :n_comp], solo_ent[0], atol=1e-5, rtol=0)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()


def test_left_padding_needs_mask_positions_with_absolute_embeddings():
    # RoPE (Qwen3) only sees relative positions, so a constant shift of a left-padded row is
    # harmless there; GPT-2's learned absolute positions are not, which makes the position_ids
    # we pass observable. Without them row 0 (2 left pads) would differ from the row alone.
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    ids, mask = _batch(seed=7)
    row = ids[0, 2:].unsqueeze(0)  # row 0 without its 2 left pads; its completion fills all T=5 slots
    with torch.no_grad():
        ours, _ = completion_logprobs(model, ids, mask, 5, chunk_size=4)
        naive, _ = naive_completion_logprobs(model, ids, mask, 5)
        solo, _ = completion_logprobs(model, row, torch.ones_like(row), 5)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, 3:8].float()
        plain = logits.log_softmax(-1).gather(-1, ids[:, 4:].unsqueeze(-1)).squeeze(-1)  # no position_ids
    torch.testing.assert_close(ours, naive, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[0], solo[0], atol=1e-5, rtol=0)
    assert (plain[0] - solo[0]).abs().max() > 1e-3
    torch.testing.assert_close(plain[1, :3], ours[1, :3], atol=1e-5, rtol=0)  # row 1: no left pads


def _constant_head_model(bias):
    """Dense model whose head ignores the hidden state: logits == bias for every position."""
    model = _dense()
    head = torch.nn.Linear(64, V, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(bias)
    model.lm_head = head
    return model


@pytest.mark.parametrize("fn", [completion_logprobs, naive_completion_logprobs])
def test_uniform_head_gives_log_v(fn):
    model = _constant_head_model(torch.zeros(V))
    ids, mask = _batch()
    with torch.no_grad():
        logp, ent = fn(model, ids, mask, 5, chunk_size=4, with_entropy=True, temperature=0.3)
    # Uniform over 53 tokens at any temperature: log p = -log 53, entropy = log 53 = 3.97029.
    torch.testing.assert_close(logp, torch.full((3, 5), -math.log(53)), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, torch.full((3, 5), math.log(53)), atol=1e-5, rtol=0)


def test_hand_computed_logprob_entropy_and_temperature():
    # Bias 2*ln(51) on token 0 and 0 on the other 52 tokens, temperature 2: effective logits
    # ln(51) and 0, so Z = 51 + 52 = 103, p0 = 51/103 and every other token has p = 1/103.
    bias = torch.zeros(V)
    bias[0] = 2 * math.log(51)
    model = _constant_head_model(bias)
    ids = torch.tensor([[5, 7, 0, 9]])  # completion = [0, 9]
    with torch.no_grad():
        logp, ent = completion_logprobs(model, ids, torch.ones_like(ids), 2, temperature=2.0, with_entropy=True)
    p0, p_other = 51 / 103, 1 / 103
    assert logp[0, 0].item() == pytest.approx(math.log(p0), abs=1e-5)  # ln(0.49515) = -0.70288
    assert logp[0, 1].item() == pytest.approx(math.log(p_other), abs=1e-5)  # ln(1/103) = -4.63473
    expected_entropy = -(p0 * math.log(p0) + 52 * p_other * math.log(p_other))  # 2.68769
    assert ent[0, 0].item() == pytest.approx(expected_entropy, abs=1e-5)
    assert ent[0, 1].item() == pytest.approx(expected_entropy, abs=1e-5)


def test_softcapped_model_falls_back_to_naive():
    model = _dense()
    model.config.final_logit_softcapping = 5.0  # Qwen3's forward ignores it: the fallback is observable
    ids, mask = _batch()
    calls = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: calls.append(tuple(o.shape)))
    with torch.no_grad():
        completion_logprobs(model, ids, mask, 5, chunk_size=4)
    hook.remove()
    assert calls == [(3, 9, V)]  # one full-logits head call, not four (4, V) chunks


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(completion_len=0), "completion_len"),
        (dict(completion_len=9), "completion_len"),
        (dict(completion_len=2.0), "completion_len"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(attention_mask=torch.ones(3, 8, dtype=torch.long)), "attention_mask"),
        (dict(input_ids=torch.ones(9, dtype=torch.long)), "input_ids"),
        (dict(input_ids=torch.ones(3, 9)), "input_ids"),
    ],
)
def test_bad_inputs_raise(kwargs, match):
    ids, mask = _batch()
    args = dict(input_ids=ids, attention_mask=mask, completion_len=5)
    extra = {k: v for k, v in kwargs.items() if k in ("temperature", "chunk_size")}
    args.update({k: v for k, v in kwargs.items() if k not in extra})
    for fn in (completion_logprobs, naive_completion_logprobs):
        with pytest.raises(ValueError, match=match):
            fn(MODELS["dense"], args["input_ids"], args["attention_mask"], args["completion_len"], **extra)


def test_wrapped_model_without_hf_accessors_takes_naive_path():
    class Wrapper(torch.nn.Module):  # stands in for DDP: forwards the call, has no get_decoder
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kwargs):
            return self.module(**kwargs)

    model = MODELS["moe"]
    ids, mask = _batch(seed=11)
    with torch.no_grad():
        wrapped, wrapped_ent = completion_logprobs(Wrapper(model), ids, mask, 5, chunk_size=4, with_entropy=True)
        direct, direct_ent = completion_logprobs(model, ids, mask, 5, chunk_size=4, with_entropy=True)
    torch.testing.assert_close(wrapped, direct, atol=1e-5, rtol=0)
    torch.testing.assert_close(wrapped_ent, direct_ent, atol=1e-5, rtol=0)
