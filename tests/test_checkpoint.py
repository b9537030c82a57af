"""Checkpoints: exact round trips (RNG, optimizer, scheduler, weights), atomic writes, safe loading, integrity."""

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from conftest import logged_steps, qwen3, tiny_cfg
from gspo.checkpoint import (
    MANIFEST_FILE,
    OPTIMIZER_FILE,
    capture_rng,
    check_data,
    check_finite_state,
    clean_stale,
    discard_newer_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_model_weights,
    resolve_resume,
    restore_rng,
    save_checkpoint,
    set_aside_damaged,
    verify_checkpoint,
)
from gspo.runtime import LOCK_FILE, RUN_MARKER, prepare_output_dir
from gspo.tasks import build_char_tokenizer
from gspo.tracking import METRICS_FILE

TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            intermediate_size=64, tie_word_embeddings=True)


def tiny_dense(seed: int):
    return qwen3(32, seed=seed, **TINY)


def tiny_moe(seed: int):
    return qwen3(32, seed=seed, moe=True, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, **TINY)


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


def test_a_checkpoint_can_hold_rng_states_captured_earlier(tmp_path):
    shuffle = torch.Generator().manual_seed(4)
    torch.manual_seed(3)
    earlier = capture_rng({"shuffle": shuffle})  # say, when a step began that is then dropped
    first = draws(shuffle)
    save_checkpoint(tmp_path, 1, rng_state=earlier)
    load_checkpoint(tmp_path / "checkpoint-1", rng_generators={"shuffle": shuffle})
    assert draws(shuffle) == first  # the draws since `earlier` come again, not the ones after saving


def test_check_rng_raises_as_restore_would_and_changes_no_rng():
    from gspo.rng import check_rng

    shuffle = torch.Generator().manual_seed(3)
    state = json.loads(json.dumps(capture_rng({"shuffle": shuffle})))
    random.random(), np.random.rand(), torch.rand(1), torch.rand(1, generator=shuffle)  # move every RNG on
    now = capture_rng({"shuffle": shuffle})
    check_rng(state, {"shuffle": shuffle})  # a state it could set: nothing raised, nothing set
    assert capture_rng({"shuffle": shuffle}) == now
    for broken, error in [({**state, "python": 1}, TypeError), ({**state, "torch": "AAAA"}, RuntimeError),
                          ({**state, "generators": {}}, ValueError)]:
        with pytest.raises(error):
            check_rng(broken, {"shuffle": shuffle})
        assert capture_rng({"shuffle": shuffle}) == now  # refused having set nothing
        with pytest.raises(error):  # the same state refused by restore_rng (which may have set some RNGs first)
            restore_rng(broken, {"shuffle": shuffle})
        now = capture_rng({"shuffle": shuffle})


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
    (tmp_path / ".tmp-checkpoint-30-1").mkdir()  # an interrupted save: not damage, ignored
    with pytest.raises(ValueError, match=r"resume='latest': .*checkpoint-20: no checkpoint.json.*latest_valid"):
        resolve_resume("latest", tmp_path)  # the newest must verify: no silent fall back
    assert resolve_resume("latest_valid", tmp_path) == latest_checkpoint(tmp_path) == tmp_path / "checkpoint-12"
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
    with pytest.raises(OSError, match=r"^checkpoint-2 could not be written \(disk full\); the previous checkpoints"):
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


@pytest.mark.slow
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
    rehash(path, OPTIMIZER_FILE)  # a careful attacker fixes the manifest too
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


