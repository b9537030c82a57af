"""LoRA through PEFT (gspo/plugs/lora.py, gspo/plugs/reference.py): only the adapters train and are checkpointed,
the reference policy is the base with its adapters off, runs resume exactly, the merged model is the
trained policy, and bad settings are named before anything loads."""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import SMALL, SMALL_MOE, changed, read_metrics, starts_with_digit, tiny_cfg
from gspo.algo.logprobs import completion_logprobs, minibatch_logprobs
from gspo.config import TrainConfig, make_config
from gspo.models import load_model
from gspo.plugs.lora import attach_adapters
from gspo.plugs.moe import find_routers
from gspo.plugs.parallel import Topology
from gspo.plugs.reference import AdaptersOff, reference_policy
from gspo.rollout import generate
from gspo.tasks import get_task
from gspo.trainer import train

pytest.importorskip("peft")

LORA = dict(lora_r=4, lora_alpha=8.0, reward_funcs=[starts_with_digit], learning_rate=1e-2)


def test_only_the_adapters_train_and_the_checkpoint_holds_only_them(tmp_path):
    cfg = tiny_cfg(tmp_path, **LORA, save_steps=3)
    train(cfg)
    run = tmp_path / "run"
    adapter = load_file(run / "model" / "adapter_model.safetensors")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)  # nothing of the base
    assert any(v.abs().max() > 0 for k, v in adapter.items() if ".lora_B." in k)  # B starts at 0: it trained
    checkpoint = run / "checkpoint-3"
    assert not (checkpoint / "model.safetensors").exists()
    assert load_file(checkpoint / "adapter_model.safetensors").keys() == adapter.keys()
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert len(optimizer["state"]) == len(adapter)  # AdamW moments for the adapters only
    # The base the adapter sits on is the preset as built: no base weight moved.
    peft = pytest.importorskip("peft")
    base, _ = load_model("tiny-dense", overrides=SMALL)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    trained = peft.PeftModel.from_pretrained(base, run / "model")
    merged = trained.merge_and_unload().state_dict()
    moved = changed(before, merged)
    assert moved and all(("proj" in k) for k in moved)  # only the adapted linear layers' weights differ


def test_adapters_off_is_the_base_model_and_costs_no_copy(tmp_path):
    model, tok = load_model("tiny-dense", overrides=SMALL)
    base, _ = load_model("tiny-dense", overrides=SMALL)  # the same preset: the starting policy
    cfg = tiny_cfg(tmp_path, **LORA, kl_coef=0.1)
    policy = attach_adapters(model, cfg)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # as if trained: the adapted policy moves away from the base
    reference = reference_policy(cfg.kl_coef, policy, Topology())
    assert isinstance(reference, AdaptersOff) and reference.model is policy  # no second model
    prompts = [r["prompt"] for r in get_task("add3").dataset("train", 2, 0)]
    rollout = generate(base, tok, prompts, 2, max_new_tokens=6)
    rows = [torch.arange(rollout.num_sequences)]
    ref = reference.logprobs(rollout, rows, {})  # (N, T)
    torch.testing.assert_close(ref, minibatch_logprobs(base, rollout, rows, {}), rtol=0, atol=1e-6)
    mask = rollout.completion_mask
    own = minibatch_logprobs(policy, rollout, rows, {})
    assert (own - ref)[mask].abs().max() > 1e-2  # with the adapters on it is another policy
    # A full fine-tuning run keeps a frozen copy instead.
    full = reference_policy(0.1, base, Topology())
    assert full.model is not base and not any(p.requires_grad for p in full.model.parameters())


def test_kl_to_the_base_grows_as_the_adapters_train(tmp_path):
    # each step's loss/kl: before its update
    train(tiny_cfg(tmp_path, **LORA, kl_coef=0.05, max_steps=4, num_minibatches=1))
    rows = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    kl = [r["loss/kl"] for r in rows]  # KL(pi_theta || pi_ref): pi_ref the base, adapters off
    assert kl[0] == 0.0  # step 1: adapters still at B = 0, the policy is its base exactly
    assert kl[-1] > 1e-3  # the adapters moved the policy off its reference (measured 0.011)
    assert all(r["ratio/mean"] == 1.0 for r in rows)  # one on-policy minibatch a step


