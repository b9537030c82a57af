"""Rollout endpoints (`rollout_endpoints`; gspo/rollout/endpoint/client.py, rollouts.py, weights.py): a run that samples
from `gspo serve` endpoints, token in and token out, is the in-process run (seeded: metric for metric, weight for
weight), runs max_staleness steps ahead exactly as the in-process lag stand-in does, resumes bit for bit, pushes its
weights by the four phases (each bearing the run's secret, the tensors over the authenticated wire), and an endpoint
that fails is named in one line and stops the run with a checkpoint."""

import contextlib
import socket
import threading
import time

import httpx
import pytest
import torch

from conftest import SMALL, SMALL_MOE, TINY_MODEL, final_weights, free_port, gspo_serving, read_metrics, tiny_cfg
from gspo.config import TrainConfig, make_config
from gspo.runtime import TrainingAborted
from gspo.trainer import train

pytest.importorskip("fastapi")

SECRET = "a secret of this test's run, 32+"
TIMING = ("time/", "throughput/", "perf/", "async/trainer_busy", "async/worker_busy", "mem/")


@pytest.fixture(autouse=True)
def run_secret(monkeypatch):
    monkeypatch.setenv("GSPO_ROLLOUT_SECRET", SECRET)


def text_hash(prompts, completions, **_):
    """A reward with spread in nearly every group, so every step moves the weights."""
    return [sum(map(ord, c)) % 5 / 4 for c in completions]


def computed(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMING)}


