"""Checkpoints: exact round trips (RNG, optimizer, scheduler, weights), atomic writes, safe loading."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from gspo.checkpoint import (MANIFEST_FILE, OPTIMIZER_FILE, capture_rng, clean_stale, latest_checkpoint,
                             list_checkpoints, load_checkpoint, load_model_weights, resolve_resume, restore_rng,
                             save_checkpoint)
from gspo.tasks import build_char_tokenizer

TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            intermediate_size=64, tie_word_embeddings=True)


def tiny_dense(seed: int):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(Qwen3Config(vocab_size=32, **TINY))


def tiny_moe(seed: int):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(Qwen3MoeConfig(vocab_size=32, moe_intermediate_size=16, num_experts=4,
                                                           num_experts_per_tok=2, **TINY))


def draws(gen: torch.Generator) -> list:
    """One draw from every RNG a training step may touch (gauss/normal exercise the cached-value slots)."""
    return [random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.normal(size=3).tolist(),
            torch.rand(3).tolist(), torch.randperm(8, generator=gen).tolist()]


# ------------------------------------------------------------------------------- RNG
def test_rng_round_trip_is_exact_for_every_generator():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    shuffle = torch.Generator().manual_seed(4)
    draws(shuffle)  # mid-stream, with a cached gaussian in Python's and NumPy's state
    state = json.loads(json.dumps(capture_rng({"shuffle": shuffle})))  # as stored: through JSON
    first = draws(shuffle)
    moved_on = draws(shuffle)
    restore_rng(state, {"shuffle": shuffle})
    assert draws(shuffle) == first
    assert moved_on != first  # so the equality above is not a coincidence of stuck generators


def test_restore_rng_rejects_other_generator_names():
    state = capture_rng({"shuffle": torch.Generator()})
    with pytest.raises(ValueError, match=r"rng_generators: names \['other'\].*\['shuffle'\]"):
        restore_rng(state, {"other": torch.Generator()})


# ------------------------------------------------------------------------------- exact resume
def train_steps(model, optimizer, scheduler, shuffle, n: int) -> None:
    """`n` AdamW steps on random token batches; the batch uses the global RNG, the row order `shuffle`."""
    for _ in range(n):
        ids = torch.randint(0, 32, (4, 6))  # (B, T)
        ids = ids[torch.randperm(4, generator=shuffle)]
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()


def fresh_training(seed: int):
    model = tiny_dense(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 4))  # 4-step warmup
    return model, optimizer, scheduler, torch.Generator().manual_seed(seed)


def test_resume_reproduces_uninterrupted_training_bitwise(tmp_path):
    model, optimizer, scheduler, shuffle = fresh_training(0)
    torch.manual_seed(10)
    train_steps(model, optimizer, scheduler, shuffle, 3)
    at_3 = {k: v.clone() for k, v in model.state_dict().items()}
    state = {"sampler": {"epoch": 0, "pos": 12}, "guard": {"skipped": 0}, "evals": {"0": {"eval/accuracy": 0.25}}}
    config = {"seed": 0, "learning_rate": 0.01, "reward_funcs": ["answer_match"]}
    path = save_checkpoint(tmp_path, 3, model=model, tokenizer=build_char_tokenizer(), optimizer=optimizer,
                           scheduler=scheduler, trainer_state=state, config=config,
                           rng_generators={"shuffle": shuffle})
    train_steps(model, optimizer, scheduler, shuffle, 3)
    uninterrupted = model.state_dict()

    # A new process would rebuild everything from scratch: other weights, other RNG positions.
    model2, optimizer2, scheduler2, shuffle2 = fresh_training(1)
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    assert not torch.equal(model2.model.embed_tokens.weight, at_3["model.embed_tokens.weight"])
    out = load_checkpoint(path, model=model2, optimizer=optimizer2, scheduler=scheduler2,
                          rng_generators={"shuffle": shuffle2})
    assert out["step"] == 3 and out["trainer_state"] == state and out["config"] == config
    assert all(torch.equal(v, at_3[k]) for k, v in model2.state_dict().items())
    assert model2.lm_head.weight is model2.model.embed_tokens.weight  # still tied after loading in place
    assert scheduler2.last_epoch == 3 and optimizer2.param_groups[0]["lr"] == 1e-2 * 1.0  # lambda(3) = 4/4
    train_steps(model2, optimizer2, scheduler2, shuffle2, 3)

    resumed = model2.state_dict()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)
    assert not torch.equal(uninterrupted["model.norm.weight"], at_3["model.norm.weight"])  # steps 4-6 moved it
    first = next(iter(optimizer.state.values()))
    first2 = next(iter(optimizer2.state.values()))
    assert first["step"].item() == first2["step"].item() == 6.0
    assert torch.equal(first["exp_avg"], first2["exp_avg"]) and torch.equal(first["exp_avg_sq"], first2["exp_avg_sq"])


def test_moe_weights_load_in_place_through_the_expert_conversion(tmp_path):
    from safetensors import safe_open

    model = tiny_moe(0)
    path = save_checkpoint(tmp_path, 1, model=model)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved_keys = set(f.keys())
    # transformers 5 fuses experts in memory but saves them one by one: the fast path cannot apply.
    assert "model.layers.0.mlp.experts.gate_up_proj" in model.state_dict()
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in saved_keys
    other = tiny_moe(1)
    params_before = [p.data_ptr() for p in other.parameters()]
    torch.manual_seed(5)
    load_model_weights(other, path)
    after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(1))  # loading drew nothing from the caller's RNG
    assert [p.data_ptr() for p in other.parameters()] == params_before  # in place: an optimizer stays valid
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in other.state_dict().items())


# ------------------------------------------------------------------------------- folders
def test_keep_last_k_and_resaving_a_step(tmp_path):
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, trainer_state={"step": step}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4"]
    save_checkpoint(tmp_path, 4, trainer_state={"step": 4, "again": True}, keep=2)  # replaces the old folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4"]
    assert load_checkpoint(tmp_path / "checkpoint-4")["trainer_state"] == {"step": 4, "again": True}
    save_checkpoint(tmp_path, 5, keep=None)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-4", "checkpoint-5"]
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        save_checkpoint(tmp_path, 6, keep=0)


def test_latest_and_resolve_resume(tmp_path):
    assert latest_checkpoint(tmp_path / "nothing") is None
    with pytest.raises(ValueError, match="resume='latest': no complete checkpoint under"):
        resolve_resume("latest", tmp_path)
    save_checkpoint(tmp_path, 5, keep=None)
    save_checkpoint(tmp_path, 12, keep=None)  # "checkpoint-12" < "checkpoint-5" as text: steps compare as numbers
    (tmp_path / "checkpoint-20").mkdir()  # a folder that never got its manifest
    (tmp_path / ".tmp-checkpoint-30-1").mkdir()
    assert resolve_resume("latest", tmp_path) == latest_checkpoint(tmp_path) == tmp_path / "checkpoint-12"
    assert resolve_resume(str(tmp_path / "checkpoint-5"), tmp_path) == tmp_path / "checkpoint-5"
    with pytest.raises(ValueError, match="checkpoint-20'.*no checkpoint.json.*never finished"):
        resolve_resume(str(tmp_path / "checkpoint-20"), tmp_path)
    with pytest.raises(ValueError, match="no such folder"):
        resolve_resume(str(tmp_path / "checkpoint-7"), tmp_path)
    with pytest.raises(ValueError, match="is a run folder, not a checkpoint"):
        resolve_resume(str(tmp_path), tmp_path)
    with open(tmp_path / "checkpoint-12" / "trainer_state.json", "a") as f:
        f.write(" ")
    with pytest.raises(ValueError, match=r"trainer_state.json has \d+ bytes, the manifest says"):
        resolve_resume(str(tmp_path / "checkpoint-12"), tmp_path)
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-5"  # the altered one no longer counts
    assert clean_stale(tmp_path) == [tmp_path / ".tmp-checkpoint-30-1"]


def test_state_that_json_or_weights_only_would_change_is_refused_before_writing(tmp_path):
    with pytest.raises(ValueError, match=r"trainer_state\['evals'\]\[10\] \(a non-string key\)"):
        save_checkpoint(tmp_path, 1, trainer_state={"evals": {10: 0.5}})
    with pytest.raises(ValueError, match=r"config\['betas'\] \(a tuple\)"):
        save_checkpoint(tmp_path, 1, config={"betas": (0.9, 0.99)})

    class Schedule:  # a scheduler whose state holds an object weights_only loading would refuse
        def state_dict(self):
            return {"fn": Schedule}

    with pytest.raises(ValueError, match=r"scheduler\['fn'\] is a type"):
        save_checkpoint(tmp_path, 1, scheduler=Schedule())
    assert list(tmp_path.iterdir()) == []


def test_failed_save_keeps_previous_checkpoint_and_leaves_nothing_partial(tmp_path, monkeypatch):
    lin = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(lin.parameters())
    save_checkpoint(tmp_path, 1, optimizer=optimizer, trainer_state={"step": 1})

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, optimizer=optimizer, trainer_state={"step": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-1"]
    assert load_checkpoint(latest_checkpoint(tmp_path), optimizer=optimizer)["trainer_state"] == {"step": 1}


# ------------------------------------------------------------------------------- kill, tampering
CHILD = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import torch
    from gspo.checkpoint import save_checkpoint

    run_dir = sys.argv[1]
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(lin.parameters(), lr=0.1)
    lin(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    save_checkpoint(run_dir, 1, optimizer=optimizer, trainer_state={"step": 1})
    print(json.dumps(optimizer.state[lin.weight]["exp_avg"].tolist()), flush=True)

    class SlowModel:  # stands in for a model large enough that writing it takes a while
        def save_pretrained(self, path):
            (Path(path) / "model.safetensors").write_bytes(b"half a model")
            print("writing", flush=True)
            time.sleep(60)

    save_checkpoint(run_dir, 2, model=SlowModel(), optimizer=optimizer, trainer_state={"step": 2})
""")


