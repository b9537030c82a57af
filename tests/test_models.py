"""Tests for gspo.models: presets, loading, pad/eos handling and untruncated sampling."""

import json
import logging
import random
import re
import struct
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gspo.config import TrainConfig, make_config
from gspo.gguf import check_gguf
from gspo.model_checks import available_memory, parameter_bytes
from gspo.models import PRESETS, count_parameters, is_moe, load_model, resolve_device, seeded_model
from gspo.tasks import build_char_tokenizer

SMALL = {"num_hidden_layers": 2}  # fewer layers keep the slower tests quick


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matmuls run ~30x slower when intra-op threads contend for a busy CPU.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prompt(tok, text="12+34="):
    return torch.tensor([tok.encode(text)])  # (1, T)


@pytest.fixture(scope="module")
def dense():
    return load_model("tiny-dense")


@pytest.fixture(scope="module")
def moe():
    return load_model("tiny-moe")


def test_presets_build_and_forward(dense, moe):
    cases = [(dense, "Qwen3ForCausalLM", False), (moe, "Qwen3MoeForCausalLM", True)]
    for (model, tok), cls, sparse in cases:
        assert type(model).__name__ == cls
        assert is_moe(model) is sparse
        cfg = model.config
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (128, 4, 4)
        assert (cfg.num_key_value_heads, cfg.head_dim, cfg.max_position_embeddings) == (2, 32, 512)
        assert cfg.vocab_size == len(tok) == 81
        assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (0, 1, 2)
        assert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # tied
        logits = model(_prompt(tok)).logits  # (1, 6, V)
        assert logits.shape == (1, 6, 81)
        assert torch.isfinite(logits).all()
        assert next(model.parameters()).dtype == torch.float32
    cfg = moe[0].config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 64)
    assert cfg.norm_topk_prob is True and cfg.mlp_only_layers == [] and cfg.decoder_sparse_step == 1
    blocks = {type(layer.mlp).__name__ for layer in moe[0].model.layers}
    assert blocks == {"Qwen3MoeSparseMoeBlock"}


def test_count_parameters_hand_derived(dense, moe):
    V, H, I, E, Im = 81, 128, 256, 8, 64
    attn = H * H + H * 64 + H * 64 + H * H + 32 + 32  # q, k, v (2 kv heads x 32), o, q_norm, k_norm
    norms = 2 * H  # input and post-attention RMSNorm
    dense_layer = attn + 3 * H * I + norms  # gate, up, down
    moe_layer = attn + E * H + E * 3 * H * Im + norms  # router + 8 experts
    embed_and_final_norm = V * H + H  # lm_head is tied, so counted once
    assert count_parameters(dense[0]) == 4 * dense_layer + embed_and_final_norm == 601_600
    assert count_parameters(moe[0]) == 4 * moe_layer + embed_and_final_norm == 998_912


def test_count_parameters_trainable_only():
    model, _ = load_model("tiny-dense", overrides=SMALL)
    total = count_parameters(model)
    model.get_input_embeddings().weight.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == total - 81 * 128
    assert count_parameters(model) == total


@pytest.mark.parametrize("preset", list(PRESETS))
def test_seeded_builds(preset):
    a, _ = load_model(preset, seed=1, overrides=SMALL)
    b, _ = load_model(preset, seed=1, overrides=SMALL)
    c, _ = load_model(preset, seed=2, overrides=SMALL)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # Every randomly initialised tensor (norm weights start at 1) differs between seeds.
    random_keys = [k for k in sa if "norm" not in k]
    assert random_keys and all(not torch.equal(sa[k], sc[k]) for k in random_keys)


def test_build_leaves_caller_rng_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    load_model("tiny-dense", seed=9, overrides=SMALL)
    assert torch.equal(torch.rand(3), expected)


