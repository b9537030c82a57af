"""launcher=ray (gspo/apps/ray_launch.py) on Ray's own test cluster (ray.cluster_utils.Cluster) on this machine: the
seeded run under Ray is the run under torchrun, a killed engine actor is restarted and the run goes on as if nothing
happened, a killed trainer actor stops the run with a checkpoint, and no actor of a run outlives it."""

import signal
import subprocess
import time

import pytest
import yaml

pytest.importorskip("ray")
pytest.importorskip("fastapi")

from conftest import SMALL, gspo_argv, gspo_env, logged_steps, read_metrics, run_gspo  # noqa: E402
from test_dist import assert_same_run  # noqa: E402
from test_rollout_endpoints import endpoints  # noqa: E402

SECRET = "a secret of this test's run, 32+"
RUN = {"model": "tiny-dense", "model_overrides": SMALL, "task": "add3", "max_steps": 3, "num_generations": 4,
       "num_minibatches": 2, "max_completion_length": 8, "learning_rate": 1e-3, "eval_num_prompts": 0,
       "progress": False, "device": "cpu", "seeded_sampling": True, "max_staleness": 1}
BUSY = ("async/trainer_busy", "async/worker_busy", "async/endpoint_restarts")
NOISE = ("mismatch/kl", "mismatch/chi2", "mismatch/abs_logp")  # the endpoint's batching, to ~1e-8 (test_dist.py)


@pytest.fixture(autouse=True)
def run_secret(monkeypatch):
    monkeypatch.setenv("GSPO_ROLLOUT_SECRET", SECRET)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    head = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    yield head
    head.shutdown()


@pytest.fixture
def connected(cluster):
    """This test's process as a client of the cluster (to find and kill the run's actors)."""
    import ray

    ray.init(address=cluster.address, namespace="gspo", log_to_driver=False)
    yield ray
    ray.shutdown()


def write_run(tmp_path, **extra) -> None:
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({**RUN, **extra}))


def ray_argv(tmp_path, cluster, *overrides) -> list:
    return gspo_argv("train", "--config", tmp_path / "run.yaml", "launcher=ray", f"ray_address={cluster.address}",
                     *overrides)


def run_actors(ray) -> list[str]:
    """The names of the named actors alive in namespace gspo (a run's engines and ranks)."""
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "gspo"]


