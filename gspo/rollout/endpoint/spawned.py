"""Rollout workers (`rollout_workers: N`): `gspo serve` endpoints the trainer starts itself, one process each, on
loopback, and samples from as from any rollout endpoints (gspo/rollout/endpoint/rollouts.py).

Each process holds a copy of the policy (under fsdp, whose trainer holds a shard only: the model loaded as the
config names it; its weights then come from the first push), builds the trainer's own Sampler plug from the
trainer's SamplingSettings, EpisodeSettings and SamplerShape (the policy itself, a low-precision copy of it, or an
engine such as vllm), and serves it. The secret it requires of every request is one only the trainer and its
children know: it travels in the spawn pipe, never on a socket, and the endpoint answers nobody without it, loopback
included. The same pipe says when the endpoint listens (its port) or why it could not start; once the trainer ends
(the pipe closes), its endpoints end too.
"""

from __future__ import annotations

import copy
import os
import secrets
import threading
import time
import traceback

START_TIMEOUT_S = 120.0  # the least time an endpoint process is given to start
# what torchrun sets in its ranks' environment, which a spawned endpoint inherits and must not read as its own
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def spawn_endpoints(model, tokenizer, sections: tuple, *, count: int, seeded: bool, load: tuple | None,
                    device: str, rows: int, timeout_s: float) -> tuple[list, list, list[str], bytes]:
    """Start `count` endpoint processes; (processes, their pipes, their URLs, the secret). `sections`: the trainer's
    (SamplingSettings, EpisodeSettings, SamplerShape); `load`: (ModelSettings, LoraSettings) to load the model by
    where the trainer's copy cannot be handed over (fsdp); `rows`: the most completions one request brings (each is
    sampled in one generator call, as the trainer's own process would)."""
    import torch
    import torch.multiprocessing as mp

    secret = secrets.token_hex(32).encode()
    context = mp.get_context("spawn")
    processes, pipes = [], []
    try:
        for rank in range(1, count + 1):
            ours, theirs = context.Pipe()
            copied = None if load else copy.deepcopy(model).cpu()  # the architecture (through shared memory)
            process = context.Process(target=_endpoint_main, name=f"gspo-rollout-worker-{rank}", daemon=True,
                                      args=(theirs, secret, copied, tokenizer, load, sections, torch.get_num_threads(),
                                            device, seeded, rows))
            process.start()
            theirs.close()
            processes.append(process)
            pipes.append(ours)
        urls = [f"http://127.0.0.1:{_started(i + 1, p, pipe, timeout_s)}/v1"
                for i, (p, pipe) in enumerate(zip(processes, pipes))]
    except BaseException:
        stop_endpoints(processes, pipes, wait_s=1)
        raise
    return processes, pipes, urls, secret


def _started(rank: int, process, pipe, timeout_s: float) -> int:
    """The port endpoint `rank` listens on, once it says so; a ValueError naming it if it cannot start."""
    from gspo.rollout.endpoint.client import EndpointLost

    deadline = time.monotonic() + max(timeout_s, START_TIMEOUT_S)
    while not pipe.poll(0.1):
        if not process.is_alive():
            raise EndpointLost(f"starting the rollout workers: rollout worker {rank} (pid {process.pid}) exited with "
                               f"status {process.exitcode}")
        if time.monotonic() > deadline:
            raise EndpointLost(f"starting the rollout workers: rollout worker {rank} did not start within "
                               f"{max(timeout_s, START_TIMEOUT_S):g} s")
    try:
        kind, value = pipe.recv()
    except EOFError:
        process.join(5)
        raise EndpointLost(f"starting the rollout workers: rollout worker {rank} (pid {process.pid}) exited with "
                           f"status {process.exitcode}") from None
    if kind != "ready":
        raise EndpointLost(f"starting the rollout workers: rollout worker {rank} failed:\n{value}")
    return value


def stop_endpoints(processes: list, pipes: list, wait_s: float = 10) -> None:
    """End the endpoints: their pipes close (each stops serving), then whatever has not ended is killed."""
    for pipe in pipes:
        pipe.close()
    for process in processes:
        process.join(timeout=wait_s)
        if process.is_alive():
            process.kill()
            process.join(timeout=wait_s)


def dead(processes: list) -> list[str]:
    """`rollout worker i (pid p) exited with status s` of each endpoint process that has ended."""
    return [f"rollout worker {i + 1} (pid {p.pid}) exited with status {p.exitcode}"
            for i, p in enumerate(processes) if not p.is_alive()]


def _endpoint_main(pipe, secret: bytes, model, tokenizer, load: tuple | None, sections: tuple, threads: int,
                   device: str, seeded: bool, rows: int) -> None:
    """An endpoint process: build the trainer's Sampler, serve it on loopback (the secret required of everyone),
    say the port in the pipe; serve until the pipe closes."""
    for name in TORCHRUN_ENV:  # spawned by a torchrun rank: a process on its own, not one of its ranks
        os.environ.pop(name, None)
    import torch

    from gspo.plugs.precision import forward_precision
    from gspo.rollout.endpoint.server import Server, endpoint_of
    from gspo.rollout.sampler import Sampler

    try:
        torch.set_num_threads(threads)  # the trainer's: the same kernels split the same way, mu bitwise its own
        sampling, episodes, shape = sections
        if model is None:
            from gspo.rollout.endpoint.weights import load_worker_model

            _, model, tokenizer = load_worker_model(*load)
        model = model.to(device).eval()  # one GPU: shared by the trainer and its workers
        sampler = Sampler(model, tokenizer, sampling, episodes, shape, seeded=seeded)
        autocast = forward_precision(shape.autocast == "bf16", device, shape.autocast == "fp16")  # the trainer's
        endpoint = endpoint_of(sampler, model, tokenizer, secret, name="gspo-rollout-worker", rows=rows,
                               max_tokens=sampling.max_completion_length, template_kwargs=sampler.template_kwargs,
                               tool_style=episodes.tool_call_style, autocast=autocast)
        server = Server(endpoint, "127.0.0.1", 0, secret=secret, open_loopback=False)
    except Exception:  # noqa: BLE001  (no engine, a model it cannot run): the trainer says why and stops
        pipe.send(("error", traceback.format_exc(limit=4)))
        return
    stop = threading.Event()

    def watch():  # the trainer's end of the pipe closes when it ends: so does this endpoint
        try:
            pipe.recv()
        except (EOFError, OSError):
            pass
        stop.set()

    threading.Thread(target=watch, daemon=True, name="gspo-trainer-watch").start()
    pipe.send(("ready", server.port))
    try:
        endpoint.engine.serve(stop)
    finally:
        server.close()
        sampler.close()


__all__ = ["START_TIMEOUT_S", "TORCHRUN_ENV", "dead", "spawn_endpoints", "stop_endpoints"]
