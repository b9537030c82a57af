"""Stages 1 and 2 of a step, sample and score, as one plug: `OneRound` samples the step's B prompts once; with
`dynamic_sampling` (DAPO, arXiv 2503.14476 sec. 3.2) `DynamicSampling` drops the groups whose rewards all agree (a
group baseline gives them no advantage) and samples more prompts in extra rounds until the step holds B groups that
do not, or `max_sampling_rounds` ran; then the step is topped up with agreeing groups (`groups/filled_frac` < 1).

Each extra round draws ceil(oversample_factor x the groups still missing) prompts per rank from the prompt source
(every rank the same draw, keeping its own share, as for the step's first round) and samples them with the run's
sampler (a rollout worker too: it answers in the order asked, so a round samples after the steps already asked
ahead, with the weights of its time: `async/staleness_*` count each kept row's own). Under torchrun every rank runs
the same rounds (their size follows the rank missing most: fsdp's sampling forwards are collective) and fills its
own share. The prompt source's draws and the sampler's requests keep one order, so a checkpoint resumes exactly
(gspo/rollout/feed.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from gspo.algo.advantages import fill_groups, informative_groups
from gspo.plugs.parallel import Topology
from gspo.rollout import Rollout
from gspo.rollout.batch import join_rollouts
from gspo.rollout.feed import RolloutFeed
from gspo.step import Scores, gather_scores


@dataclass
class Drawn:
    """A step's sampled and scored groups: what stages 3-5 train on and report."""

    examples: list  # the global batch's data rows, one per group: every rank's B, in rank order
    rollout: Rollout  # this rank's B * G rows
    per_fn: dict  # reward function name -> (B * G,) this rank's raw values
    scores: Scores  # every rank's rows (N,)
    stats: dict  # the tasks' metrics, async/staleness_*, groups/* of dynamic sampling, time/extra_sampling_s
    generate_s: float  # seconds sampling the step's first round


@dataclass
class Round:
    """One sampling round of a step, as dynamic sampling keeps it."""

    examples: list  # the round's global data rows (every rank's share, in rank order)
    per_rank: int  # prompts per rank (n)
    informative: torch.Tensor  # (W, n) bool: every rank's groups whose rewards do not all agree
    rollout: Rollout  # this rank's n * G rows
    rewards: torch.Tensor  # (n * G,) this rank's rewards
    per_fn: dict  # reward function name -> (n * G,) this rank's values
    stale: float  # updates the weights that sampled it were behind the step's (0: in this process)


class OneRound:
    """The step's B prompts (this rank's share of the global batch), sampled once and scored."""

    def __init__(self, feed: RolloutFeed, source, topology: Topology, *, batch: int, group_size: int, drop_bad: bool,
                 timeout_s: float | None, stop_ids: list[int]):
        self.feed, self.source, self.topology = feed, source, topology
        self.batch, self.group_size, self.stop_ids = batch, group_size, stop_ids
        self.drop_bad, self.timeout_s = drop_bad, timeout_s

    def draw(self, step: int) -> Drawn:
        """Step `step`'s rollout (asked for max_staleness steps ago by rollout workers), scored: every rank then
        holds every sequence's scalars. A dropped sample (drop_bad_rewards) has a NaN reward."""
        t0 = time.perf_counter()
        examples, rollout = self.feed.next(step)
        generate_s = time.perf_counter() - t0
        rewards, per_fn, scores = self.score(examples[self.topology.batch_share(self.batch)], rollout,
                                             offset=self.topology.rank * self.batch)
        stats = {**self.source.observe(scores.rewards, scores.valid, self.group_size),  # several tasks: reweigh them
                 **self.feed.staleness(step)}
        return Drawn(examples, rollout, per_fn, scores, stats, generate_s)

    def score(self, rows: list, rollout: Rollout, offset: int) -> tuple[torch.Tensor, dict, Scores]:
        """(this rank's rewards (n,), its reward functions' values, every rank's Scores) of `rows`' rollout;
        `offset`: the first of `rows` in the latest global batch the prompt source drew."""
        rewards, per_fn = self.source.score(rows, rollout.prompts, rollout.completions, self.group_size,
                                            drop_bad=self.drop_bad, offset=offset, timeout_s=self.timeout_s,
                                            completion_ids=rollout.completion_token_ids(), episodes=rollout.episodes)
        return rewards, per_fn, gather_scores(self.topology, rollout, rewards, per_fn, self.stop_ids)


