"""Rollout workers: sampling in processes of their own, overlapped with training (`rollout_workers`,
`max_staleness`; docs/samplers.md).

`RemoteSampler` answers the Sampler plug's calls with worker processes that each hold their own copy of
the policy. `request(prompts, step, first_row)` hands each worker a contiguous share of a step's prompts
and returns at once; `receive(step)` waits for the shares and joins them into one padded Rollout, tagged
with the version of the weights that sampled it (the number of `sync`s before it). After each update
round `sync` broadcasts the policy's weights over a torch.distributed gloo group of the sampler's own
(not the default group: torchrun's, if any, is left alone) and each worker answers a probe (the
log-probs of a fixed sequence) that must match the trainer's, as the vllm backend's push is checked.
Requests and rollouts travel over the same group as pickled uint8 tensors (what torch.distributed's
send_object_list does), posted without waiting: a gloo send completes only once the peer receives it,
and two processes that each wait on a send before receiving would wait forever. A worker handles its
messages in the order they were sent, so which weights sample which step is fixed by the order of the
trainer's calls, never by timing (gspo/rollout/feed.py).

A rollout carries what the worker's sampler recorded: token ids, mu and, for routing_replay=rollout, the
experts it chose (Rollout.routing). With LoRA only the adapters travel after the first broadcast. Under
torchrun every trainer rank has workers of its own for its share of the batch (fsdp: the ranks gather each
parameter whole once, then each broadcasts to its workers).

A worker that dies, stops answering within `rollout_timeout_s` or fails (one that cannot build its sampler
says why in its first answer) is named in one line (`RolloutWorkerLost`); the trainer then stops with a
checkpoint. Workers are daemon processes: they end with the trainer.
"""

from __future__ import annotations

import copy
import datetime
import os
import pickle
import socket
import time
import traceback
from dataclasses import fields
from types import SimpleNamespace

import torch

from gspo.rollout.batch import join_rollouts

TAG_HEADER, TAG_BODY = 0, 1  # a message is its length (int64), then its bytes
PROBE_LENGTH = 16  # tokens of the probe sequence every weight broadcast is checked on
START_TIMEOUT_S = 120.0  # the least time a worker is given to start and join the group
KEEP_RNG_STATES = 16  # the workers' random state after each of this many latest rollouts (for checkpoints)
# what torchrun sets in its ranks' environment, which a spawned worker inherits and must not read as its own
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID")
# the fields outside SamplingSettings that gspo.rollout.Sampler reads (its batch size, seed, and whether mu is kept)
SAMPLER_READS = ("num_generations", "seed", "per_device_batch_size", "use_sampler_logprobs", "rollout_correction",
                 "log_mismatch", "chat_template_kwargs", "sandbox")


class RolloutWorkerLost(ValueError):
    """A rollout worker died, went silent or failed; the message names it."""


def _group(rank: int, world: int, host: str, port: int, timeout_s: float):
    """A gloo group of the trainer (rank 0) and its workers, built from a TCPStore the trainer serves at
    host:port. Joining may take START_TIMEOUT_S at least (a worker imports torch first); messages wait
    `timeout_s`."""
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    start = datetime.timedelta(seconds=max(timeout_s, START_TIMEOUT_S))
    store = TCPStore(host, port, world, rank == 0, timeout=start)
    return ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=timeout_s))


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port"; a ValueError naming the setting otherwise."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rollout_address={address!r}: expected host:port (e.g. 10.0.0.5:29600)")
    return host, int(port)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Posted:
    """Messages sent and not yet received by their peer: their buffers are kept alive until then."""

    def __init__(self):
        self.items: list = []

    def post(self, group, obj, dst: int) -> list:
        """Send a picklable object to rank `dst` without waiting; returns the sends' Work objects."""
        body = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)  # (n,)
        header = torch.tensor([body.numel()], dtype=torch.int64)  # (1,)
        works = [group.send([header], dst, TAG_HEADER), group.send([body], dst, TAG_BODY)]
        self.items = [item for item in self.items if not all(w.is_completed() for w in item[0])]
        self.items.append((works, (header, body)))
        return works


def recv(group, src: int):
    """The next object rank `src` posted."""
    size = torch.zeros(1, dtype=torch.int64)
    group.recv([size], src, TAG_HEADER).wait()
    body = torch.empty(int(size), dtype=torch.uint8)  # (n,)
    group.recv([body], src, TAG_BODY).wait()
    return pickle.loads(body.numpy().tobytes())


