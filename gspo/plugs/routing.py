"""The Routing plug: MoE routing replay and the drift meter (docs/moe.md); a no-op on dense models.

`routing_replay` fixes the experts of the training forwards to those recorded at pi_old
("old_policy", GSPO sec. 5.3's Routing Replay) or by the sampler ("rollout", R3); with
`log_routing_drift`, `moe/expert_change_frac` measures how many expert choices each optimizer
step changes under free routing, and under replay `moe/replay_mismatch_frac` how often the
replayed experts overrule the routers' own choice. `router_aux_loss_coef` adds the routers'
load-balancing loss (gspo.algo.balance) to each minibatch's loss, logged as `moe/aux_loss`.
`build_routing` returns `NoRouting` when there is nothing to replay, measure or balance, so the
trainer never asks which case it is in.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext

import torch

from gspo.algo.balance import load_balance_loss
from gspo.algo.logprobs import (
    PackedLayout,
    is_fsdp2,
    minibatch_logprobs,
    padding_free_layout,
    position_ids_from_mask,
)
from gspo.plugs.moe import (
    REPLAY_MODES,
    RoutingRecord,
    collect_router_logits,
    expert_change_counts,
    find_routers,
    record_routing,
    replay_routing,
    require_replay_support,
    unsupported_moe,
)
from gspo.rollout import Rollout
from gspo.rollout.batch import one_sequence_per_row


def build_routing(model, replay: str, drift: bool, packed: bool = False, aux_coef: float = 0.0):
    """The plug for `routing_replay=replay`, `log_routing_drift=drift` (drift is measured on MoE models only) and
    `router_aux_loss_coef=aux_coef`; `packed`: the training forwards run padding-free (cfg.padding_free), so
    records move between the layouts."""
    if replay not in REPLAY_MODES:
        raise ValueError(f"routing_replay={replay!r} is not one of {', '.join(REPLAY_MODES)}")
    if replay != "none":
        require_replay_support(model)  # dense or unsupported MoE: a clear ValueError before any rollout
    if aux_coef and not find_routers(model):
        raise ValueError(f"router_aux_loss_coef={aux_coef}: " + (unsupported_moe(model) or (
            f"the routers' load-balancing loss needs a Mixture-of-Experts model; {type(model).__name__} has no MoE "
            "router")) + "; use router_aux_loss_coef: 0")
    reason = unsupported_moe(model) if drift else None
    if reason is not None:
        warnings.warn(f"log_routing_drift: no moe/* drift metrics for this model: {reason}", stacklevel=2)
    drift = drift and bool(find_routers(model))
    if replay == "none" and not drift and not aux_coef:
        return NoRouting()
    return MoERouting(model, replay, drift, packed, aux_coef)


class NoRouting:
    """Dense models, or MoE with free routing and no drift meter: nothing recorded, replayed or measured."""

    records_pi_old = False
    records_sampling = False

    def sampling_recorder(self, sampler=None):
        return None

    def logprobs(self, model, rollout: Rollout, minibatches, logp_kwargs, writes=None) -> torch.Tensor:
        return minibatch_logprobs(model, rollout, minibatches, logp_kwargs, writes=writes)

    def watch(self, mb: Rollout, stand_in: bool = False, model=None) -> _NoWatch:
        return _NoWatch()


class _NoWatch:
    def replaying(self):
        return nullcontext()

    def recording(self):
        return nullcontext()

    def router_loss(self) -> tuple[float, dict]:
        return 0.0, {}

    def after_step(self) -> tuple[dict, dict]:
        return {}, {}


class MoERouting:
    """Replay (`replay` "old_policy" or "rollout") and/or the drift meter (`drift`).

    Records are kept in the rollout's padded (N, P+T) layout; around a padding-free forward (`packed`)
    they are packed into its rows for replay and recorded ones unpacked (`to_layout`, `from_layout`).
    """

    def __init__(self, model, replay: str, drift: bool, packed: bool = False, aux_coef: float = 0.0):
        self.model, self.replay, self.drift, self.packed, self.aux_coef = model, replay, drift, packed, aux_coef
        self.balance = bool(aux_coef) or drift  # the load-balancing loss: added with a coefficient, else only logged
        self.top_k = find_routers(model)[0].module.top_k if self.balance else None  # experts per token, the loss's k
        self.records_pi_old = replay == "old_policy"  # pi_old forwards record the experts for every minibatch
        self.records_sampling = replay == "rollout"  # the sampler records them (the generator must be able to)

    def sampling_recorder(self, sampler=None):
        """rollout replay: record the experts of `sampler` (the policy, or its copy), kept in `Rollout.routing`."""
        return record_routing(self.model if sampler is None else sampler) if self.records_sampling else None

    def logprobs(self, model, rollout: Rollout, minibatches, logp_kwargs, writes=None) -> torch.Tensor:
        """pi_old log-probs (N, T); "old_policy" records their experts into `rollout.routing`, "rollout" replays."""
        logp, recorded = minibatch_logprobs_and_routing(model, rollout, minibatches, logp_kwargs,
                                                        replay=self.replay == "rollout",
                                                        record=self.records_pi_old, writes=writes)
        if self.records_pi_old:
            rollout.routing = recorded
        return logp

    def watch(self, mb: Rollout, stand_in: bool = False, model=None) -> _Watch:
        """The routing of minibatch `mb`'s training forward through `model` (the policy as trained: a DDP
        wrapper runs padded; None: the routers' model)."""
        forward = self.model if model is None else model
        one_sequence_per_row(mb, "routing replay, the drift meter or the routers' load-balancing loss on an MoE model")
        layout = padding_free_layout(forward, mb.attention_mask, mb.completion_len) if self.packed else None
        return _Watch(self, mb, 0.0 if stand_in else 1.0, layout)


