"""MoE routing record / replay and routing-drift measurement.

GSPO paper (arXiv 2507.18071, sec. 5.3): after a gradient step about 10% of the experts a MoE model
activates for the same response change, so token-level importance ratios compare different
sub-networks. "Routing Replay" caches the experts chosen under pi_old and reuses them when
computing pi_theta. This module does that on plain Hugging Face models, with forward hooks only:

    with record_routing(model) as rec:          # rollout / old-log-prob forward (or generate)
        model.generate(...)
    record = rec.record()                       # RoutingRecord, indices (layers, N, L, k)
    with replay_routing(model, record.pad_to(L)):
        logits = model(input_ids).logits        # experts = recorded ones; gate weights from
        loss.backward()                         # current logits, so the router still learns

Supported (transformers 5.x): Qwen3-MoE (`qwen3_moe`), Qwen2-MoE (`qwen2_moe`), Mixtral
(`mixtral`), OLMoE (`olmoe`). Their routers (`mlp.gate`, classes `*TopKRouter`) all take
flattened (N*L, H) hidden states and return `(router_logits, router_scores, router_indices)`:
softmax over all experts in fp32, top-k, renormalise the k weights if `norm_topk_prob` (Mixtral
always), and the experts consume `(indices (T, k), weights (T, k))`, never a dense (T, E) map.
Replay rewrites the router's output (scores, indices) in a forward hook; `router_logits` is
passed through untouched, so `output_router_logits=True` still works, but the auxiliary
load-balancing loss recomputes its own top-k from the logits and thus ignores replay.

Index -1 in a record means "route freely at this token" (see `RoutingRecord.pad_to`).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "REPLAY_MODES",
    "Router",
    "RoutingRecord",
    "RoutingRecorder",
    "RoutingReplayer",
    "SUPPORTED_ARCHITECTURES",
    "collect_router_logits",
    "expert_change_frac",
    "find_routers",
    "gate_weights",
    "record_routing",
    "replay_routing",
    "require_replay_support",
    "unsupported_moe",
]

REPLAY_MODES = ("none", "old_policy", "rollout")
"""`routing_replay`: route freely, replay the experts recorded at pi_old (GSPO sec. 5.3), or replay
those the sampler used (rollout routing replay, R3)."""


# ----------------------------------------------------------------------------- architectures

@dataclass(frozen=True)
class Adapter:
    """How one architecture's router behaves (verified against transformers 5.24 source)."""

    arch: str  # config.model_type
    router_class: str  # class name of the `mlp.gate` module
    always_normalize: bool  # Mixtral renormalises the top-k weights unconditionally

    def normalize(self, router: nn.Module) -> bool:
        """Whether the top-k gate weights are renormalised to sum to 1."""
        return self.always_normalize or bool(getattr(router, "norm_topk_prob", False))


_ADAPTERS = (
    Adapter("qwen3_moe", "Qwen3MoeTopKRouter", always_normalize=False),
    Adapter("qwen2_moe", "Qwen2MoeTopKRouter", always_normalize=False),
    Adapter("mixtral", "MixtralTopKRouter", always_normalize=True),
    Adapter("olmoe", "OlmoeTopKRouter", always_normalize=False),
)
_BY_CLASS = {a.router_class: a for a in _ADAPTERS}
SUPPORTED_ARCHITECTURES = tuple(a.arch for a in _ADAPTERS)
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass
class Router:
    """One MoE router: `module` maps (N*L, H) -> (logits (T, E), weights (T, k), indices (T, k))."""

    layer: int  # decoder layer index (dense layers in between are skipped)
    name: str  # qualified module name, e.g. "model.layers.3.mlp.gate"
    module: nn.Module  # the router (gate)
    block: nn.Module  # the sparse MoE block that calls it with (N, L, H) hidden states
    adapter: Adapter