def sent_parameters(model, trained_only: bool) -> list:
    """The parameters a weight broadcast carries, in order (tied ones once): all of them, or (`trained_only`, every
    broadcast after the first) those the optimizer changes: with LoRA the adapters, the frozen base went once."""
    return [p for p in model.parameters() if p.requires_grad or not trained_only]


def flat_weights(model, trained_only: bool = False) -> dict[torch.dtype, torch.Tensor]:
    """The parameters of `model` (`sent_parameters`) flattened into one CPU buffer per dtype (gloo sends from
    the CPU). Under fsdp each parameter is gathered whole first, parameter by parameter: a collective, so every
    rank calls this at the same point (each then broadcasts to its own workers)."""
    by_dtype: dict[torch.dtype, list] = {}
    for p in sent_parameters(model, trained_only):
        whole = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()  # fsdp: a DTensor shard
        by_dtype.setdefault(p.dtype, []).append(whole.reshape(-1).cpu())
    return {dtype: torch.cat(parts) for dtype, parts in by_dtype.items()}


def on_device(rollout, device):
    """`rollout` with its tensors (and routing record) on `device` (a worker's rollout travels through the CPU)."""
    from dataclasses import fields, replace

    return replace(rollout, **{f.name: getattr(rollout, f.name).to(device) for f in fields(rollout)
                               if isinstance(getattr(rollout, f.name), torch.Tensor) or f.name == "routing"
                               and rollout.routing is not None})


def load_flat_weights(model, flat: dict[torch.dtype, torch.Tensor], trained_only: bool = False) -> None:
    """Copy buffers of `flat_weights` back into `model`'s parameters, in the same order."""
    params = sent_parameters(model, trained_only)
    own: dict[torch.dtype, int] = {}
    for p in params:  # counted, not copied: flat_weights(model) would concatenate every weight
        own[p.dtype] = own.get(p.dtype, 0) + p.numel()
    sent = {dtype: t.numel() for dtype, t in flat.items()}
    if own != sent:
        raise ValueError(f"the broadcast weights do not fit this model: {sent} values per dtype sent, this model "
                         f"has {own} (a rollout server must load the trainer's model, with the same LoRA settings)")
    offsets = dict.fromkeys(flat, 0)
    with torch.no_grad():
        for p in params:
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


def load_worker_model(model_settings, lora_settings) -> tuple:
    """(device, model, tokenizer): the run's model loaded as its config names it, with the run's LoRA adapters,
    for a worker that cannot be handed a copy (a rollout server; a worker of an fsdp trainer, whose copy is
    sharded); its weights then come from the trainer's first broadcast."""
    from gspo.lora import attach_adapters
    from gspo.models import seeded_model

    device, model, tokenizer = seeded_model(model_settings)
    return device, attach_adapters(model, lora_settings), tokenizer


