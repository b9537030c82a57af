"""Rollout workers: sampling in processes of their own (issue 34, first part: one worker, no staleness yet).

`RemoteSampler` answers the Sampler plug's calls (`sample`, `sync`, `close`) with worker processes that
each hold their own copy of the policy. Prompts go out, a Rollout comes back, tagged with the policy
version that sampled it; after each update round `sync` broadcasts the policy's weights to every worker
over a torch.distributed gloo group of the sampler's own (not the default group: torchrun's, if any, is
left alone), and each worker answers a probe (the log-probs of a fixed sequence) that must match the
trainer's, as the vllm backend's push is checked. Requests and rollouts travel over the same group as
pickled uint8 tensors (what torch.distributed's send_object_list does).

A worker that dies or stops answering is found within `rollout_timeout_s` and named in one line; the
workers are daemon processes, so they end with the trainer.
"""

from __future__ import annotations

import copy
import datetime
import pickle
import socket
import time
import traceback

import torch

TAG_HEADER, TAG_BODY = 0, 1  # a message is its length (int64), then its bytes
PROBE_LENGTH = 16  # tokens of the probe sequence every weight broadcast is checked on


def _group(rank: int, world: int, port: int, timeout_s: float):
    """A gloo group of the trainer (rank 0) and its workers, built from a TCPStore on localhost."""
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
    return ProcessGroupGloo(store, rank, world, timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def send(group, obj, dst: int) -> int:
    """Send a picklable object to rank `dst`; returns its size in bytes."""
    body = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)  # (n,)
    group.send([torch.tensor([body.numel()], dtype=torch.int64)], dst, TAG_HEADER).wait()
    group.send([body], dst, TAG_BODY).wait()
    return body.numel()


def recv(group, src: int):
    """The next object rank `src` sent."""
    size = torch.zeros(1, dtype=torch.int64)
    group.recv([size], src, TAG_HEADER).wait()
    body = torch.empty(int(size), dtype=torch.uint8)  # (n,)
    group.recv([body], src, TAG_BODY).wait()
    return pickle.loads(body.numpy().tobytes())


def flat_weights(model) -> dict[torch.dtype, torch.Tensor]:
    """The parameters of `model` (tied ones once) flattened into one buffer per dtype."""
    by_dtype: dict[torch.dtype, list] = {}
    for p in model.parameters():
        by_dtype.setdefault(p.dtype, []).append(p.detach().reshape(-1))
    return {dtype: torch.cat(parts) for dtype, parts in by_dtype.items()}


def load_flat_weights(model, flat: dict[torch.dtype, torch.Tensor]) -> None:
    """Copy buffers of `flat_weights` back into `model`'s parameters, in the same order."""
    offsets = dict.fromkeys(flat, 0)
    with torch.no_grad():
        for p in model.parameters():
            start = offsets[p.dtype]
            p.copy_(flat[p.dtype][start : start + p.numel()].view_as(p))
            offsets[p.dtype] = start + p.numel()


