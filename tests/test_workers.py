"""Rollout workers (`rollout_workers`: gspo serve endpoints the trainer starts itself, gspo/rollout/endpoint/spawned.py,
sampled from as rollout endpoints: rollouts.py, gspo/rollout/feed.py): a worker samples what the trainer's process
would, follows the pushed weights, runs max_staleness steps ahead exactly as the in-process lag stand-in does,
resumes bit for bit, answers nobody without the run's secret, and a dead or silent worker is named within the
timeout and stops the run with a checkpoint."""

import copy
import dataclasses
import importlib.util
import multiprocessing
import os
import pickle
import signal
import socket
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import SMALL, SMALL_MOE, final_weights, read_metrics, tiny_cfg
from gspo.models import load_model
from gspo.rollout import Sampler, sampler_sections
from gspo.rollout.endpoint.client import EndpointLost
from gspo.rollout.endpoint.rollouts import EndpointSampler
from gspo.runtime import TrainingAborted
from gspo.trainer import train

PROMPTS = ["12+34=", "5+6=", "70+8="]
SECRET = "a secret of this test's run"


def seeded_sampler(model, tok, cfg) -> Sampler:
    """The trainer's own Sampler of `cfg` in this process, seeded: what a worker must sample alike."""
    return Sampler(model, tok, *sampler_sections(cfg), seeded=True)


def workers_of(model, tok, cfg, workers: int = 1, seeded: bool = True, timeout_s: float = 60) -> EndpointSampler:
    """The sampler of `cfg` with `workers` rollout workers (started now, each with a copy of `model`)."""
    cfg = dataclasses.replace(cfg, rollout_workers=workers, rollout_timeout_s=timeout_s)
    return EndpointSampler(model, tok, *sampler_sections(cfg), seeded=seeded)


pytestmark = pytest.mark.slow  # each test spawns a worker (a fresh interpreter importing torch)


def test_a_worker_samples_what_the_process_samples_and_follows_the_weights(tmp_path):
    torch.manual_seed(0)
    model, tok = load_model("tiny-dense", overrides=SMALL)
    cfg = tiny_cfg(tmp_path, seeded_sampling=True)
    before = copy.deepcopy(model)
    remote = workers_of(model, tok, cfg)
    try:
        local, remote_1 = seeded_sampler(model, tok, cfg).sample(PROMPTS, 1, 0), remote.sample(PROMPTS, 1, 0)
        assert torch.equal(local.input_ids, remote_1.input_ids) and local.completions == remote_1.completions
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)  # an update
        stats = remote.sync(model)
        assert stats["async/sync_bytes"] == 4.0 * sum(p.numel() for p in model.parameters())  # float32, tied once
        assert stats["time/sync_s"] > 0 and "time/sampler_start_s" in stats
        local_2, remote_2 = seeded_sampler(model, tok, cfg).sample(PROMPTS, 2, 0), remote.sample(PROMPTS, 2, 0)
        stale_2 = seeded_sampler(before, tok, cfg).sample(PROMPTS, 2, 0)
        assert torch.equal(local_2.input_ids, remote_2.input_ids)  # the new weights, bit for bit
        assert not torch.equal(stale_2.input_ids, remote_2.input_ids)  # and they mattered
    finally:
        remote.close()
    assert not any(p.is_alive() for p in remote.processes)