def _worker_main(rank: int, world: int, host: str, port: int, timeout_s: float, model, tokenizer,
                 device: str | None = None, load: tuple | None = None) -> None:
    """A rollout worker: join the group, take the run's sampling settings, then sample on request and load
    broadcast weights, in the order asked, until told to stop.

    It samples with the trainer's own Sampler plug, built from the run's sampling settings: the policy
    copy itself, a low-precision copy of it (sampler_dtype) or an engine (vllm), as in the trainer's process.
    `device`: where it samples (a rollout server's own); None: the trainer's. `load`: (ModelSettings,
    LoraSettings) to load the model from (`load_worker_model`) when `model` is None.
    """
    from gspo.moe import record_routing
    from gspo.rollout.sampling import Sampler

    for name in TORCHRUN_ENV:  # spawned by a torchrun rank: a process on its own, not one of its ranks
        os.environ.pop(name, None)
    group, posted = _group(rank, world, host, port, timeout_s), Posted()
    _, options = recv(group, 0)  # ("setup", options): the same for every worker but its random state
    try:
        torch.set_num_threads(options["threads"])
        if model is None:
            _, model, tokenizer = load_worker_model(*load)
        model = model.to(device or options["device"]).eval()  # one GPU: shared by the trainer and its workers
        # routing_replay=rollout: the experts this worker's sampler chose travel in the rollout (Rollout.routing)
        recorder = record_routing if options["records"] else lambda sampler: None
        sampler = Sampler(model, tokenizer, options["settings"], seeded=options["seeded"], recorder=recorder,
                          records=options["records"])
    except Exception:  # noqa: BLE001  (no engine, a model it cannot run): the trainer reports it and stops
        for work in posted.post(group, ("error", traceback.format_exc(limit=4)), 0):
            work.wait()
        return
    posted.post(group, ("ready",), 0)
    version, rng = options["version"], options["rng"]
    if rng is not None:  # resumed: where the checkpointed run's worker stood
        torch.set_rng_state(rng)
    elif not options["seeded"]:
        torch.manual_seed(options["settings"].seed + 1000 * rank)  # its own stream, reproducible for a given seed
    busy = 0.0  # seconds spent sampling and loading weights
    while True:
        request = recv(group, 0)
        kind, t0 = request[0], time.perf_counter()
        if kind == "stop":
            sampler.close()
            return
        try:
            if kind == "weights":
                _, version, shapes, trained_only = request
                flat = {dtype: torch.empty(n, dtype=dtype) for dtype, n in shapes.items()}
                for dtype in shapes:
                    group.broadcast(flat[dtype], 0).wait()
                load_flat_weights(model, flat, trained_only)
                sampler.sync(model)  # a copy or an engine takes the new weights (an engine checks them itself)
                load_s = time.perf_counter() - t0
                busy += load_s
                reply = ("probe", probe_logprobs(model, options["vocab_size"]), busy, load_s)
            elif kind == "sample":
                _, prompts, step, first_row, rows = request
                rollout = sampler.sample(prompts, step, first_row, rows)
                busy += time.perf_counter() - t0
                reply = ("rollout", step, version, on_device(rollout, "cpu"), torch.get_rng_state())
        except Exception:  # noqa: BLE001  reported to the trainer, which stops the run naming this worker
            reply = ("error", traceback.format_exc(limit=4))
        posted.post(group, reply, 0)


def sampler_settings(cfg) -> SimpleNamespace:
    """What a worker's Sampler reads of the run's config (SamplingSettings and a few more), as plain values:
    the whole TrainConfig would carry reward functions and data a worker neither needs nor can always unpickle."""
    from gspo.config import EpisodeSettings, SamplingSettings

    names = [f.name for f in fields(SamplingSettings) + fields(EpisodeSettings)] + list(SAMPLER_READS)
    return SimpleNamespace(**{name: getattr(cfg, name) for name in names})