def test_overrides():
    model, _ = load_model("tiny-moe", overrides={"num_hidden_layers": 2, "num_experts": 4})
    assert len(model.model.layers) == 2
    assert model.config.num_experts == 4
    assert model.model.layers[0].mlp.gate.weight.shape == (4, 128)  # router: (experts, hidden)
    dense, _ = load_model("tiny-dense", overrides={"num_hidden_layers": 3, "intermediate_size": 32})
    assert dense.config.layer_types == ["full_attention"] * 3  # derived field follows the override
    assert dense.model.layers[0].mlp.up_proj.weight.shape == (32, 128)


def test_bad_override_key():
    with pytest.raises(ValueError, match="num_layerz"):
        load_model("tiny-dense", overrides={"num_layerz": 2})
    with pytest.raises(ValueError, match="num_expertz"):
        load_model("tiny-moe", overrides={"num_expertz": 2})


def test_dtype_validation_and_cast():
    with pytest.raises(ValueError, match="dtype must be one of .*bfloat16"):
        load_model("tiny-dense", dtype="fp32")
    model, _ = load_model("tiny-dense", dtype="bfloat16", overrides=SMALL)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model, _ = load_model("tiny-dense", dtype="auto", overrides=SMALL)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_save_and_reload_round_trip(preset, tmp_path):
    model, tok = load_model(preset, overrides=SMALL)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    ids = _prompt(tok)
    expected = model(ids).logits

    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    plain_tok = AutoTokenizer.from_pretrained(tmp_path)
    assert plain_tok.encode("12+34=") == ids[0].tolist()
    assert torch.equal(plain(ids).logits, expected)
    assert plain.generation_config.top_k == 0  # the untruncated sampling default is saved too

    ours, ours_tok = load_model(str(tmp_path))
    assert torch.equal(ours(ids).logits, expected)
    greedy = ours.generate(ids, max_new_tokens=5, do_sample=False)  # (1, 6 + 5)
    assert greedy.shape == (1, 11) and torch.equal(greedy[:, :6], ids)
    # Greedy continuation equals the argmax of the logits of the original model.
    assert greedy[0, 6].item() == expected[0, -1].argmax().item()
    assert ours_tok.decode(greedy[0, :6]) == "12+34="