def wait_for_step(run_dir, step: int, process, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not logged_steps(run_dir) or logged_steps(run_dir)[-1] < step:
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no step {step} within {timeout_s} s"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_seeded_run_under_ray_is_the_run_under_torchrun(tmp_path, cluster, mode):
    # torchrun: two ranks on a gspo serve endpoint; Ray: two trainer actors (torch.distributed as torchrun sets it
    # up) and one engine actor. The same seeded run: metric for metric, weight for weight.
    write_run(tmp_path, distributed=mode, per_device_batch_size=2)
    env = gspo_env(GSPO_ROLLOUT_SECRET=SECRET)
    with endpoints(tmp_path) as urls:
        done = run_gspo("train", "--config", tmp_path / "run.yaml", f"rollout_endpoints={urls}",
                        "output_dir=torchrun", cwd=tmp_path, nproc=2, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run(ray_argv(tmp_path, cluster, "ray_trainers=2", "rollout_workers=1", "output_dir=ray"),
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "launcher=ray: 2 trainer rank(s), 1 rollout engine(s) at http://" in done.stderr
    assert_same_run(tmp_path / "torchrun", tmp_path / "ray", ignore=BUSY, noise=NOISE)


GATE = '''import os
import time

calls = 0


def digit(prompts, completions, **_):
    """1 where the completion starts with a digit. Where ./armed exists, the third call writes ./paused and waits
    for ./go: the test kills the engine while the trainer is held here, steps before the run's end."""
    global calls
    calls += 1
    if calls == 3 and os.path.exists("armed"):
        open("paused", "w").close()
        while not os.path.exists("go"):
            time.sleep(0.1)
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]
'''


@pytest.mark.slow
def test_a_killed_engine_actor_is_restarted_and_the_run_goes_on(tmp_path, connected):
    # Ray restarts the engine at its address (max_engine_restarts); the trainer waits for it, pushes the weights it
    # lost and asks again: seeded, the run is the run without the loss. Then no actor of the run is left. The engine
    # is killed while the trainer waits in a reward function (GATE), so the kill cannot come after the run's last use
    # of the engine, however slow the machine.
    ray = connected
    cluster_address = ray.get_runtime_context().gcs_address
    write_run(tmp_path, max_steps=5, per_device_batch_size=4, reward_funcs=["format", "gate_mod:digit"])
    (tmp_path / "gate_mod.py").write_text(GATE)
    env = gspo_env(GSPO_ROLLOUT_SECRET=SECRET)
    argv = gspo_argv("train", "--config", tmp_path / "run.yaml", "launcher=ray", f"ray_address={cluster_address}",
                     "rollout_workers=1")
    kept = subprocess.run([*argv, "output_dir=kept"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=400)
    assert kept.returncode == 0, kept.stderr[-3000:]
    assert run_actors(ray) == []
    (tmp_path / "armed").touch()
    process = subprocess.Popen([*argv, "output_dir=lost"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "paused").exists():
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the reward function did not pause the run within 240 s"
            time.sleep(0.2)
        (name,) = [n for n in run_actors(ray) if n.endswith("/engine0")]
        ray.kill(ray.get_actor(name, namespace="gspo"), no_restart=False)
        (tmp_path / "go").touch()
        _, err = process.communicate(timeout=400)
    finally:
        process.kill()
    assert process.returncode == 0, err[-3000:]
    assert "is back after" in err and "asking again" in err, err[-3000:]
    lost = read_metrics(tmp_path / "lost")
    assert lost[-1]["async/endpoint_restarts"] == 1.0
    assert_same_run(tmp_path / "kept", tmp_path / "lost", ignore=BUSY, noise=NOISE)
    assert run_actors(ray) == []


@pytest.mark.slow
@pytest.mark.parametrize("how", ["trainer actor killed", "Ctrl-C", "SIGTERM"])
def test_a_run_stopped_under_ray_saves_a_checkpoint_and_leaves_no_actor(tmp_path, connected, how):
    # A trainer actor killed (its `gspo train` gets SIGTERM from the kernel as its keeper ends), or Ctrl-C or SIGTERM
    # at the driver: the rank saves a checkpoint of its last step and ends, the engines are killed, nothing is left.
    # The driver starts with SIGINT ignored, as a non-interactive shell starts a background job (CI's): it handles
    # SIGINT itself all the same.
    ray = connected
    cluster_address = ray.get_runtime_context().gcs_address
    write_run(tmp_path, max_steps=200, per_device_batch_size=4, save_steps=1000)
    env = gspo_env(GSPO_ROLLOUT_SECRET=SECRET)
    argv = gspo_argv("train", "--config", tmp_path / "run.yaml", "launcher=ray", f"ray_address={cluster_address}",
                     "rollout_workers=1", "output_dir=out")
    process = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        wait_for_step(tmp_path / "out", 2, process)
        if how in ("Ctrl-C", "SIGTERM"):
            process.send_signal(signal.SIGINT if how == "Ctrl-C" else signal.SIGTERM)
        else:
            (rank,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("/rank0")]
            ray.kill(ray.get_actor(rank["name"], namespace="gspo"))
        _, err = process.communicate(timeout=300)
    finally:
        process.kill()
    if how in ("Ctrl-C", "SIGTERM"):
        assert process.returncode == (130 if how == "Ctrl-C" else 143), err[-3000:]
        assert f"launcher=ray: {how}: every rank saves a checkpoint and stops" in err
    else:
        assert process.returncode == 2, err[-3000:]
        assert "launcher=ray: trainer rank 0's actor ended" in err
    checkpoints = sorted((tmp_path / "out").glob("checkpoint-*"))
    assert checkpoints, err[-3000:]
    assert int(checkpoints[-1].name.split("-")[1]) >= 2
    assert run_actors(ray) == []


def test_launcher_ray_is_refused_where_it_cannot_run(tmp_path):
    from gspo.apps.ray_launch import _child_config
    from gspo.config import TrainConfig, make_config
    from gspo.trainer import train

    cfg = make_config(TrainConfig, {"model": "tiny-dense", "launcher": "ray"})
    with pytest.raises(ValueError, match=r"launcher=ray: `gspo train --config \.\.\.` places the run's processes"):
        train(cfg)
    cfg = make_config(TrainConfig, {"model": "tiny-dense", "launcher": "ray", "reward_funcs": [lambda p, c: [0.0]]})
    with pytest.raises(ValueError, match=r"launcher=ray: reward_funcs holds a Python object"):
        _child_config(cfg)