class DynamicSampling:
    """DAPO's dynamic sampling over a `OneRound` (module docstring). `grouped(scores)`: the (N,) samples whose
    rewards count in their group's statistics (overlong filtering may leave the truncated out); `pad`: the id the
    rounds' rollouts are joined with."""

    def __init__(self, first: OneRound, *, rounds: int, factor: float, grouped, pad: int):
        self.first, self.rounds, self.factor, self.grouped, self.pad = first, rounds, factor, grouped, pad

    def draw(self, step: int) -> Drawn:
        first, topology = self.first, self.first.topology
        B, G, W, rank = first.batch, first.group_size, topology.world_size, topology.rank
        drawn = first.draw(step)
        t0 = time.perf_counter()
        own = slice(rank * B * G, (rank + 1) * B * G)
        informative = informative_groups(drawn.scores.rewards, G, self.grouped(drawn.scores)).view(W, B)  # (W, B)
        rounds = [Round(drawn.examples, B, informative, drawn.rollout, drawn.scores.rewards[own], drawn.per_fn,
                        drawn.stats.get("async/staleness_max", 0.0))]
        sampled = [drawn.scores]  # every rank's rows of each round, for the sampled groups' statistics
        missing = (B - informative.sum(1)).clamp(min=0)  # (W,) groups each rank still needs
        rows_before = B * G * W  # the step's global rows sampled so far: an extra round's seeds follow them
        for round_ in range(1, self.rounds):
            if int(missing.max()) == 0:
                break
            n = math.ceil(int(missing.max()) * self.factor)  # prompts per rank (every rank the same)
            share = slice(rank * n, (rank + 1) * n)
            examples, rollout, version = first.feed.extra(step, round_, n * W, share,
                                                          first_row=rows_before + rank * n * G)
            rewards, per_fn, scores = first.score(examples[share], rollout, offset=rank * n)
            found = informative_groups(scores.rewards, G, self.grouped(scores)).view(W, n)  # (W, n)
            stale = 0.0 if version is None else float(step - 1 - version)
            rounds.append(Round(examples, n, found, rollout, rewards, per_fn, stale))
            sampled.append(scores)
            missing = (missing - found.sum(1)).clamp(min=0)
            rows_before += n * W * G
        extra_s = time.perf_counter() - t0
        stats = {**drawn.stats, **self.sampled_stats(rounds, sampled, B * W, missing), "time/extra_sampling_s": extra_s}
        if len(rounds) == 1:  # the first round was enough (or the only one allowed)
            return Drawn(drawn.examples, drawn.rollout, drawn.per_fn, drawn.scores, stats, drawn.generate_s)
        # every rank's choice (each knows every rank's groups): the global batch's rows, rank by rank
        chosen = [fill_groups(torch.cat([r.informative[k] for r in rounds]), B) for k in range(W)]  # (B,) each
        drawn_by_rank = [[e for r in rounds for e in r.examples[k * r.per_rank:(k + 1) * r.per_rank]] for k in range(W)]
        kept_examples = [drawn_by_rank[k][i] for k in range(W) for i in chosen[k].tolist()]
        mine = chosen[rank]
        rows = (mine[:, None] * G + torch.arange(G)).view(-1)  # (B * G,) this rank's rows of its rounds, joined
        rollout = join_rollouts([r.rollout for r in rounds], self.pad).select(rows)
        rewards = torch.cat([r.rewards for r in rounds])[rows]  # (B * G,)
        per_fn = {name: torch.cat([r.per_fn[name] for r in rounds])[rows] for name in rounds[0].per_fn}
        if "async/staleness_max" in stats:  # every kept row's own weights: the step's first round's or a later's
            stale = torch.tensor([r.stale for r in rounds for _ in range(r.per_rank)])[mine]  # (B,)
            own_stale = {"async/staleness_mean": float(stale.mean()), "async/staleness_max": float(stale.max())}
            stats.update({k: float(v) for k, v in topology.reduce(own_stale, dict.fromkeys(own_stale, B)).items()})
        scores = gather_scores(topology, rollout, rewards, per_fn, first.stop_ids)
        return Drawn(kept_examples, rollout, per_fn, scores, stats, drawn.generate_s)

    @staticmethod
    def sampled_stats(rounds: list[Round], sampled: list[Scores], wanted: int, missing: torch.Tensor) -> dict:
        """`groups/*` of the step's sampling (every rank's): groups sampled, the informative ones kept, how full
        the step is of them, the share of the sampled groups whose rewards agree, and the rounds taken; the
        sampled rows' mean reward (`reward/mean` is the kept rows'). `sampled`: each round's Scores."""
        agree = sum(int((~r.informative).sum()) for r in rounds)  # (W, n) each: every rank's groups
        total = sum(r.informative.numel() for r in rounds)
        kept = wanted - int(missing.sum())
        rewards = torch.cat([s.rewards[s.valid] for s in sampled])
        return {"groups/sampled": float(total), "groups/kept": float(kept), "groups/filled_frac": kept / wanted,
                "groups/sampled_zero_std_frac": agree / total, "groups/sampling_rounds": float(len(sampled)),
                "reward/sampled_mean": rewards.mean().item() if len(rewards) else math.nan}


__all__ = ["Drawn", "DynamicSampling", "OneRound", "Round"]