class _Watch:
    """One minibatch's routing: replay around its forward and backward, drift measured around its update.

    `weight` 0 (a stand-in row, gspo.plugs.parallel.Part): the statistics count for nothing. `layout`: the
    training forward's padding-free rows (None: padded); the drift meter's forwards use the same.
    """

    def __init__(self, routing: MoERouting, mb: Rollout, weight: float, layout: PackedLayout | None = None):
        self.routing, self.mb, self.weight, self.layout = routing, mb, weight, layout
        self.replayer, self.logits = None, None
        replay = routing.replay != "none"
        # Drift is measured with free routing: under replay that needs its own forward.
        self.before = free_routing(routing.model, mb, layout) if routing.drift and replay else None

    @contextmanager
    def replaying(self):
        """Spans forward and backward: a checkpointed recompute must see the same experts."""
        if self.routing.replay == "none":
            yield
            return
        with replay_routing(self.routing.model, to_layout(self.mb.routing, self.layout)) as self.replayer:
            yield

    @contextmanager
    def recording(self):
        """Spans the forward only: free routing's experts are the drift meter's "before"; with the load-balancing
        loss or the drift meter, the routers' logits (with their gradient)."""
        meters = self.routing.drift and self.routing.replay == "none"
        with record_routing(self.routing.model) if meters else nullcontext() as recorder:
            with collect_router_logits(self.routing.model) if self.routing.balance else nullcontext() as logits:
                yield
        if recorder is not None:
            self.before = from_layout(recorder.record(), self.layout)
        self.logits = logits

    def router_loss(self) -> tuple[torch.Tensor | float, dict]:
        """(router_aux_loss_coef x the routers' load-balancing loss over the forward's real tokens, prompts too, as
        Hugging Face's, or 0.0 without a coefficient; `moe/aux_loss`, the loss itself, where it is added or the
        drift meter runs: at coefficient 0 it measures the routers' balance without touching the update), or
        (0.0, {}) with neither."""
        if not self.routing.balance:
            return 0.0, {}
        logits = [torch.cat(forwards) for forwards in self.logits]  # per router: (rows, E), one forward
        loss = load_balance_loss(logits, self.routing.top_k, real_rows(self.mb, self.layout))
        return (self.routing.aux_coef * loss if self.routing.aux_coef else 0.0), {"moe/aux_loss": loss.detach()}

    def after_step(self) -> tuple[dict, dict]:
        """(stats, weights) after the optimizer step: `moe/expert_change_frac` (and per layer),
        `moe/replay_mismatch_frac`."""
        stats, weights = {}, {}
        positions = completion_positions(self.mb)
        if self.routing.drift:  # after the step, free routing again: which expert choices did it change?
            after = free_routing(self.routing.model, self.mb, self.layout)
            changed, total = expert_change_counts(self.before, after, positions)
            add_fraction(stats, weights, "moe/expert_change_frac", changed, total, self.before.layers, self.weight)
        if self.replayer is not None:  # how often the replayed experts overrule the routers' own choice
            own = from_layout(self.replayer.free_record(), self.layout)
            changed, total = expert_change_counts(self.mb.routing, own, positions)
            add_fraction(stats, weights, "moe/replay_mismatch_frac", changed, total, None, self.weight)
        return stats, weights


def add_fraction(stats: dict, weights: dict, name: str, changed, total, layers, weight: float) -> None:
    """`name` = sum(changed) / sum(total) (and `name/layer_<i>` per router with `layers`), weighted by its counts."""
    stats[name], weights[name] = (changed.sum() / total.sum()).item(), weight * float(total.sum())
    for layer, c, t in zip(layers or (), changed.tolist(), total.tolist()):
        stats[f"{name}/layer_{layer}"] = c / t if t else float("nan")
        weights[f"{name}/layer_{layer}"] = weight * t


