"""torch.distributed for the trainer: torchrun set-up, rollout gathering, gradient averaging, FSDP2.

    torchrun --nproc_per_node 2 -m gspo train --config run.yaml distributed=ddp

How a step is split (trainer.py): every rank draws the same global batch of B * world prompts
and keeps its B (whole groups, so group normalisation is unchanged); it samples and scores its
completions, then `gather_rollout` gives every rank the whole rollout. Each global minibatch is
cut into `world` equal parts, one per rank. Loss terms are scaled by the rank's share of the
global minibatch (`share`), so the averaged gradient is the gradient of the single-process
loss on the global minibatch. Statistics are computed from per-row values summed across ranks
(`fill_rows`), so the logged metrics are the single-process ones.

Modes: `ddp` keeps a full replica per rank and averages gradients with one bucketed all-reduce
after backward (`average_gradients`). We do not use the `DistributedDataParallel` wrapper: its
gradient hooks need the forward to go through the wrapper, and our log-prob path calls the
backbone and output head directly to avoid full-vocabulary logits. `fsdp` shards parameters,
gradients and optimizer state with FSDP2 `fully_shard` (each decoder layer, then the root).
Single-process runs never import torch.distributed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

MODES = ("ddp", "fsdp")


@dataclass(frozen=True)
class Dist:
    """Where this process stands; world_size 1 means no torch.distributed at all."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    mode: str = "ddp"

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched() -> bool:
    """True inside torchrun (or any launcher that sets WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def setup(device: torch.device, mode: str, timeout_s: float) -> Dist:
    """Join the process group torchrun describes in the environment: gloo on CPU, nccl on CUDA."""
    if not launched():
        return Dist(mode=mode)
    import torch.distributed as dist

    if mode not in MODES:
        raise ValueError(f"config: distributed={mode!r} is not one of {', '.join(MODES)}")
    if not dist.is_available():
        raise ValueError("torchrun: this torch build has no torch.distributed")
    backend = "nccl" if device.type == "cuda" else "gloo"
    available = dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()
    if not available:
        raise ValueError(f"torchrun: backend {backend!r} (for device {device.type}) is not available in this torch build")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if not dist.is_initialized():
        # A rank that dies leaves the others blocked in a collective: the timeout turns that into an error.
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                                device_id=torch.device("cuda", local) if backend == "nccl" else None)
    return Dist(rank, world, local, mode)


def teardown(d: Dist) -> None:
    if d.enabled:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def wrap(model, d: Dist):
    """`fsdp`: shard each decoder layer, then the root (FSDP2). `ddp`: replicas start equal."""
    if not d.enabled:
        return model
    import torch.distributed as dist

    if d.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in _decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        return model
    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor.data, src=0)
    return model


def _decoder_layers(model) -> list:
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(backbone, "layers", None)
    if layers is None:
        raise ValueError(f"fsdp: cannot find the decoder layers of {type(model).__name__} (expected .layers)")
    return list(layers)


def average_gradients(model, d: Dist) -> None:
    """ddp: sum the (pre-scaled) gradients of all ranks in one flat all-reduce.

    A parameter no rank used (an MoE expert nobody routed to) keeps grad None, as it would in a
    single process, so AdamW leaves it and its moments alone.
    """
    if not d.enabled or d.mode != "ddp":
        return  # fsdp reduces gradients itself (averaging: the loss scale accounts for it)
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


def grad_scale(d: Dist, local: float, total: float) -> float:
    """Weight of this rank's loss so the gradients combine into the global minibatch's gradient.

    The local loss is a mean over `local` units (sequences or tokens) of a global minibatch of
    `total`; ddp sums gradients across ranks, fsdp averages them (hence the extra world_size).
    """
    share = local / total if total else 0.0
    return share * (d.world_size if d.mode == "fsdp" else 1)


def all_sum(tensor: torch.Tensor, d: Dist) -> torch.Tensor:
    """Elementwise sum over ranks (in place), or the tensor itself in one process."""
    if d.enabled:
        import torch.distributed as dist

        dist.all_reduce(tensor)
    return tensor


def fill_rows(values: torch.Tensor, rows: torch.Tensor, shape: tuple, d: Dist) -> torch.Tensor:
    """Every rank's per-row values in one (N, T) tensor: rows computed here go in, the rest are summed in."""
    full = torch.zeros(shape, dtype=values.dtype, device=values.device)  # (N, T)
    full[rows, : values.shape[1]] = values
    return all_sum(full, d)


def merge_records(record, d: Dist):
    """A routing record (R, N, L, k) whose ranks filled disjoint rows (-1 elsewhere): every rank's rows, on every rank."""
    if not d.enabled:
        return record
    from gspo.moe import RoutingRecord

    return RoutingRecord(all_sum(record.indices + 1, d) - 1, record.layers)  # -1 + 1 = 0 adds nothing


def gather_objects(obj, d: Dist) -> list:
    if not d.enabled:
        return [obj]
    import torch.distributed as dist

    out = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


def flag_any(flag: bool, d: Dist) -> bool:
    """True on every rank if it is true on any (e.g. a stop signal seen by one rank)."""
    if not d.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    return bool(all_sum(t, d).item() > 0)


