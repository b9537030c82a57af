"""Rollout workers (gspo/rollout/workers.py): a worker process samples what the trainer's process would, follows
the broadcast weights, and a dead worker is named within the timeout."""

import copy
import os
import signal
import time

import pytest
import torch

from conftest import SMALL, tiny_cfg
from gspo.models import load_model
from gspo.rollout import Sampler
from gspo.rollout.workers import RemoteSampler

PROMPTS = ["12+34=", "5+6=", "70+8="]

pytestmark = pytest.mark.slow  # each test spawns a worker (a fresh interpreter importing torch)


def test_a_worker_samples_what_the_process_samples_and_follows_the_weights(tmp_path):
    torch.manual_seed(0)
    model, tok = load_model("tiny-dense", overrides=SMALL)
    cfg = tiny_cfg(tmp_path, seeded_sampling=True)
    before = copy.deepcopy(model)
    remote = RemoteSampler(model, tok, cfg, seeded=True, workers=1, timeout_s=60)
    try:
        local, remote_1 = Sampler(model, tok, cfg, seeded=True).sample(PROMPTS, 1, 0), remote.sample(PROMPTS, 1, 0)
        assert torch.equal(local.input_ids, remote_1.input_ids) and local.completions == remote_1.completions
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)  # an update
        stats = remote.sync(model)
        assert stats["async/sync_bytes"] == 4.0 * sum(p.numel() for p in model.parameters())  # float32, tied once
        assert stats["time/sync_s"] > 0 and "time/sampler_start_s" in stats
        local_2, remote_2 = Sampler(model, tok, cfg, seeded=True).sample(PROMPTS, 2, 0), remote.sample(PROMPTS, 2, 0)
        stale_2 = Sampler(before, tok, cfg, seeded=True).sample(PROMPTS, 2, 0)
        assert torch.equal(local_2.input_ids, remote_2.input_ids)  # the new weights, bit for bit
        assert not torch.equal(stale_2.input_ids, remote_2.input_ids)  # and they mattered
    finally:
        remote.close()
    assert not any(p.is_alive() for p in remote.processes)


def test_a_dead_worker_is_named_within_the_timeout(tmp_path):
    model, tok = load_model("tiny-dense", overrides=SMALL)
    remote = RemoteSampler(model, tok, tiny_cfg(tmp_path), seeded=False, workers=1, timeout_s=5)
    try:
        pid = remote.processes[0].pid
        os.kill(pid, signal.SIGKILL)
        remote.processes[0].join(5)
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match=rf"rollout worker 1 \(pid {pid}\) exited with status -9"):
            remote.sample(PROMPTS, 1, 0)
        assert time.perf_counter() - t0 < 30
    finally:
        remote.close()


def test_a_run_with_a_worker_trains_exactly_as_one_without(tmp_path):
    # Synchronous so far: the worker samples with the weights of the latest sync, i.e. the policy's, so a
    # seeded run with a worker must be the same run, metric for metric and weight for weight.
    from conftest import final_weights, read_metrics
    from gspo.trainer import train

    runs = {}
    for workers in (0, 1):
        cfg = tiny_cfg(tmp_path / str(workers), max_steps=2, seeded_sampling=True, rollout_workers=workers,
                       eval_num_prompts=0, log_mismatch=True)
        train(cfg)
        runs[workers] = read_metrics(tmp_path / str(workers) / "run"), final_weights(tmp_path / str(workers) / "run")
    (plain, w0), (remote, w1) = runs[0], runs[1]
    for a, b in zip(plain, remote, strict=True):
        timing = ("time/", "throughput/", "async/")
        assert {k: v for k, v in a.items() if not k.startswith(timing)} == {
            k: v for k, v in b.items() if not k.startswith(timing)}
    assert remote[1]["async/sync_bytes"] > 0 and "async/sync_bytes" not in plain[1]
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