def test_load_from_path_with_dtype(tmp_path):
    model, tok = load_model("tiny-dense", overrides=SMALL)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    half, _ = load_model(str(tmp_path), dtype="bfloat16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="overrides apply only to presets"):
        load_model(str(tmp_path), overrides=SMALL)


def test_attn_implementation_reaches_the_model_and_packed_forwards_match(tmp_path):
    from gspo.algo.logprobs import completion_logprobs

    model, tok = load_model("tiny-dense", overrides=SMALL, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    assert load_model("tiny-dense", overrides=SMALL)[0].config._attn_implementation == "sdpa"  # transformers' pick
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert load_model(str(tmp_path), attn_implementation="sdpa")[0].config._attn_implementation == "sdpa"
    cfg = make_config(TrainConfig, {"model": "tiny-moe", "model_overrides": SMALL, "attn_implementation": "eager",
                                    "device": "cpu"})
    assert seeded_model(cfg)[1].config._attn_implementation == "eager"
    # a rollout's layout (left-padded prompts, right-padded completions): packed = padded under eager too
    ids = torch.randint(3, len(tok), (3, 9))  # (N, P 4 + T 5)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0, 0, 0]])
    padded, _ = completion_logprobs(model, ids, mask, 5, packed=False)  # (N, T)
    packed, _ = completion_logprobs(model, ids, mask, 5, packed=True)  # (N, T)
    real = mask[:, 4:].bool()
    assert real.sum() == 10 and (padded[real] != 0).all()
    torch.testing.assert_close(packed[real], padded[real], rtol=1e-5, atol=1e-6)


def test_bad_attn_implementation_names_the_field():
    with pytest.raises(ValueError, match="attn_implementation 'no_such_kernel'"):
        load_model("tiny-dense", overrides=SMALL, attn_implementation="no_such_kernel")
    with pytest.raises(ValueError, match="attn_implementation must be a name"):
        load_model("tiny-dense", overrides=SMALL, attn_implementation="")
    # flash-attn is not installed here (and there is no CUDA): refused with the field named
    with pytest.raises(ValueError, match="attn_implementation 'flash_attention_2'"):
        load_model("tiny-dense", overrides=SMALL, attn_implementation="flash_attention_2")


def test_missing_local_path(tmp_path):
    with pytest.raises(ValueError, match=r"no such directory \(and not a model gspo knows by name: presets: "
                                         r"tiny-dense, tiny-moe; packaged: smollm2\)"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no such directory"):
        load_model("./not/a/checkpoint")
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(tmp_path))  # exists but is empty


def test_tokenizer_without_pad_uses_eos(tmp_path, caplog):
    model, tok = load_model("tiny-dense", overrides=SMALL)
    model.save_pretrained(tmp_path)
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token is None
    with caplog.at_level(logging.WARNING, logger="gspo.models"):
        model, tok = load_model(str(tmp_path))
    assert "no pad token" in caplog.text
    assert tok.pad_token == "<eos>" and tok.pad_token_id == 2
    assert model.generation_config.pad_token_id == 2
    assert model.generation_config.eos_token_id == 2


def test_generation_config_has_special_ids(dense):
    gen = dense[0].generation_config
    assert (gen.pad_token_id, gen.eos_token_id, gen.bos_token_id) == (0, 2, 1)


def test_sampling_is_not_truncated():
    model, tok = load_model("tiny-dense", overrides={"num_hidden_layers": 1})
    assert model.generation_config.top_k == 0 and model.generation_config.top_p == 1.0
    n = 600
    ids = _prompt(tok).expand(n, -1)  # (n, 6)
    mask = torch.ones_like(ids)
    # A random init gives a near-uniform next-token distribution over all 81 tokens
    # (every probability > 1/1000), so 600 draws see far more than 50 distinct tokens.
    probs = model(ids[:1]).logits[0, -1].softmax(-1)  # (V,)
    assert probs.min() > 1e-3
    torch.manual_seed(0)
    full = model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=True)[:, -1]  # (n,)
    assert len(set(full.tolist())) > 60
    # Control: transformers' old default top_k=50 can never produce more than 50.
    torch.manual_seed(0)
    top50 = model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=True, top_k=50)
    top50 = top50[:, -1]  # (n,)
    assert len(set(top50.tolist())) <= 50


def test_default_generate_samples_and_greedy_is_explicit(dense):
    model, tok = dense
    ids = _prompt(tok)
    greedy = [model.generate(ids, max_new_tokens=8, do_sample=False) for _ in range(2)]
    assert torch.equal(greedy[0], greedy[1])
    torch.manual_seed(0)
    sampled = {tuple(model.generate(ids, max_new_tokens=8)[0].tolist()) for _ in range(4)}
    assert len(sampled) > 1  # the default mode samples


def test_is_moe_reads_common_config_names():
    class Cfg:
        def __init__(self, **kw):
            self.__dict__.update(kw)

        def get_text_config(self):
            return self

    class M:
        def __init__(self, **kw):
            self.config = Cfg(**kw)

    assert is_moe(M(num_local_experts=8))  # Mixtral / GPT-OSS naming
    assert is_moe(M(n_routed_experts=64))  # DeepSeek naming
    assert not is_moe(M(num_experts=1))
    assert not is_moe(M())


def test_presets_follow_tokenizer():
    tok = build_char_tokenizer()
    cfg = PRESETS["tiny-dense"](tok)
    assert cfg.vocab_size == len(tok) and cfg.eos_token_id == tok.eos_token_id


