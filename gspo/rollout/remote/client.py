"""Rollout workers: sampling in processes of their own, overlapped with training (`rollout_workers`,
`max_staleness`; docs/samplers.md).

`RemoteSampler` answers the Sampler plug's calls with worker processes that each hold their own copy of
the policy (rollout/remote/worker.py). `request(prompts, step, first_row)` hands each worker a contiguous share of a
step's prompts and returns at once; `receive(step)` waits for the shares, checks each against what was asked, and
joins them into one padded Rollout, tagged with the version of the weights that sampled it (the number of `sync`s
before it). After each update round `sync` sends the policy's weights to every worker and each answers a probe
(the log-probs of a fixed sequence) that must match the trainer's, as the vllm backend's push is checked.

Everything travels over gspo/rollout/remote/wire.py: a listener on the host it is given (loopback for spawned workers),
peers that prove the run's secret before anything they send is read, tensors and a schema-checked JSON header,
never a pickle. Each connection is read and written by threads of its own, so neither side ever waits on the
other's full socket buffer.

A rollout carries what the worker's sampler recorded: token ids, mu and, for routing_replay=rollout, the
experts it chose (Rollout.routing). With LoRA only the adapters travel after the first broadcast. Under
torchrun every trainer rank has workers of its own for its share of the batch (fsdp: the ranks gather each
parameter whole once, then each sends it to its workers).

A worker that dies, stops answering within `rollout_timeout_s`, fails (one that cannot build its sampler says
why in its first answer) or sends what the protocol or the request does not allow is named in one line
(`RolloutWorkerLost`); the trainer then stops with a checkpoint. Workers are daemon processes: they end with the
trainer.
"""

from __future__ import annotations

import copy
import secrets
import sys
import time

import torch

from gspo.rollout.batch import join_rollouts
from gspo.rollout.remote.protocol import TO_TRAINER, plain, probe_of, rollout_of
from gspo.rollout.remote.wire import DTYPE_NAMES, Peer, WireError, accept_peers, listen
from gspo.rollout.remote.worker import (
    START_TIMEOUT_S,
    _worker_main,
    flat_weights,
    on_device,
    probe_logprobs,
    sections_message,
)

KEEP_RNG_STATES = 16  # the workers' random state after each of this many latest rollouts (for checkpoints)


def _endpoint(sampling, address: str | None, trainer_rank: int) -> tuple[str, int, bytes, str]:
    """(host, port, secret, a name for errors) where the trainer waits for its workers: `address` (rollout servers,
    which must prove the run's secret; under torchrun trainer rank r waits at port + r), or loopback at a port the
    kernel picks with a secret only this process and its children know."""
    from gspo.config import rollout_secret, split_address

    if not address:
        return "127.0.0.1", 0, secrets.token_bytes(32), "rollout workers"
    (host, port), secret = split_address(address), rollout_secret(sampling)
    port += trainer_rank
    where = f"rollout_address={host}:{port}"
    if secret is None:
        raise ValueError(f"{where}: rollout servers must prove the run's secret; set GSPO_ROLLOUT_SECRET (or "
                         "rollout_secret_file) for the trainer and every server")
    return host, port, secret, where


class RolloutWorkerLost(ValueError):
    """A rollout worker died, went silent, failed or broke the protocol; the message names it."""