def barrier(d: Dist) -> None:
    if d.enabled:
        import torch.distributed as dist

        dist.barrier()


def full_state_dict(model, d: Dist) -> dict | None:
    """fsdp: the full (unsharded) weights on CPU, on rank 0 (None elsewhere); every rank must call it.

    Tied aliases (an output head sharing the embedding) are left out, as `save_pretrained` of the
    unwrapped model leaves them out.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not d.is_main:
        return None
    return {k: v for k, v in sd.items() if k not in tied_aliases(model)}


def tied_aliases(model) -> set[str]:
    """Names of parameters that are another parameter under a second name (tied weights)."""
    first = {n for n, _ in model.named_parameters()}
    return {n for n, _ in model.named_parameters(remove_duplicate=False)} - first


def full_optimizer_state(model, optimizer, d: Dist) -> dict | None:
    """fsdp: the whole optimizer state on CPU, on rank 0 (None elsewhere); every rank must call it.

    Laid out as a single process's `optimizer.state_dict()` (parameters numbered in
    `model.parameters()` order, one group), so a checkpoint resumes the same way under fsdp, ddp or
    in one process, on any number of ranks.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not d.is_main:
        return None
    number = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return {"state": {number[name]: state for name, state in sd["state"].items()},
            "param_groups": [{**g, "params": [number[name] for name in g["params"]]} for g in sd["param_groups"]]}


def load_optimizer_state(model, optimizer, state: dict) -> None:
    """fsdp: shard a `full_optimizer_state` (or one process's) state dict into `optimizer`, on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = [name for name, _ in model.named_parameters()]
    groups = state.get("param_groups", [])
    count = sum(len(g["params"]) for g in groups)
    if count != len(names):
        raise ValueError(f"resume: the checkpoint's optimizer holds {count} parameters, the model has {len(names)}")
    by_name = {"state": {names[i]: s for i, s in state["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def gather_rollout(local, rewards: torch.Tensor, pad_id: int, d: Dist):
    """(global Rollout, global rewards (N,)): every rank's rows in rank order, re-padded to common widths.

    Prompts stay left-padded and completions right-padded, so the layout is the one a single
    process sampling the whole batch would have produced.
    """
    from gspo.rollout import Rollout

    if not d.enabled:
        return local, rewards
    device = local.input_ids.device
    T = local.completion_len
    part = {"prompt_ids": local.input_ids[:, :-T].cpu(), "prompt_mask": local.attention_mask[:, :-T].cpu(),
            "completion_ids": local.input_ids[:, -T:].cpu(), "completion_mask": local.completion_mask.cpu(),
            "sampler_logprobs": None if local.sampler_logprobs is None else local.sampler_logprobs.cpu(),
            "prompts": local.prompts, "completions": local.completions, "rewards": rewards.cpu(),
            "routing": None if local.routing is None else (local.routing.indices.cpu(), local.routing.layers)}
    parts = gather_objects(part, d)
    P = max(p["prompt_ids"].shape[1] for p in parts)
    T = max(p["completion_ids"].shape[1] for p in parts)

    def pad(t: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
        extra = width - t.shape[1]
        fill = torch.full((t.shape[0], extra), value, dtype=t.dtype)
        return torch.cat([fill, t] if left else [t, fill], dim=1)

    prompt_ids = torch.cat([pad(p["prompt_ids"], P, pad_id, True) for p in parts])  # (N, P)
    prompt_mask = torch.cat([pad(p["prompt_mask"], P, 0, True) for p in parts])  # (N, P)
    completion_ids = torch.cat([pad(p["completion_ids"], T, pad_id, False) for p in parts])  # (N, T)
    cmask = torch.cat([pad(p["completion_mask"], T, False, False) for p in parts])  # (N, T)
    sampler_lp = None
    if parts[0]["sampler_logprobs"] is not None:
        sampler_lp = torch.cat([pad(p["sampler_logprobs"], T, 0.0, False) for p in parts]).to(device)  # (N, T)
    routing = None
    if parts[0]["routing"] is not None:  # (R, n, P_rank + T_rank, k) -> (R, N, P + T, k), -1 in the new padding
        from gspo.moe import RoutingRecord

        def widen(indices: torch.Tensor, width: int) -> torch.Tensor:
            R, n, _, k = indices.shape
            prompt, completion = indices[:, :, : width], indices[:, :, width:]
            return torch.cat([indices.new_full((R, n, P - width, k), -1), prompt, completion,
                              indices.new_full((R, n, T - completion.shape[2], k), -1)], dim=2)

        indices = torch.cat([widen(p["routing"][0], p["prompt_ids"].shape[1]) for p in parts], dim=1)
        routing = RoutingRecord(indices.to(device), parts[0]["routing"][1])
    rollout = Rollout(
        input_ids=torch.cat([prompt_ids, completion_ids], dim=1).to(device),
        attention_mask=torch.cat([prompt_mask, cmask.long()], dim=1).to(device),
        completion_mask=cmask.to(device),
        prompts=[x for p in parts for x in p["prompts"]],
        completions=[x for p in parts for x in p["completions"]],
        sampler_logprobs=sampler_lp,
        routing=routing,
    )
    return rollout, torch.cat([p["rewards"] for p in parts])
