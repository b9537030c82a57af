"""Where each step's prompts and rollout come from: drawn and sampled when the step begins, or asked for
`ahead` steps early from rollout endpoints or workers (`max_staleness`, gspo/rollout/endpoint/rollouts.py).

`RolloutFeed.next(step)` first asks the sampler for every step up to `step + ahead` not yet asked for
(drawing their prompts from the prompt source, in step order), then waits for step `step`'s rollout. A
worker answers in the order it was asked and loads new weights in the order they were sent, so the
rollout of step t is sampled by the weights the updates of step t - 1 - ahead left (the first ones until
then): at most `ahead` versions behind the weights step t trains, and exactly that many once the pipe is
full, whatever the timing. Nothing older than the bound is ever asked for, so nothing is dropped.

Checkpoints: `resume_state(after)` is what a run resumed after step `after` needs to continue exactly:
the rollouts of steps after+1 .. after+ahead (waited for; they are determined already), the prompt
source's state before the first step it does not keep, and the worker's random state. A worker that was
lost cannot hand over its unfinished rollouts: those steps are left out and sampled again on resume
(with newer weights: that resume is no longer bit-exact, and says so).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, fields

from gspo.data.rows import Row
from gspo.rollout.batch import Rollout, step_of
from gspo.rollout.endpoint.client import EndpointLost

PENDING_FILE = "rollouts.pt"  # the checkpoint's file of rollouts asked for but not yet trained on


class RolloutFeed:
    """Prompts and rollouts step by step, `ahead` steps asked for in advance (0: when the step begins)."""

    def __init__(self, source, sampler, *, batch: int, share: slice, first_row: int, ahead: int = 0, after: int = 0,
                 last: float = math.inf, pending: dict | None = None):
        """`after`: the step the run resumes after (0: a new run); `last`: the last step (max_steps: nothing is
        asked for beyond it); `pending`: the checkpoint's rollouts asked for ahead."""
        self.source, self.sampler, self.ahead, self.last = source, sampler, ahead, last
        self.batch, self.share, self.first_row = batch, share, first_row
        self.examples: dict[int, list] = {}  # step -> its global batch of examples, while asked for
        self.source_before: dict[int, dict] = {}  # step -> the source's state before its prompts were drawn
        self.ready: dict[int, Rollout] = {}  # step -> rollout received and kept (resume, or waited for early)
        self.versions: dict[int, int | None] = {}  # step -> version of the weights that sampled it (None: here)
        self.asked = after  # the last step asked for
        self.order: list = []  # every rollout asked of the sampler, in order: a step, or (step, round) (extra rounds)
        for step, examples, rollout, version in unpack_pending(pending):
            self.examples[step], self.ready[step], self.versions[step], self.asked = examples, rollout, version, step

    def _ask(self, upto: int) -> None:
        while self.asked < upto:
            step = self.asked = self.asked + 1
            self.source_before[step] = copy.deepcopy(self.source.state_dict())
            self.examples[step] = examples = self.source.next(self.batch)
            if step not in self.ready:
                mine = examples[self.share]
                self.order.append(step)
                self.sampler.request([e["prompt"] for e in mine], step, first_row=self.first_row, rows=mine)

    def extra(self, step: int, round_: int, count: int, share: slice, first_row: int
              ) -> tuple[list, Rollout, int | None]:
        """An extra sampling round of step `step` (dynamic sampling, gspo/rounds.py), sampled now: `count` more
        prompts from the prompt source (every rank draws the same), this rank's `share` of them sampled as rollout
        (step, round_) with rows numbered from `first_row` within the step. Returns (the round's global examples,
        this rank's rollout, the weights' version that sampled it: None in this process).

        A worker answers in the order asked: the round samples after the steps already asked ahead, with the
        weights of its time. The source's draws follow the steps', so a checkpoint after this step holds its
        position after them (`resume_state`)."""
        examples = self.source.next(count)
        mine, key = examples[share], (step, round_)
        self.order.append(key)
        self.sampler.request([e["prompt"] for e in mine], key, first_row=first_row, rows=mine)
        rollout = self.sampler.receive(key, wait=True)
        return examples, rollout, self.sampler.version_of(key)

    def next(self, step: int) -> tuple[list, Rollout]:
        """(the global batch of examples, this rank's rollout) of `step`."""
        self._ask(min(step + self.ahead, self.last))
        for old in [s for s in self.source_before if s < step]:  # done with: resume_state never goes back
            del self.source_before[old], self.examples[old]
        for done in (self.ready, self.versions):
            done.pop(step - 1, None)
        if step not in self.ready:  # kept until the next step: a step dropped unfinished is checkpointed with it
            self._receive(step, wait=True)
        return self.examples[step], self.ready[step]

    def _receive(self, step: int, wait: bool) -> None:
        rollout = self.sampler.receive(step, wait=wait)  # None: not here, and not waited for
        if rollout is not None:
            self.ready[step], self.versions[step] = rollout, self.sampler.version_of(step)

    def staleness(self, step: int) -> dict:
        """`async/staleness_*` of step `step`'s rollout: how many updates of the weights it trains were not in the
        weights that sampled it (step t trains the weights of t - 1 updates); {} for in-process sampling."""
        version = self.versions.get(step)
        if version is None:
            return {}
        stale = float(step - 1 - version)
        return {"async/staleness_mean": stale, "async/staleness_max": stale}

    def resume_state(self, after: int, wait: bool = True) -> tuple[dict, dict]:
        """(prompt source state, pending rollouts) for a checkpoint after step `after`: what resuming there needs.

        `wait`: receive the rollouts still being sampled (False when the worker is lost: those are dropped).
        """
        kept = []
        for step in range(after + 1, min(after + self.ahead, self.asked) + 1):
            if step not in self.ready:
                try:
                    self._receive(step, wait)
                except EndpointLost:  # raised again by the next step's receive, which stops the run
                    break
            if step not in self.ready:
                break
            kept.append(step)
        first_missing = after + 1 + len(kept)
        state = self.source_before[first_missing] if first_missing <= self.asked else self.source.state_dict()
        rng = self.sampler.rng_after(self._last_kept(after, kept))
        return copy.deepcopy(state), pack_pending(kept, [self.examples[s] for s in kept],
                                                  [self.ready[s] for s in kept], [self.versions[s] for s in kept], rng)

    def _last_kept(self, after: int, kept: list[int]):
        """The last rollout asked of the sampler before the first one a resume after step `after` does not keep
        (one of a later step, not among the `kept` steps): the sampler's random state after it is where a resumed
        run's sampler starts (extra rounds sample between the steps asked ahead)."""
        last = kept[-1] if kept else after
        for key in self.order:
            s = step_of(key)
            if s > after and (isinstance(key, tuple) or s not in kept):
                break
            last = key
        return last


