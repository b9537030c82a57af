"""gspo's own decode loop (gspo/rollout/decode.py) against HF `generate`: same tokens, log-probs, routing."""

import dataclasses

import pytest
import torch

from conftest import SMALL as SMALL_TIED
from conftest import SMALL_MOE
from gspo.models import load_model
from gspo.plugs.moe import record_routing
from gspo.rollout import GENERATORS, generate, row_seeds
from gspo.rollout.decode import PrefixKVLayer, prefix_cache, sample, unsupported_reason
from gspo.tasks import build_char_tokenizer

# untied head: a random model with tied embeddings mostly repeats its input token, a weak greedy test
SMALL = {**SMALL_TIED, "tie_word_embeddings": False}
# ragged: after left padding the rows start at different columns
PROMPTS = ["12+34=", "7=", "123+456+789=", "5+5="]


@pytest.fixture(scope="module")
def dense():
    return load_model("tiny-dense", seed=1, overrides=SMALL)


@pytest.fixture(scope="module")
def gpt2():
    """Absolute learned positions: wrong position ids under left padding would change every token."""
    from transformers import AutoModelForCausalLM, GPT2Config

    tok = build_char_tokenizer()
    config = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        tie_word_embeddings=False, initializer_range=0.2,  # varied greedy tokens
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).eval(), tok


def both(model, tok, seed=0, **kw):
    """rollout.generate with the own loop and with HF generate, from the same global seed."""
    out = {}
    for backend in ("gspo", "hf"):
        torch.manual_seed(seed)
        out[backend] = generate(model, tok, PROMPTS, 2, backend=backend, **kw)
    return out["gspo"], out["hf"]


