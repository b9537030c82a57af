"""Reliability: non-finite guard, bad rewards dropped or named, checkpoints and exact resume, signals."""

import dataclasses
import json
import math
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import (
    SMALL,
    TINY_RUN,
    changed,
    comparable,
    final_weights,
    gspo_argv,
    gspo_env,
    initial_weights,
    logged_steps,
    read_metrics,
    starts_with_digit,
    tiny_cfg,
)
from gspo.algo.objectives import OBJECTIVES
from gspo.apps.cli import main
from gspo.runtime import TrainingAborted
from gspo.tracking import read_jsonl
from gspo.trainer import train

KILL_SEED = 15  # picks the step of the SIGKILL below: the same one on every run


class NanGrad(torch.autograd.Function):
    """Identity forward, NaN backward: a finite loss whose gradient is poisoned."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * math.nan


def poison(monkeypatch, kinds: list[str]):
    """Register objective "poisoned" for the test: gspo, with the i-th policy loss made NaN ("loss"), given
    a NaN gradient ("grad") or left alone ("ok")."""
    gspo_objective, calls = OBJECTIVES["gspo"], []

    def poisoned(x):
        policy, stats = gspo_objective.loss(x)
        kind = kinds[len(calls)] if len(calls) < len(kinds) else "ok"
        calls.append(kind)
        if kind == "loss":
            policy = policy + math.nan
        elif kind == "grad":
            policy = NanGrad.apply(policy)
        return policy, stats

    monkeypatch.setitem(OBJECTIVES, "poisoned", dataclasses.replace(gspo_objective, loss=poisoned))  # removed after
    return calls


def test_nonfinite_loss_and_gradient_skip_the_step(tmp_path, monkeypatch):
    calls = poison(monkeypatch, ["loss", "grad"])  # the run's only two optimizer steps
    cfg = tiny_cfg(tmp_path, max_steps=1, num_minibatches=2, reward_funcs=[starts_with_digit],
                   per_device_batch_size=4, objective="poisoned")
    train(cfg)
    assert calls == ["loss", "grad"]
    trained = final_weights(tmp_path / "run")
    assert changed(initial_weights(cfg), trained) == []  # neither NaN update touched the weights
    record = read_metrics(tmp_path / "run")[1]
    assert record["guard/skipped_steps"] == 2
    assert all(torch.isfinite(tensor).all() for tensor in trained.values())


def test_a_step_or_a_skip_frees_the_gradients():
    # they are spent once the step is taken or skipped: the next forward and the next rollout do not hold them
    from gspo.runtime import NonFiniteGuard
    from gspo.step import step_or_skip

    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    guard = NonFiniteGuard(5)
    for loss_of in (lambda out: out.sum(), lambda out: out.sum() * math.nan):
        before = layer.weight.detach().clone()
        loss = loss_of(layer(torch.ones(1, 3)))
        loss.backward()
        assert layer.weight.grad is not None
        step_or_skip(optimizer, scheduler, guard, 1, loss.detach(), torch.tensor(1.0))
        assert layer.weight.grad is None and layer.bias.grad is None
        assert torch.equal(layer.weight, before) == (not math.isfinite(loss.item()))  # stepped, or skipped
    assert guard.skipped == 1


def test_a_good_step_after_a_skip_updates_and_resets_the_streak(tmp_path, monkeypatch):
    poison(monkeypatch, ["loss", "ok", "grad", "ok"])
    cfg = tiny_cfg(tmp_path, max_steps=2, num_minibatches=2, reward_funcs=[starts_with_digit], max_consecutive_skips=2,
                   per_device_batch_size=4, objective="poisoned")
    train(cfg)  # never two in a row: no abort
    records = read_metrics(tmp_path / "run")
    assert [r["guard/skipped_steps"] for r in records[1:]] == [1, 2]  # cumulative count


def test_consecutive_nonfinite_steps_abort_with_a_clear_message(tmp_path, monkeypatch):
    poison(monkeypatch, ["loss"] * 10)
    cfg = tiny_cfg(tmp_path, max_steps=3, num_minibatches=2, max_consecutive_skips=3, objective="poisoned")
    with pytest.raises(TrainingAborted, match="step 2: 3 optimizer steps in a row had a non-finite loss"):
        train(cfg)
    # Through the CLI: one line on stderr, exit status 3.
    poison(monkeypatch, ["loss"] * 10)
    code = main(["train", "model=tiny-dense", f"output_dir={tmp_path / 'cli'}", "max_steps=2", "num_minibatches=2",
                 "per_device_batch_size=2", "num_generations=2", "max_completion_length=4", "eval_num_prompts=2",
                 "eval_k=2", "max_consecutive_skips=2", "progress=false", "device=cpu", "objective=poisoned"])
    assert code == 3


def nan_for_first(prompts, completions, **_):
    """NaN for the first completion of every batch, else 1 if it starts with a digit."""
    return [math.nan if i == 0 else float(c[:1].isdigit()) for i, c in enumerate(completions)]


def test_bad_rewards_stop_the_run_or_are_dropped_and_counted(tmp_path):
    with pytest.raises(ValueError, match="'nan_for_first' returned non-finite nan at sample 0"):
        train(tiny_cfg(tmp_path, max_steps=1, reward_funcs=[nan_for_first]))
    cfg = tiny_cfg(tmp_path, max_steps=2, reward_funcs=[nan_for_first], drop_bad_rewards=True, log_samples_count=2,
                   output_dir=str(tmp_path / "drop"))
    train(cfg)
    records = read_metrics(tmp_path / "drop")
    assert [r["reward/dropped"] for r in records[1:]] == [1, 1]
    assert all(math.isfinite(r["reward/mean"]) and math.isfinite(r["loss/policy"]) for r in records[1:])
    samples = read_jsonl(tmp_path / "drop" / "samples.jsonl", null_as_nan=False)
    first = [s for s in samples if s["step"] == 1]
    assert first[0]["reward"] is None and first[0]["advantage"] == 0.0  # dropped: no reward, no advantage


# ------------------------------------------------------------------------------- kill, interrupt, resume
SLOW_REWARD = '''
import time


def slow_digit(prompts, completions, **_):
    time.sleep(0.25)  # makes every step last long enough to be killed in the middle of the run
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]
'''


def run_args(tmp_path, out: str, *extra: str) -> list[str]:
    (tmp_path / "slow_reward.py").write_text(SLOW_REWARD)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "model": "tiny-dense", "model_overrides": SMALL, "task": "add3", "max_steps": 8, "per_device_batch_size": 4,
        "num_generations": 4, "num_minibatches": 2, "max_completion_length": 8, "learning_rate": 1e-3,
        "eval_num_prompts": 4, "eval_k": 2, "eval_steps": 3, "progress": False, "device": "cpu", "save_steps": 1,
        "reward_funcs": ["slow_reward:slow_digit"], "log_samples_steps": 1}))
    return gspo_argv("train", "--config", tmp_path / "run.yaml", f"output_dir={out}", *extra)


def launch(tmp_path, out: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(run_args(tmp_path, out, *extra), cwd=tmp_path, env=gspo_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def resume(tmp_path, out: str) -> subprocess.CompletedProcess:
    return subprocess.run(run_args(tmp_path, out, "--resume", "latest"), cwd=tmp_path, env=gspo_env(tmp_path),
                          capture_output=True, text=True, timeout=300)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if any(s >= step for s in logged_steps(run_dir)):
            return
        time.sleep(0.02)
    raise AssertionError(f"step {step} never logged")


@pytest.mark.slow
def test_killed_or_interrupted_runs_resume_exactly(tmp_path):
    full = launch(tmp_path, "full")
    assert full.wait(timeout=300) == 0, full.communicate()
    expected = comparable(tmp_path / "full")
    assert [r["step"] for r in expected] == list(range(9))
    # Checkpoints every step, the newest 2 kept; the last one is the final step.
    assert sorted(p.name for p in (tmp_path / "full").glob("checkpoint-*")) == ["checkpoint-7", "checkpoint-8"]

    # SIGKILL at a seeded random step in 2..5: no chance to save, so resume from the newest complete checkpoint.
    kill_at = random.Random(KILL_SEED).randint(2, 5)
    proc = launch(tmp_path, "killed")
    wait_for_step(tmp_path / "killed", kill_at, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    resumed = resume(tmp_path, "killed")
    assert resumed.returncode == 0, resumed.stderr
    assert comparable(tmp_path / "killed") == expected, f"killed at step {kill_at}"
    want = final_weights(tmp_path / "full")
    assert changed(want, final_weights(tmp_path / "killed")) == [], f"killed at step {kill_at}: weights differ"
    samples = read_jsonl(tmp_path / "killed" / "samples.jsonl")
    assert [s["step"] for s in samples] == [s["step"] for s in read_jsonl(tmp_path / "full" / "samples.jsonl")]

    # SIGTERM: the step in flight finishes (or, still sampling or scoring, is dropped whole), a checkpoint of the
    # last completed step is saved, exit status 128 + 15; the resumed run is the uninterrupted one.
    proc = launch(tmp_path, "termed")
    wait_for_step(tmp_path / "termed", 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    stopped_at = int(re.search(r"SIGTERM after step (\d+)", err).group(1))
    assert stopped_at < 8 and (tmp_path / "termed" / f"checkpoint-{stopped_at}").is_dir()
    assert max(logged_steps(tmp_path / "termed")) == stopped_at
    resumed = resume(tmp_path, "termed")
    assert resumed.returncode == 0, resumed.stderr
    assert comparable(tmp_path / "termed") == expected
    assert changed(want, final_weights(tmp_path / "termed")) == []


def test_resume_and_output_dir_errors(tmp_path):
    cfg = tiny_cfg(tmp_path, max_steps=2, save_steps=1, save_total_limit=3)
    train(cfg)
    with pytest.raises(ValueError, match="already holds a run .*--resume latest.*overwrite_output_dir=true"):
        train(cfg)
    with pytest.raises(ValueError, match="checkpoint is at step 2 and max_steps=2: nothing left to run"):
        train(tiny_cfg(tmp_path, max_steps=2, resume_from_checkpoint="latest"))
    with pytest.raises(ValueError, match=r"other settings: learning_rate=0.001 \(now 0.01\)"):
        train(tiny_cfg(tmp_path, max_steps=4, learning_rate=1e-2, resume_from_checkpoint="latest"))
    with pytest.raises(ValueError, match="checkpoint-2 is newer than checkpoint-1"):
        train(tiny_cfg(tmp_path, max_steps=4, resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1")))
    with pytest.raises(ValueError, match="resume='latest': no complete checkpoint"):
        train(tiny_cfg(tmp_path, output_dir=str(tmp_path / "empty"), resume_from_checkpoint="latest"))
    # Extending a finished run: more steps from its final checkpoint.
    train(tiny_cfg(tmp_path, max_steps=3, resume_from_checkpoint="latest"))
    assert logged_steps(tmp_path / "run") == [0, 1, 2, 3]
    # overwrite_output_dir starts afresh: old metrics and checkpoints gone.
    train(tiny_cfg(tmp_path, max_steps=1, overwrite_output_dir=True))
    assert logged_steps(tmp_path / "run") == [0, 1]
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-1"]


# ------------------------------------------------------------------------------- resume on changed data, CLI
def write_sums(path: Path, firsts) -> Path:
    """A JSON Lines dataset of "a+a=" prompts with their answers, one row per first term `a`."""
    path.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in firsts))
    return path


def test_resume_on_changed_data_is_refused_naming_the_file_unless_allowed(tmp_path, capsys):
    data, held = write_sums(tmp_path / "data.jsonl", range(10, 30)), write_sums(tmp_path / "held.jsonl", range(50, 54))

    def cfg(**kw):
        return tiny_cfg(tmp_path, task=None, dataset=str(data), eval_dataset=str(held), reward_funcs=["answer_match"],
                        save_steps=1, **kw)

    train(cfg(max_steps=2))  # 2 steps of 2 prompts: the sampler stands 4 rows into its first pass over 20
    again = dict(max_steps=3, resume_from_checkpoint="latest")
    allow = "Restore the data, or set resume_allow_changed_data=true to train on the new rows from the saved position"
    write_sums(data, [*range(10, 29), 31])  # same path, same count, one row replaced
    with pytest.raises(ValueError, match=re.escape(f"resume: the data changed since checkpoint-2 was saved: {data} "
                                                   f"has the same 20 rows, but other content. {allow}")):
        train(cfg(**again))
    write_sums(data, range(10, 13))  # fewer rows than the sampler's position: named, not an IndexError
    write_sums(held, range(60, 64))
    with pytest.raises(ValueError, match=re.escape(f"since checkpoint-2 was saved: {data} has 3 rows (20 then); "
                                                   f"{held} has the same 4 rows, but other content. {allow}")):
        train(cfg(**again))
    assert logged_steps(tmp_path / "run") == [0, 1, 2]  # refused before anything ran
    capsys.readouterr()
    train(cfg(**again, resume_allow_changed_data=True))  # said explicitly: a warning, then the next pass over 3 rows
    assert f"{data} has 3 rows (20 then)" in capsys.readouterr().err
    assert logged_steps(tmp_path / "run") == [0, 1, 2, 3]
    train(cfg(max_steps=4, resume_from_checkpoint="latest"))  # checkpoint-3 vouches for the new rows: no flag needed
    assert logged_steps(tmp_path / "run") == [0, 1, 2, 3, 4]


def test_overrides_follow_resume_and_a_resume_keeps_file_modes(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**TINY_RUN, "task": "add3", "output_dir": str(tmp_path / "run")}))
    run_dir, old_umask = tmp_path / "run", os.umask(0o027)  # new files: rw-r-----
    try:
        assert main(["train", "--config", str(config), "save_steps=1", "max_steps=2"]) == 0
        (run_dir / "metrics.jsonl").chmod(0o664)  # as the user set them: a resume keeps them so
        (run_dir / "samples.jsonl").chmod(0o604)
        assert main(["train", "--config", str(config), "save_steps=1", "--resume", "latest", "max_steps=3"]) == 0
    finally:
        os.umask(old_umask)
    assert logged_steps(run_dir) == [0, 1, 2, 3]
    mode = lambda p: p.stat().st_mode & 0o777  # noqa: E731
    assert (mode(run_dir / "metrics.jsonl"), mode(run_dir / "samples.jsonl")) == (0o664, 0o604)
    for folder in (run_dir / "model", run_dir / "checkpoint-3"):  # every file readable as the umask says
        assert {p.name: oct(mode(p)) for p in folder.iterdir()} == {p.name: oct(0o640) for p in folder.iterdir()}


def test_sft_refuses_an_earlier_run_without_offering_resume(tmp_path, capsys):
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "metrics.jsonl").write_text("")
    assert main(["sft", f"output_dir={tmp_path / 'sft'}", "num_examples=4", "progress=false"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run (metrics.jsonl)" in err and "overwrite_output_dir=true" in err
    assert "--resume" not in err  # gspo sft has no --resume
