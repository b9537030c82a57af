"""`gspo train --config c.yaml launcher=ray`: the run's trainer ranks and rollout engines placed on a Ray cluster.

    ray start --head                         # one machine (others: ray start --address <head>:6379)
    gspo train --config c.yaml launcher=ray ray_trainers=2 rollout_workers=2

One placement group holds a bundle per trainer rank and one per rollout engine (`ray_placement`: PACK or SPREAD;
each bundle 1 CPU, and 1 GPU where the run's device is cuda). Each engine is an actor serving the run's model as
`gspo serve` does (gspo/apps/serve.py; or, with ray_engine=vllm, vLLM's OpenAI server with gspo's weight-transfer
backend) on its node's address, the run's secret required of every client; Ray restarts
a lost one up to `max_engine_restarts` times at the same address, and the trainer (rollout_endpoint_wait_s) joins it
again, gives it the last weights it pushed and asks again what it lost (seeded rows draw the same tokens). Each
trainer rank is an actor that runs `gspo train` as a child process with the environment torchrun would give it
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: rank 0 hosts torch.distributed's store), so DDP and FSDP2
run as under torchrun, with the endpoints as `rollout_endpoints`.

Stopping: Ctrl-C or SIGTERM at the driver, a failed rank or a dead trainer actor stops every rank (SIGTERM: each saves a
checkpoint of the last step it finished, as under torchrun), then kills the engines and removes the placement
group: no actor is left behind. A rank runs under a keeper process: Ray kills a dead actor's children (the keeper),
not theirs, so the rank gets SIGTERM from the kernel as its keeper ends (PR_SET_PDEATHSIG), saves its checkpoint, and
the driver waits for it on its node. Exit status: 0, or 2 with one line naming what ended the run; 130 after Ctrl-C,
143 after SIGTERM (the driver handles both itself).

What Ray itself is trusted with: a Ray cluster runs whatever a client of its ports submits (Ray's own security
model); keep its ports on a private network. gspo sends the run's secret to its actors through Ray (never on a
command line) and each child reads it from its environment.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from gspo.config import RAY_ENGINES, check_implemented

GRACE_S = 120.0  # how long a stopped rank may take to save its checkpoint and end
NAMESPACE = "gspo"  # the run's actors are named "<run id>/engine<e>" and "<run id>/rank<r>" in it
# what the driver's environment says that its actors (and their processes) see too: offline hubs and caches, threads,
# the import path
PASSED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "HF_DATASETS_OFFLINE", "OMP_NUM_THREADS",
              "PYTHONPATH")


def launch(cfg) -> int:
    """Place and run `cfg` (launcher=ray) on the Ray cluster at cfg.ray_address; the exit status."""
    from gspo.rollout.endpoint.server import need

    need("ray", "ray")
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    values, secret = _child_config(cfg)
    ranks, engines = cfg.ray_trainers, cfg.rollout_workers
    run_id = f"{os.getpid()}-{int(time.time())}"  # names this run's engine actors: "<run_id>/engine<e>"
    passed = {name: os.environ[name] for name in PASSED_ENV if name in os.environ}
    ray.init(address=cfg.ray_address, namespace=NAMESPACE, log_to_driver=True, runtime_env={"env_vars": passed},
             **({} if cfg.ray_address else {"include_dashboard": False}))
    gpu = str(cfg.device).startswith("cuda") or (cfg.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    bundle = {"CPU": 1.0, **({"GPU": 1.0} if gpu else {})}
    group, trainers, served, stopped = None, [], [], False
    _SIGNALLED.clear()
    previous = {signum: signal.signal(signum, _interrupted) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        group = placement_group([dict(bundle) for _ in range(ranks + engines)], strategy=cfg.ray_placement)
        ready, _ = _wait(ray, [group.ready()], cfg.ray_start_timeout_s)
        if not ready:
            raise LaunchError(f"launcher=ray: {ranks + engines} bundles of {bundle} ({ranks} trainer rank(s), "
                              f"{engines} rollout engine(s)) could not be placed within ray_start_timeout_s="
                              f"{cfg.ray_start_timeout_s:g} s; the cluster has {ray.cluster_resources()}")

        def place(i: int):
            return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i)

        address = ray.remote(num_cpus=0)(_free_address)
        engine_cls = ray.remote(num_cpus=0, num_gpus=1 if gpu else 0)(RolloutEngine)
        hosts = ray.get([address.options(scheduling_strategy=place(ranks + e)).remote() for e in range(engines)])
        served = [engine_cls.options(scheduling_strategy=place(ranks + e), max_restarts=cfg.max_engine_restarts,
                                     max_task_retries=0, name=f"{run_id}/engine{e}")
                  .remote(values, host, port, secret) for e, (host, port) in enumerate(hosts)]
        urls = _started(ray, [engine.url.remote() for engine in served], cfg.ray_start_timeout_s, "rollout engine")
        if urls:
            values = {**values, "rollout_endpoints": urls, "rollout_workers": 0,
                      "rollout_endpoint_wait_s": cfg.rollout_endpoint_wait_s or 300.0}
        store_host, store_port = ray.get(address.options(scheduling_strategy=place(0)).remote())
        trainer_cls = ray.remote(num_cpus=0, num_gpus=1 if gpu else 0, max_concurrency=3)(TrainerRank)
        nodes = ray.get([address.options(scheduling_strategy=place(r)).remote() for r in range(ranks)])
        for r in range(ranks):
            local = [n[0] for n in nodes[:r]].count(nodes[r][0])
            env = {"RANK": str(r), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(local),
                   "LOCAL_WORLD_SIZE": str([n[0] for n in nodes].count(nodes[r][0])), "MASTER_ADDR": store_host,
                   "MASTER_PORT": str(store_port)} if ranks > 1 else {}
            trainers.append(trainer_cls.options(scheduling_strategy=place(r), max_restarts=0, name=f"{run_id}/rank{r}")
                            .remote(values, {**env, "GSPO_ROLLOUT_SECRET": secret}, os.getcwd()))
        pids = _started(ray, [t.start.remote() for t in trainers], cfg.ray_start_timeout_s, "trainer rank")
        print(f"launcher=ray: {ranks} trainer rank(s), {engines} rollout engine(s)"
              + (f" at {', '.join(urls)}" if urls else "") + f"; output_dir {cfg.output_dir}", file=sys.stderr,
              flush=True)
        status = _watch(ray, trainers, pids, place, cfg.output_dir)
        stopped = True
        return status
    except Interrupted as err:
        print(f"launcher=ray: {err.name}: every rank saves a checkpoint and stops", file=sys.stderr, flush=True)
        return 128 + err.signum
    except LaunchError as err:
        print(err, file=sys.stderr, flush=True)
        return 2
    finally:
        if not stopped and trainers:
            _stop_ranks(ray, trainers)
        for engine in served:
            ray.kill(engine, no_restart=True)
        if group is not None:
            remove_placement_group(group)
        ray.shutdown()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class LaunchError(Exception):
    """What ended a launch, in one line."""


class Interrupted(BaseException):
    """Ctrl-C or SIGTERM at the driver (a BaseException, as KeyboardInterrupt is: code that catches Exception, Ray's
    included, lets it through)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum, self.name = signum, "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