@contextlib.contextmanager
def endpoints(tmp_path, count: int = 1, **serve):
    """`count` gspo serve endpoints of the tiny model (SMALL) on loopback; their URLs."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(gspo_serving(tiny_cfg(tmp_path / f"serve{i}", **serve))) for i in range(count)]
        yield [server.url + "/v1" for server in servers]


def cfg_of(tmp_path, name: str, **kw) -> TrainConfig:
    return tiny_cfg(tmp_path / name, **{"max_steps": 2, "seeded_sampling": True, "eval_num_prompts": 0,
                                        "log_mismatch": True, **kw})


def test_a_run_on_an_endpoint_trains_exactly_as_one_without(tmp_path):
    # Seeded, max_staleness 0: the endpoint samples each step with the weights the trainer just pushed, in one
    # generator call of the step's rows (one request), so the run is the in-process run, mu bit for bit.
    train(cfg_of(tmp_path, "plain"))
    with endpoints(tmp_path) as urls:
        train(cfg_of(tmp_path, "endpoint", rollout_endpoints=urls))
    plain, remote = read_metrics(tmp_path / "plain" / "run"), read_metrics(tmp_path / "endpoint" / "run")
    assert [r["step"] for r in remote] == [1, 2]
    for a, b in zip(plain, remote, strict=True):
        assert computed(a) == {k: v for k, v in computed(b).items() if not k.startswith("async/")}
    assert remote[0]["mismatch/kl"] == plain[0]["mismatch/kl"]
    params = sum(p.numel() for p in torch.nn.Module.parameters(_model(tmp_path / "plain")))
    assert [r["async/sync_bytes"] for r in remote] == [4.0 * params] * 2  # float32, every parameter (no LoRA)
    assert [r["async/staleness_max"] for r in remote] == [0.0, 0.0] and remote[0]["time/sampler_start_s"] > 0
    w0, w1 = final_weights(tmp_path / "plain" / "run"), final_weights(tmp_path / "endpoint" / "run")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def _model(run_dir):
    from gspo.models import load_model

    return load_model(str(run_dir / "run" / "model"))[0]


@pytest.mark.slow
@pytest.mark.parametrize("count", [1, 2])
def test_endpoints_one_step_ahead_are_the_in_process_lag_of_one(tmp_path, count):
    # max_staleness 1 asks for step t's rollout as step t - 1 begins, after the weights of step t - 2 were pushed:
    # what sampler_lag 1 simulates with a copy in one process. Seeded, the two runs are the same run (two
    # endpoints: the rows split in two requests, the same tokens).
    common = dict(max_steps=4, learning_rate=1e-2, reward_funcs=[text_hash])
    train(cfg_of(tmp_path, "lag", sampler_lag=1, **common))
    with endpoints(tmp_path, count) as urls:
        train(cfg_of(tmp_path, "async", rollout_endpoints=urls, max_staleness=1, **common))
    lag, real = read_metrics(tmp_path / "lag" / "run"), read_metrics(tmp_path / "async" / "run")
    exact = [{k: v for k, v in computed(r).items() if not k.startswith(("mismatch/", "async/"))} for r in (*lag, *real)]
    assert exact[:4] == exact[4:]
    for a, b in zip(lag, real):  # the lag's copy has requires_grad off: other CPU kernels, mu within 5e-7
        off = {k: (v, b[k]) for k, v in a.items() if k.startswith("mismatch/") and b[k] != pytest.approx(v, rel=1e-5,
                                                                                                          abs=1e-6)}
        assert not off, off
    assert [r["async/staleness_mean"] for r in real] == [0.0, 1.0, 1.0, 1.0]
    assert real[0]["mismatch/kl"] < 1e-10 and all(r["mismatch/kl"] > 1e-3 for r in real[1:])
    w_lag, w_real = final_weights(tmp_path / "lag" / "run"), final_weights(tmp_path / "async" / "run")
    assert all(torch.equal(w_lag[k], w_real[k]) for k in w_lag)


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1])
def test_a_run_on_an_endpoint_stopped_with_rollouts_in_flight_resumes_bit_for_bit(tmp_path, staleness):
    def cfg(name, urls, **kw):
        return cfg_of(tmp_path, name, max_steps=4, rollout_endpoints=urls, max_staleness=staleness, learning_rate=1e-2,
                      reward_funcs=[text_hash], **kw)

    with endpoints(tmp_path) as urls:
        train(cfg("whole", urls))
        train(cfg("parts", urls), callbacks=[lambda step, metrics: "stop" if step == 2 else None])
        pending = torch.load(tmp_path / "parts" / "run" / "checkpoint-2" / "rollouts.pt", weights_only=True)
        assert pending["steps"] == list(range(3, 3 + staleness)) and pending["worker_rng"] is None
        train(cfg("parts", urls, resume_from_checkpoint="latest"))
    whole, parts = read_metrics(tmp_path / "whole" / "run"), read_metrics(tmp_path / "parts" / "run")
    assert [r["step"] for r in parts] == [1, 2, 3, 4]
    assert [computed(r) for r in whole] == [computed(r) for r in parts]
    w, p = final_weights(tmp_path / "whole" / "run"), final_weights(tmp_path / "parts" / "run")
    assert all(torch.equal(w[k], p[k]) for k in w)


@contextlib.contextmanager
def serve_process(tmp_path, *overrides):
    """`gspo serve` of the tiny model (SMALL) in a process of its own (its torch random state its own); its URL."""
    import json
    import subprocess

    from conftest import gspo_argv, gspo_env

    process = subprocess.Popen(gspo_argv("serve", "model=tiny-dense", f"model_overrides={json.dumps(SMALL)}",
                                         *overrides, "--port", "0"), cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                               env=gspo_env(GSPO_ROLLOUT_SECRET=SECRET))
    try:
        line = ""
        while "gspo serve:" not in line:
            line = process.stderr.readline()
            assert line or process.poll() is None, "gspo serve exited before listening"
        yield line.split(" at ")[1].split(" ")[0]
    finally:
        process.kill()
        process.wait(30)


@pytest.mark.slow
def test_an_unseeded_run_on_an_endpoint_resumes_bit_for_bit(tmp_path):
    # Unseeded, rows draw from the endpoint's own random state: the trainer keeps it after every rollout (GET
    # /rng_state), the checkpoint holds the state after the last rollout it keeps, and the resumed run sets it
    # (POST /rng_state) before sampling on: the uninterrupted run, bit for bit (the endpoint in a process of its
    # own: a thread would share the trainer's random state).
    def cfg(name, urls, **kw):
        return cfg_of(tmp_path, name, max_steps=4, seeded_sampling=False, rollout_endpoints=urls, max_staleness=1,
                      learning_rate=1e-2, reward_funcs=[text_hash], **kw)

    with serve_process(tmp_path) as url:
        train(cfg("whole", [url]))
        train(cfg("parts", [url]), callbacks=[lambda step, metrics: "stop" if step == 2 else None])
        pending = torch.load(tmp_path / "parts" / "run" / "checkpoint-2" / "rollouts.pt", weights_only=True)
        assert pending["steps"] == [3] and len(pending["worker_rng"]) == 1
        train(cfg("parts", [url], resume_from_checkpoint="latest"))
    whole, parts = read_metrics(tmp_path / "whole" / "run"), read_metrics(tmp_path / "parts" / "run")
    assert [computed(r) for r in whole] == [computed(r) for r in parts]
    w, p = final_weights(tmp_path / "whole" / "run"), final_weights(tmp_path / "parts" / "run")
    assert all(torch.equal(w[k], p[k]) for k in w)


def test_the_weight_routes_need_the_secret_in_order_and_the_trainer_s_proof(tmp_path, monkeypatch):
    from gspo.rollout.endpoint.wire import WireError, accept_peers, listen

    def post(url, path, body=None, key=SECRET):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(url + path, json=body, headers=headers, timeout=30)

    with endpoints(tmp_path) as (url,):
        url = url[:-3]
        # loopback clients may sample without the secret, never touch the weights
        assert post(url, "/start_weight_update", key=None).status_code == 401
        assert post(url, "/start_weight_update", key="not the secret, but as long").status_code == 401
        answer = post(url, "/start_weight_update")
        assert answer.status_code == 409 and "before init_weight_transfer_engine" in answer.json()["error"]["message"]
        bad = post(url, "/init_weight_transfer_engine", {"init_info": {"backend": "nccl", "host": "127.0.0.1",
                                                                      "port": 1, "rank": 1}})
        assert bad.status_code == 400 and "by backend 'gspo' only" in bad.json()["error"]["message"]
        # a listener that does not know the run's secret: the endpoint refuses to join it, and says so
        listener = listen("127.0.0.1", 0)
        port = listener.getsockname()[1]
        refused = []
        thread = threading.Thread(target=lambda: _accept_quietly(accept_peers, listener, refused))
        thread.start()
        answer = post(url, "/init_weight_transfer_engine",
                      {"init_info": {"backend": "gspo", "host": "127.0.0.1", "port": port, "rank": 1}})
        thread.join(30)
        listener.close()
        assert answer.status_code == 400 and "could not join the trainer" in answer.json()["error"]["message"]
        assert refused and isinstance(refused[0], (WireError, TimeoutError, OSError))
        assert httpx.get(url + "/weight_info", headers={"Authorization": f"Bearer {SECRET}"}).json() == {
            "weight_version": None}
    monkeypatch.delenv("GSPO_ROLLOUT_SECRET")
    with endpoints(tmp_path / "open") as (url,):  # started without a secret: no weight updates at all
        answer = post(url[:-3], "/start_weight_update")
        assert answer.status_code == 403 and "need the run's secret" in answer.json()["error"]["message"]


def _accept_quietly(accept_peers, listener, out: list) -> None:
    try:
        accept_peers(listener, b"another run's secret, 32 chars+", range(1, 2), 10)
    except (TimeoutError, OSError) as err:
        out.append(err)
    else:
        out.append(AssertionError("the endpoint joined a listener without the run's secret"))


def test_an_endpoint_serving_another_model_is_named_before_training(tmp_path):
    with endpoints(tmp_path, model_overrides=TINY_MODEL) as urls:
        with pytest.raises(ValueError, match=r"rollout endpoint http://127\.0\.0\.1:\d+: loading the weights: HTTP "
                                             r"400: update_weights: the trainer sends 24 parameters, this model "
                                             r"takes 13 \(differing: model\.layers\.1\."):
            train(cfg_of(tmp_path, "other", rollout_endpoints=urls))


def test_an_endpoint_that_stops_mid_run_stops_it_with_a_checkpoint(tmp_path):
    from conftest import gspo_serving as serving

    holder = {}

    def stop_after_step_2(step, metrics):
        if step == 2:
            holder["stop"].close()  # the endpoint's HTTP server stops: its next request is refused

    with serving(tiny_cfg(tmp_path / "serve")) as server:
        holder["stop"] = server
        with pytest.raises(TrainingAborted, match=r"rollout endpoint http://127\.0\.0\.1:\d+: [^\n]*\n"
                                                  r"stopped after step 2; checkpoint saved to .*checkpoint-2"):
            train(cfg_of(tmp_path, "run", max_steps=4, rollout_endpoints=[server.url + "/v1"],
                         rollout_timeout_s=20), callbacks=[stop_after_step_2])
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "run")] == [1, 2]
    with endpoints(tmp_path / "again") as urls:  # another endpoint: the run goes on from its checkpoint
        train(cfg_of(tmp_path, "run", max_steps=4, rollout_endpoints=urls, resume_from_checkpoint="latest"))
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "run")] == [1, 2, 3, 4]


def test_a_lost_endpoint_that_comes_back_is_given_the_last_weights_and_asked_again(tmp_path):
    # rollout_endpoint_wait_s: the endpoint stops after step 2 and a new one (the checkpoint's weights, as a restarted
    # process loads them) listens at its URL a second later; the trainer waits, joins it, pushes the weights of its
    # last push and asks again. Seeded, the run is the run without the loss, metric for metric, weight for weight.
    from gspo.apps.serve import serve

    port = free_port()
    serving, stops = [], []

    def start(delay_s: float = 0.0):
        def run():
            time.sleep(delay_s)
            stop = threading.Event()
            stops.append(stop)
            serve(tiny_cfg(tmp_path / f"serve{len(stops)}"), "127.0.0.1", port, ready=serving.append, stop=stop)

        threading.Thread(target=run, daemon=True).start()

    def lose_it_after_step_2(step, metrics):
        if step == 2:
            serving[0].close()  # its next request is refused
            start(delay_s=1.0)

    start()
    while not serving:
        time.sleep(0.05)
    try:
        url = [f"http://127.0.0.1:{port}/v1"]
        train(cfg_of(tmp_path, "lost", max_steps=4, rollout_endpoints=url, rollout_endpoint_wait_s=60),
              callbacks=[lose_it_after_step_2])
    finally:
        for stop in stops:
            stop.set()
    with endpoints(tmp_path / "kept") as urls:
        train(cfg_of(tmp_path, "kept", max_steps=4, rollout_endpoints=urls))
    lost, kept = read_metrics(tmp_path / "lost" / "run"), read_metrics(tmp_path / "kept" / "run")
    assert [r["async/endpoint_restarts"] for r in lost] == [0.0, 0.0, 1.0, 1.0]
    for a, b in zip(lost, kept, strict=True):
        assert {k: v for k, v in computed(a).items() if not k.startswith("async/")} == {
            k: v for k, v in computed(b).items() if not k.startswith("async/")}
    w0, w1 = final_weights(tmp_path / "lost" / "run"), final_weights(tmp_path / "kept" / "run")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


@pytest.mark.slow
def test_episodes_on_an_endpoint_are_the_in_process_episodes_and_resume_bit_for_bit(tmp_path):
    # Multi-turn episodes: the trainer runs the environment, each turn's rows go to the endpoint with their seeds and
    # how many tokens each seed's stream sampled already (seed_offset), so a later turn goes on with the row's own
    # stream as the in-process sampler does: the same run, and resumed with a rollout in flight, the same again.
    from test_episodes import EPISODES

    def cfg(name, urls, **kw):
        return cfg_of(tmp_path, name, **{"max_steps": 3, "rollout_endpoints": urls, "log_mismatch": True,
                                         **EPISODES, **kw})

    train(cfg("here", None))
    with endpoints(tmp_path) as urls:
        train(cfg("there", urls))
        train(cfg("whole", urls, max_staleness=1))
        train(cfg("parts", urls, max_staleness=1), callbacks=[lambda step, metrics: "stop" if step == 1 else None])
        train(cfg("parts", urls, max_staleness=1, resume_from_checkpoint="latest"))
    here, there = (read_metrics(tmp_path / name / "run") for name in ("here", "there"))
    assert [computed(r) for r in here] == [{k: v for k, v in computed(r).items() if not k.startswith("async/")}
                                           for r in there]
    assert all(r["episode/turns_mean"] > 1 for r in here)  # episodes of several turns were sampled
    whole, parts = read_metrics(tmp_path / "whole" / "run"), read_metrics(tmp_path / "parts" / "run")
    assert [computed(r) for r in whole] == [computed(r) for r in parts]
    w, p = final_weights(tmp_path / "whole" / "run"), final_weights(tmp_path / "parts" / "run")
    assert all(torch.equal(w[k], p[k]) for k in w)


def test_a_row_s_stream_goes_on_where_its_earlier_turns_left_it():
    # an endpoint's SeededSampler given a seed_offset draws what the trainer's own one draws after as many steps
    from gspo.rollout.policy import SeededSampler

    scores = torch.randn(2, 50)  # (N, V)
    here = SeededSampler([5, 7], 1.0, "cpu")
    for _ in range(3):
        here(None, scores)
    there = SeededSampler([5, 7], 1.0, "cpu", offsets=[3, 3])
    assert torch.equal(here(None, scores), there(None, scores))
    view = here.rows([1])
    view.advance([4])
    assert here.offsets() == [0, 4] and view.offsets() == [4]  # counted per row, in cells the views share


@pytest.mark.slow
def test_an_moe_endpoint_returns_its_experts_for_rollout_routing_replay(tmp_path):
    # routing_replay=rollout (R3): gspo serve records the experts of every position it fed and returns them per choice
    # in vLLM's format (routed_experts: base64 .npy, (positions, layers, k)); asked for "padded" they include the
    # row's padding in its call, which the trainer's own sampler records too, so laid out on the trainer's rows the
    # record is the in-process one: the seeded run on an endpoint is the in-process run, single-turn and over
    # episodes, and resumes bit for bit with a rollout in flight.
    from test_workers import MOE_R3

    moe = {**MOE_R3, "reward_funcs": [text_hash], "log_mismatch": True}
    episodes = dict(environment="test_episodes:Countdown", max_turns=2, max_episode_tokens=32,
                    max_completion_length=4)
    train(tiny_cfg(tmp_path / "here", max_steps=2, **moe))
    train(tiny_cfg(tmp_path / "episodes_here", max_steps=2, **moe, **episodes))
    with endpoints(tmp_path, model="tiny-moe", model_overrides=SMALL_MOE) as urls:
        train(tiny_cfg(tmp_path / "there", max_steps=2, rollout_endpoints=urls, **moe))
        train(tiny_cfg(tmp_path / "episodes", max_steps=2, rollout_endpoints=urls, **moe, **episodes))

        def cfg(name, **kw):
            return tiny_cfg(tmp_path / name, max_steps=3, rollout_endpoints=urls, max_staleness=1, **moe, **episodes,
                            **kw)

        train(cfg("whole"))
        train(cfg("parts"), callbacks=[lambda step, metrics: "stop" if step == 1 else None])
        (record,) = torch.load(tmp_path / "parts" / "run" / "checkpoint-1" / "rollouts.pt",
                               weights_only=True)["rollouts"]
        assert record["routing"]["indices"].shape[:2] == (2, 8) and record["routing"]["indices"].max() >= 0
        train(cfg("parts", resume_from_checkpoint="latest"))
    for a, b in (("here", "there"), ("episodes_here", "episodes"), ("whole", "parts")):
        ra, rb = ([{k: v for k, v in computed(r).items() if not k.startswith("async/")}
                   for r in read_metrics(tmp_path / name / "run")] for name in (a, b))
        assert ra == rb, (a, b)
        w0, w1 = final_weights(tmp_path / a / "run"), final_weights(tmp_path / b / "run")
        assert all(torch.equal(w0[k], w1[k]) for k in w0), (a, b)
    assert all("moe/expert_change_frac" in r and r["episode/turns_mean"] > 1
               for r in read_metrics(tmp_path / "episodes" / "run"))


def test_the_endpoint_s_connections_send_without_nagle_s_delay(tmp_path):
    # asyncio sets TCP_NODELAY on accepted connections only where the listener was made with proto IPPROTO_TCP;
    # without it every answer after a connection's first waited ~40 ms (a weight update: 150 ms instead of 15)
    with gspo_serving(tiny_cfg(tmp_path)) as server:
        assert server.sock.proto == socket.IPPROTO_TCP
        with socket.create_connection(("127.0.0.1", server.port)) as client:
            client.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b" 200 " in client.recv(4096)


def test_one_request_seeded_s_samples_what_requests_seeded_s_s_plus_1_would(tmp_path):
    with endpoints(tmp_path) as (url,):
        def sample(seed, n, prompt=(1, 2, 3)):
            body = {"model": "tiny-dense", "prompt": [list(prompt)], "n": n, "max_tokens": 6, "seed": seed,
                    "logprobs": 0}
            return [c["token_ids"] for c in httpx.post(url + "/completions", json=body, timeout=60).json()["choices"]]

        together = sample(11, 3)
        assert together == sample(11, 1) + sample(12, 1) + sample(13, 1)
        assert sample([13, 11], 2) == [together[2], together[0]]  # gspo's extension: a seed per choice
        assert len({tuple(t) for t in together}) > 1  # the seeds mattered
        wrong = httpx.post(url + "/completions", json={"prompt": [1, 2], "n": 2, "seed": [1]}, timeout=30)
        assert wrong.status_code == 400 and "one per choice" in wrong.json()["error"]["message"]


@pytest.mark.parametrize(("settings", "message"), [
    ({"rollout_endpoints": ["localhost:8000"]}, r"'localhost:8000' is not an http\(s\)://host:port URL"),
    ({"rollout_endpoints": [1]}, r"1 is not an http\(s\)://host:port URL"),
    ({"rollout_endpoints": ["http://a:1/v1", "http://a:1"]}, r"names an endpoint twice"),
    ({"rollout_endpoints": ["http://a:1"], "rollout_workers": 1}, r"use one of them"),
    ({"rollout_endpoints": ["http://a:1"], "generation_backend": "hf"}, r"generation_backend='hf' choose the "
                                                                        r"trainer's own sampler"),
    ({"rollout_endpoints": ["http://a:1"], "sampler_lag": 1}, r"sampler_lag=1"),
    ({"rollout_endpoints": ["http://a:1"], "agent": "x:y"}, r"rollout_endpoints are not supported with them"),
    ({"max_staleness": 1}, r"set rollout_workers: 1 or rollout_endpoints"),
    ({"rollout_endpoints": ["http://a:1"], "rollout_endpoint_wait_s": -1}, r"rollout_endpoint_wait_s=-1.0 must be"),
    ({"rollout_endpoints": ["http://a:1"], "launcher": "ray"}, r"launcher=ray starts the rollout engines itself"),
    ({"launcher": "slurm"}, r"launcher='slurm' is not one of process, ray"),
    ({"launcher": "ray", "ray_trainers": 0}, r"ray_trainers=0 must be > 0"),
    ({"launcher": "ray", "ray_placement": "pack"}, r"ray_placement='pack' is not one of"),
    ({"launcher": "ray", "ray_engine": "sglang"}, r"ray_engine='sglang' is not one of gspo, vllm"),
    ({"rollout_endpoints": ["http://a:1"], "rollout_weight_transfer": "ipc"},
     r"rollout_weight_transfer='ipc' is not one of gspo, nccl"),
    ({"rollout_weight_transfer": "nccl"}, r"rollout_weight_transfer=nccl is how vllm serve endpoints take weights"),
])
def test_rollout_endpoint_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        make_config(TrainConfig, {"model": "tiny-dense", **settings})


def test_rollout_endpoints_need_the_run_s_secret(monkeypatch):
    monkeypatch.delenv("GSPO_ROLLOUT_SECRET")
    with pytest.raises(ValueError, match="updates the endpoints' weights, which needs the run's secret"):
        make_config(TrainConfig, {"model": "tiny-dense", "rollout_endpoints": ["http://127.0.0.1:1"]})
    monkeypatch.setenv("GSPO_ROLLOUT_SECRET", SECRET)
    cfg = make_config(TrainConfig, {"model": "tiny-dense", "rollout_endpoints": ["http://127.0.0.1:1"],
                                    "max_staleness": 2})
    assert cfg.max_staleness == 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_trainer_processes_on_an_endpoint_match_one(tmp_path, mode):
    # Under torchrun each rank samples its share from the endpoint (seeded per row: the same tokens) and rank 0
    # pushes the weights for all after a barrier; the run is the one-process run on the endpoint, to the float
    # tolerance of test_dist.py (the ranks' requests share the endpoint's generator calls as timing has it).
    import yaml

    from conftest import gspo_env, run_gspo
    from test_dist import assert_same_run

    run = {"model": "tiny-dense", "model_overrides": SMALL, "task": "add3", "max_steps": 3, "num_generations": 4,
           "num_minibatches": 2, "max_completion_length": 8, "learning_rate": 1e-3, "eval_num_prompts": 0,
           "progress": False, "device": "cpu", "seeded_sampling": True, "max_staleness": 1, "distributed": mode}
    with endpoints(tmp_path) as urls:
        (tmp_path / "run.yaml").write_text(yaml.safe_dump({**run, "rollout_endpoints": urls}))
        env = gspo_env(GSPO_ROLLOUT_SECRET=SECRET)
        for name, nproc, batch in (("one", 1, 4), ("two", 2, 2)):
            done = run_gspo("train", "--config", tmp_path / "run.yaml", f"per_device_batch_size={batch}",
                            f"output_dir={name}", cwd=tmp_path, nproc=nproc, env=env, timeout=240)
            assert done.returncode == 0, done.stderr[-3000:]
    # The endpoint's log-probs of a row depend (to ~1e-8) on which rows shared its generator call: timing, not the run.
    assert_same_run(tmp_path / "one", tmp_path / "two", ignore=("async/trainer_busy", "async/worker_busy"),
                    noise=("mismatch/kl", "mismatch/chi2", "mismatch/abs_logp"))
    assert [r["async/staleness_max"] for r in read_metrics(tmp_path / "two")] == [0.0, 1.0, 1.0]


def test_the_retired_rollout_server_says_what_to_run_instead(capsys):
    from gspo.apps.cli import main

    assert main(["rollout-server", "--config", "run.yaml", "--connect", "127.0.0.1:29600", "--rank", "1"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("gspo: error: gspo rollout-server is retired: on each machine that samples, start `gspo "
                           "serve --config") and "rollout_endpoints" in line and "\n" not in line


def test_nccl_weight_transfer_is_refused_where_it_cannot_form_a_group(tmp_path):
    # rollout_weight_transfer=nccl: the trainer is rank 0 of an NCCL group with vllm serve's GPUs; with gspo serve
    # endpoints only there is no such server, and a policy on the CPU has no GPU for its rank: each named at once.
    from gspo.config.sampling import WEIGHT_TRANSFERS
    from gspo.rollout.endpoint.client import TRANSFERS, Endpoints

    assert tuple(TRANSFERS) == WEIGHT_TRANSFERS
    with endpoints(tmp_path) as urls:
        with pytest.raises(ValueError, match=r"rollout_weight_transfer=nccl: .* none of rollout_endpoints is one"):
            Endpoints(urls, SECRET.encode(), timeout_s=30, vocab_size=100, weight_transfer="nccl")
    from gspo.rollout.endpoint.vllm_nccl import check_trainer_device

    with pytest.raises(ValueError, match=r"its policy is on cpu, not a CUDA GPU \(use rollout_weight_transfer=gspo"):
        check_trainer_device(torch.device("cpu"))
    check_trainer_device(torch.device("cuda", 0))  # a device object only: no GPU is touched


def test_the_nccl_messages_are_what_vllm_s_nccl_backend_reads():
    # The init and update messages of vLLM's NCCL backend (its unique-id rendezvous; test_vllm.py parses them with
    # vLLM's own classes) and the tensors in the order the update lists them, cut from gspo's flat buffers.
    import base64

    from gspo.rollout.endpoint.vllm_nccl import init_info, update_info, workers_of
    from gspo.rollout.endpoint.vllm_weights import Layout

    uid = bytes(range(128))
    info = init_info(uid, workers=2)
    assert base64.b64decode(info["nccl_unique_id_b64"]) == uid
    assert (info["rank_offset"], info["world_size"], info["packed"]) == (1, 3, True)
    with pytest.raises(ValueError, match="an ncclUniqueId is 128 bytes, not 4"):
        init_info(b"1234", workers=1)
    flat = {"float32": torch.arange(10.0), "bfloat16": torch.arange(4.0).bfloat16()}
    layout = {"names": ["a", "b", "c"], "dtype_names": ["float32", "bfloat16", "float32"],
              "shapes": [[2, 3], [4], [4]], "trained_only": False}
    assert update_info(layout) == {k: layout[k] for k in ("names", "dtype_names", "shapes")}
    pairs = list(Layout.of(layout).split(flat))
    assert [n for n, _ in pairs] == ["a", "b", "c"]
    assert pairs[0][1].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and pairs[2][1].tolist() == [6.0, 7.0, 8.0, 9.0]
    assert pairs[1][1].dtype == torch.bfloat16 and pairs[1][1].tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match=r"values left in the buffers after the last tensor: \{'float32': 4\}"):
        list(Layout.of({**layout, "shapes": [[2, 3], [4], [0]]}).split(flat))
    with pytest.raises(ValueError, match="c: the float32 buffer ends before it"):
        list(Layout.of({**layout, "shapes": [[2, 3], [4], [5]]}).split(flat))
    assert workers_of({"world_size": 4}, "x") == 4
    with pytest.raises(ValueError, match=r"x: /get_world_size answered \{'world_size': 0\}, not a world size"):
        workers_of({"world_size": 0}, "x")