def test_resolve_device_and_the_torchrun_rule(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
    # Under torchrun with CUDA each process takes the GPU of its LOCAL_RANK and makes it current.
    current = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 1)
    assert current == [1, 1]
    assert resolve_device("cuda:0") == torch.device("cuda", 0)  # an explicit GPU is the user's call
    assert resolve_device("cpu") == torch.device("cpu") and current == [1, 1]
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: plain cuda, no device made current
    assert resolve_device("cuda") == torch.device("cuda") and current == [1, 1]


def test_seeded_model_seeds_every_rng_and_builds_the_preset():
    cfg = make_config(TrainConfig, {"model_overrides": SMALL, "seed": 3, "device": "cpu"})
    draws = []
    for _ in range(2):
        device, model, tok = seeded_model(cfg)
        draws.append((random.random(), float(np.random.rand()), torch.rand(1).item(),
                      next(model.parameters()).flatten()[:4].tolist()))
    assert device == torch.device("cpu") and tok.pad_token_id is not None
    assert draws[0] == draws[1]


# ------------------------------------------------------------------------------- sizes, memory, damaged model files
def saved_tiny(folder):
    """A tiny-dense (SMALL) saved to `folder` with its tokenizer; returns the folder."""
    model, tok = load_model("tiny-dense", overrides=SMALL)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def edit_config(folder, **values):
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
    return path


def refusal(call) -> str:
    """The one-line ValueError message `call()` raises."""
    with pytest.raises(ValueError) as refused:
        call()
    assert "\n" not in str(refused.value)
    return str(refused.value)


def test_parameter_bytes_is_the_hand_derived_count_without_the_norms(dense, moe):
    # Embeddings (once when tied), attention and MLP (or router + experts); norms (1,408 here) are left out.
    assert parameter_bytes(dense[0].config, 4) == (601_600 - 1_408) * 4
    assert parameter_bytes(moe[0].config, 2) == (998_912 - 1_408) * 2
    from transformers import Qwen3Config

    untied = Qwen3Config(vocab_size=10, hidden_size=8, num_hidden_layers=1, intermediate_size=16, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=4, tie_word_embeddings=False)
    embed, attention, mlp = 2 * 10 * 8, 8 * 2 * 4 + 2 * 8 * 1 * 4 + 2 * 4 * 8, 3 * 8 * 16  # q, k + v, o; gate, up, down
    assert parameter_bytes(untied, 4) == (embed + attention + mlp) * 4 == 2_944


def test_a_model_too_large_for_memory_is_refused_before_it_is_built():
    # Before: built layer by layer until the process died (36 s to a 5 GB limit, then a traceback).
    if available_memory() is None:
        pytest.skip("neither psutil nor /proc/meminfo here: the check is skipped")
    H, L = 100_000, 100_000
    need = (81 * H + L * (H * 4 * 32 + 2 * H * 2 * 32 + 4 * 32 * H + 3 * H * 256)) * 4  # embed; q, k + v, o; MLP
    started = time.monotonic()
    message = refusal(lambda: load_model("tiny-dense", overrides={"num_hidden_layers": L, "hidden_size": H}))
    assert re.fullmatch(rf"model 'tiny-dense': its weights alone need about {need / 2**30:.1f} GiB \(estimated from "
                        r"vocab_size=81, hidden_size=100000, num_hidden_layers=100000, intermediate_size=256\), more "
                        r"than the [\d.]+ GiB of memory available; lower them in model_overrides", message), message
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("overrides, named", [({"hidden_size": -1}, "hidden_size=-1"),
                                              ({"num_hidden_layers": -3}, "num_hidden_layers=-3"),
                                              ({"num_hidden_layers": 0, "hidden_size": 0},
                                               "hidden_size=0, num_hidden_layers=0")])
def test_sizes_below_one_are_refused_naming_them(overrides, named):
    assert refusal(lambda: load_model("tiny-dense", overrides=overrides)) == f"model_overrides: {named} must be > 0"