class RemoteSampler:
    """The Sampler plug with its sampling in worker processes (`rollout_workers: N`).

    Built from the policy as training starts (or resumes: `version`, the workers' random states `rng`):
    it starts the workers with a copy of it each, or (`address`, "host:port") waits there for rollout
    servers started elsewhere (`gspo rollout-server`), sends every worker the run's sampling settings and
    broadcasts the policy's weights; then every `sync(policy)` broadcasts the updated weights to all of them
    (`time/sync_s`, `async/sync_bytes`) and checks each on a probe. `request` hands each worker a contiguous
    share of a step's prompts (whole groups, row numbers kept: with seeded sampling the tokens are those one
    sampler draws) and returns at once; `receive` waits for every share and joins them into one padded
    Rollout, so the trainer can train while the workers sample (gspo/rollout/feed.py).
    """

    def __init__(self, model, tokenizer, cfg, *, seeded: bool, workers: int, timeout_s: float = 300.0,
                 version: int = 0, rng: list | None = None, address: str | None = None, records: bool = False,
                 trainer_rank: int = 0):
        import torch.multiprocessing as mp

        from gspo.config import LoraSettings, ModelSettings, section
        from gspo.given import is_marker
        from gspo.logprobs import is_fsdp2
        from gspo.rollout.batch import pad_id

        self.name = "workers"
        self.reason = (f"sampler: {workers} rollout worker process(es), gloo weight broadcast, rollouts asked for "
                       f"{cfg.max_staleness} step(s) ahead")
        self.workers, self.timeout_s, self.version, self.synced = workers, timeout_s, version, False
        self.group_size, self.pad = cfg.num_generations, pad_id(tokenizer, model)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.device = next(model.parameters()).device
        # the workers' random states after their latest rollouts (a checkpoint's, resuming; None: seeded afresh)
        rng = [rng] if isinstance(rng, torch.Tensor) else rng  # a checkpoint of one worker, before lists
        self.latest_rng = list(rng) if rng is not None else [None] * workers
        if len(self.latest_rng) != workers:
            raise ValueError(f"resume: the checkpoint holds the random states of {len(self.latest_rng)} rollout "
                             f"worker(s), this run has rollout_workers={workers}")
        # the trainer's thread count: the same kernels split the same way, so mu is bitwise the in-process one
        options = {"threads": torch.get_num_threads(), "seeded": seeded, "version": version, "records": records,
                   "device": str(self.device), "vocab_size": self.vocab_size, "settings": sampler_settings(cfg)}
        if address:  # under torchrun each trainer rank has servers of its own: rank r waits at port + r
            host, port = split_address(address)
            port += trainer_rank
        else:  # a port of this rank's own choosing (an offset would land on a port nobody checked was free)
            host, port = "127.0.0.1", _free_port()
        world, t0 = workers + 1, time.perf_counter()
        # fsdp: the trainer holds a shard only, so each worker loads the model as the config names it
        load = (section(cfg, ModelSettings), section(cfg, LoraSettings)) if is_fsdp2(model) else None
        if load and is_marker(cfg.model):
            raise ValueError("rollout_workers under distributed=fsdp: each worker loads the model the config names "
                             "(the trainer's copy is sharded), and a model object given from Python cannot be "
                             "loaded there; name the model by path, or use distributed=ddp")
        self.processes = []  # the workers this sampler started (none: rollout servers started elsewhere)
        for rank in range(1, world if address is None else 1):
            copied = None if load else copy.deepcopy(model).cpu()  # the architecture (through shared memory)
            process = mp.get_context("spawn").Process(target=_worker_main, name=f"gspo-rollout-worker-{rank}",
                                                      args=(rank, world, host, port, timeout_s, copied, tokenizer,
                                                            None, load), daemon=True)
            process.start()
            self.processes.append(process)
        self.posted, self.lost = Posted(), None  # lost: a RolloutWorkerLost, once a worker is
        waiting = f"waiting at {address} for {workers} rollout server(s)" if address else "joining the sampler's group"
        self.group = self._call(lambda: _group(0, world, host, port, timeout_s), waiting)
        self.parts: dict[int, list[int]] = {}  # step -> the workers sampling its prompts, in row order
        self.arrived: dict[tuple[int, int], tuple] = {}  # (step, worker) -> (version, rollout, rng), not handed out
        self.versions: dict[int, int] = {}  # step -> the weights' version that sampled its rollout
        self.rngs: dict[int, list] = {}  # step -> every worker's random state after its rollout
        for rank in range(1, world):
            setup = ("setup", {**options, "rng": self.latest_rng[rank - 1]})
            self._call(lambda r=rank, m=setup: self.posted.post(self.group, m, r), "sending the sampling settings",
                       rank)
        for rank in range(1, world):  # each builds its Sampler; one that cannot says why (its traceback)
            self._read(rank, "ready", "starting the rollout workers")
        self.started = False  # the first broadcast sends every weight, later ones what training changes
        sent = self._broadcast(model)  # every worker starts from the policy's weights, checked on the probe
        self._check()
        self.started = True
        self.start_s = time.perf_counter() - t0
        self.waited, self.mark = 0.0, time.perf_counter()
        self.worker_busy = [busy for _, busy, _ in sent["answers"]]  # seconds each worker spent working so far

    def _call(self, fn, what: str, rank: int | None = None):
        """`fn()`; a failed collective becomes one line naming the worker that died or went silent."""
        try:
            return fn()
        except RuntimeError as err:  # gloo: a peer closed the connection, or the timeout passed
            for process in self.processes:  # a killed worker resets its connection before it can be reaped
                process.join(timeout=1.0)
            dead = [f"rollout worker {i + 1} (pid {p.pid}) exited with status {p.exitcode}"
                    for i, p in enumerate(self.processes) if not p.is_alive()]
            silent = f"rollout worker {rank or 'group'}: no answer within rollout_timeout_s={self.timeout_s:g}"
            raise self._lose(f"{what}: {'; '.join(dead) or silent} ({str(err).splitlines()[0][:160]})") from None

    def _lose(self, message: str) -> RolloutWorkerLost:
        """The workers are lost for good: every later request or receive raises this."""
        self.lost = RolloutWorkerLost(message)
        return self.lost

    def _read(self, rank: int, kind: str, what: str, step: int | None = None) -> tuple:
        """Worker `rank`'s next answer of `kind` (a rollout: of `step`); its rollouts of other steps are kept."""
        while True:
            message = self._call(lambda: recv(self.group, rank), what, rank)
            if message[0] == "error":
                raise self._lose(f"{what}: rollout worker {rank} failed:\n{message[1]}")
            if message[0] == "rollout":
                self.arrived[message[1], rank] = message[2:]
                if kind == "rollout" and message[1] == step:
                    return ()
            elif message[0] == kind:
                return message[1:]
            else:
                raise self._lose(f"{what}: rollout worker {rank} answered {message[0]!r}, expected {kind!r}")

    def _check(self) -> None:
        if self.lost is not None:
            raise self.lost

    def request(self, prompts: list[str], step: int, first_row: int, rows: list | None = None) -> None:
        """Hand step `step`'s prompts (and data rows) to the workers, a contiguous share each (sizes within one of
        each other); they sample them with the weights of the latest `sync`."""
        self._check()
        self.parts[step], start = [], 0
        for rank in range(1, self.workers + 1):
            n = len(prompts) // self.workers + (rank <= len(prompts) % self.workers)
            if n:
                request = ("sample", prompts[start:start + n], step, first_row + start * self.group_size,
                           None if rows is None else [dict(row) for row in rows[start:start + n]])
                self._call(lambda r=request, k=rank: self.posted.post(self.group, r, k),
                           f"step {step}: sending prompts", rank)
                self.parts[step].append(rank)
            start += n

    def receive(self, step: int, wait: bool = True):
        """Step `step`'s rollout (asked for with `request`), the workers' shares joined in row order; without
        `wait`, only one whose shares are all here, else None."""
        ranks = self.parts.get(step, [])
        missing = [rank for rank in ranks if (step, rank) not in self.arrived]
        if missing and wait:
            self._check()
            t0 = time.perf_counter()
            for rank in missing:
                self._read(rank, "rollout", f"step {step}: waiting for its rollout", step)
            self.waited += time.perf_counter() - t0
        if not ranks or any((step, rank) not in self.arrived for rank in ranks):
            return None
        shares = [self.arrived.pop((step, rank)) for rank in ranks]
        versions = {version for version, _, _ in shares}
        assert len(versions) == 1, versions  # every worker got every broadcast before this request
        for rank, (_, _, rng) in zip(ranks, shares):
            self.latest_rng[rank - 1] = rng
        self.versions[step], self.rngs[step] = versions.pop(), list(self.latest_rng)
        del self.parts[step]
        for old in sorted(self.rngs)[:-KEEP_RNG_STATES]:
            del self.rngs[old], self.versions[old]
        return on_device(join_rollouts([rollout for _, rollout, _ in shares], self.pad), self.device)

    def sample(self, prompts: list[str], step: int, first_row: int, rows: list | None = None):
        """`request` then `receive`: one step sampled without overlap."""
        self.request(prompts, step, first_row, rows)
        return self.receive(step)

    def rng_after(self, step: int) -> list | None:
        """Each worker's random state right after step `step`'s rollout (None: not known here)."""
        return self.rngs.get(step)

    def version_of(self, step: int) -> int:
        """The version of the weights (the number of `sync`s before) that sampled step `step`'s rollout."""
        return self.versions[step]

    def _broadcast(self, policy) -> dict | None:
        """Send the policy's weights (version `self.version`) to every worker and check each on the probe;
        (seconds in the broadcast, the workers' answers), or None once a worker is lost."""
        trained_only = self.started  # after the first broadcast: what the optimizer changes (LoRA: the adapters)
        # fsdp: the probe's forward is a collective, like the gather below: both run before anything here can
        # fail on this rank only (the probe is the trainer's own work, not time in the broadcast)
        own = probe_logprobs(policy, self.vocab_size)
        t0 = time.perf_counter()
        flat = flat_weights(policy, trained_only)  # fsdp: gathered once here, broadcast once below
        shapes = {dtype: t.numel() for dtype, t in flat.items()}
        answers = []
        try:
            for rank in range(1, self.workers + 1):
                message = ("weights", self.version, shapes, trained_only)
                self._call(lambda r=rank, m=message: self.posted.post(self.group, m, r), "sending weights", rank)
            for t in flat.values():
                self._call(lambda t=t: self.group.broadcast(t, 0).wait(), "broadcasting weights")
            t_broadcast = time.perf_counter() - t0
            for rank in range(1, self.workers + 1):
                answers.append(self._read(rank, "probe", "checking the broadcast weights"))
        except RolloutWorkerLost:  # kept in self.lost
            return None
        for rank, (theirs, _, _) in enumerate(answers, 1):
            diff = (theirs - own).abs().max().item()
            if not diff <= 1e-5:
                raise ValueError(f"rollout worker {rank}: the broadcast weights give log-probs {diff:.3g} away from "
                                 "the policy's on the probe")
        return {"t_broadcast": t_broadcast, "answers": answers,
                "bytes": float(sum(t.numel() * t.element_size() for t in flat.values()))}

    def sync(self, policy) -> dict:
        """Broadcast the policy's weights to every worker and check each on the probe; this step's timings.

        A lost worker is not raised here (the step's updates are done and its metrics still logged): the next
        `request` or `receive` raises it, before anything of the next step is applied.
        """
        if self.lost is not None:
            return {}
        self.version += 1
        sent = self._broadcast(policy)
        if sent is None:
            return {}
        now = time.perf_counter()
        load_s = max(load for _, _, load in sent["answers"])
        interval, waited = now - self.mark, self.waited + max(0.0, sent["t_broadcast"] - load_s)
        busy = [b for _, b, _ in sent["answers"]]
        stats = {"time/sync_s": load_s,  # the workers' side: receiving and loading; waiting for them is below
                 "time/wait_for_rollout_s": waited,
                 "async/trainer_busy": 1.0 - waited / interval,
                 "async/worker_busy": sum(b - before for b, before in zip(busy, self.worker_busy))
                 / (self.workers * interval),
                 "async/sync_bytes": sent["bytes"]}
        self.waited, self.worker_busy, self.mark = 0.0, busy, now
        if not self.synced:
            stats["time/sampler_start_s"], self.synced = self.start_s, True
        return stats

    def close(self) -> None:
        """Tell every worker to stop (and wait until each has the message: a rollout server would otherwise see
        the trainer's connection close first); end the ones this sampler started."""
        for rank in range(1, self.workers + 1):
            if self.lost is None or (rank <= len(self.processes) and self.processes[rank - 1].is_alive()):
                try:
                    for work in self.posted.post(self.group, ("stop",), rank):
                        work.wait(datetime.timedelta(seconds=10))
                except RuntimeError:  # that worker is gone already
                    pass
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def build_sampler(model, tokenizer, cfg, *, seeded: bool, rank: int = 0, recorder=lambda model: None,
                  records: bool = False, version: int = 0, rng: torch.Tensor | None = None):
    """The run's Sampler plug: in the trainer's process (`gspo.rollout.Sampler`), or `RemoteSampler` with
    rollout_workers > 0: under torchrun each trainer rank (`rank`) has workers of its own for its share of the
    batch. `version`: the steps the weights have taken (a resumed run's); `rng`: a resumed worker's random state."""
    from gspo.rollout.sampling import Sampler

    if not cfg.rollout_workers:
        return Sampler(model, tokenizer, cfg, seeded=seeded, recorder=recorder, records=records)
    return RemoteSampler(model, tokenizer, cfg, seeded=seeded, workers=cfg.rollout_workers,
                         timeout_s=cfg.rollout_timeout_s, version=version, rng=rng, address=cfg.rollout_address,
                         records=records, trainer_rank=rank)