# ------------------------------------------------------------------------------- integrity
def rehash(path, name: str) -> None:
    """Rewrite `name`'s manifest entry to match the file: only a check of the content can then object."""
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    data = (path / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


def flip_middle_byte(file) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def test_manifest_holds_the_sha256_and_size_of_every_file(tmp_path):
    model, optimizer, scheduler, shuffle = fresh_training(0)
    path = save_checkpoint(tmp_path, 3, model=model, tokenizer=build_char_tokenizer(), optimizer=optimizer,
                           scheduler=scheduler, rng_generators={"shuffle": shuffle})
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    on_disk = {p.name for p in path.iterdir()} - {MANIFEST_FILE}
    assert manifest["version"] == 2 and set(manifest["files"]) == on_disk
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng.json", "tokenizer.json"} <= on_disk
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


def test_a_same_size_change_in_any_file_is_named_at_resume_not_when_listing(tmp_path):
    model, optimizer, scheduler, shuffle = fresh_training(0)
    train_steps(model, optimizer, scheduler, shuffle, 1)
    path = save_checkpoint(tmp_path, 12, model=model, optimizer=optimizer, trainer_state={"sampler": {"pos": 4}})
    other = tiny_dense(1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    for name in ["model.safetensors", "optimizer.pt", "rng.json", "trainer_state.json"]:
        size = (path / name).stat().st_size
        flip_middle_byte(path / name)
        assert (path / name).stat().st_size == size
        with pytest.raises(ValueError, match=rf"checkpoint-12: {name} does not match its sha256 in checkpoint.json "
                                             r"\(damaged or modified\)$"):
            verify_checkpoint(path)
        with pytest.raises(ValueError, match=rf"resume='latest': .*checkpoint-12: {name} does not match.*latest_valid"):
            resolve_resume("latest", tmp_path)
        assert list_checkpoints(tmp_path) == [path]  # sizes only, as documented: pruning stays cheap
        with pytest.raises(ValueError, match=rf"{name} does not match its sha256"):
            load_checkpoint(path, model=other)
        assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())  # refused before copying
        flip_middle_byte(path / name)  # flipped back: the same bytes verify again
        verify_checkpoint(path)


def test_nan_weights_under_a_matching_manifest_are_refused_before_loading(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_checkpoint(tmp_path, 12, model=tiny_dense(0))
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.layers.0.mlp.up_proj.weight"][5, 7] = float("nan")
    size = file.stat().st_size
    save_file(tensors, str(file), metadata={"format": "pt"})
    assert file.stat().st_size == size
    rehash(path, "model.safetensors")
    verify_checkpoint(path)  # the hash agrees: only the finite check stands between this and sampling
    other = tiny_dense(1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    message = r"checkpoint-12/model.safetensors: model.layers.0.mlp.up_proj.weight holds NaN/inf$"
    with pytest.raises(ValueError, match=message):
        load_model_weights(other, path)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path, model=other)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_nan_optimizer_state_under_a_matching_manifest_is_refused_before_loading(tmp_path):
    model, optimizer, scheduler, shuffle = fresh_training(0)
    train_steps(model, optimizer, scheduler, shuffle, 1)
    path = save_checkpoint(tmp_path, 12, model=model, optimizer=optimizer, scheduler=scheduler)
    state = torch.load(path / OPTIMIZER_FILE, weights_only=True)
    state["state"][3]["exp_avg_sq"].view(-1)[0] = float("nan")
    size = (path / OPTIMIZER_FILE).stat().st_size
    with open(path / OPTIMIZER_FILE, "wb") as f:  # as save_checkpoint writes it (a path lays out the zip apart)
        torch.save(state, f)
    assert (path / OPTIMIZER_FILE).stat().st_size == size  # still unpickles, same size: only its values changed
    rehash(path, OPTIMIZER_FILE)
    model2, optimizer2, scheduler2, _ = fresh_training(1)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    message = r"checkpoint-12/optimizer.pt: state of parameter 3 \('exp_avg_sq'\) holds NaN/inf$"
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path, model=model2, optimizer=optimizer2, scheduler=scheduler2)
    # Nothing was copied in: not the weights (loaded after the state check), not the optimizer or schedule.
    assert all(torch.equal(v, before[k]) for k, v in model2.state_dict().items())
    assert len(optimizer2.state) == 0 and scheduler2.last_epoch == 0


@pytest.mark.parametrize("name, text", [("rng.json", "garbage"), ("rng.json", '{"python": 1}'),
                                        ("trainer_state.json", "{not json")])
def test_garbage_json_under_a_matching_manifest_is_named(tmp_path, name, text):
    model, optimizer, scheduler, shuffle = fresh_training(0)
    path = save_checkpoint(tmp_path, 12, model=model, optimizer=optimizer, scheduler=scheduler)
    (path / name).write_text(text)
    rehash(path, name)
    model2, optimizer2, scheduler2, _ = fresh_training(1)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(ValueError, match=rf"checkpoint-12/{name}: not the (JSON|RNG states) gspo writes"):
        load_checkpoint(path, model=model2, optimizer=optimizer2, scheduler=scheduler2)
    # refused before anything is copied in: unreadable JSON, and RNG states that cannot be set (checked first)
    assert all(torch.equal(v, before[k]) for k, v in model2.state_dict().items())


def test_check_finite_state_names_the_first_bad_floating_tensor_only():
    state = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.tensor([0.5, float("inf")])}},
             "param_groups": [{"lr": 0.1, "params": [0]}]}
    with pytest.raises(ValueError, match=r"^fsdp optimizer: state of parameter 0 \('exp_avg'\) holds NaN/inf$"):
        check_finite_state(state, "fsdp optimizer")
    with pytest.raises(ValueError, match=r"^s: \['ema'\]\[1\] holds NaN/inf$"):
        check_finite_state({"ema": [torch.ones(2), torch.tensor([float("nan")])]}, "s")
    # ReduceLROnPlateau starts with best=inf (a Python float) and integer tensors cannot be NaN.
    check_finite_state({"best": float("inf"), "ids": torch.tensor([1, 2]), "w": torch.zeros(3)}, "s")