def assert_same(a, b, logprobs=False):
    assert a.input_ids.shape == b.input_ids.shape
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert a.completions == b.completions
    if logprobs:
        torch.testing.assert_close(a.sampler_logprobs, b.sampler_logprobs, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- the cache

def test_prefix_layer_returns_the_concatenation_without_reallocating():
    layer = PrefixKVLayer(capacity=6)
    g = torch.Generator().manual_seed(0)
    pieces = [(torch.randn(2, 3, n, 4, generator=g), torch.randn(2, 3, n, 5, generator=g)) for n in (3, 1, 2)]
    ptrs = set()
    for i, (k, v) in enumerate(pieces):
        keys, values = layer.update(k, v)
        assert torch.equal(keys, torch.cat([p[0] for p in pieces[: i + 1]], dim=2))
        assert torch.equal(values, torch.cat([p[1] for p in pieces[: i + 1]], dim=2))  # own head dim 5
        ptrs.add((keys.data_ptr(), values.data_ptr()))
    assert len(ptrs) == 1  # every update wrote into the one buffer allocated by the first
    assert layer.key_buffer.shape == (2, 3, 6, 4) and layer.value_buffer.shape == (2, 3, 6, 5)
    assert layer.get_seq_length() == 6
    assert layer.get_mask_sizes(1) == (7, 0)  # 6 cached + 1 query, no offset
    with pytest.raises(ValueError, match="capacity 6"):
        layer.update(pieces[1][0], pieces[1][1])


def test_prefix_cache_is_an_hf_cache():
    cache = prefix_cache(num_layers=2, capacity=4)
    assert cache.get_seq_length() == 0 and cache.get_mask_sizes(3, 0) == (3, 0)
    k = torch.ones(1, 1, 3, 2)
    cache.update(k, k, 0)
    cache.update(k, k, 1)
    assert cache.get_seq_length() == 3 and cache.get_mask_sizes(1, 1) == (4, 0)
    assert cache.is_sliding == [False, False] and not cache.is_compileable


# ----------------------------------------------------------------------------- same tokens as HF

def test_greedy_matches_hf(dense):
    ours, hf = both(*dense, greedy=True, max_new_tokens=10, with_logprobs=True)
    assert ours.input_ids.shape == (8, 12 + 10)  # widest prompt 12, no row emits EOS in 10 steps
    assert len(set(ours.completions)) == 4  # a different completion per prompt (G = 2 copies each)
    assert_same(ours, hf, logprobs=True)


def test_a_frozen_head_gets_a_contiguous_prefill_input(dense):
    """The prefill keeps the last position only, a strided (N, 1, H) view; a frozen head (a sampler copy, a LoRA
    base) runs that as a batched product copying the head once per row, so the loop hands it a contiguous copy.
    The greedy tokens stay those of the same weights trainable."""
    import copy

    model, tok = dense
    frozen = copy.deepcopy(model).requires_grad_(False)
    seen = []
    hook = frozen.get_output_embeddings().register_forward_hook(
        lambda _m, args, _out: seen.append((tuple(args[0].shape), args[0].is_contiguous())))
    try:
        ours = generate(frozen, tok, PROMPTS, 2, greedy=True, max_new_tokens=4, backend="gspo")
    finally:
        hook.remove()
    H = model.config.hidden_size
    assert seen[0] == ((4, 1, H), True)  # the prefill's head, on its last position, once per distinct prompt
    assert all(shape == (8, 1, H) and contiguous for shape, contiguous in seen[1:])
    assert len(seen) == 4  # the prefill and 3 decode steps (the last token is never fed back)
    trainable = generate(model, tok, PROMPTS, 2, greedy=True, max_new_tokens=4, backend="gspo")
    assert torch.equal(ours.input_ids, trainable.input_ids)


@pytest.mark.parametrize("G", [1, 3])
def test_a_repeated_prompt_is_prefilled_once(dense, G):
    """A group's G rows share a prompt: the prefill runs each distinct prompt once and repeats its cache; the
    tokens stay HF generate's (which prefills every row)."""
    model, tok = dense
    rows = []
    hook = model.register_forward_pre_hook(lambda _m, args, kwargs: rows.append(kwargs["input_ids"].shape),
                                           with_kwargs=True)
    try:
        torch.manual_seed(5)
        ours = generate(model, tok, PROMPTS, G, temperature=0.9, max_new_tokens=6, backend="gspo")
    finally:
        hook.remove()
    assert rows[0] == (4, 12) and all(shape == (4 * G, 1) for shape in rows[1:])  # widest prompt: 12 tokens
    torch.manual_seed(5)
    assert_same(ours, generate(model, tok, PROMPTS, G, temperature=0.9, max_new_tokens=6, backend="hf"))


@pytest.mark.parametrize("kw", [{}, {"top_k": 5}, {"top_p": 0.8}])
def test_sampling_matches_hf_bitwise(dense, kw):
    ours, hf = both(*dense, seed=3, temperature=0.7, max_new_tokens=10, with_logprobs=True, **kw)
    assert_same(ours, hf, logprobs=True)
    assert len(set(ours.completions)) > 1  # really sampled: the repeated prompts got different completions


def test_seeded_sampling_matches_hf(dense):
    model, tok = dense
    seeds = row_seeds(seed=7, step=2, first_row=0, count=8)
    ours, hf = both(model, tok, temperature=0.7, max_new_tokens=10, with_logprobs=True, row_seeds=seeds)
    assert_same(ours, hf, logprobs=True)
    torch.manual_seed(123)  # the global RNG does not matter to seeded rows
    again = generate(model, tok, PROMPTS, 2, temperature=0.7, max_new_tokens=10, row_seeds=seeds, backend="gspo")
    assert torch.equal(again.input_ids, ours.input_ids)


def test_early_stop_pads_finished_rows_like_hf(dense):
    model, tok = dense
    eos_before = model.generation_config.eos_token_id
    try:
        model.generation_config.eos_token_id = [999]  # never sampled (V = 81): every row runs 12 steps
        torch.manual_seed(5)
        free = generate(model, tok, PROMPTS, 2, max_new_tokens=12, backend="gspo")
        P = free.input_ids.shape[1] - 12
        stop = int(free.input_ids[0, P + 2])  # row 0's third token becomes the stop token
        model.generation_config.eos_token_id = [stop]
        ours, hf = both(model, tok, seed=5, max_new_tokens=12, with_logprobs=True)
    finally:
        model.generation_config.eos_token_id = eos_before
    assert_same(ours, hf, logprobs=True)  # includes T: both ran the same number of steps
    lengths = ours.completion_mask.sum(1)  # (N,)
    T = ours.completion_len
    assert lengths[0] <= 3 and int(lengths.max()) == T  # row 0 stopped early, the longest row sets T
    for row in (lengths < T).nonzero()[:, 0]:
        n = int(lengths[row])
        assert int(ours.input_ids[row, P + n - 1]) == stop  # its last kept token is the EOS
        assert (ours.input_ids[row, P + n:] == tok.pad_token_id).all()  # then padding, as HF
        assert (ours.sampler_logprobs[row, n:] == 0).all()
    # before rollout's masking: finished rows emit (and feed back) padding, exactly as HF
    ids, mask = (x.repeat_interleave(2, 0) for x in tok(PROMPTS, return_tensors="pt", padding=True,
                                                         padding_side="left").values())  # (8, P) as rollout
    torch.manual_seed(5)
    raw = sample(model, ids, mask, max_new_tokens=12, eos_token_ids=[stop], pad_token_id=0)[0]  # (8, T)
    torch.manual_seed(5)
    hf_raw = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=0,
                            temperature=1.0, eos_token_id=[stop], pad_token_id=0)[:, ids.shape[1]:]  # (8, T)
    assert torch.equal(raw, hf_raw) and (raw[0, int(lengths[0]):] == 0).all() and int(lengths[0]) < raw.shape[1]