def serve_rollouts(cfg, address: str, rank: int) -> None:
    """`gspo rollout-server`: one rollout worker started on its own, here or on another machine. It loads the
    run's model as `cfg` says (the trainer's config: the same architecture; the weights come from the trainer),
    joins the trainer waiting at `address` as worker `rank` (1 .. rollout_workers) and samples on its own
    device (cfg.device) until the trainer stops it."""
    from gspo.config import LoraSettings, ModelSettings, section

    if not 1 <= rank <= cfg.rollout_workers:
        raise ValueError(f"rollout-server: --rank {rank} must be in 1..rollout_workers={cfg.rollout_workers}")
    host, port = split_address(address)
    device, model, tokenizer = load_worker_model(section(cfg, ModelSettings), section(cfg, LoraSettings))
    try:
        _worker_main(rank, cfg.rollout_workers + 1, host, port, cfg.rollout_timeout_s, model, tokenizer,
                     device=str(device))
    except RuntimeError as err:  # gloo: the trainer ended or cannot be reached
        raise ValueError(f"rollout-server: lost the trainer at {address}: {str(err).splitlines()[0][:200]}") from None


__all__ = ["Posted", "RemoteSampler", "RolloutWorkerLost", "build_sampler", "flat_weights", "load_flat_weights",
           "probe_logprobs", "recv", "serve_rollouts", "split_address"]