def pack_pending(steps: list[int], examples: list, rollouts: list[Rollout], versions: list, rng) -> dict:
    """A plain state (torch.load(weights_only=True) reads it) of rollouts not yet trained on, with their
    steps' examples (each a dict of the row's values and, for a data row, where it came from)."""
    examples = [[{"values": dict(e), "where": getattr(e, "where", None)} for e in batch] for batch in examples]
    return {"steps": list(steps), "examples": examples, "versions": list(versions), "worker_rng": rng,
            "rollouts": [{k: v for k, v in asdict(r).items() if v is not None} for r in rollouts]}


def all_ranks_pending(states: list[dict]) -> dict:
    """The checkpoint's PENDING_FILE from every trainer rank's `pack_pending` (rank order): one process's as it
    is; under torchrun {"ranks": [...]}, each rank's workers having sampled its own share ahead."""
    return states[0] if len(states) == 1 else {"ranks": states}


def rank_pending(state: dict | None, rank: int, world_size: int) -> dict | None:
    """This rank's part of a checkpoint's PENDING_FILE (`all_ranks_pending`); a ValueError where rollouts sampled
    ahead by another number of trainer ranks would have to be split anew."""
    if not state:
        return None
    ranks = state.get("ranks", [state])
    if len(ranks) != world_size:
        if any(part["steps"] for part in ranks):
            raise ValueError(f"resume: the checkpoint holds rollouts sampled ahead (max_staleness) by the workers of "
                             f"{len(ranks)} trainer process(es), each for its own share of the batch; resume it with "
                             f"{len(ranks)} process(es) (this run has {world_size})")
        return None
    return ranks[rank]


def unpack_pending(state: dict | None):
    """(step, examples, Rollout, weights' version) of each pending rollout of `pack_pending`."""
    from gspo.plugs.moe import RoutingRecord

    if not state:
        return []
    names = {f.name for f in fields(Rollout)}
    for r in state["rollouts"]:
        unknown = set(r) - names
        if unknown:
            raise ValueError(f"resume: {PENDING_FILE} holds rollout fields this version does not know: "
                             f"{sorted(unknown)}")
    examples = [[e["values"] if e["where"] is None else Row(e["values"], e["where"]) for e in batch]
                for batch in state["examples"]]
    rollouts = [Rollout(**{**r, **({"routing": RoutingRecord(**r["routing"])} if "routing" in r else {})})
                for r in state["rollouts"]]  # asdict made the routing record a dict
    return list(zip(state["steps"], examples, rollouts, state["versions"]))


__all__ = ["PENDING_FILE", "RolloutFeed", "all_ranks_pending", "pack_pending", "rank_pending", "unpack_pending"]