def test_finished_rows_leave_the_forward_batch_and_the_tokens_stay_hfs(dense):
    """Once at most half of the rows run, the finished ones leave the decode forward; the draw still covers all
    N rows, so every token is HF generate's and the log-probs its own within rounding."""
    model, tok = dense
    eos_before = model.generation_config.eos_token_id
    try:
        model.generation_config.eos_token_id = [999]  # never sampled: every row runs 16 steps
        torch.manual_seed(5)
        free = generate(model, tok, PROMPTS, 2, max_new_tokens=16, backend="gspo")
        P = free.input_ids.shape[1] - 16
        rows = free.input_ids[:, P:].tolist()
        # stop tokens: the other rows' first two tokens, less every token of one row, which runs to the end
        stops = min(([v for other in rows if other is not row for v in other[:2] if v not in row] for row in rows),
                    key=lambda stops: sum(not set(other[:2]) & set(stops) for other in rows))
        model.generation_config.eos_token_id = sorted(set(stops))
        batches = []
        hook = model.register_forward_pre_hook(lambda _m, args, kwargs: batches.append(kwargs["input_ids"].shape[0]),
                                               with_kwargs=True)
        try:
            ours, hf = both(model, tok, seed=5, max_new_tokens=16, with_logprobs=True)
        finally:
            hook.remove()
    finally:
        model.generation_config.eos_token_id = eos_before
    assert_same(ours, hf, logprobs=True)
    lengths = ours.completion_mask.sum(1).tolist()  # (N,)
    assert ours.completion_len == 16 and sum(n <= 2 for n in lengths) >= 5  # most rows stopped by token 2
    # ours (16 forwards, then HF's 16, all of 8 rows): the prefill of the 4 distinct prompts, then 15 decode
    # batches that shrink to the unfinished rows once those are at most half of the batch
    prefill, decode, hf_batches = batches[0], batches[1:16], batches[16:]
    assert prefill == 4 and hf_batches == [8] * 16
    running = [sum(n > t + 1 for n in lengths) for t in range(15)]  # rows unfinished after token t
    expected, n = [], 8
    for r in running:
        n = r if 2 * r <= n else n
        expected.append(n)
    assert decode == expected and decode[-1] == 1  # e.g. [4, 1, 1, ...]: 4 rows ended at token 1, 3 at token 2


