"""The architecture matrix (docs/architectures.md): a tiny random-init model of each family this
transformers version ships, built from config, trains GSPO steps with its own attention, sampled by
gspo's decode loop (HF generate where a layer needs a sliding-window cache); the chunked log-probs
equal the naive path; on each MoE, routing replay and the drift metric work, or the run is refused
with an error that names the architecture."""

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import changed, final_weights, random_record, read_metrics, tiny_cfg
from gspo.algo.logprobs import completion_logprobs, naive_completion_logprobs, padding_free_layout
from gspo.plugs.moe import SUPPORTED_ARCHITECTURES, find_routers, replay_routing
from gspo.plugs.routing import to_layout
from gspo.rollout.sampling import pick_generator
from gspo.tasks.tokenizer import build_char_tokenizer
from gspo.trainer import train

ATTN = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128}
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
DENSE = {
    "llama": ATTN, "mistral": {**ATTN, "sliding_window": None}, "qwen2": ATTN, "qwen3": ATTN,
    "gemma": ATTN, "gemma2": {**ATTN, "sliding_window": 64}, "phi3": ATTN,
    "gpt2": {"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 128},
}
SPARSE = {
    "qwen3_moe": {**ATTN, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen2_moe": {**ATTN, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32},
    "mixtral": {**ATTN, **MOE, "sliding_window": None},
    "olmoe": {**ATTN, "num_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {**ATTN, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                    "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                    "v_head_dim": 8, "n_shared_experts": 1},
    "gpt_oss": {**ATTN, **MOE, "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
}

# Sliding-window layers need a cache gspo's decode loop does not build: these sample with HF generate
HF_GENERATE = {"gemma2", "gpt_oss"}


def build(model_type: str, tmp_path):
    """A tiny random-init model of `model_type` with gspo's character tokenizer, saved as a checkpoint."""
    tok = build_char_tokenizer()
    kw = {**DENSE, **SPARSE}[model_type]
    config = AutoConfig.for_model(model_type, **kw, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path / model_type
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, path


def ragged_batch(model):
    """(ids, mask, scored) of 4 rows of 14 tokens, T = 6: a left-padded row, two short completions."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (4, 14), generator=g)  # (N, P+T)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    mask[1, 10:] = 0  # short completions (right padding)
    mask[2, 12:] = 0
    return ids, mask, mask[:, -6:].bool()  # scored: (N, T) real completion tokens


@pytest.mark.parametrize("model_type", list(DENSE) + list(SPARSE))
def test_chunked_and_padding_free_logprobs_equal_the_naive_path(model_type, tmp_path):
    """The chunked head and the packed rows of padding_free, with each architecture's own attention."""
    model, _ = build(model_type, tmp_path)
    ids, mask, scored = ragged_batch(model)
    with torch.no_grad():
        naive, ent_naive = naive_completion_logprobs(model, ids, mask, 6, with_entropy=True)
        chunked, ent = completion_logprobs(model, ids, mask, 6, chunk_size=4, with_entropy=True)
        packed, ent_packed = completion_logprobs(model, ids, mask, 6, with_entropy=True, packed=True)
    torch.testing.assert_close(chunked, naive, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_naive, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[scored], naive[scored], rtol=1e-5, atol=1e-5)  # padded slots: 0 there
    torch.testing.assert_close(ent_packed[scored], ent_naive[scored], rtol=1e-5, atol=1e-5)


def length_reward(completions, **kwargs):
    """A reward a random-init model's answers spread on (add3's answer_match is 0 for all: no gradient)."""
    return [len(c) / 10 for c in completions]


def _run(tmp_path, path, **kw):
    cfg = tiny_cfg(tmp_path, model=str(path), model_overrides=None, max_steps=2, objective="gspo",
                   log_samples_steps=0, reward_funcs=[length_reward], **kw)
    train(cfg)
    return read_metrics(tmp_path / "run")


@pytest.mark.parametrize("model_type", list(DENSE) + list(SPARSE))
def test_each_architecture_trains_gspo_steps(model_type, tmp_path):
    model, path = build(model_type, tmp_path)
    assert pick_generator(model, "auto") == ("hf" if model_type in HF_GENERATE else "gspo")
    rows = [r for r in _run(tmp_path, path) if "loss/policy" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss/policy"]) and math.isfinite(r["grad/norm"]) and r["grad/norm"] > 0
               for r in rows)
    assert all(r["completion/mean_len"] > 0 for r in rows)
    before, after = model.state_dict(), final_weights(tmp_path / "run")  # the saved model against the built one
    assert set(after) == set(before) and len(changed(before, after)) > len(before) // 2, changed(before, after)


@pytest.mark.parametrize("model_type", list(SPARSE))
def test_routing_replay_and_drift_on_each_moe_or_a_named_refusal(model_type, tmp_path):
    model, path = build(model_type, tmp_path)
    if model_type in SUPPORTED_ARCHITECTURES:
        assert len(find_routers(model)) == 2
        rows = [r for r in _run(tmp_path, path, routing_replay="old_policy") if "loss/policy" in r]
        assert all(0 <= r["moe/expert_change_frac"] <= 1 for r in rows) and "moe/expert_change_frac/layer_1" in rows[0]
        ids, mask, scored = ragged_batch(model)  # experts replayed in the padding-free rows = in the padded layout
        record, layout = random_record(model, ids), padding_free_layout(model, mask, 6)
        with torch.no_grad():
            with replay_routing(model, record):
                padded, _ = completion_logprobs(model, ids, mask, 6)
            with replay_routing(model, to_layout(record, layout)):
                packed, _ = completion_logprobs(model, ids, mask, 6, packed=True)
            free, _ = completion_logprobs(model, ids, mask, 6, packed=True)
        torch.testing.assert_close(packed[scored], padded[scored], rtol=1e-5, atol=1e-5)
        assert (free - packed)[scored].abs().max() > 1e-3  # the replay changed them
    else:
        assert find_routers(model) == []
        with pytest.raises(ValueError, match=f"routing replay: the '{model_type}' architecture .* is not supported"):
            _run(tmp_path, path, routing_replay="old_policy")
        with pytest.warns(UserWarning, match=f"no moe/\\* drift metrics for this model: the '{model_type}'"):
            rows = _run(tmp_path, path, overwrite_output_dir=True)
        assert not any(k.startswith("moe/") for r in rows for k in r)