def test_resume_continues_the_adapters_exactly(tmp_path):
    every = dict(LORA, save_steps=2, eval_steps=2)  # step 2 evaluates in both (the last step of a run always does)
    train(tiny_cfg(tmp_path / "a", **every, max_steps=4, save_total_limit=3))
    train(tiny_cfg(tmp_path / "b", **every, max_steps=2))
    train(tiny_cfg(tmp_path / "b", **every, max_steps=4, resume_from_checkpoint="latest"))
    a = load_file(tmp_path / "a" / "run" / "model" / "adapter_model.safetensors")
    b = load_file(tmp_path / "b" / "run" / "model" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    at_2 = load_file(tmp_path / "a" / "run" / "checkpoint-2" / "adapter_model.safetensors")
    assert changed(at_2, a)  # steps 3-4 moved them: the equality says something
    ma = [r for r in read_metrics(tmp_path / "a" / "run") if r["step"] > 2]
    mb = [r for r in read_metrics(tmp_path / "b" / "run") if r["step"] > 2]
    assert [(r["reward/mean"], r["grad/norm"]) for r in ma] == [(r["reward/mean"], r["grad/norm"]) for r in mb]


def test_merged_model_is_the_trained_policy_and_the_adapter_folder_loads(tmp_path, monkeypatch):
    train(tiny_cfg(tmp_path, **LORA, lora_save_merged=True))
    run = tmp_path / "run"
    merged = AutoModelForCausalLM.from_pretrained(run / "merged")  # plain transformers, no peft
    # Each folder's model card says how to load what it holds.
    assert "library_name: peft" in (run / "model" / "README.md").read_text()
    assert "library_name: transformers" in (run / "merged" / "README.md").read_text()
    peft = pytest.importorskip("peft")
    base, tok = load_model("tiny-dense", overrides=SMALL)
    policy = peft.PeftModel.from_pretrained(base, run / "model")
    ids = torch.randint(3, 80, (3, 10), generator=torch.Generator().manual_seed(0))  # (N, P+T)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        a, _ = completion_logprobs(policy, ids, mask, 4)
        b, _ = completion_logprobs(merged, ids, mask, 4)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), policy.disable_adapter():
        untrained, _ = completion_logprobs(policy, ids, mask, 4)
    assert (a - untrained).abs().max() > 1e-3  # the merged weights carry what the adapters learned
    # The adapter folder names no base (a preset): loading it says where the merged weights are.
    with pytest.raises(ValueError, match="merged/ folder"):
        load_model(str(run / "model"))
    # With a named base (a saved checkpoint), load_model gives the merged policy.
    base_dir = tmp_path / "base"
    fresh, tok = load_model("tiny-dense", overrides=SMALL)
    fresh.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    config = json.loads((run / "model" / "adapter_config.json").read_text())
    (run / "model" / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(base_dir)}))
    loaded, _ = load_model(str(run / "model"))
    with torch.no_grad():
        c, _ = completion_logprobs(loaded, ids, mask, 4)
    torch.testing.assert_close(c, b, rtol=1e-5, atol=1e-5)


def test_moe_routers_get_no_adapter_and_replay_still_works(tmp_path):
    cfg = tiny_cfg(tmp_path, **LORA, model="tiny-moe", model_overrides=SMALL_MOE, routing_replay="old_policy",
                   max_steps=2)
    model, _ = load_model("tiny-moe", overrides=SMALL_MOE)
    routers = len(find_routers(model))
    policy = attach_adapters(model, cfg)
    assert len(find_routers(policy)) == routers == 2  # same router modules, not wrapped
    assert not any(p.requires_grad for r in find_routers(policy) for p in r.module.parameters())
    assert any("lora_" in n for n, _ in policy.named_parameters())
    train(cfg)
    rows = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert all("moe/expert_change_frac" in r for r in rows), rows[0].keys()