def test_all_rows_stop_early_then_T_is_the_steps_run(dense):
    model, tok = dense
    ids, mask = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left").values()
    first = sample(model, ids, mask, max_new_tokens=1, eos_token_ids=[999], pad_token_id=0, greedy=True)[0]
    # every row stops at once when its greedy first token is a stop token
    forwards = []
    handle = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        out, lp = sample(model, ids, mask, max_new_tokens=12, eos_token_ids=first[:, 0].tolist(), pad_token_id=0,
                         greedy=True, with_logprobs=True)
    finally:
        handle.remove()
    assert out.shape == (4, 1) and lp.shape == (4, 1)
    assert len(forwards) == 1  # the prefill only: the last token is never fed back
    hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                        eos_token_id=first[:, 0].tolist(), pad_token_id=0)
    assert torch.equal(out, hf[:, ids.shape[1]:])


def test_absolute_positions_gpt2_match_hf(gpt2):
    ours, hf = both(*gpt2, greedy=True, max_new_tokens=8, with_logprobs=True)
    assert_same(ours, hf, logprobs=True)
    ours, hf = both(*gpt2, seed=1, temperature=0.7, max_new_tokens=8, with_logprobs=True)
    assert_same(ours, hf, logprobs=True)


def test_moe_routing_record_matches_hf():
    model, tok = load_model("tiny-moe", seed=2, overrides=SMALL_MOE)
    out = {}
    for backend in ("gspo", "hf"):
        torch.manual_seed(4)
        out[backend] = generate(model, tok, PROMPTS, 2, temperature=0.7, max_new_tokens=6, backend=backend,
                                routing_recorder=record_routing(model))
    ours, hf = out["gspo"], out["hf"]
    assert_same(ours, hf)
    assert ours.routing.indices.shape == (2, 8, 12 + 6, 2)  # (layers, N, P+T, top-k)
    assert torch.equal(ours.routing.indices, hf.routing.indices)
    assert (ours.routing.indices[:, :, :-1] >= 0).all()  # every fed position recorded (padding too)
    assert (ours.routing.indices[:, :, -1] == -1).all()  # the last token was never fed back


@pytest.mark.parametrize("backend", ["gspo", "hf"])
def test_rollout_tensors_leave_inference_mode_as_normal_tensors(backend):
    """Sampling runs under torch.inference_mode; what the rollout hands to training must not be inference
    tensors (those cannot be saved for backward or written in place outside it)."""
    model, tok = load_model("tiny-moe", seed=2, overrides=SMALL_MOE)
    rollout = generate(model, tok, PROMPTS, 2, max_new_tokens=6, backend=backend, with_logprobs=True,
                       routing_recorder=record_routing(model))
    leaving = {"input_ids": rollout.input_ids, "attention_mask": rollout.attention_mask,
               "completion_mask": rollout.completion_mask, "sampler_logprobs": rollout.sampler_logprobs,
               "routing": rollout.routing.indices}
    assert [name for name, t in leaving.items() if t.is_inference()] == []
    assert not any(p.is_inference() for p in model.parameters())
    weight = torch.ones_like(rollout.sampler_logprobs, requires_grad=True)
    (weight * rollout.sampler_logprobs).sum().backward()  # saved for backward: refused for an inference tensor
    assert torch.equal(weight.grad, rollout.sampler_logprobs)
    rollout.input_ids[0, 0] += 0  # written in place


def test_under_autocast_sampling_keeps_the_weight_cast_cache(dense):
    """Inference mode turns autocast's cache of weight casts off, so every decode step would cast every weight
    again: under an autocast, trainable float32 weights sample outside inference mode (a frozen copy, or no
    autocast, inside it); the tokens are the same."""
    import copy

    model, tok = dense
    frozen = copy.deepcopy(model).requires_grad_(False)

    def modes(m, autocast):
        seen = []
        hook = m.register_forward_pre_hook(lambda *_: seen.append(torch.is_inference_mode_enabled()))
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = generate(m, tok, PROMPTS, 2, greedy=True, max_new_tokens=3, backend="gspo")
        finally:
            hook.remove()
        return set(seen), out.input_ids

    cached, ids = modes(model, True)
    frozen_modes, frozen_ids = modes(frozen, True)  # nothing to cache: inference mode, the same casts uncached
    assert cached == {False} and frozen_modes == {True} and torch.equal(frozen_ids, ids)
    assert modes(model, False)[0] == {True}