def test_kill_during_write_leaves_previous_checkpoint_loadable(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    run_dir = tmp_path / "run"
    child = subprocess.Popen([sys.executable, str(script), str(run_dir)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        exp_avg = json.loads(child.stdout.readline() or "null")
        assert child.stdout.readline() == "writing\n", child.stderr.read()
        os.kill(child.pid, signal.SIGKILL)  # mid-write of checkpoint 2
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    partial = run_dir / f".tmp-checkpoint-2-{child.pid}"
    assert (partial / "model.safetensors").read_bytes() == b"half a model"  # the kill really hit mid-write
    assert sorted(p.name for p in run_dir.iterdir()) == [partial.name, "checkpoint-1"]
    assert resolve_resume("latest", run_dir) == run_dir / "checkpoint-1"

    lin = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(lin.parameters(), lr=0.1)
    out = load_checkpoint(run_dir / "checkpoint-1", optimizer=optimizer)
    assert out["step"] == 1 and out["trainer_state"] == {"step": 1}
    # AdamW after one step: exp_avg = (1 - beta1) * grad = 0.1 * 1 for every weight (d sum / d w = input = 1)
    assert optimizer.state[lin.weight]["exp_avg"].tolist() == exp_avg == [[pytest.approx(0.1)] * 3] * 2
    assert clean_stale(run_dir) == [partial] and not partial.exists()


class Payload:
    """Unpickling this would call open(marker, "w"): code execution from a checkpoint file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_tampered_optimizer_file_is_refused_without_running_it(tmp_path):
    lin = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(lin.parameters())
    path = save_checkpoint(tmp_path, 1, optimizer=optimizer)
    marker = tmp_path / "pwned"
    torch.save({"state": {}, "param_groups": [], "x": Payload(str(marker))}, path / OPTIMIZER_FILE)
    manifest = json.loads((path / MANIFEST_FILE).read_text())  # a careful attacker fixes the sizes too
    manifest["files"][OPTIMIZER_FILE] = (path / OPTIMIZER_FILE).stat().st_size
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="optimizer.pt: refused, it holds objects other than tensors"):
        load_checkpoint(path, optimizer=optimizer)
    assert not marker.exists()


def test_sharded_weights_load_in_place(tmp_path):
    model = tiny_dense(0)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    other = tiny_dense(1)
    load_model_weights(other, tmp_path)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in other.state_dict().items())
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_model_weights(other, tmp_path / "missing")