def probe_logprobs(model, vocab_size: int) -> torch.Tensor:
    """(L-1,) log-probs of a fixed random sequence under `model`: the weights' fingerprint after a broadcast."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (1, PROBE_LENGTH), generator=g)  # (1, L)
    with torch.no_grad():
        logits = model(input_ids=ids.to(next(model.parameters()).device)).logits.float()  # (1, L, V)
    return torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None].to(logits.device))[:, 0].cpu()


def _worker_main(rank: int, world: int, port: int, timeout_s: float, model, tokenizer, options: dict) -> None:
    """A rollout worker: sample on request, load broadcast weights, until told to stop."""
    from gspo.rollout.sampling import generate, row_seeds

    torch.set_num_threads(options.pop("threads"))
    group = _group(rank, world, port, timeout_s)
    model.eval()
    version = 0
    seeded, seed = options.pop("seeded"), options.pop("seed")
    if not seeded:
        torch.manual_seed(seed + 1000 * rank)  # its own stream, reproducible for a given seed
    while True:
        request = recv(group, 0)
        kind = request[0]
        if kind == "stop":
            return
        try:
            if kind == "weights":
                _, version, shapes = request
                flat = {dtype: torch.empty(n, dtype=dtype) for dtype, n in shapes.items()}
                for dtype in shapes:
                    group.broadcast(flat[dtype], 0).wait()
                load_flat_weights(model, flat)
                send(group, ("probe", probe_logprobs(model, options["vocab_size"])), 0)
            elif kind == "sample":
                _, prompts, step, first_row = request
                G = options["num_generations"]
                rollout = generate(model, tokenizer, prompts, G, **options["generate"],
                                   row_seeds=row_seeds(seed, step, first_row, len(prompts) * G) if seeded else None)
                send(group, ("rollout", version, rollout), 0)
        except Exception:  # noqa: BLE001  reported to the trainer, which stops the run naming this worker
            send(group, ("error", traceback.format_exc(limit=4)), 0)


class RemoteSampler:
    """The Sampler plug with its sampling in worker processes (`rollout_workers: N`).

    Built from the policy as training starts: each worker gets a copy of it, then every `sync(policy)`
    broadcasts the updated weights (`time/sync_s`, `async/sync_bytes`) and checks them on a probe.
    `sample(prompts, step, first_row)` sends the prompts to the worker and waits for its rollout (one
    worker so far); with seeded sampling the tokens are those the in-process sampler draws.
    """

    def __init__(self, model, tokenizer, cfg, *, seeded: bool, workers: int, timeout_s: float = 300.0,
                 with_logprobs: bool = False):
        import torch.multiprocessing as mp

        from gspo.config import SamplingSettings, section
        from gspo.rollout.sampling import sampling_options

        if workers != 1:
            raise ValueError(f"rollout_workers={workers}: one worker is supported so far")
        s = section(cfg, SamplingSettings)
        self.name, self.reason = "workers", f"sampler: {workers} rollout worker process(es), gloo weight broadcast"
        self.workers, self.timeout_s, self.version, self.synced = workers, timeout_s, 0, False
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        # the trainer's thread count: the same kernels split the same way, so mu is bitwise the in-process one
        options = {"threads": torch.get_num_threads(), "seeded": seeded, "seed": cfg.seed,
                   "num_generations": cfg.num_generations, "vocab_size": self.vocab_size,
                   "generate": {**sampling_options(s), "with_logprobs": with_logprobs,
                                "backend": s.generation_backend}}
        port, world = _free_port(), workers + 1
        ctx = mp.get_context("spawn")
        t0 = time.perf_counter()
        self.processes = []
        for rank in range(1, world):
            copied = copy.deepcopy(model).cpu()  # its own weights (a CPU copy travels through shared memory)
            process = ctx.Process(target=_worker_main, name=f"gspo-rollout-worker-{rank}", daemon=True,
                                  args=(rank, world, port, timeout_s, copied, tokenizer, dict(options)))
            process.start()
            self.processes.append(process)
        self.group = self._call(lambda: _group(0, world, port, timeout_s), "joining the sampler's group")
        self.start_s = time.perf_counter() - t0

    def _call(self, fn, what: str):
        """`fn()`; a failed collective becomes one line naming the worker that died or went silent."""
        try:
            return fn()
        except RuntimeError as err:  # gloo: a peer closed the connection, or the timeout passed
            dead = [f"rollout worker {i + 1} (pid {p.pid}) exited with status {p.exitcode}"
                    for i, p in enumerate(self.processes) if not p.is_alive()]
            why = "; ".join(dead) or f"no answer within rollout_timeout_s={self.timeout_s:g}"
            raise ValueError(f"{what}: {why} ({str(err).splitlines()[0][:160]})") from None

    def _answer(self, rank: int, kind: str, what: str):
        message = self._call(lambda: recv(self.group, rank), what)
        if message[0] == "error":
            raise ValueError(f"{what}: rollout worker {rank} failed:\n{message[1]}")
        assert message[0] == kind, message[0]
        return message[1:]

    def sample(self, prompts: list[str], step: int, first_row: int):
        """This step's rollout, sampled by the worker with the weights of the latest `sync` (one worker so far:
        joining several workers' rollouts into one padded layout is the next part)."""
        self._call(lambda: send(self.group, ("sample", prompts, step, first_row), 1), f"step {step}: sending prompts")
        version, rollout = self._answer(1, "rollout", f"step {step}: sampling")
        assert version == self.version, (version, self.version)  # synchronous so far: never stale
        return rollout

    def sync(self, policy) -> dict:
        t0 = time.perf_counter()
        flat = flat_weights(policy)
        self.version += 1
        shapes = {dtype: t.numel() for dtype, t in flat.items()}
        for rank in range(1, self.workers + 1):
            self._call(lambda r=rank: send(self.group, ("weights", self.version, shapes), r), "sending weights")
        for t in flat.values():
            self._call(lambda t=t: self.group.broadcast(t, 0).wait(), "broadcasting weights")
        own = probe_logprobs(policy, self.vocab_size)
        for rank in range(1, self.workers + 1):
            (theirs,) = self._answer(rank, "probe", "checking the broadcast weights")
            diff = (theirs - own).abs().max().item()
            if not diff <= 1e-5:
                raise ValueError(f"rollout worker {rank}: the broadcast weights give log-probs {diff:.3g} away from "
                                 "the policy's on the probe")
        stats = {"time/sync_s": time.perf_counter() - t0,
                 "async/sync_bytes": float(sum(t.numel() * t.element_size() for t in flat.values()))}
        if not self.synced:
            stats["time/sampler_start_s"], self.synced = self.start_s, True
        return stats

    def close(self) -> None:
        for rank, process in enumerate(self.processes, 1):
            if process.is_alive():
                try:
                    send(self.group, ("stop",), rank)
                except RuntimeError:
                    pass
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def build_sampler(model, tokenizer, cfg, *, seeded: bool, distributed: bool, recorder=lambda model: None,
                  records: bool = False):
    """The run's Sampler plug: in the trainer's process (`gspo.rollout.Sampler`), or `RemoteSampler` with
    rollout_workers > 0 (one process, the policy's own weights, no expert record: refused otherwise)."""
    from gspo.lora import is_peft
    from gspo.rollout.sampling import Sampler, keeps_sampler_logprobs

    if not cfg.rollout_workers:
        return Sampler(model, tokenizer, cfg, seeded=seeded, recorder=recorder, records=records)
    if distributed:
        raise ValueError("rollout_workers: not under torchrun yet (each rank would need its own workers)")
    if records:
        raise ValueError("rollout_workers: routing_replay=rollout needs the sampler's expert record, which a worker "
                         "does not return yet; use routing_replay=old_policy")
    if is_peft(model):
        raise ValueError("rollout_workers: not with LoRA yet (the worker would need the adapters' merged weights)")
    return RemoteSampler(model, tokenizer, cfg, seeded=seeded, workers=cfg.rollout_workers,
                         timeout_s=cfg.rollout_timeout_s, with_logprobs=keeps_sampler_logprobs(cfg))


__all__ = ["RemoteSampler", "build_sampler", "flat_weights", "load_flat_weights", "probe_logprobs", "recv", "send"]