def small_run(run_dir, steps) -> None:
    for step in steps:
        save_checkpoint(run_dir, step, trainer_state={"step": step}, keep=None)


def test_latest_names_a_damaged_newest_checkpoint_and_latest_valid_is_the_explicit_fall_back(tmp_path):
    truncated, unfinished = tmp_path / "truncated", tmp_path / "unfinished"
    small_run(truncated, [1, 2])
    small_run(unfinished, [1, 2])
    with open(truncated / "checkpoint-2" / "rng.json", "r+b") as f:
        f.truncate(100)
    (unfinished / "checkpoint-2" / MANIFEST_FILE).unlink()
    (truncated / ".tmp-checkpoint-3-7").mkdir()  # an interrupted save is not damage: still ignored
    for run_dir, problem in [(truncated, r"rng.json has 100 bytes, the manifest says \d+ \(truncated or modified\)"),
                             (unfinished, r"no checkpoint.json, so it is not a gspo checkpoint")]:
        listing = sorted(p.name for p in run_dir.iterdir())
        with pytest.raises(ValueError, match=rf"resume='latest': the newest checkpoint fails verification: "
                                             rf".*checkpoint-2: {problem}.*--resume latest_valid.*or pass a "):
            resolve_resume("latest", run_dir)
        assert resolve_resume("latest_valid", run_dir) == run_dir / "checkpoint-1"
        assert list_checkpoints(run_dir) == [run_dir / "checkpoint-1"]  # listing skips the damaged one
        assert sorted(p.name for p in run_dir.iterdir()) == listing  # resolving renamed and deleted nothing
    (truncated / "checkpoint-1" / MANIFEST_FILE).unlink()
    with pytest.raises(ValueError, match=r"resume='latest_valid': no checkpoint under .* verifies: .*checkpoint-2: "):
        resolve_resume("latest_valid", truncated)


