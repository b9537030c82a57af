"""torchrun on CPU (gloo, 2 processes): DDP and FSDP2 match one process; checkpoints resume; a dead rank does not hang.

Tolerance: the 2-process runs compute every row's log-probs in a different batch (each rank trims
its own part of a minibatch) and on one thread instead of two, so floating-point sums differ in
their last bits; measured differences are ~3e-6 of a tensor's largest weight after 3 steps and
~2e-5 relative on the smallest metrics (kl/approx ~1e-4). We allow 5e-5 and 1e-3. Everything
that does not go through a float reduction (tokens sampled, rewards, lengths) must be equal.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from gspo.tracking import read_jsonl
from tests.test_trainer import SMALL

EXACT = ("reward/mean", "reward/std", "completion/mean_len", "completion/max_len", "groups/zero_std_frac", "lr",
         "eval/accuracy", "eval/mean_at_k", "guard/skipped_steps")
REWARD = '''
import os


def digit(prompts, completions, **_):
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


calls = 0


def dies(prompts, completions, **_):
    """Rank 1 dies on its second call (step 2)."""
    global calls
    calls += 1
    if os.environ.get("RANK") == "1" and calls == 2:
        os._exit(7)
    return digit(prompts, completions)
'''


def run(tmp: Path, nproc: int, *overrides: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tmp), "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc > 1 else [sys.executable]
    return subprocess.run([*launcher, "-m", "gspo", "train", "--config", str(tmp / "run.yaml"), *overrides],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    (tmp / "rewards_mod.py").write_text(REWARD)
    (tmp / "run.yaml").write_text(yaml.safe_dump({
        "model": "tiny-dense", "model_overrides": SMALL, "task": "add3", "max_steps": 3, "num_generations": 4,
        "num_minibatches": 2, "max_completion_length": 8, "learning_rate": 1e-3, "eval_num_prompts": 4, "eval_k": 2,
        "progress": False, "device": "cpu", "reward_funcs": ["format", "rewards_mod:digit"], "kl_coef": 0.01,
        "log_samples_steps": 0, "seeded_sampling": True, "eval_steps": 2}))
    done = {
        "one": run(tmp, 1, "per_device_batch_size=4", "output_dir=one", "save_steps=1"),
        "ddp": run(tmp, 2, "per_device_batch_size=2", "output_dir=ddp", "save_steps=1"),
        "fsdp": run(tmp, 2, "per_device_batch_size=2", "output_dir=fsdp", "distributed=fsdp"),
    }
    for name, proc in done.items():
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    return tmp


def metrics(path: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in read_jsonl(path)]


def assert_same_run(a: Path, b: Path, rel: float = 5e-5, metric_rel: float = 1e-3) -> None:
    ma, mb = metrics(a / "metrics.jsonl"), metrics(b / "metrics.jsonl")
    assert [r["step"] for r in ma] == [r["step"] for r in mb]
    for ra, rb in zip(ma, mb):
        assert set(ra) == set(rb)
        for key, va in ra.items():
            if key in EXACT or key == "step":
                assert va == rb[key], (ra["step"], key, va, rb[key])
            else:
                assert va == pytest.approx(rb[key], rel=metric_rel, abs=1e-9), (ra["step"], key)
    wa, wb = load_file(a / "model" / "model.safetensors"), load_file(b / "model" / "model.safetensors")
    for key, tensor in wa.items():
        scale = tensor.abs().max()
        assert (tensor - wb[key]).abs().max() <= rel * scale, key


def test_two_process_ddp_and_fsdp_match_one_process(runs):
    one = runs / "one"
    start = load_file(one / "model" / "model.safetensors")
    assert_same_run(one, runs / "ddp")
    assert_same_run(one, runs / "fsdp")
    rewards = [r["reward/mean"] for r in read_jsonl(one / "metrics.jsonl")[1:]]
    assert any(r > 0 for r in rewards)  # a learning signal, so the runs really moved their weights
    assert start  # (loaded above)


def test_only_rank_zero_writes(runs):
    lines = (runs / "ddp" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]  # one writer, no duplicates
    assert sorted(p.name for p in (runs / "ddp").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]


def test_two_process_checkpoint_resumes_on_two_or_one_processes(runs):
    for name, nproc, batch, reference in (("resume2", 2, 2, "ddp"), ("resume1", 1, 4, "one")):
        target = runs / name
        shutil.copytree(runs / "ddp", target)
        shutil.rmtree(target / "checkpoint-3")
        shutil.rmtree(target / "model")
        done = run(runs, nproc, f"per_device_batch_size={batch}", f"output_dir={name}", "save_steps=1",
                   "--resume", "latest")
        assert done.returncode == 0, done.stderr[-3000:]
        if nproc == 2:  # same world size: the same computation, bit for bit
            assert metrics(target / "metrics.jsonl") == metrics(runs / "ddp" / "metrics.jsonl")
            wa, wb = load_file(target / "model" / "model.safetensors"), load_file(runs / "ddp/model/model.safetensors")
            assert all(torch.equal(wa[k], wb[k]) for k in wa)
        else:  # another world size: the single-process run's numbers, within the float tolerance
            assert_same_run(runs / reference, target)


def test_a_dead_rank_stops_the_run_with_a_message(runs):
    started = time.monotonic()
    done = run(runs, 2, "per_device_batch_size=2", "output_dir=dead", "reward_funcs=[rewards_mod:dies]",
               "dist_timeout_s=30")
    assert done.returncode != 0
    assert time.monotonic() - started < 120
    assert "exitcode  : 7" in done.stderr or "exit code 7" in done.stderr or "exitcode: 7" in done.stderr, \
        done.stderr[-2000:]