def find_routers(model: nn.Module) -> list[Router]:
    """All supported MoE routers of `model`, ordered by decoder layer."""
    routers = []
    for name, module in model.named_modules():
        adapter = _BY_CLASS.get(type(module).__name__)
        if adapter is None:
            continue
        block_name, _, _ = name.rpartition(".")
        found = re.search(r"layers\.(\d+)\.", name)
        if not block_name or found is None:
            raise ValueError(f"router {name!r} is not inside a `layers.<i>.` decoder layer")
        block = model.get_submodule(block_name)
        routers.append(Router(int(found.group(1)), name, module, block, adapter))
    routers.sort(key=lambda r: r.layer)
    return routers


def _text_config(model: nn.Module):
    """The model's text config (a multimodal model's language part), or its config, or None."""
    config = getattr(model, "config", None)
    return config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config


def has_experts(model: nn.Module) -> bool:
    """Whether `model`'s config declares experts (an MoE), from the config alone."""
    config = _text_config(model)
    return any(bool(getattr(config, key, None)) for key in _EXPERT_COUNT_KEYS)


def unsupported_moe(model: nn.Module) -> str | None:
    """Why an MoE `model`'s routers cannot be found (an architecture gspo has no adapter for), or
    None for a supported architecture or a model without experts. From the config alone."""
    arch = getattr(_text_config(model), "model_type", None)
    if has_experts(model) and arch not in SUPPORTED_ARCHITECTURES:
        return (f"the {arch!r} architecture ({type(model).__name__}) is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return None


def require_replay_support(model: nn.Module) -> list[Router]:
    """`find_routers(model)`, or a ValueError saying why routing replay cannot run on `model`."""
    routers = find_routers(model)
    if routers:
        return routers
    reason = unsupported_moe(model)
    if reason is not None:
        raise ValueError(f"routing replay: {reason}")
    raise ValueError(
        f"routing replay needs a Mixture-of-Experts model; {type(model).__name__} has no MoE router"
    )


# ----------------------------------------------------------------------------- record type

@dataclass
class RoutingRecord:
    """Top-k expert choices of every router for every token of an (N, L) batch.

    `indices[r, n, l]` are the k experts router r (decoder layer `layers[r]`) chose for token
    (n, l); -1 in every slot means "route freely" at that token.
    """

    indices: Tensor  # (R, N, L, k) int64
    layers: tuple[int, ...]  # decoder layer of each router, len R

    def __post_init__(self):
        if self.indices.dim() != 4 or self.indices.dtype != torch.int64:
            raise ValueError(
                f"indices must be an int64 tensor of shape (layers, N, L, k); got "
                f"{self.indices.dtype} {tuple(self.indices.shape)}"
            )
        self.layers = tuple(int(x) for x in self.layers)
        if len(self.layers) != self.indices.shape[0]:
            raise ValueError(f"layers has {len(self.layers)} entries but indices has {self.indices.shape[0]} routers")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, L): the input_ids shape this record aligns with."""
        return tuple(self.indices.shape[1:3])

    @property
    def top_k(self) -> int:
        return self.indices.shape[3]

    def select(self, rows: Tensor | slice | Sequence[int], positions: slice | None = None) -> RoutingRecord:
        """The record of a subset of sequences (a minibatch): rows index N, `positions` slices L.

        `positions` follows a column trim of the matching input_ids (see `Rollout.select`).
        """
        if not isinstance(rows, (Tensor, slice)):
            rows = torch.as_tensor(list(rows), dtype=torch.long)
        if isinstance(rows, Tensor):
            if rows.dtype == torch.bool and rows.shape != (self.shape[0],):
                raise ValueError(f"boolean rows must have shape ({self.shape[0]},); got {tuple(rows.shape)}")
            rows = rows.to(self.indices.device)
        if positions is not None and not isinstance(positions, slice):
            raise ValueError(f"positions must be a slice of the L axis or None; got {type(positions).__name__}")
        indices = self.indices[:, rows]  # (R, n, L, k)
        if positions is not None:
            indices = indices[:, :, positions]  # (R, n, l, k)
        return RoutingRecord(indices, self.layers)

    def pad_to(self, length: int, value: int = -1) -> RoutingRecord:
        """Right-pad positions to `length`; -1 (default) lets those tokens route freely.

        A record taken across `generate` covers positions 0..L-2 of the returned (N, L) sequence
        (the last token is never fed back); `record.pad_to(L)` aligns it with that sequence. The
        last position only predicts beyond the sequence, so its routing never affects the
        log-probs of the sequence's own tokens.
        """
        n, cur = self.shape
        if length < cur:
            raise ValueError(f"length must be >= the record's length {cur}; got {length}")
        if value < -1:
            raise ValueError(f"value must be an expert index or -1; got {value}")
        pad = self.indices.new_full((len(self.layers), n, length - cur, self.top_k), value)  # (R, N, P, k)
        return RoutingRecord(torch.cat([self.indices, pad], dim=2), self.layers)

    @staticmethod
    def cat(records: Sequence[RoutingRecord], dim: int = 0) -> RoutingRecord:
        """Join records along the (N, L) grid: dim=0 stacks sequences, dim=1 appends positions."""
        if not records:
            raise ValueError("records must not be empty")
        if dim not in (0, 1):
            raise ValueError(f"dim must be 0 (sequences) or 1 (positions); got {dim}")
        layers = records[0].layers
        if any(r.layers != layers for r in records):
            raise ValueError("records must come from the same routers (equal `layers`)")
        return RoutingRecord(torch.cat([r.indices for r in records], dim=dim + 1), layers)

    def to(self, device: torch.device | str) -> RoutingRecord:
        return RoutingRecord(self.indices.to(device), self.layers)


# ----------------------------------------------------------------------------- gating math

def gate_weights(router_logits: Tensor, indices: Tensor, normalize: bool) -> Tensor:
    """Gate weights of given experts, as the HF routers compute them for their own top-k.

    router_logits: (T, E); indices: (T, k) int64 -> (T, k) float32. Softmax over all E experts in
    fp32, gather the k chosen, renormalise to sum 1 if `normalize`. At the router's own top-k this
    reproduces its weights bit for bit, and it is differentiable in the logits.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)  # (T, E)
    weights = probs.gather(-1, indices)  # (T, k)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)  # (T, k)
    return weights