class Evil:
    """A pickle that, once loaded, writes the file `path`: code run by whoever unpickles it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_worker_answers_nobody_without_the_run_s_secret_and_listens_on_loopback_only(tmp_path):
    # before (issue 47): with rollout_workers: 1 the trainer's TCPStore listened on every interface and unpickled
    # what a racing local process sent. A worker is now a gspo serve endpoint on loopback whose secret only the
    # trainer and the worker know (handed over in the spawn pipe): a local process's request to sample or to touch
    # the weights is refused before its body is read, and a pickle sent raw runs nothing.
    import httpx

    from test_wire import listening

    model, tok = load_model("tiny-dense", overrides=SMALL)
    cfg, ran = tiny_cfg(tmp_path, seeded_sampling=True), tmp_path / "ran"
    remote = workers_of(model, tok, cfg)
    try:
        (url,) = remote.endpoints.bases
        port = int(url.rsplit(":", 1)[1])
        assert [host for host, p in listening(remote.processes[0].pid) if p == port] == ["127.0.0.1"]
        for path, body in (("/v1/completions", {"prompt": [1, 2], "max_tokens": 2}), ("/v1/models", None),
                           ("/start_weight_update", None), ("/rng_state", {"rng_state": ""}),
                           ("/init_weight_transfer_engine", {"init_info": {"backend": "gspo", "host": "127.0.0.1",
                                                                          "port": 1, "rank": 1}})):
            answer = httpx.request("GET" if body is None and path == "/v1/models" else "POST", url + path, json=body,
                                   headers={"Authorization": "Bearer not the run's secret at all"}, timeout=10)
            assert answer.status_code == 401, (path, answer.text)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(pickle.dumps(("ready", Evil(ran))))
            raw.settimeout(2)
            try:  # not an HTTP request: refused (400), the connection closed, or still waited on; never unpickled
                reply = raw.recv(200)
            except TimeoutError:
                reply = b""
            assert reply == b"" or reply.startswith(b"HTTP/1.1 400"), reply
        local, far = seeded_sampler(model, tok, cfg).sample(PROMPTS, 1, 0), remote.sample(PROMPTS, 1, 0)
        assert torch.equal(local.input_ids, far.input_ids) and local.completions == far.completions
    finally:
        remote.close()
    assert not ran.exists()


def test_two_workers_share_a_step_as_one_sampler_would(tmp_path):
    model, tok = load_model("tiny-dense", overrides=SMALL)
    cfg = tiny_cfg(tmp_path, seeded_sampling=True, log_mismatch=True)  # mu kept
    remote = workers_of(model, tok, cfg, workers=2)
    try:
        local = seeded_sampler(model, tok, cfg)
        one, two = local.sample(PROMPTS, 1, 0), remote.sample(PROMPTS, 1, 0)  # shares of 2 and 1 prompts
        assert torch.equal(one.input_ids, two.input_ids) and torch.equal(one.attention_mask, two.attention_mask)
        assert torch.equal(one.completion_mask, two.completion_mask) and one.completions == two.completions
        assert (one.sampler_logprobs - two.sampler_logprobs).abs().max() < 1e-5  # other batch shapes: rounding
        assert remote.rng_after(1) is None and remote.version_of(1) == 0  # seeded: no random state to keep
    finally:
        remote.close()


def test_a_dead_worker_is_named_within_the_timeout(tmp_path):
    model, tok = load_model("tiny-dense", overrides=SMALL)
    remote = workers_of(model, tok, tiny_cfg(tmp_path), seeded=False, timeout_s=5)
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


TIMING = ("time/", "throughput/", "async/")


def text_hash(prompts, completions, **_):
    """A reward with spread in nearly every group, so every step moves the weights."""
    return [sum(map(ord, c)) % 5 / 4 for c in completions]


def computed(record: dict) -> dict:
    """A metrics line without its timings (and the async/* bookkeeping that only a worker run has)."""
    return {k: v for k, v in record.items() if not k.startswith(TIMING)}


def worker(process_list=None):
    """The run's rollout worker process (a child named gspo-rollout-worker-1)."""
    (found,) = [p for p in multiprocessing.active_children() if p.name == "gspo-rollout-worker-1"]
    return found


def test_a_silent_worker_is_named_after_the_timeout(tmp_path):
    model, tok = load_model("tiny-dense", overrides=SMALL)
    remote = workers_of(model, tok, tiny_cfg(tmp_path), seeded=False, timeout_s=3)
    try:
        os.kill(remote.processes[0].pid, signal.SIGSTOP)  # alive, never answers
        t0 = time.perf_counter()
        with pytest.raises(EndpointLost, match=r"step 1: waiting for its rollout: rollout worker 1: no answer "
                                               r"within rollout_timeout_s=3"):
            remote.sample(PROMPTS, 1, 0)
        assert 2.5 < time.perf_counter() - t0 < 30
        with pytest.raises(EndpointLost, match="no answer"):  # lost for good: no second wait
            remote.request(PROMPTS, 2, 0)
    finally:
        os.kill(remote.processes[0].pid, signal.SIGKILL)
        remote.close()


def test_a_run_with_a_worker_trains_exactly_as_one_without(tmp_path):
    # max_staleness 0: the worker samples with the weights of the latest sync, i.e. the policy's, so a
    # seeded run with a worker must be the same run, metric for metric and weight for weight.
    runs = {}
    for workers in (0, 1):
        cfg = tiny_cfg(tmp_path / str(workers), max_steps=2, seeded_sampling=True, rollout_workers=workers,
                       eval_num_prompts=0, log_mismatch=True)
        train(cfg)
        runs[workers] = read_metrics(tmp_path / str(workers) / "run"), final_weights(tmp_path / str(workers) / "run")
    (plain, w0), (remote, w1) = runs[0], runs[1]
    for a, b in zip(plain, remote, strict=True):
        assert computed(a) == computed(b)
    assert remote[1]["async/sync_bytes"] > 0 and "async/sync_bytes" not in plain[1]
    assert [r["async/staleness_max"] for r in remote] == [0.0, 0.0]
    assert all(0 < r["async/trainer_busy"] <= 1 and 0 < r["async/worker_busy"] <= 1 for r in remote)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


@pytest.mark.parametrize("workers", [1, 2])
def test_workers_one_step_ahead_are_the_in_process_lag_of_one(tmp_path, workers):
    # max_staleness 1 asks for step t's rollout as step t - 1 begins, after the weights of step t - 2 were sent:
    # what sampler_lag 1 simulates with a copy in one process. Seeded, the two runs are the same run.
    common = dict(max_steps=4, seeded_sampling=True, eval_num_prompts=0, learning_rate=1e-2, log_mismatch=True,
                  reward_funcs=[text_hash])
    train(tiny_cfg(tmp_path / "lag", sampler_lag=1, **common))
    train(tiny_cfg(tmp_path / "async", rollout_workers=workers, max_staleness=1, **common))
    lag, real = read_metrics(tmp_path / "lag" / "run"), read_metrics(tmp_path / "async" / "run")
    # mu alone differs in the last bits: the lag's copy has requires_grad off, which takes other CPU kernels
    # (log-probs within 5e-7 of the policy's); one worker's copy keeps it on and matches the policy bitwise,
    # two workers sample in other batch shapes (the same tokens: seeded per row).
    exact = [{k: v for k, v in computed(r).items() if not k.startswith("mismatch/")} for r in (*lag, *real)]
    assert exact[:4] == exact[4:]
    for a, b in zip(lag, real):  # abs 1e-6: step 1's values are rounding alone (1e-8 .. 6e-7 with 2 threads)
        off = {k: (v, b[k]) for k, v in a.items() if k.startswith("mismatch/") and b[k] != pytest.approx(v, rel=1e-5,
                                                                                                          abs=1e-6)}
        assert not off, off
    assert [r["async/staleness_mean"] for r in real] == [0.0, 1.0, 1.0, 1.0]  # step 1: the first weights
    # step 1: mu and pi_old of the same weights (KV-cached decode vs one forward: rounding only); then stale
    assert real[0]["mismatch/kl"] < 1e-10 and all(r["mismatch/kl"] > 1e-3 for r in real[1:])
    w_lag, w_real = final_weights(tmp_path / "lag" / "run"), final_weights(tmp_path / "async" / "run")
    assert all(torch.equal(w_lag[k], w_real[k]) for k in w_lag)


@pytest.mark.parametrize("staleness,seeded,workers", [(0, True, 1), (1, True, 1), (1, False, 1), (1, False, 2)])
def test_a_run_stopped_with_rollouts_in_flight_resumes_bit_for_bit(tmp_path, staleness, seeded, workers):
    # Stopped after step 2 (a callback's stop), step 3's rollout already asked for under max_staleness 1: the
    # checkpoint keeps it (and the worker's random state, for unseeded sampling), so the resumed run is the
    # uninterrupted one.
    def cfg(name, **kw):
        return tiny_cfg(tmp_path / name, max_steps=4, seeded_sampling=seeded, rollout_workers=workers,
                        max_staleness=staleness, eval_num_prompts=0, learning_rate=1e-2, reward_funcs=[text_hash], **kw)

    train(cfg("whole"))
    train(cfg("parts"), callbacks=[lambda step, metrics: "stop" if step == 2 else None])
    pending = torch.load(tmp_path / "parts" / "run" / "checkpoint-2" / "rollouts.pt", weights_only=True)
    assert pending["steps"] == list(range(3, 3 + staleness))
    assert (pending["worker_rng"] is None) if seeded else len(pending["worker_rng"]) == workers  # seeded: none needed
    train(cfg("parts", resume_from_checkpoint="latest"))
    whole, parts = read_metrics(tmp_path / "whole" / "run"), read_metrics(tmp_path / "parts" / "run")
    assert [r["step"] for r in parts] == [1, 2, 3, 4]
    assert [computed(r) for r in whole] == [computed(r) for r in parts]
    assert [r["async/staleness_max"] for r in parts] == [0.0] + [float(staleness)] * 3
    w, p = final_weights(tmp_path / "whole" / "run"), final_weights(tmp_path / "parts" / "run")
    assert all(torch.equal(w[k], p[k]) for k in w)


def test_a_worker_killed_mid_run_stops_it_with_a_checkpoint_that_resumes(tmp_path):
    cfg = dict(max_steps=4, seeded_sampling=True, rollout_workers=1, max_staleness=1, eval_num_prompts=0,
               rollout_timeout_s=20)

    def kill_after_step_2(step, metrics):
        if step == 2:
            os.kill(worker().pid, signal.SIGKILL)

    # Step 3's rollout came back during step 2 (max_staleness 1), so step 3 may still train (then its weight
    # broadcast finds the worker gone); or posting step 4's prompts already fails. Either way the run stops
    # before a step it cannot finish, with the checkpoint of the last one it did.
    t0 = time.perf_counter()
    with pytest.raises(TrainingAborted, match=r"rollout worker 1 \(pid \d+\) exited with status -9[^\n]*\n"
                                              r"stopped after step ([23]); checkpoint saved to .*checkpoint-\1; "
                                              r"continue with --resume latest") as stopped:
        train(tiny_cfg(tmp_path, **cfg), callbacks=[kill_after_step_2])
    assert time.perf_counter() - t0 < 60
    last = int(str(stopped.value).split("stopped after step ")[1][0])
    run = tmp_path / "run"
    assert [r["step"] for r in read_metrics(run)] == list(range(1, last + 1))
    pending = torch.load(run / f"checkpoint-{last}" / "rollouts.pt", weights_only=True)
    assert pending["steps"] == ([3] if last == 2 else [])  # step 4's rollout never came back: sampled on resume
    train(tiny_cfg(tmp_path, **cfg, resume_from_checkpoint="latest"))
    metrics = read_metrics(run)
    assert [r["step"] for r in metrics] == [1, 2, 3, 4] and metrics[-1]["async/staleness_max"] == 0.0


def test_a_worker_samples_with_the_run_s_sampler_a_bf16_copy_here(tmp_path):
    # The worker runs the trainer's own Sampler plug, so sampler_dtype (a bf16 copy, the stand-in for an engine's
    # numerics) works there as in-process: seeded, the same run.
    common = dict(max_steps=2, seeded_sampling=True, eval_num_prompts=0, sampler_dtype="bfloat16",
                  reward_funcs=[text_hash], learning_rate=1e-2)
    train(tiny_cfg(tmp_path / "here", **common))
    train(tiny_cfg(tmp_path / "worker", rollout_workers=1, **common))
    here, worker = read_metrics(tmp_path / "here" / "run"), read_metrics(tmp_path / "worker" / "run")
    assert [computed(r) for r in here] == [computed(r) for r in worker]
    assert all(r["mismatch/kl"] > 1e-8 for r in worker)  # bf16 mu against the fp32 trainer


def test_a_bf16_run_s_worker_samples_under_the_trainer_s_autocast(tmp_path):
    # bf16: the trainer's own sampler runs under its autocast, and so does a worker's (before, a worker sampled in
    # float32: other tokens, mu 1.45x slower on SmolLM2 at T = 128). max_staleness 0, seeded: the same run.
    common = dict(max_steps=2, seeded_sampling=True, eval_num_prompts=0, bf16=True, reward_funcs=[text_hash],
                  learning_rate=1e-2, log_mismatch=True)
    train(tiny_cfg(tmp_path / "here", **common))
    train(tiny_cfg(tmp_path / "worker", rollout_workers=1, **common))
    here, worker = read_metrics(tmp_path / "here" / "run"), read_metrics(tmp_path / "worker" / "run")
    assert len(here) == len(worker) == 2
    assert [computed(r) for r in here] == [computed(r) for r in worker]  # mu and its mismatch metrics included
    assert all(r["mismatch/kl"] < 1e-4 for r in worker)


def test_a_worker_that_cannot_build_its_sampler_says_why(tmp_path):
    # The worker says in its pipe that it listens, or its traceback once building its Sampler failed: here a vllm
    # engine without vllm.
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: the worker's engine would start")
    model, tok = load_model("tiny-dense", overrides=SMALL)
    with pytest.raises(EndpointLost, match=r"(?s)starting the rollout workers: rollout worker 1 failed:\n"
                                           r"Traceback.*backend='vllm' cannot run this model: .*vllm"):
        workers_of(model, tok, tiny_cfg(tmp_path, generation_backend="vllm"), seeded=False)


MOE_R3 = dict(model="tiny-moe", model_overrides=SMALL_MOE, routing_replay="rollout", seeded_sampling=True,
              eval_num_prompts=0, learning_rate=1e-2, reward_funcs=[text_hash])


def test_a_worker_returns_its_experts_for_rollout_routing_replay_and_resumes(tmp_path):
    # routing_replay=rollout (R3) replays the experts the sampler chose: a worker records them and they travel
    # in the rollout, so a seeded run with a worker at max_staleness 0 is the in-process run; at max_staleness 1
    # a checkpoint holds the record of the rollout sampled ahead and the resumed run is the uninterrupted one.
    train(tiny_cfg(tmp_path / "here", max_steps=2, **MOE_R3))
    train(tiny_cfg(tmp_path / "worker", max_steps=2, rollout_workers=1, **MOE_R3))
    here, worker = read_metrics(tmp_path / "here" / "run"), read_metrics(tmp_path / "worker" / "run")
    assert [computed(r) for r in here] == [computed(r) for r in worker]
    w0, w1 = final_weights(tmp_path / "here" / "run"), final_weights(tmp_path / "worker" / "run")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)

    def cfg(name, **kw):
        return tiny_cfg(tmp_path / name, max_steps=3, rollout_workers=1, max_staleness=1, **MOE_R3, **kw)

    train(cfg("whole"))
    train(cfg("parts"), callbacks=[lambda step, metrics: "stop" if step == 1 else None])
    pending = torch.load(tmp_path / "parts" / "run" / "checkpoint-1" / "rollouts.pt", weights_only=True)
    (record,) = pending["rollouts"]
    assert record["routing"]["indices"].shape[:2] == (2, 8) and record["routing"]["indices"].max() >= 0
    train(cfg("parts", resume_from_checkpoint="latest"))
    whole, parts = read_metrics(tmp_path / "whole" / "run"), read_metrics(tmp_path / "parts" / "run")
    assert [computed(r) for r in whole] == [computed(r) for r in parts]
    w, p = final_weights(tmp_path / "whole" / "run"), final_weights(tmp_path / "parts" / "run")
    assert all(torch.equal(w[k], p[k]) for k in w)


def test_rollout_routing_replay_over_episodes_with_a_worker_is_the_in_process_run(tmp_path):
    # R3 over multi-turn episodes (tests/test_episodes.py: the record of each call): a worker's record of its
    # episodes travels in the rollout like a single-turn one, so the seeded runs are equal, metric for metric
    episodes = dict(environment="test_episodes:Countdown", max_turns=3, max_episode_tokens=32,
                    max_completion_length=4)
    train(tiny_cfg(tmp_path / "here", max_steps=2, **MOE_R3, **episodes))
    train(tiny_cfg(tmp_path / "worker", max_steps=2, rollout_workers=1, **MOE_R3, **episodes))
    here, worker = read_metrics(tmp_path / "here" / "run"), read_metrics(tmp_path / "worker" / "run")
    assert [computed(r) for r in here] == [computed(r) for r in worker]
    assert all(r["episode/turns_mean"] > 1 and "moe/expert_change_frac" in r for r in here)
    w0, w1 = final_weights(tmp_path / "here" / "run"), final_weights(tmp_path / "worker" / "run")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_a_lora_run_s_worker_gets_the_adapters_only_after_the_first_broadcast(tmp_path):
    lora = dict(max_steps=2, seeded_sampling=True, eval_num_prompts=0, lora_r=4, lora_alpha=8.0,
                reward_funcs=[text_hash], learning_rate=1e-2)
    train(tiny_cfg(tmp_path / "here", **lora))
    train(tiny_cfg(tmp_path / "worker", rollout_workers=1, **lora))
    here, worker = read_metrics(tmp_path / "here" / "run"), read_metrics(tmp_path / "worker" / "run")
    assert [computed(r) for r in here] == [computed(r) for r in worker]
    w0, w1 = (load_file(tmp_path / name / "run" / "model" / "adapter_model.safetensors") for name in ("here", "worker"))
    assert w0 and all(".lora_" in k for k in w0) and all(torch.equal(w0[k], w1[k]) for k in w0)
    # the adapters in float32: 4 bytes per value of every lora_A / lora_B matrix, the frozen base not again
    assert [r["async/sync_bytes"] for r in worker] == [4.0 * sum(v.numel() for v in w0.values())] * 2
