"""Topology: one process, DDP or FSDP2 under torchrun. The trainer's only view of other ranks.

    torchrun --nproc_per_node 2 -m gspo train --config run.yaml distributed=ddp

How a step is split: every rank draws the same global batch of B * world prompts and keeps its
B (whole groups of G, so advantages need nothing from other ranks). It samples, scores and keeps
its N / world sequences: rollouts stay on the rank that sampled them. Each epoch's minibatch
partition of the global rollout is drawn from the shared seed, the same on every rank; a rank
trains the rows of a global minibatch that it holds (`Topology.part`), its loss weighted by its
share of the minibatch's units (sequences or tokens), so the summed gradient is the gradient of
the single-process loss. Statistics travel as (value, weight) pairs and are recombined
(`Topology.reduce`), so the logged metrics are the single-process ones.

What crosses ranks per step (docs/distributed.md): the gradients (one all-reduce per minibatch
under ddp; fsdp's own all-gathers and reduce-scatters), one all-gather of a few scalars per
sequence (rewards, each reward function's value, length, stop flag), one all-gather of ~20
statistics per minibatch, and a stop flag. Never token tensors, texts or routing records.

Modes: `ddp` keeps a full replica per rank and averages gradients with one bucketed all-reduce
after backward. We do not use the `DistributedDataParallel` wrapper: its gradient hooks need
the forward to go through the wrapper, and our log-prob path calls the backbone and output head
directly to avoid full-vocabulary logits. `fsdp` shards parameters, gradients and optimizer state
with FSDP2 `fully_shard` (each decoder layer, then the root); its forwards are collective, so a
rank that holds no row of a minibatch runs a stand-in row with weight 0 (`Part`). Single-process runs never
import torch.distributed, and every method below is then the identity or a no-op.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch

MODES = ("ddp", "fsdp")


def launched() -> bool:
    """True inside torchrun (or any launcher that sets WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass(frozen=True)
class Part:
    """This rank's rows of one global minibatch: `index` numbers rows of its local rollout (N_local,).

    `units`: this rank's count of the units the loss averages over (sequences or tokens), `total`
    the global minibatch's. `stand_in` marks a stand-in row (a rank holding none of the minibatch): it
    runs the forwards every fsdp rank must run, and counts for nothing.
    """

    index: torch.Tensor  # (n,) local row numbers
    units: float
    total: float
    tokens: float = 0.0  # this rank's completion tokens of the minibatch
    total_tokens: float = 0.0  # the global minibatch's

    @property
    def stand_in(self) -> bool:
        """True for a stand-in row, False for this rank's real rows (every real row counts at least one unit)."""
        return not self.units

    def by_tokens(self) -> Part:
        """The same rows, shared out by completion tokens (for a token-mean loss such as the critic's)."""
        return Part(self.index, self.tokens, self.total_tokens, self.tokens, self.total_tokens)


@dataclass(frozen=True)
class Topology:
    """Where this process stands; world_size 1 means no torch.distributed at all."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    mode: str = "ddp"
    heartbeat: Heartbeat | None = field(default=None, compare=False, repr=False)
    """Under torchrun: this rank's liveness in the job's store, and the others' (None: not launched, or no store)."""

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.enabled and self.mode == "fsdp"

    @property
    def can_abandon_step(self) -> bool:
        """A signal may drop a step whole in one process; ranks must agree, so under torchrun it finishes."""
        return not self.enabled

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def setup(device: torch.device, mode: str, timeout_s: float) -> Topology:
        """Join the process group torchrun describes in the environment: gloo on CPU, nccl on CUDA."""
        if not launched():
            return Topology(mode=mode)
        import torch.distributed as dist

        if mode not in MODES:
            raise ValueError(f"config: distributed={mode!r} is not one of {', '.join(MODES)}")
        if not dist.is_available():
            raise ValueError("torchrun: this torch build has no torch.distributed")
        backend = "nccl" if device.type == "cuda" else "gloo"
        available = dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()
        if not available:
            raise ValueError(f"torchrun: backend {backend!r} (for device {device.type}) is not available in this "
                             "torch build")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", 0))
        if not dist.is_initialized():
            # A rank that dies leaves the others blocked in a collective: the timeout turns that into an error.
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                                    device_id=torch.device("cuda", local) if backend == "nccl" else None)
        store = (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))  # env:// (torchrun): the job's store
        heartbeat = Heartbeat(store[0], int(store[1]), rank, world) if all(store) else None
        return Topology(rank, world, local, mode, heartbeat)

    def raise_if_rank_lost(self, err: BaseException) -> None:
        """After `err` (a failed collective, say): raise `RankLost` naming the ranks that have ended, if any.

        gloo names a dead peer by its address ("Connection reset by peer"), or waits out the timeout;
        the heartbeats name it by rank. Takes up to `Heartbeat.WINDOW` seconds. torchrun SIGTERMs the
        survivors ~0.1 s after a rank dies: a SIGTERM that arrives meanwhile is held, then delivered if
        no rank was lost; if one was, SIGTERM is ignored from then on (this process is ending, with the
        line that says why, which torchrun's SIGTERM would otherwise cut short).
        """
        if self.heartbeat is None or getattr(err, "ranks_checked", False):  # the loop looked already
            return
        err.ranks_checked = True
        with _held(signal.SIGTERM) as arrived:
            gone = self.heartbeat.lost()
        if not gone:
            for signum in arrived:
                signal.raise_signal(signum)
            return
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        many = len(gone) > 1
        raise RankLost(f"rank{'s' * many} {', '.join(map(str, gone))} of {self.world_size} exited mid-run (no "
                       f"heartbeat for {Heartbeat.WINDOW:g} s); {'their' if many else 'its'} own output above and "
                       "torchrun's report say why") from err

    def teardown(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop.set()
        if self.enabled:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    def wrap(self, model):
        """`fsdp`: shard each decoder layer, then the root (FSDP2). `ddp`: replicas start equal."""
        if not self.enabled:
            return model
        import torch.distributed as dist

        if self.mode == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for layer in _decoder_layers(model):
                fully_shard(layer)
            fully_shard(model)
            return model
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, src=0)
        return model

    # ------------------------------------------------------------------ one step's rows
    def batch_share(self, per_rank: int) -> slice:
        """This rank's rows of a global batch of per_rank * world_size rows (rank order)."""
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def part(self, idx: torch.Tensor, num_local: int, lengths: torch.Tensor, by_tokens: bool) -> Part:
        """This rank's rows of the global minibatch `idx` (global row numbers, rank r holds
        r * num_local .. (r+1) * num_local - 1), and its share of the minibatch's units.

        `lengths`: (N,) completion tokens of every global row; `by_tokens`: the loss's units are
        tokens (else sequences, one per row).
        """
        total_tokens = float(lengths[idx].sum())
        total = total_tokens if by_tokens else float(len(idx))
        if not self.enabled:
            return Part(idx, total, total, total_tokens, total_tokens)
        first = self.rank * num_local
        mine = idx[(idx >= first) & (idx < first + num_local)]  # (n,) in the minibatch's order
        if len(mine) == 0:  # none here: a stand-in row, weight 0 (fsdp's forwards are collective)
            return Part(torch.zeros(1, dtype=idx.dtype), 0.0, total, 0.0, total_tokens)
        tokens = float(lengths[mine].sum())
        return Part(mine - first, tokens if by_tokens else float(len(mine)), total, tokens, total_tokens)

    def loss_scale(self, part: Part) -> float:
        """Weight of this rank's loss (a mean over `part.units`) so gradients combine into the global
        minibatch's gradient: ddp sums gradients across ranks, fsdp averages them (hence world_size)."""
        share = part.units / part.total if part.total else 0.0
        return 0.0 if part.stand_in else share * (self.world_size if self.sharded else 1)

    def backward(self, loss: torch.Tensor, part: Part) -> None:
        """Backpropagate this rank's share of the minibatch loss (`loss_scale`; 1 in one process).

        A stand-in row skips it under ddp, where a parameter no rank used must keep grad
        None; fsdp's backward is collective, so there it runs, scaled by 0.
        """
        if not part.stand_in or self.sharded:
            (loss * self.loss_scale(part)).backward()

    def replicated_scale(self) -> float:
        """Weight of a loss every rank computes in full (the SFT term), so the gradients add up to it once."""
        return 1.0 if self.sharded or not self.enabled else 1.0 / self.world_size

    # ------------------------------------------------------------------ communication
    def gather_rows(self, values: torch.Tensor) -> torch.Tensor:
        """(k, N_local) per-sequence scalars of every rank -> (k, N) in rank order (the global row order)."""
        if not self.enabled:
            return values
        return torch.cat(self._all_gather(values), dim=1)

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of `tensor` (same shape on every rank), in rank order."""
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return parts

    def reduce(self, stats: dict, weights: dict) -> dict:
        """Statistics of the global minibatch from every rank's (value, weight) pairs.

        A `*/min` or `*/max` key takes the extreme over ranks, a `*/std` key (population std) is
        recombined with its `*/mean` sibling, anything else is the weighted mean. A weight is the
        count the value averages over on this rank (0: no such units here, the value is ignored).
        One process: `stats` as they are.
        """
        if not self.enabled or not stats:
            return stats
        keys = list(stats)
        mine = torch.tensor([[float(stats[k]) for k in keys], [float(weights[k]) for k in keys]],
                            dtype=torch.float64)  # (2, K)
        values, w = torch.stack(self._all_gather(mine)).unbind(1)  # (W, K) each
        out = {}
        for j, key in enumerate(keys):
            seen = w[:, j] > 0  # (W,)
            v, wj = values[seen, j], w[seen, j]
            if key.endswith("/min"):
                out[key] = v.min()
            elif key.endswith("/max"):
                out[key] = v.max()
            elif key.endswith("/std"):  # pooled population variance: within-rank plus between-rank spread
                means = values[seen, keys.index(key[: -len("std")] + "mean")]
                mean = (wj * means).sum() / wj.sum()
                out[key] = ((wj * (v.square() + (means - mean).square())).sum() / wj.sum()).sqrt()
            else:
                out[key] = (wj * v).sum() / wj.sum() if len(v) else torch.tensor(math.nan, dtype=torch.float64)
        return {k: v.float() for k, v in out.items()}

    def average_gradients(self, model) -> None:
        """ddp: sum the (pre-scaled) gradients of all ranks in one flat all-reduce.

        A parameter no rank used (an MoE expert nobody routed to) keeps grad None, as it would in a
        single process, so AdamW leaves it and its moments alone. fsdp reduces gradients itself.
        """
        if not self.enabled or self.mode != "ddp":
            return
        import torch.distributed as dist

        params = [p for p in model.parameters() if p.requires_grad]
        used = torch.tensor([p.grad is not None for p in params], dtype=torch.float32)  # (P,)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([used.to(grads[0].device)] + [g.reshape(-1) for g in grads])  # one bucket
        dist.all_reduce(flat)
        used, offset = flat[: len(params)], len(params)
        for p, u in zip(params, used.tolist()):
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone() if u > 0 else None
            offset += n

    def gather_object(self, obj) -> list | None:
        """Every rank's picklable `obj`, in rank order, on rank 0 (None elsewhere); [obj] in one process. Every
        rank must call it."""
        if not self.enabled:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank if it is true on any (e.g. a stop signal seen by one rank)."""
        if not self.enabled:
            return flag
        import torch.distributed as dist

        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t)
        return bool(t.item() > 0)

    def barrier(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.barrier()

    # ------------------------------------------------------------------ checkpoints
    def full_state(self, model, optimizer) -> dict:
        """What `save_checkpoint` needs to write the single-process layout; every rank must call it.

        fsdp gathers the full weights and optimizer state onto rank 0 (None elsewhere); otherwise
        the replicas are written as they are.
        """
        if not self.sharded:
            return {"model_state_dict": None, "optimizer": optimizer, "optimizer_state_dict": None}
        return {"model_state_dict": self.full_weights(model), "optimizer": None,
                "optimizer_state_dict": _full_optimizer_state(model, optimizer, self)}

    def full_weights(self, model) -> dict | None:
        """fsdp: the full (unsharded) weights on CPU, on rank 0 (None elsewhere); every rank must call it.

        Tied aliases (an output head sharing the embedding) are left out, as `save_pretrained` of the
        unwrapped model leaves them out. Not sharded: None (the model holds them).
        """
        if not self.sharded:
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_main:
            return None
        return {k: v for k, v in sd.items() if k not in tied_aliases(model)}

    def load_optimizer_state(self, model, optimizer, state: dict) -> None:
        """fsdp: shard a single-process layout optimizer state (a checkpoint's) into `optimizer`, on every rank."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = [name for name, _ in model.named_parameters()]
        groups = state.get("param_groups", [])
        count = sum(len(g["params"]) for g in groups)
        if count != len(names):
            raise ValueError(f"resume: the checkpoint's optimizer holds {count} parameters, the model has {len(names)}")
        by_name = {"state": {names[i]: s for i, s in state["state"].items()},
                   "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups]}
        set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


class RankLost(ConnectionError):
    """Another rank of the job ended mid-run; the message names it (the CLI prints it as one line, status 2)."""


class Heartbeat:
    """Which ranks are alive, kept in the job's store (torchrun's agent hosts it: it outlives every rank).

    A daemon thread adds 1 to this rank's counter every PERIOD seconds; a rank whose counter stands
    still for WINDOW seconds has ended (os._exit, a crash, SIGKILL) or is frozen. The first rank to
    find one records it in the store, so later ones name the same rank, not a survivor that left
    after it. Keys are per torchrun restart. Without the store (torchrun's agent gone; rank 0 when it
    hosts the store itself) nothing is found, and the caller's error stands.
    """

    PERIOD, WINDOW = 0.5, 2.0  # seconds: a live rank's counter moves ~4 times in a window

    def __init__(self, host: str, port: int, rank: int, world_size: int):
        self.address, self.rank, self.world_size = (host, port), rank, world_size
        self.prefix = f"gspo/heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.stop = threading.Event()
        threading.Thread(target=self._beat, name="gspo-heartbeat", daemon=True).start()

    def _store(self):
        import torch.distributed as dist

        # A client of its own, with a short timeout: the process group's store waits dist_timeout_s.
        return dist.TCPStore(*self.address, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False)

    def _beat(self) -> None:
        try:
            store = self._store()
            while True:
                store.add(f"{self.prefix}{self.rank}", 1)
                if self.stop.wait(self.PERIOD):
                    return
        except Exception:  # noqa: BLE001 - the store is gone: there is no one left to tell
            return

    def lost(self) -> list[int]:
        """The other ranks that have ended: as first recorded in the store, else after watching for WINDOW
        seconds ([] when every rank beats, or the store cannot be reached)."""
        try:
            store, found = self._store(), f"{self.prefix}lost"
            if not store.check([found]):
                keys = [f"{self.prefix}{r}" for r in range(self.world_size)]
                before = [store.add(key, 0) for key in keys]  # (W,) counts
                time.sleep(self.WINDOW)
                still = [r for r, key in enumerate(keys) if r != self.rank and store.add(key, 0) == before[r]]
                if not still:
                    return []
                store.compare_set(found, "", ",".join(map(str, still)))  # the first finding stays
            return [r for r in map(int, store.get(found).decode().split(",")) if r != self.rank]
        except Exception:  # noqa: BLE001 - no store: no finding; the caller's own error stands
            return []


@contextmanager
def _held(*signums):
    """Signals that arrive inside are held: yields the list they are appended to (main thread only)."""
    arrived = []
    if threading.current_thread() is not threading.main_thread():
        yield arrived
        return
    previous = {s: signal.signal(s, lambda signum, frame: arrived.append(signum)) for s in signums}
    try:
        yield arrived
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _full_optimizer_state(model, optimizer, topology: Topology) -> dict | None:
    """fsdp: the whole optimizer state on CPU, on rank 0 (None elsewhere); every rank must call it.

    Laid out as a single process's `optimizer.state_dict()` (parameters numbered in
    `model.parameters()` order, one group), so a checkpoint resumes the same way under fsdp, ddp or
    in one process, on any number of ranks.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not topology.is_main:
        return None
    number = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return {"state": {number[name]: state for name, state in sd["state"].items()},
            "param_groups": [{**g, "params": [number[name] for name in g["params"]]} for g in sd["param_groups"]]}


def _decoder_layers(model) -> list:
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(backbone, "layers", None)
    if layers is None:
        raise ValueError(f"fsdp: cannot find the decoder layers of {type(model).__name__} (expected .layers)")
    return list(layers)


def tied_aliases(model) -> set[str]:
    """Names of parameters that are another parameter under a second name (tied weights)."""
    first = {n for n, _ in model.named_parameters()}
    return {n for n, _ in model.named_parameters(remove_duplicate=False)} - first