def _hidden_of(args: tuple, kwargs: dict) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


# Routers currently under replay: a second replay of the same router at once is an error.
_REPLAYING: weakref.WeakSet = weakref.WeakSet()


# ----------------------------------------------------------------------------- record

class RoutingRecorder:
    """Collects each router's top-k during forwards; `record()` joins them along positions.

    All forwards inside one `record_routing` block are taken as consecutive chunks of the same N
    sequences, which is what `generate` does (prefill (N, P), then (N, 1) per decode step). Record
    independent batches in separate blocks and join them with `RoutingRecord.cat`.
    Beam search (which reorders rows between steps) is not supported.
    """

    def __init__(self, routers: list[Router]):
        self.routers = routers
        self.chunks: list[list[Tensor]] = [[] for _ in routers]  # per router: (N, l, k) per forward

    def record(self) -> RoutingRecord:
        """(R, N, L, k) record; after `generate` L = len(sequences) - 1, see `RoutingRecord.pad_to`."""
        counts = {len(c) for c in self.chunks}
        if counts == {0}:
            raise ValueError("no forward pass ran inside record_routing; nothing was recorded")
        if len(counts) != 1:
            raise ValueError(f"routers saw different numbers of forwards ({sorted(counts)}); cannot align the record")
        for chunks in self.chunks:
            if len({c.shape[0] for c in chunks}) != 1:
                raise ValueError(
                    "forwards inside record_routing had different batch sizes "
                    f"{[c.shape[0] for c in chunks]}; record separate batches in separate blocks"
                )
        # routers may sit on different devices (device_map); gather on the first one's
        device = self.chunks[0][0].device
        per_router = [torch.cat(chunks, dim=1).to(device) for chunks in self.chunks]  # R x (N, L, k)
        return RoutingRecord(torch.stack(per_router), tuple(r.layer for r in self.routers))  # (R, N, L, k)

    def _hooks(self, i: int):
        batch_shape: list[tuple[int, int]] = []

        def block_pre_hook(module, args, kwargs):
            batch_shape[:] = [tuple(_hidden_of(args, kwargs).shape[:2])]

        def router_hook(module, args, output):
            n, length = batch_shape[0]  # set by the block, which reshapes (N, L, H) -> (N*L, H)
            indices = output[2].detach()  # (N*L, k)
            self.chunks[i].append(indices.reshape(n, length, indices.shape[-1]))  # (N, L, k)

        return block_pre_hook, router_hook


@contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingRecorder]:
    """Record the experts every router uses; call `.record()` on the yielded recorder.

    Inside a `replay_routing` block this records the replayed (i.e. actually used) experts.
    Record under `torch.no_grad()`: a gradient-checkpointing recompute would record twice.
    """
    recorder = RoutingRecorder(require_replay_support(model))
    handles = []
    try:
        for i, router in enumerate(recorder.routers):
            block_pre_hook, router_hook = recorder._hooks(i)
            handles.append(router.block.register_forward_pre_hook(block_pre_hook, with_kwargs=True))
            handles.append(router.module.register_forward_hook(router_hook))
        yield recorder
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def collect_router_logits(model: nn.Module) -> Iterator[list[list[Tensor]]]:
    """Every router's logits of the forwards inside the block, with their gradient: the yielded list holds one list
    per router (in layer order) of (rows, E) tensors, one per forward (rows: the forward's N*L flattened tokens).
    Wrap the forward only: a checkpointed recompute in the backward would add its logits again."""
    routers = require_replay_support(model)
    logits: list[list[Tensor]] = [[] for _ in routers]
    handles = []
    try:
        for i, router in enumerate(routers):
            handles.append(router.module.register_forward_hook(
                lambda module, args, output, i=i: logits[i].append(output[0])))  # (N*L, E)
        yield logits
    finally:
        for handle in handles:
            handle.remove()


# ----------------------------------------------------------------------------- replay

class RoutingReplayer:
    """Handle of a `replay_routing` block.

    `free_record()` gives what the routers would have chosen themselves (their own top-k from the
    current logits, given the replayed upstream layers) in the latest replayed forward; compare it
    with the replayed record in `expert_change_frac` for a drift estimate at no extra forward.
    """

    def __init__(self, routers: list[Router], record: RoutingRecord):
        self.routers = routers
        self.record = record
        self.free: list[Tensor | None] = [None] * len(routers)  # per router (N, L, k)

    def free_record(self) -> RoutingRecord:
        if any(f is None for f in self.free):
            raise ValueError("no forward pass ran inside replay_routing yet")
        return RoutingRecord(torch.stack([f.to(self.free[0].device) for f in self.free]), self.record.layers)

    def _hooks(self, i: int, router: Router, indices: Tensor):
        n, length = self.record.shape
        normalize = router.adapter.normalize(router.module)

        def block_pre_hook(module, args, kwargs):
            got = tuple(_hidden_of(args, kwargs).shape[:2])
            if got != (n, length):
                raise ValueError(
                    f"replay_routing: forward input has shape (N, L) = {got} but the record is for "
                    f"{(n, length)}; select/pad the record to match the batch"
                )

        def router_hook(module, args, output):
            logits, scores, own = output  # (T, E), (T, k), (T, k)
            if own.shape != (n * length, indices.shape[-1]):
                raise ValueError(
                    f"replay_routing: router {router.name} produced {tuple(own.shape)} choices, "
                    f"record expects {(n * length, indices.shape[-1])}"
                )
            self.free[i] = own.detach().reshape(n, length, -1)  # (N, L, k)
            chosen = indices.reshape(n * length, -1)  # (T, k)
            free = chosen[:, 0] < 0  # (T,) -1 = route freely here
            chosen = torch.where(free[:, None], own, chosen)  # (T, k)
            # Gate weights from the *current* logits at the replayed experts, so the router
            # weight still gets gradients (GSPO sec. 5.3 Routing Replay).
            weights = gate_weights(logits, chosen, normalize).to(scores.dtype)  # (T, k)
            return logits, weights, chosen

        return block_pre_hook, router_hook