# ------------------------------------------------------------------------------- forwards
def minibatch_logprobs_and_routing(model, rollout: Rollout, minibatches, logp_kwargs, *, replay: bool = False,
                                   record: bool = False, writes=None) -> tuple[torch.Tensor, RoutingRecord | None]:
    """gspo.algo.logprobs.minibatch_logprobs with every forward routed by `rollout.routing` (`replay`), and with
    `record` the experts those forwards used.

    The record is full width, (R, N, P+T, k) like `rollout.input_ids`: each minibatch's trimmed
    columns are written back in place and the trimmed-away (all-padding) ones are -1, so a
    later epoch's reshuffled minibatches can `select` and replay it. `writes`: one bool per
    minibatch, False for a forward that must run but whose result is not kept (a stand-in row).
    """
    full = None

    @contextmanager
    def around(j, idx, mb, keep):
        nonlocal full
        hooked = (replay or record) and logp_kwargs.get("packed", False)  # records move between the layouts
        layout = padding_free_layout(model, mb.attention_mask, mb.completion_len) if hooked else None
        with replay_routing(model, to_layout(mb.routing, layout)) if replay else nullcontext():
            with record_routing(model) if record else nullcontext() as recorder:
                yield
        if record and keep:
            full = widen_record(rollout, idx, from_layout(recorder.record(), layout), into=full)  # (R, N, P+T, k)

    logp = minibatch_logprobs(model, rollout, minibatches, logp_kwargs, writes=writes,
                              around=around if replay or record else None)  # (N, T)
    return logp, full


def widen_record(rollout: Rollout, rows: torch.Tensor, part: RoutingRecord, into: RoutingRecord | None = None
                 ) -> RoutingRecord:
    """A minibatch's record (R, n, l, k) written into the rollout's (R, N, P+T, k) layout (-1 elsewhere)."""
    if into is None:
        R, _, _, k = part.indices.shape
        into = RoutingRecord(part.indices.new_full((R, *rollout.input_ids.shape, k), -1), part.layers)
    left, cut, _ = rollout.trim(rows)
    into.indices[:, rows.to(into.indices.device), left:cut] = part.indices
    return into


@torch.no_grad()
def free_routing(model, mb: Rollout, layout: PackedLayout | None = None) -> RoutingRecord:
    """(R, n, l, k) experts the routers pick on their own for `mb`: one no-grad backbone forward.

    Same inputs as `completion_logprobs` (in `layout`'s padding-free rows, if given; -1 then at
    padding), so at equal weights it matches the training forward's free routing exactly; the
    output head is skipped (the logits do not matter here).
    """
    sharded = is_fsdp2(model)  # fsdp: the root's forward must run (it gathers the embedding), with one logit row
    backbone = model.get_decoder() if hasattr(model, "get_decoder") and not sharded else model
    with record_routing(model) as recorder:
        if layout is not None:
            backbone(**layout.inputs(mb.input_ids, mb.attention_mask))
        else:
            backbone(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                     position_ids=position_ids_from_mask(mb.attention_mask), use_cache=False,
                     **({"logits_to_keep": 1} if sharded else {}))
    return from_layout(recorder.record(), layout)


def to_layout(record: RoutingRecord, layout: PackedLayout | None) -> RoutingRecord:
    """A padded record (R, n, l, k) in `layout`'s rows (R, rows, capacity, k), -1 (route freely) in free
    slots; itself where `layout` is None."""
    if layout is None:
        return record
    return RoutingRecord(layout.pack(record.indices.movedim(0, 2), fill=-1).movedim(2, 0), record.layers)


def from_layout(record: RoutingRecord, layout: PackedLayout | None) -> RoutingRecord:
    """A record of `layout`'s rows (R, rows, capacity, k) back in the padded (R, n, l, k) layout, -1 at
    padding; itself where `layout` is None."""
    if layout is None:
        return record
    indices = layout.unpack(record.indices.movedim(0, 2), fill=-1).movedim(2, 0).contiguous()  # (R, n, l, k)
    return RoutingRecord(indices, record.layers)


def real_rows(mb: Rollout, layout: PackedLayout | None) -> torch.Tensor:
    """(rows,) 1 on the router rows of `mb`'s training forward that hold a real token, 0 on padding: the (N, L)
    attention mask flattened, or for padding-free rows (`layout`) the slots its tokens were packed into."""
    if layout is None:
        return mb.attention_mask.reshape(-1)  # (N*L,)
    real = torch.zeros(layout.rows * layout.capacity, device=layout.slots.device)  # (R*C,)
    real[layout.slots[layout.slots >= 0]] = 1.0
    return real


def completion_positions(mb: Rollout) -> torch.Tensor:
    """(n, l) bool: the positions whose hidden states give the completion log-probs.

    Completion token j (column P+j) is predicted at column P+j-1, so these are the last prompt
    token and every real completion token but the last (whose output predicts nothing we score).
    """
    n, width = mb.input_ids.shape
    T = mb.completion_len
    positions = torch.zeros(n, width, dtype=torch.bool, device=mb.input_ids.device)  # (n, P+T)
    positions[:, width - T - 1 : width - 1] = mb.completion_mask  # (n, T) shifted left by one
    return positions