# ----------------------------------------------------------------------------- backend choice

def counting(monkeypatch, name: str) -> list:
    """Swap the registered generator `name` for one that counts its calls (the registry is the seam)."""
    calls, backend = [], GENERATORS[name]

    def sample(*args, **kwargs):
        calls.append(1)
        return backend.sample(*args, **kwargs)

    monkeypatch.setitem(GENERATORS, name, dataclasses.replace(backend, sample=sample))
    return calls


def test_auto_uses_own_loop_on_plain_models(dense, monkeypatch):
    calls = counting(monkeypatch, "gspo")
    assert unsupported_reason(dense[0]) is None
    torch.manual_seed(0)
    generate(*dense, PROMPTS, 1, max_new_tokens=3)
    assert calls == [1]
    generate(*dense, PROMPTS, 1, max_new_tokens=3, backend="hf")
    assert calls == [1]


def test_sliding_window_model_falls_back_to_hf(monkeypatch):
    sliding = {**SMALL, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}
    model, tok = load_model("tiny-dense", seed=0, overrides=sliding)
    assert "sliding" in unsupported_reason(model)
    with pytest.raises(ValueError, match="cannot run this model: layer 0 needs a DynamicSlidingWindowLayer"):
        generate(model, tok, PROMPTS, 1, max_new_tokens=3, backend="gspo")
    calls = counting(monkeypatch, "gspo")
    torch.manual_seed(0)
    auto = generate(model, tok, PROMPTS, 1, max_new_tokens=3)
    torch.manual_seed(0)
    hf = generate(model, tok, PROMPTS, 1, max_new_tokens=3, backend="hf")
    assert calls == [] and torch.equal(auto.input_ids, hf.input_ids)


def test_generation_config_processor_falls_back(dense):
    model, tok = dense
    model.generation_config.suppress_tokens = [5]
    try:
        expected = "generation_config sets ['suppress_tokens'], which only HF generate implements"
        assert unsupported_reason(model) == expected
        with pytest.raises(ValueError, match="suppress_tokens"):
            generate(model, tok, PROMPTS, 1, max_new_tokens=3, backend="gspo")
    finally:
        model.generation_config.suppress_tokens = None
    assert unsupported_reason(model) is None


def test_bad_arguments_raise(dense):
    model, tok = dense
    with pytest.raises(ValueError, match="backend must be"):
        generate(model, tok, PROMPTS, 1, max_new_tokens=3, backend="nope")
    ids, mask = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left").values()
    with pytest.raises(ValueError, match="max_new_tokens"):
        sample(model, ids, mask, max_new_tokens=0, eos_token_ids=[2], pad_token_id=0)
    with pytest.raises(ValueError, match="temperature"):
        sample(model, ids, mask, max_new_tokens=2, eos_token_ids=[2], pad_token_id=0, temperature=0.0)


# ----------------------------------------------------------------------------- PEFT models

@pytest.fixture(scope="module")
def adapted():
    """A LoRA model whose adapters change its outputs (B initialised at random, not at zero)."""
    peft = pytest.importorskip("peft")
    model, tok = load_model("tiny-dense", seed=1, overrides=SMALL)  # its own copy: adapters are put in place
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0,
                             init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return peft.get_peft_model(model, config), tok