class RemoteSampler:
    """The Sampler plug with its sampling in worker processes (`rollout_workers: N`).

    Built from the policy as training starts (or resumes: `version`, the workers' random states `rng`): it listens
    on loopback and starts the workers with a copy of the policy each and a secret of this run's, or (`address`,
    "host:port") listens there for rollout servers started elsewhere (`gspo rollout-server`, the secret from the
    config: `rollout_secret`); a peer that cannot prove the secret is dropped and counted (`refused`). It sends
    every worker the sections its Sampler is built from and the policy's weights; then every `sync(policy)` sends the
    updated weights to all of them (`time/sync_s`, `async/sync_bytes`) and checks each on a probe. `request` hands each
    worker a contiguous share of a step's prompts (whole groups, row numbers kept: with seeded sampling the tokens
    are those one sampler draws) and returns at once; `receive` waits for every share, checks it against what was
    asked (gspo/rollout/remote/protocol.py) and joins them into one padded Rollout, so the trainer can train while the
    workers sample (gspo/rollout/feed.py).
    """

    def __init__(self, model, tokenizer, sampling, episodes, shape, *, seeded: bool, workers: int,
                 timeout_s: float = 300.0, version: int = 0, rng: list | None = None, address: str | None = None,
                 records: bool = False, trainer_rank: int = 0, load: tuple | None = None):
        """`sampling`, `episodes`, `shape`: what every worker builds its Sampler from (gspo.rollout.sampler_sections);
        `load`: the run's (ModelSettings, LoraSettings), which each worker of an fsdp trainer loads the model by."""
        from gspo.algo.logprobs import is_fsdp2
        from gspo.given import is_marker
        from gspo.rollout.batch import pad_id

        self.name = "workers"
        self.reason = (f"sampler: {workers} rollout worker process(es), weights over authenticated sockets, rollouts "
                       f"asked for {sampling.max_staleness} step(s) ahead")
        self.workers, self.timeout_s, self.version, self.synced = workers, timeout_s, version, False
        self.group_size, self.pad = shape.num_generations, pad_id(tokenizer, model)
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
                   "device": str(self.device), "vocab_size": self.vocab_size,
                   "settings": sections_message(sampling, episodes, shape)}
        host, port, secret, where = _endpoint(sampling, address, trainer_rank)
        # fsdp: the trainer holds a shard only, so each worker loads the model as the config names it
        load = load if is_fsdp2(model) else None
        if is_fsdp2(model) and load is None:
            raise ValueError("rollout_workers under distributed=fsdp: build_sampler needs load=(ModelSettings, "
                             "LoraSettings), which each worker loads the model by (the trainer's copy is sharded)")
        if load and is_marker(load[0].model):
            raise ValueError("rollout_workers under distributed=fsdp: each worker loads the model the config names "
                             "(the trainer's copy is sharded), and a model object given from Python cannot be "
                             "loaded there; name the model by path, or use distributed=ddp")
        try:
            listener = listen(host, port)
        except WireError as err:
            raise ValueError(f"{where}: {err}") from None
        self.processes, self.peers, self.refused, self.lost = [], {}, 0, None  # lost: once a worker is
        t0 = time.perf_counter()
        try:
            self.peers = self._join(listener, secret, address, None if address else (model, tokenizer, load))
            self.parts: dict[int, dict[int, int]] = {}  # step -> {worker: sequences asked for}, in row order
            self.asked_version: dict[int, int] = {}  # step -> the weights' version when its prompts were sent
            self.arrived: dict[tuple[int, int], tuple] = {}  # (step, worker) -> (rollout, rng), not handed out yet
            self.versions: dict[int, int] = {}  # step -> the weights' version that sampled its rollout
            self.rngs: dict[int, list] = {}  # step -> every worker's random state after its rollout
            for rank, peer in self.peers.items():
                peer.post("setup", options, {"rng": self.latest_rng[rank - 1]})
            for rank in self.peers:  # each builds its Sampler (a server loads its model); one that cannot says why
                self._read(rank, "ready", "starting the rollout workers", wait_s=max(timeout_s, START_TIMEOUT_S))
            self.started = False  # the first broadcast sends every weight, later ones what training changes
            sent = self._broadcast(model)  # every worker starts from the policy's weights, checked on the probe
            self._check()
        except BaseException:
            for process in self.processes:  # a worker still joining would wait for its start timeout
                process.kill()
            self.close()
            raise
        self.started = True
        self.start_s = time.perf_counter() - t0
        self.waited, self.mark = 0.0, time.perf_counter()
        self.worker_busy = [busy for _, busy, _ in sent["answers"]]  # seconds each worker spent working so far

    def _join(self, listener, secret: bytes, address: str | None, spawn: tuple | None) -> dict:
        """{rank: Peer} of every worker, once each proved `secret` at `listener` (closed then: nobody else joins
        this run); `spawn`: (model, tokenizer, load) to start the workers from, None: servers started elsewhere."""
        import torch.multiprocessing as mp

        for rank in range(1, self.workers + 1 if spawn else 1):
            model, tokenizer, load = spawn
            copied = None if load else copy.deepcopy(model).cpu()  # the architecture (through shared memory)
            process = mp.get_context("spawn").Process(  # the secret travels in the spawn pipe, never on a socket
                target=_worker_main, name=f"gspo-rollout-worker-{rank}", daemon=True,
                args=(rank, "127.0.0.1", listener.getsockname()[1], secret, copied, tokenizer, None, load))
            process.start()
            self.processes.append(process)
        waiting = f"waiting at {address} for {self.workers} rollout server(s)" if address else "starting the workers"
        try:
            socks = accept_peers(listener, secret, range(1, self.workers + 1), max(self.timeout_s, START_TIMEOUT_S),
                                 alive=lambda: self._dead(waiting), refused=self._refuse)
        except TimeoutError as err:
            raise self._lose(f"{waiting}: {err}" + (f" ({self.refused} refused)" if self.refused else "")) from None
        finally:
            listener.close()
        return {rank: Peer(sock, TO_TRAINER) for rank, sock in sorted(socks.items())}

    def _refuse(self, line: str) -> None:
        self.refused += 1
        print(f"rollout: refused a connection from {line} ({self.refused} so far)", file=sys.stderr, flush=True)

    def _dead(self, what: str) -> None:
        """Raise (the workers lost) if a worker this sampler started has exited, naming it and its exit status."""
        dead = [f"rollout worker {i + 1} (pid {p.pid}) exited with status {p.exitcode}"
                for i, p in enumerate(self.processes) if not p.is_alive()]
        if dead:
            raise self._lose(f"{what}: {'; '.join(dead)}")

    def _lose(self, message: str) -> RolloutWorkerLost:
        """The workers are lost for good: every later request or receive raises this."""
        self.lost = RolloutWorkerLost(message)
        return self.lost

    def _get(self, rank: int, what: str, wait_s: float | None = None):
        """Worker `rank`'s next message; a dead, silent or malformed worker is lost, in one line naming it."""
        try:
            return self.peers[rank].get(wait_s or self.timeout_s)
        except TimeoutError:
            raise self._lose(f"{what}: rollout worker {rank}: no answer within rollout_timeout_s={self.timeout_s:g}"
                             ) from None
        except WireError as err:
            raise self._lose(f"{what}: rollout worker {rank} sent a malformed message: {err}") from None
        except OSError:  # it closed the connection: a worker that exited, a server that ended
            for process in self.processes:  # a killed worker's connection closes before it can be reaped
                process.join(timeout=1.0)
            self._dead(what)
            raise self._lose(f"{what}: rollout worker {rank} closed the connection") from None

    def _read(self, rank: int, kind: str, what: str, step: int | None = None, wait_s: float | None = None):
        """Worker `rank`'s next answer of `kind` (a rollout: of `step`); its rollouts of other steps are kept."""
        while True:
            message = self._get(rank, what, wait_s)
            if message.kind == "error":
                raise self._lose(f"{what}: rollout worker {rank} failed:\n{message.fields['text']}")
            if message.kind == "rollout":
                try:
                    self._keep(rank, message)
                except WireError as err:
                    raise self._lose(f"{what}: rollout worker {rank} sent {err}") from None
                if kind == "rollout" and message.fields["step"] == step:
                    return message
            elif message.kind == kind:
                return message
            else:
                raise self._lose(f"{what}: rollout worker {rank} answered {message.kind!r}, expected {kind!r}")

    def _keep(self, rank: int, message) -> None:
        """Keep a worker's rollout once it is one it was asked for, with the weights it was asked with."""
        step, version = message.fields["step"], message.fields["version"]
        if rank not in self.parts.get(step, {}) or (step, rank) in self.arrived:
            raise WireError(f"a rollout of step {step}, which it was not asked for")
        if version != self.asked_version[step]:
            raise WireError(f"a rollout of step {step} sampled with weights version {version}; it held version "
                            f"{self.asked_version[step]}")
        self.arrived[step, rank] = rollout_of(message, self.parts[step][rank], self.vocab_size)

    def _check(self) -> None:
        if self.lost is not None:
            raise self.lost

    def request(self, prompts: list[str], step: int, first_row: int, rows: list | None = None) -> None:
        """Hand step `step`'s prompts (and data rows) to the workers, a contiguous share each (sizes within one of
        each other); they sample them with the weights of the latest `sync`."""
        self._check()
        self.parts[step], self.asked_version[step], start = {}, self.version, 0
        for rank, peer in self.peers.items():
            n = len(prompts) // self.workers + (rank <= len(prompts) % self.workers)
            if n:
                share = None if rows is None else [plain(dict(row), f"data row {first_row // self.group_size + i}")
                                                  for i, row in enumerate(rows[start:start + n], start)]
                peer.post("sample", {"prompts": list(prompts[start:start + n]), "step": step,
                                     "first_row": first_row + start * self.group_size, "rows": share})
                self.parts[step][rank] = n * self.group_size
            start += n

    def receive(self, step: int, wait: bool = True):
        """Step `step`'s rollout (asked for with `request`), the workers' shares joined in row order; without
        `wait`, only one whose shares are all here, else None."""
        ranks = list(self.parts.get(step, {}))
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
        for rank, (_, rng) in zip(ranks, shares):
            self.latest_rng[rank - 1] = rng
        self.versions[step], self.rngs[step] = self.asked_version.pop(step), list(self.latest_rng)
        del self.parts[step]
        for old in sorted(self.rngs)[:-KEEP_RNG_STATES]:
            del self.rngs[old], self.versions[old]
        return on_device(join_rollouts([rollout for rollout, _ in shares], self.pad), self.device)

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
        flat = flat_weights(policy, trained_only)  # fsdp: gathered once here, sent to every worker below
        tensors = {DTYPE_NAMES[dtype]: t for dtype, t in flat.items()}
        answers = []
        try:
            posted = {rank: peer.post("weights", {"version": self.version, "trained_only": trained_only}, tensors)
                      for rank, peer in self.peers.items()}  # written to every worker at once, a thread each
            for rank, written in posted.items():
                if not written.wait(self.timeout_s):
                    raise self._lose(f"sending weights: rollout worker {rank}: no answer within rollout_timeout_s="
                                     f"{self.timeout_s:g}")
            t_broadcast = time.perf_counter() - t0
            for rank in self.peers:
                message = self._read(rank, "probe", "checking the broadcast weights")
                try:
                    answers.append(probe_of(message))
                except WireError as err:
                    raise self._lose(f"checking the broadcast weights: rollout worker {rank} sent {err}") from None
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
        """Send the policy's weights to every worker and check each on the probe; this step's timings.

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
            stats["async/refused_peers"] = float(self.refused)
        return stats

    def close(self) -> None:
        """Tell every worker to stop (and wait until each has the message: a rollout server would otherwise see
        the trainer's connection close first); end the ones this sampler started."""
        stops = [peer.post("stop") for rank, peer in self.peers.items()
                 if self.lost is None or rank > len(self.processes) or self.processes[rank - 1].is_alive()]
        for written in stops:
            written.wait(10)
        for peer in self.peers.values():
            peer.close(wait_s=10 if self.lost is None else 1)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


__all__ = ["RemoteSampler", "RolloutWorkerLost"]