@contextmanager
def replay_routing(model: nn.Module, record: RoutingRecord) -> Iterator[RoutingReplayer]:
    """Forwards inside the block use `record`'s experts instead of each router's own top-k.

    Every forward must have input shape (N, L) == `record.shape`. With gradient checkpointing,
    call `backward()` inside the block too: the recompute must replay the same experts.
    Hooks are removed on exit, also when an exception escapes.
    """
    routers = require_replay_support(model)
    if not isinstance(record, RoutingRecord):
        raise ValueError(f"record must be a RoutingRecord; got {type(record).__name__}")
    layers = tuple(r.layer for r in routers)
    if record.layers != layers:
        raise ValueError(f"record is for router layers {record.layers} but the model's routers are at {layers}")
    for router in routers:
        if record.top_k != router.module.top_k:
            raise ValueError(f"record has top_k={record.top_k} but router {router.name} "
                             f"uses top_k={router.module.top_k}")
        if record.indices.numel() and int(record.indices.max()) >= router.module.num_experts:
            raise ValueError(f"record names expert {int(record.indices.max())} "
                             f"but the model has {router.module.num_experts}")
    if any(r.module in _REPLAYING for r in routers):
        raise ValueError("replay_routing is already active on this model; nested replay is not supported")

    replayer = RoutingReplayer(routers, record)
    handles, claimed = [], []
    try:
        for i, router in enumerate(routers):
            _REPLAYING.add(router.module)
            claimed.append(router.module)
            indices = record.indices[i].to(router.module.weight.device)  # (N, L, k)
            block_pre_hook, router_hook = replayer._hooks(i, router, indices)
            handles.append(router.block.register_forward_pre_hook(block_pre_hook, with_kwargs=True))
            # prepend: run before any recording hook so recorders see the replayed experts
            handles.append(router.module.register_forward_hook(router_hook, prepend=True))
        yield replayer
    finally:
        for handle in handles:
            handle.remove()
        for module in claimed:
            _REPLAYING.discard(module)


# ----------------------------------------------------------------------------- drift

def expert_change_frac(
    before: RoutingRecord, after: RoutingRecord, mask: Tensor | None = None
) -> tuple[float, list[float]]:
    """Fraction of expert selections in `after` that are not among `before`'s top-k.

    Counts (token, router, top-k slot) triples: slot j of `after` at token (n, l) and router r is
    "changed" if that expert is not in the set `before.indices[r, n, l]` (a mere reordering of
    the same experts is no change). Averaged over tokens where `mask` (N, L) is nonzero and
    neither record has -1 (free routing). Returns (overall, per-router list); NaN if no token
    counts. This is GSPO sec. 5.3's "fraction of activated experts that change".
    """
    changed, total = expert_change_counts(before, after, mask)
    per_layer = (changed / total).tolist()  # 0/0 -> nan where nothing counts
    overall = (changed.sum() / total.sum()).item()
    return overall, per_layer


def expert_change_counts(before: RoutingRecord, after: RoutingRecord, mask: Tensor | None = None
                         ) -> tuple[Tensor, Tensor]:
    """(changed (R,), total (R,)) float64: the counts behind `expert_change_frac`, per router.

    Counts add across batches (or ranks): the fraction of a union is sum(changed) / sum(total).
    """
    if before.layers != after.layers or before.shape != after.shape or before.top_k != after.top_k:
        raise ValueError(
            f"before and after must have equal layers, (N, L) and top_k; got {before.layers}/{before.shape}/"
            f"k={before.top_k} vs {after.layers}/{after.shape}/k={after.top_k}"
        )
    b = before.indices
    a = after.indices.to(b.device)
    valid = (a >= 0).all(-1) & (b >= 0).all(-1)  # (R, N, L)
    if mask is not None:
        if tuple(mask.shape) != before.shape:
            raise ValueError(f"mask must have shape (N, L) = {before.shape}; got {tuple(mask.shape)}")
        valid = valid & mask.to(b.device).bool()[None]  # (R, N, L)
    kept = (a[..., :, None] == b[..., None, :]).any(-1)  # (R, N, L, k)
    changed = (~kept & valid[..., None]).sum(dim=(1, 2, 3)).double()  # (R,)
    total = valid.sum(dim=(1, 2)).double() * after.top_k  # (R,)
    return changed, total