def test_set_aside_damaged_keeps_the_bytes_out_of_reach_of_saves_and_prunes(tmp_path):
    small_run(tmp_path, [1, 2, 3])
    (tmp_path / "checkpoint-1" / MANIFEST_FILE).unlink()  # damaged, but not newer than the resumed step: stays
    with open(tmp_path / "checkpoint-3" / "trainer_state.json", "a") as f:
        f.write(" ")
    kept = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint-3").iterdir()}
    assert set_aside_damaged(tmp_path, newer_than=2) == [tmp_path / "checkpoint-3.damaged"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoint-3.damaged").iterdir()} == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-2", "checkpoint-3.damaged"]
    # The resumed run writes step 3 again and prunes to one: checkpoints 1 and 2 go, the damaged copy stays.
    save_checkpoint(tmp_path, 3, trainer_state={"again": True}, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-3.damaged"]
    (tmp_path / "checkpoint-3" / MANIFEST_FILE).unlink()
    assert set_aside_damaged(tmp_path, newer_than=2) == [tmp_path / "checkpoint-3.damaged-2"]  # the name is taken
    save_checkpoint(tmp_path, 4, keep=1)
    assert clean_stale(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3.damaged", "checkpoint-3.damaged-2",
                                                          "checkpoint-4"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoint-3.damaged").iterdir()} == kept
    assert set_aside_damaged(tmp_path, newer_than=0) == []  # checkpoint-4 verifies


def test_prune_counts_only_complete_checkpoints(tmp_path):
    small_run(tmp_path, [1, 2, 3])
    (tmp_path / "checkpoint-3" / MANIFEST_FILE).unlink()
    save_checkpoint(tmp_path, 4, keep=2)
    # Counting folders would have kept 3 (damaged) and 4, leaving one usable checkpoint; 2 and 4 are kept,
    # the damaged 3 left for set_aside_damaged, only 1 (older than every kept one) deleted.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]


def test_version_1_manifest_resumes_by_size_with_a_warning(tmp_path):
    import warnings

    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    path = save_checkpoint(tmp_path, 1, optimizer=optimizer, trainer_state={"step": 1})
    manifest = json.loads((path / MANIFEST_FILE).read_text())  # as the previous release wrote it: sizes only
    manifest.update(version=1, files={k: v["size"] for k, v in manifest["files"].items()})
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match="checkpoint-1: a version-1 checkpoint: its checkpoint.json carries no "
                                         "content hashes"):
        assert resolve_resume("latest", tmp_path) == path
    with pytest.warns(UserWarning, match="no content hashes"):
        assert load_checkpoint(path, optimizer=optimizer)["trainer_state"] == {"step": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # listing hashes nothing, so it has nothing to warn about
        assert list_checkpoints(tmp_path) == [path]
    with open(path / "rng.json", "a") as f:
        f.write(" ")
    with pytest.raises(ValueError, match=r"rng.json has \d+ bytes, the manifest says"):
        verify_checkpoint(path, hashes=False)


def test_a_linked_checkpoint_is_removed_as_a_link_never_its_target(tmp_path):
    archive, run_dir = tmp_path / "archive", tmp_path / "run"
    small_run(archive, [1, 2])
    files = {p.name: p.read_bytes() for p in (archive / "checkpoint-1").iterdir()}
    run_dir.mkdir()
    (run_dir / "checkpoint-1").symlink_to(archive / "checkpoint-1", target_is_directory=True)  # an old one, linked in
    assert resolve_resume("latest", run_dir) == run_dir / "checkpoint-1"  # it counts, and resumes
    save_checkpoint(run_dir, 2, keep=2)
    save_checkpoint(run_dir, 3, keep=2)  # prunes checkpoint-1: the link goes, not what it points to
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    assert {p.name: p.read_bytes() for p in (archive / "checkpoint-1").iterdir()} == files
    # A link left under a trash name (by an interrupted prune): every run's start removes the link only.
    stale = run_dir / ".tmp-trash-checkpoint-1-99"
    stale.symlink_to(archive / "checkpoint-1", target_is_directory=True)
    assert clean_stale(run_dir) == [stale] and not os.path.lexists(stale)
    # Newer linked checkpoints abandoned by a resume, or an overwritten run's: links removed, targets kept.
    (run_dir / "checkpoint-4").symlink_to(archive / "checkpoint-2", target_is_directory=True)
    discard_newer_checkpoints(run_dir, 3, allowed=True)
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    (run_dir / "checkpoint-5").symlink_to(archive / "checkpoint-2", target_is_directory=True)
    prepare_output_dir(tiny_cfg(tmp_path, overwrite_output_dir=True))
    assert sorted(p.name for p in run_dir.iterdir()) == [RUN_MARKER]  # the marker of a gspo run, written at its start
    assert [p.name for p in list_checkpoints(archive)] == ["checkpoint-1", "checkpoint-2"]
    assert {p.name: p.read_bytes() for p in (archive / "checkpoint-1").iterdir()} == files



def snapshot(folder) -> dict:
    """Every file under `folder` (its path there -> its bytes)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_folder_that_is_no_gspo_run_is_refused_where_gspo_would_write_over_its_files(tmp_path):
    # Before: a user's model/README.md, model/config.json and plots/ were written over without a word.
    run_dir = tmp_path / "run"
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "model" / "README.md").write_text("my notes\n")
    (run_dir / "model" / "config.json").write_text('{"mine": 1}')
    (run_dir / "plots").mkdir()
    (run_dir / "plots" / "mine.png").write_bytes(b"png")
    files = snapshot(run_dir)
    for overwrite in (False, True):  # overwrite_output_dir replaces a gspo run's files, never a user's
        with pytest.raises(ValueError) as refused:
            prepare_output_dir(tiny_cfg(tmp_path, overwrite_output_dir=overwrite))
        assert str(refused.value) == (f"output_dir {run_dir} holds no gspo run, but gspo would write over its model/, "
                                      "plots/; move them, or choose another output_dir")
        assert snapshot(run_dir) == files


def test_a_folder_of_other_files_takes_gspo_s_files_beside_them_only_with_overwrite(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "data").mkdir(parents=True)
    (run_dir / "data" / "train.jsonl").write_text("{}\n")
    (run_dir / "notes.txt").write_text("mine")
    files = snapshot(run_dir)
    with pytest.raises(ValueError) as refused:
        prepare_output_dir(tiny_cfg(tmp_path))
    assert str(refused.value) == (f"output_dir {run_dir} is not empty and holds no gspo run (data/, notes.txt); "
                                  "choose a new or empty output_dir, or set overwrite_output_dir=true to write gspo's "
                                  "files beside these")
    assert snapshot(run_dir) == files
    prepare_output_dir(tiny_cfg(tmp_path, overwrite_output_dir=True))
    assert snapshot(run_dir).keys() == {*files, RUN_MARKER} and snapshot(run_dir).items() >= files.items()
    # From now on it is a gspo run: its own files go on an overwrite, the user's stay.
    (run_dir / METRICS_FILE).write_text('{"step": 1}\n')
    small_run(run_dir, [1])
    with pytest.raises(ValueError, match=r"already holds a run \(metrics.jsonl\)"):
        prepare_output_dir(tiny_cfg(tmp_path))
    prepare_output_dir(tiny_cfg(tmp_path, overwrite_output_dir=True))
    assert snapshot(run_dir).keys() == {*files, RUN_MARKER} and snapshot(run_dir).items() >= files.items()


def test_a_gspo_run_from_before_the_marker_is_still_a_run_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    small_run(run_dir, [1, 2])  # an older run: checkpoints and metrics, no marker
    (run_dir / METRICS_FILE).write_text('{"step": 1}\n{"step": 2}\n')
    (run_dir / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"already holds a run \(metrics.jsonl\); continue it with --resume latest"):
        prepare_output_dir(tiny_cfg(tmp_path))
    assert not (run_dir / RUN_MARKER).exists()
    assert prepare_output_dir(tiny_cfg(tmp_path, resume_from_checkpoint="latest"), resuming=True) == run_dir
    assert (run_dir / RUN_MARKER).is_file() and resolve_resume("latest", run_dir) == run_dir / "checkpoint-2"
    assert (run_dir / METRICS_FILE).read_text() == '{"step": 1}\n{"step": 2}\n'
    # An empty folder, or one a run left only its lock in, is no one's: a run starts there.
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / LOCK_FILE).write_text("pid 1 on elsewhere since long ago\n")
    prepare_output_dir(tiny_cfg(tmp_path, output_dir=str(tmp_path / "empty")))
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == [RUN_MARKER, LOCK_FILE]

def test_a_resumed_run_says_which_checkpoint_it_loaded_once_on_stderr(tmp_path, capsys):
    from gspo.trainer import train

    cfg = dict(save_steps=1, eval_num_prompts=0, log_samples_steps=0)  # progress=false (tiny_cfg): said anyway
    train(tiny_cfg(tmp_path, **cfg, max_steps=1))
    assert "continuing from" not in capsys.readouterr().err
    train(tiny_cfg(tmp_path, **cfg, max_steps=2, resume_from_checkpoint="latest"))
    said = [line for line in capsys.readouterr().err.splitlines() if "continuing from" in line]
    assert said == [f"resume: continuing from {tmp_path / 'run' / 'checkpoint-1'} (after step 1)"]
    assert logged_steps(tmp_path / "run") == [1, 2]


def test_check_data_names_every_changed_file_and_what_changed():
    saved = {"data.jsonl": {"rows": 20, "sha256": "aa"}, "held.jsonl": {"rows": 4, "sha256": "bb"}}
    assert check_data(saved, dict(saved), "checkpoint-2", allow=False) == []
    now = {"data.jsonl": {"rows": 3, "sha256": "cc"}, "held.jsonl": {"rows": 4, "sha256": "dd"}}
    changes = ("the data changed since checkpoint-2 was saved: data.jsonl has 3 rows (20 then); held.jsonl has "
               "the same 4 rows, but other content")
    with pytest.raises(ValueError) as refused:
        check_data(saved, now, "checkpoint-2", allow=False)
    assert str(refused.value) == (f"resume: {changes}. Restore the data, or set resume_allow_changed_data=true to "
                                  "train on the new rows from the saved position")
    assert check_data(saved, now, "checkpoint-2", allow=True) == [
        f"resume: {changes}; resume_allow_changed_data=true: training goes on with the new rows from the saved "
        "position"]
    # A checkpoint from before fingerprints resumes, with a warning; a built-in task has no data file to check.
    assert check_data(None, now, "checkpoint-2", allow=False) == [
        "resume: checkpoint-2 records no fingerprint of the data (an older gspo saved it): a change to "
        "data.jsonl, held.jsonl since then cannot be detected"]
    assert check_data(None, {}, "checkpoint-2", allow=False) == []
    with pytest.raises(ValueError, match=r"^checkpoint-2/trainer_state.json: not the trainer state gspo writes "
                                         r"\(data must map each data file to its rows and sha256, got "
                                         r"\{'data.jsonl': 20\}\)$"):
        check_data({"data.jsonl": 20}, now, "checkpoint-2", allow=True)  # hand-edited: named, not a traceback


# ------------------------------------------------------------------------------- write failures
WRITER = textwrap.dedent("""
    import json, resource, signal, subprocess, sys
    from pathlib import Path
    import torch
    from safetensors.torch import save_file
    from gspo.checkpoint import load_checkpoint, save_checkpoint

    run_dir, mode = Path(sys.argv[1]), sys.argv[2]
    small = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    save_checkpoint(run_dir, 1, optimizer=small, trainer_state={"step": 1})  # every file under 64 KB
    if mode == "fsize":  # files may not grow past 64 KB: a write past it fails with EFBIG (SIGXFSZ ignored)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))

    class Model:  # writes its weights with safetensors, as save_pretrained does
        def save_pretrained(self, path):
            save_file({"w": torch.zeros(1 << 16)}, str(Path(path) / "model.safetensors"))  # 256 KB

    lin = torch.nn.Linear(256, 256)
    big = torch.optim.AdamW(lin.parameters())
    lin(torch.ones(1, 256)).sum().backward()
    big.step()  # exp_avg, exp_avg_sq: 256 KB each

    def attempt(what, **kwargs):
        try:
            save_checkpoint(run_dir, 2, **kwargs)
            out = {"what": what, "errno": None}
        except OSError as err:
            out = {"what": what, "errno": err.errno, "message": str(err)}
        print(json.dumps({**out, "left": sorted(p.name for p in run_dir.iterdir())}), flush=True)

    attempt("torch.save", optimizer=big)
    attempt("safetensors", model=Model())
    attempt("json", trainer_state={"log": "x" * (1 << 18)})
    if mode == "tmpfs":
        subprocess.run(["mount", "-o", "remount,ro", str(run_dir)], check=True)
        attempt("read-only", trainer_state={})
    out = load_checkpoint(run_dir / "checkpoint-1", optimizer=torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))
    print(json.dumps({"loaded": out["trainer_state"]}), flush=True)
""")


def check_write_failures(out: str, code: int, cause: str) -> None:
    *attempts, loaded = [json.loads(line) for line in out.splitlines()]
    assert [a["what"] for a in attempts[:3]] == ["torch.save", "safetensors", "json"]
    for a in attempts:
        want_code, want_cause = (errno.EROFS, "Read-only file system") if a["what"] == "read-only" else (code, cause)
        assert a["errno"] == want_code, a
        assert a["message"].startswith(f"[Errno {want_code}] checkpoint-2 could not be written ({want_cause}); "
                                       "the previous checkpoints are intact"), a
        assert a["left"] == ["checkpoint-1"], a  # no partial folder, nothing earlier touched
    assert loaded == {"loaded": {"step": 1}}


@pytest.mark.slow
def test_write_failures_name_the_cause_and_keep_the_previous_checkpoints(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), "fsize"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    check_write_failures(done.stdout, errno.EFBIG, "File too large")
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["checkpoint-1"]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="a tmpfs mount needs root and unshare")
def test_a_full_or_read_only_disk_keeps_the_previous_checkpoints(tmp_path):
    script, run_dir = tmp_path / "writer.py", tmp_path / "run"
    script.write_text(WRITER)
    run_dir.mkdir()
    # A private mount namespace: the 128 KB tmpfs is seen by this child only and vanishes with it.
    shell = f'mount -t tmpfs -o size=128k tmpfs "$0" || exit 77; exec {sys.executable} {script} "$0" tmpfs'
    done = subprocess.run(["unshare", "--mount", "sh", "-c", shell, str(run_dir)], capture_output=True, text=True,
                          timeout=120)
    if done.returncode == 77 or done.stderr.startswith("unshare:"):
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    check_write_failures(done.stdout, errno.ENOSPC, "No space left on device")