@pytest.mark.parametrize("settings, message", [
    (dict(lora_r=4, peft={"r": 8}), "not both"),
    (dict(peft={"lora_alpha": 16}), "needs r"),
    (dict(peft={"r": 8, "not_a_field": 1}), "refused by peft.LoraConfig"),
    (dict(lora_r=4, distributed="fsdp"), "fsdp is not supported"),
    (dict(lora_r=-1), "lora_r"),
    (dict(lora_r=4, lora_dropout=1.0), "lora_dropout"),
])
def test_bad_lora_settings_are_named_at_config_time(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        tiny_cfg(tmp_path, **settings)


def test_a_target_that_matches_nothing_and_a_missing_peft_are_named(tmp_path, monkeypatch):
    model, _ = load_model("tiny-dense", overrides=SMALL)
    with pytest.raises(ValueError, match="matched no layer|Target modules"):
        attach_adapters(model, tiny_cfg(tmp_path, lora_r=4, lora_target_modules=["no_such_proj"]))
    moe, _ = load_model("tiny-moe", overrides=SMALL_MOE)
    with pytest.raises(ValueError, match="router 'base_model.model.model.layers.0.mlp.gate'"):
        attach_adapters(moe, tiny_cfg(tmp_path, model="tiny-moe", peft={"r": 4, "target_modules": ["q_proj"],
                                                                       "target_parameters": ["mlp.gate.weight"]}))
    monkeypatch.setitem(sys.modules, "peft", None)  # as if the extra were not installed
    with pytest.raises(ValueError, match=r"gspo\[peft\]"):
        make_config(TrainConfig, {"lora_r": 4})


def test_merged_state_dict_is_the_policy_under_plain_names_and_leaves_it_alone(tmp_path):
    """What the vLLM engine loads (gspo/rollout/vllm_engine.py): base weights plus each adapter's delta."""
    from gspo.plugs.lora import merged_state_dict

    model, _ = load_model("tiny-dense", overrides=SMALL)
    policy = attach_adapters(model, tiny_cfg(tmp_path, lora_r=4))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    merged = merged_state_dict(policy)
    plain, _ = load_model("tiny-dense", overrides=SMALL)
    assert merged.keys() == plain.state_dict().keys()  # the plain model's names, no adapter tensors
    plain.load_state_dict(merged)
    ids = torch.randint(3, 80, (2, 9), generator=torch.Generator().manual_seed(0))  # (N, P+T)
    with torch.no_grad():
        a, _ = completion_logprobs(policy, ids, torch.ones_like(ids), 4)
        b, _ = completion_logprobs(plain, ids, torch.ones_like(ids), 4)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not changed(before, policy.state_dict())  # computed out of place


def test_adapters_do_not_shift_the_runs_random_stream(tmp_path):
    """B starts at 0, so a LoRA run's first rollout is full fine-tuning's, token for token."""
    train(tiny_cfg(tmp_path / "full", reward_funcs=[starts_with_digit], max_steps=1))
    train(tiny_cfg(tmp_path / "lora", **LORA, max_steps=1))
    full, lora = (read_metrics(tmp_path / name / "run")[1] for name in ("full", "lora"))
    for key in ("reward/mean", "completion/mean_len", "completion/max_len", "eval/accuracy"):
        assert full[key] == lora[key], key


def test_a_bfloat16_base_trains_float32_adapters(tmp_path):
    """The LoRA + bf16 recipe (docs/benchmarks.md, 8): base weights in bfloat16, adapters (and AdamW) in float32."""
    train(tiny_cfg(tmp_path, **LORA, dtype="bfloat16", save_steps=3))
    adapter = load_file(tmp_path / "run" / "model" / "adapter_model.safetensors")
    assert all(t.dtype == torch.float32 for t in adapter.values())
    assert any(t.abs().max() > 0 for k, t in adapter.items() if ".lora_B." in k)
    rows = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert all(r["grad/norm"] > 0 for r in rows)