def test_a_lora_model_runs_in_the_own_loop_with_hfs_tokens(adapted, monkeypatch):
    # issue 32: the loop refused PEFT models ("PeftModelForCausalLM.forward takes no cache argument") and auto
    # fell back to HF generate in silence
    model, tok = adapted
    assert unsupported_reason(model) is None
    for kw in ({"greedy": True}, {"temperature": 0.7}, {"temperature": 0.7, "top_k": 5},
               {"temperature": 0.7, "row_seeds": row_seeds(seed=7, step=2, first_row=0, count=8)}):
        ours, hf = both(model, tok, seed=3, max_new_tokens=10, with_logprobs=True, **kw)
        assert_same(ours, hf, logprobs=True)
    calls = counting(monkeypatch, "gspo")
    generate(model, tok, PROMPTS, 1, max_new_tokens=3)
    assert calls == [1]  # auto takes the own loop


def test_the_adapters_are_active_in_the_own_loop(adapted):
    model, tok = adapted
    torch.manual_seed(0)
    on = generate(model, tok, PROMPTS, 1, greedy=True, max_new_tokens=10, with_logprobs=True, backend="gspo")
    with model.disable_adapter():
        torch.manual_seed(0)
        off = generate(model, tok, PROMPTS, 1, greedy=True, max_new_tokens=10, with_logprobs=True, backend="gspo")
        torch.manual_seed(0)
        base_hf = generate(model, tok, PROMPTS, 1, greedy=True, max_new_tokens=10, with_logprobs=True, backend="hf")
    assert_same(off, base_hf, logprobs=True)
    assert not torch.allclose(on.sampler_logprobs, off.sampler_logprobs, atol=1e-3)


def test_prompt_learning_adapters_stay_on_hf_generate():
    peft = pytest.importorskip("peft")
    model, tok = load_model("tiny-dense", seed=1, overrides=SMALL)
    tuned = peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    assert "prompt learning" in unsupported_reason(tuned)


def test_the_chosen_sampler_and_why_are_said(dense, adapted):
    from gspo.rollout.registry import choose_generator

    assert choose_generator(dense[0], "auto") == ("gspo", "sampler: gspo (generation_backend='auto': the first that "
                                                          "runs this model)")
    assert choose_generator(adapted[0], "hf") == ("hf", "sampler: hf (generation_backend='hf')")
    sliding = {**SMALL, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}
    name, why = choose_generator(load_model("tiny-dense", seed=0, overrides=sliding)[0], "auto")
    assert name == "hf" and why.startswith("sampler: hf (generation_backend='auto': not gspo: layer 0 needs a "
                                           "DynamicSlidingWindowLayer cache")


@pytest.mark.parametrize("kw", [{"min_p": 0.9}, {"repetition_penalty": 1.5}, {"repetition_penalty": 0.7, "top_k": 5},
                                {"repetition_penalty": 1.5, "greedy": True}])
def test_min_p_and_repetition_penalty_match_hf(dense, kw):
    # issue 32 point 7; HF generate ignored both before (gspo passed it neutral values)
    ours, hf = both(*dense, seed=3, temperature=0.7, max_new_tokens=10, with_logprobs=True, **kw)
    assert_same(ours, hf, logprobs=True)
    torch.manual_seed(3)
    plain = generate(*dense, PROMPTS, 2, temperature=0.7, max_new_tokens=10, with_logprobs=True,
                     greedy=kw.get("greedy", False), top_k=kw.get("top_k", 0), backend="gspo")
    assert not torch.equal(plain.sampler_logprobs, ours.sampler_logprobs)  # the knob did change the distribution


def test_repetition_penalty_leaves_left_padding_alone(dense):
    # the pad token is not among the tokens a row has seen: HF's prompt_ignore_length, here as there
    model, tok = dense
    ours, hf = both(model, tok, greedy=True, max_new_tokens=6, with_logprobs=True, repetition_penalty=3.0)
    assert_same(ours, hf, logprobs=True)
    with pytest.raises(ValueError, match="seeded sampling draws from the full softmax"):
        generate(model, tok, PROMPTS, 1, max_new_tokens=3, min_p=0.1, row_seeds=list(range(4)))