_SIGNALLED: list[int] = []  # what the driver's handler saw, raised as Interrupted where the driver waits


def _interrupted(signum, frame):
    """The driver's SIGINT and SIGTERM handler (even where a non-interactive shell started it with SIGINT ignored):
    the run stops as a whole. It only notes the signal: an exception raised inside Ray's C++ wait is lost to a
    SystemError; `_wait` raises it, between waits of a second."""
    _SIGNALLED.append(signum)


def _wait(ray, refs: list, timeout_s: float, num_returns: int | None = None) -> tuple[list, list]:
    """ray.wait in slices of a second, raising Interrupted once the driver was signalled."""
    deadline, want = time.monotonic() + timeout_s, len(refs) if num_returns is None else num_returns
    while True:
        if _SIGNALLED:
            raise Interrupted(_SIGNALLED[0])
        done, pending = ray.wait(refs, num_returns=want, timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        if len(done) >= want or time.monotonic() >= deadline:
            return done, pending


def _child_config(cfg) -> tuple[dict, str]:
    """(the config the trainer ranks and engines run: every field, launcher=process, the secret left out; the run's
    secret, made for this run where none is set). A ValueError names a value only Python can hold."""
    import json
    import secrets

    from gspo.config import rollout_secret, sampler_sections, to_dict
    from gspo.given import is_marker

    sampling = sampler_sections(cfg)[0]
    secret = (rollout_secret(sampling) or secrets.token_hex(32).encode()).decode()
    values = {**to_dict(cfg), "launcher": "process", "rollout_secret": None, "rollout_secret_file": None}
    for name, value in values.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise ValueError(f"launcher=ray: {name} holds a Python object ({type(value).__name__}); the ranks run "
                             "`gspo train` from the config: name it (a reward as module:function)") from None
        if is_marker(value):
            raise ValueError(f"launcher=ray: {name}={value!r} was given from Python; the ranks run `gspo train` from "
                             "the config: name it by path")
    return values, secret


def _free_address() -> tuple[str, int]:
    """(this node's address as Ray knows it, a port free on it now), run in the bundle whose node it is for."""
    import socket

    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


def _started(ray, refs: list, timeout_s: float, what: str) -> list:
    """Each ref's value; a LaunchError naming the first that failed or did not answer within timeout_s."""
    done, pending = _wait(ray, refs, timeout_s)
    if pending:
        raise LaunchError(f"launcher=ray: {len(pending)} {what}(s) did not start within ray_start_timeout_s="
                          f"{timeout_s:g} s")
    try:
        return ray.get(refs)
    except Exception as err:  # noqa: BLE001 - Ray's errors carry the actor's traceback
        raise LaunchError(f"launcher=ray: a {what} did not start: {_one_line(err)}") from None


def _watch(ray, trainers: list, pids: list, place, output_dir: str) -> int:
    """Wait for every rank's `gspo train`; on the first that fails (or whose actor dies) stop the others. 0, or 2."""
    runs = {t.wait.remote(): r for r, t in enumerate(trainers)}
    failure = None
    while runs and failure is None:
        done, _ = _wait(ray, list(runs), 1.0, num_returns=1)
        for ref in done:
            r = runs.pop(ref)
            try:
                code = ray.get(ref)
            except Exception as err:  # noqa: BLE001 - the actor died (killed, its node lost)
                failure = f"trainer rank {r}'s actor ended ({_one_line(err)})"
                _stop_orphan(ray, place(r), pids[r])
                continue
            if code:
                failure = f"trainer rank {r} exited with status {code} (its output above says why)"
    if failure is None:
        return 0
    _stop_ranks(ray, [trainers[r] for r in runs.values()])
    print(f"launcher=ray: {failure}; the other ranks were stopped (each saved a checkpoint in {output_dir})",
          file=sys.stderr, flush=True)
    return 2


def _stop_ranks(ray, trainers: list) -> None:
    """SIGTERM every rank's `gspo train` (it saves a checkpoint and ends) and wait for them, GRACE_S at most."""
    refs = []
    for t in trainers:
        try:
            refs.append(t.stop.remote())
        except Exception:  # noqa: BLE001 - an actor already gone
            pass
    ray.wait(refs, num_returns=len(refs), timeout=GRACE_S)


def _stop_orphan(ray, strategy, pid: int) -> None:
    """A rank whose actor died: it got SIGTERM from the kernel as its keeper ended; wait for it to end, on its node."""
    ray.wait([ray.remote(num_cpus=0)(_end_process).options(scheduling_strategy=strategy).remote(pid)],
             timeout=GRACE_S + 10)


def _end_process(pid: int) -> bool:
    """Wait for `pid` to end (GRACE_S; then SIGKILL). True where it had already ended."""
    if not _running(pid):
        return True
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        if not _running(pid):
            return False
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    return False


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie that nobody has reaped yet has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _one_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(err).__name__


class TrainerRank:
    """A Ray actor holding one trainer rank: `gspo train` with torchrun's environment, under a keeper process (`keep`):
    Ray kills a dead actor's child processes (SIGKILL: no checkpoint), but not their children."""

    def __init__(self, values: dict, env: dict, cwd: str):
        self.values, self.env, self.cwd, self.keeper, self.rank_pid = values, env, cwd, None, None

    def start(self) -> int:
        """Start the rank's `gspo train` (its config in a file only this user may read); the rank's pid."""
        import subprocess
        import tempfile

        import yaml

        fd, path = tempfile.mkstemp(prefix="gspo-rank-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(self.values, f)
        cwd = self.cwd if os.path.isdir(self.cwd) else None
        read, write = os.pipe()
        self.keeper = subprocess.Popen(
            [sys.executable, "-c", "from gspo.apps.ray_launch import keep; keep()", str(write), sys.executable,
             "-m", "gspo", "train", "--config", path], env={**os.environ, **self.env}, cwd=cwd, pass_fds=(write,),
            preexec_fn=lambda: _die_with_parent(signal.SIGKILL), start_new_session=True)
        os.close(write)
        with os.fdopen(read) as pipe:
            said = pipe.read().strip()
        if not said.isdigit():
            raise RuntimeError(f"launcher=ray: the rank's keeper did not start it (exit status {self.keeper.wait()})")
        self.rank_pid = int(said)
        return self.rank_pid

    def wait(self) -> int:
        return self.keeper.wait()

    def stop(self) -> int | None:
        """SIGTERM the rank (it saves a checkpoint of its last step and ends); its exit status."""
        import subprocess

        if self.keeper is None or self.keeper.poll() is not None:
            return None if self.keeper is None else self.keeper.returncode
        self.keeper.send_signal(signal.SIGUSR1)  # the keeper passes it on as SIGTERM
        try:
            return self.keeper.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            os.kill(self.rank_pid, signal.SIGKILL)
            return self.keeper.wait()


def keep() -> None:
    """A rank's keeper (`python -c ... keep() FD ARGV...`): start ARGV with SIGTERM as its parent-death signal, say its
    pid on FD, pass SIGUSR1 on to it as SIGTERM (its actor's stop), end with its status. Killed with its actor (SIGKILL
    from Ray or from the kernel), it leaves the rank one SIGTERM: the rank saves its checkpoint and ends, waited for by
    the driver (`_stop_orphan`). It ignores SIGTERM and SIGINT: a second SIGTERM would stop the rank at once."""
    import subprocess

    fd, argv = int(sys.argv[1]), sys.argv[2:]
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the driver's to handle
    child = subprocess.Popen(argv, preexec_fn=_die_with_parent)
    signal.signal(signal.SIGUSR1, lambda signum, frame: child.send_signal(signal.SIGTERM))
    with os.fdopen(fd, "w") as pipe:
        pipe.write(str(child.pid))
    code = child.wait()
    sys.exit(128 - code if code < 0 else code)  # killed by signal N: 128 + N, as a shell says it


def _die_with_parent(signum: int = signal.SIGTERM) -> None:
    """In the child before exec: `signum` when the process that started it ends (Linux's PR_SET_PDEATHSIG)."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, int(signum))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the driver's stop still reaches the rank through its actor
        pass


class RolloutEngine:
    """A Ray actor serving the run's model on its node's address, the run's secret required of every client: as
    `gspo serve` does, in this process (ray_engine=gspo), or as vLLM's OpenAI server in a child process with gspo's
    weight-transfer backend (ray_engine=vllm). Restarted by Ray, it serves again at the same address."""

    def __init__(self, values: dict, host: str, port: int, secret: str):
        from gspo.config import TrainConfig, make_config

        os.environ["GSPO_ROLLOUT_SECRET"] = secret
        engine = {**values, "rollout_endpoints": None, "rollout_workers": 0, "max_staleness": 0,
                  "rollout_endpoint_wait_s": 0.0}
        cfg = make_config(TrainConfig, engine)
        self.address = f"http://{host}:{port}/v1"
        self.stop = ENGINES[cfg.ray_engine](cfg, host, port, secret)

    def url(self) -> str:
        return self.address


def _gspo_engine(cfg, host: str, port: int, secret: str):
    """gspo serve on a thread of this actor; returns what stops it."""
    import threading

    from gspo.apps.serve import serve

    stop, started, failed = threading.Event(), threading.Event(), []

    def run():
        try:
            serve(cfg, host, port, ready=lambda server: started.set(), stop=stop)
        except BaseException as err:  # noqa: BLE001 - raised in the actor's constructor below
            failed.append(err)
            started.set()

    threading.Thread(target=run, name="gspo-engine", daemon=True).start()
    started.wait()
    if failed:
        raise failed[0]
    return stop.set


def _vllm_engine(cfg, host: str, port: int, secret: str):
    """vLLM's OpenAI server (this Python's vllm) on host:port with the run's weight-transfer backend
    (rollout_weight_transfer: gspo's, or vLLM's NCCL on the engine's GPU), its RL routes on,
    the secret as its API key and gspo's (in its environment, never on its command line); ends with this actor."""
    import subprocess
    import urllib.request

    memory = (["--kv-cache-memory-bytes", str(cfg.vllm_kv_cache_bytes)] if cfg.vllm_kv_cache_bytes else
              ["--gpu-memory-utilization", str(cfg.vllm_gpu_memory_utilization)] if str(cfg.device) != "cpu" else [])
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(cfg.model), "--host", host,
            "--port", str(port), "--dtype", cfg.dtype, "--seed", str(cfg.seed), "--max-model-len",
            str(cfg.max_prompt_length + cfg.max_completion_length), "--weight-transfer-config",
            json.dumps({"backend": cfg.rollout_weight_transfer}),
            *(["--enforce-eager"] if str(cfg.device) == "cpu" else []), *memory]
    server = subprocess.Popen(argv, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", "GSPO_ROLLOUT_SECRET": secret,
                                         "VLLM_API_KEY": secret}, preexec_fn=lambda: _die_with_parent(signal.SIGKILL))
    deadline = time.monotonic() + cfg.ray_start_timeout_s
    request = urllib.request.Request(f"http://{host}:{port}/v1/models", headers={"Authorization": f"Bearer {secret}"})
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"launcher=ray: vllm serve of {cfg.model} exited with status {server.returncode} "
                               "(its output above says why)")
        try:
            with urllib.request.urlopen(request, timeout=2):
                return server.terminate
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"launcher=ray: vllm serve of {cfg.model} did not answer within "
                                   f"ray_start_timeout_s={cfg.ray_start_timeout_s:g} s") from None
            time.sleep(1)


ENGINES = {"gspo": _gspo_engine, "vllm": _vllm_engine}  # ray_engine: how an engine actor serves
check_implemented(RAY_ENGINES, ENGINES, "gspo.apps.ray_launch.ENGINES")


__all__ = ["launch"]