def test_a_config_json_with_bad_sizes_is_refused_naming_the_file(tmp_path):
    folder = saved_tiny(tmp_path / "model")
    path = edit_config(folder, hidden_size=-1, num_hidden_layers=-3)
    assert refusal(lambda: load_model(str(folder))) == f"model {path}: hidden_size=-1, num_hidden_layers=-3 must be > 0"
    path = edit_config(folder, hidden_size=128, num_hidden_layers=2, vocab_size=10**10)
    if available_memory() is not None:
        assert re.fullmatch(rf"model {re.escape(str(path))}: its weights alone need about [\d.]+ GiB \(estimated from "
                            r"vocab_size=10000000000, hidden_size=128, num_hidden_layers=2, intermediate_size=256\), "
                            r"more than the [\d.]+ GiB of memory available; check its sizes",
                            refusal(lambda: load_model(str(folder))))
    path.write_text("{not json")
    assert refusal(lambda: load_model(str(folder))).startswith(f"model {path}: not a JSON object (")


def test_a_damaged_safetensors_file_is_named_with_what_is_wrong(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = saved_tiny(tmp_path / "model")
    weights = folder / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])  # an interrupted copy
    assert refusal(lambda: load_model(str(folder))) == (
        f"model file {weights}: cut short ({len(whole) // 2} of the {len(whole)} bytes its header describes); "
        "copy or download it again")
    weights.write_bytes(b"garbage" * 3)
    assert refusal(lambda: load_model(str(folder))) == (
        f"model file {weights}: not a safetensors file (its header would take 7450474826515505511 bytes of its 21)")
    weights.write_bytes(whole)
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(7, 5)
    save_file(tensors, weights, metadata={"format": "pt"})
    assert refusal(lambda: load_model(str(folder))) == (
        f"model file {weights}: model.layers.0.mlp.up_proj.weight has shape (7, 5), but {folder / 'config.json'} "
        "makes it (256, 128)")


def gguf_header(version: int = 3, tensors: int = 0, entries: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, entries)  # magic, version, tensor and metadata counts


@pytest.mark.parametrize("content, problem", [
    (b"", "is empty"),
    (b"this is not a gguf file\n" * 4, "is not a GGUF file (it starts with b'this', not b'GGUF')"),
    (gguf_header()[:10], "is cut short (10 bytes; a GGUF header alone takes 24)"),
    (gguf_header(tensors=2**60), "claims 1152921504606846976 tensors and 0 metadata entries, more than its 24 bytes "
                                 "can hold"),
    (gguf_header(tensors=3, entries=2) + bytes(40), "claims 3 tensors and 2 metadata entries, more than its 64 bytes "
                                                    "can hold"),
])
def test_a_damaged_gguf_file_is_named_with_what_is_wrong(tmp_path, monkeypatch, content, problem):
    monkeypatch.setenv("GSPO_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    assert refusal(lambda: load_model(str(path))) == f"model {str(path)!r}: {problem}"
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_a_gguf_file_cut_in_its_tensors_is_named(tmp_path, monkeypatch):
    gguf = pytest.importorskip("gguf")
    monkeypatch.setenv("GSPO_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["a", "bc", "<s>"] * 50)  # metadata of every kind the parser skips: strings, arrays
    writer.add_token_scores([0.5] * 150)
    writer.add_custom_alignment(64)
    writer.add_tensor("token_embd.weight", np.ones((16, 8), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    check_gguf(path, gguf.GGML_QUANT_SIZES)  # whole: passes
    end = max(t.data_offset + t.n_bytes for t in gguf.GGUFReader(path).tensors)  # gguf's own reading
    whole = path.read_bytes()
    path.write_bytes(whole[:-100])  # an interrupted download: the header whole, the last tensors not
    assert refusal(lambda: load_model(str(path))) == (
        f"model {str(path)!r}: is cut short ({len(whole) - 100} bytes; its tensors end at byte {end}); "
        "copy or download it again")
