"""The stages of one RL step after sampling: score, prepare, update (per minibatch) and metrics.

    rollout --gather_scores--> Scores (N,) --prepare--> Batch (pi_old, pi_ref, advantages, minibatch plan)
            --Learner.update x M x epochs--> per-minibatch stats --step_metrics--> one metrics line

Every stage works on this rank's rows and asks the Topology (gspo/plugs/parallel.py) for the little it
needs from other ranks; in one process each of those calls is the identity.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, replace

import numpy as np
import torch

from gspo.algo.advantages import group_stats
from gspo.algo.correction import behaviour_weights, correction_units, mismatch_metrics, mismatch_moments
from gspo.algo.logprobs import completion_logprobs
from gspo.algo.objectives import check_loss_options, objective_options, policy_loss, stat_units
from gspo.config import BatchSettings, CorrectionSettings, ObjectiveSettings, PrecisionSettings
from gspo.plugs.parallel import Part, Topology
from gspo.plugs.protocols import AuxiliaryTerm, Baseline, Reference, Routing
from gspo.rollout import Rollout


@dataclass
class Scores:
    """Per-sequence scalars of the whole global batch, (N,) each, the same on every rank."""

    rewards: torch.Tensor  # (N,) float32, NaN where a sample was dropped
    valid: torch.Tensor  # (N,) bool
    per_fn: dict  # reward function name -> (N,) its raw values
    lengths: torch.Tensor  # (N,) float32 completion tokens
    stopped: torch.Tensor  # (N,) bool: ended on a stop token (not at the length limit)
    prompt_lengths: torch.Tensor  # (N,) float32 prompt tokens


def gather_scores(topology: Topology, rollout: Rollout, rewards: torch.Tensor, per_fn: dict,
                  stop_ids: list[int]) -> Scores:
    """This rank's rewards, reward-function values, lengths and stop flags, joined with every rank's.

    One all-gather of (4 + functions) numbers per sequence; float64 on the wire, so every value
    comes back exactly in its own dtype.
    """
    lengths = rollout.completion_mask.sum(-1).float()  # (n,)
    prompt_lengths = rollout.attention_mask.sum(-1).float() - lengths  # (n,)
    stopped = ended_with_eos(rollout, stop_ids)  # (n,)
    local = [rewards, lengths, stopped, prompt_lengths, *per_fn.values()]
    every = topology.gather_rows(torch.stack([v.detach().cpu().double() for v in local]))  # (4 + F, N)
    back = [row.to(v.dtype) for row, v in zip(every, local)]
    rewards, lengths, stopped, prompt_lengths, *values = back
    return Scores(rewards, torch.isfinite(rewards), dict(zip(per_fn, values)), lengths, stopped, prompt_lengths)


def group_members(scores: Scores, plan: BatchSettings) -> torch.Tensor:
    """(N,) bool: the samples whose rewards count in their group's statistics: the valid ones, less the truncated
    where overlong filtering leaves them out of the groups (mask_truncated_completions, not truncated_in_groups)."""
    if plan.mask_truncated_completions and not plan.truncated_in_groups:
        return scores.valid & scores.stopped
    return scores.valid


@dataclass
class Batch:
    """What the updates of one step train on, computed once."""

    rollout: Rollout  # this rank's rows, with rewards, advantages, old_logprobs (pi_old), ref_logprobs, routing
    epochs: list  # num_epochs lists of M Parts: this rank's rows of each global minibatch
    first_on_policy: bool  # the first minibatch's pi_old is its own first training forward (left to update)
    stats: dict  # the baseline's: advantages/*, and a critic's value/explained_var

    def minibatches(self):
        """(i, part, on_policy) for every minibatch of every epoch, in training order."""
        for epoch, parts in enumerate(self.epochs):
            for i, part in enumerate(parts):
                yield i, part, self.first_on_policy and epoch == 0 and i == 0


def prepare(rollout: Rollout, scores: Scores, *, plan: BatchSettings, objective: ObjectiveSettings, logp_kwargs: dict,
            topology: Topology, routing: Routing, model, reference: Reference, baseline: Baseline,
            shuffle: torch.Generator) -> Batch:
    """The minibatch plan of every epoch, pi_old and pi_ref log-probs, advantages: the step's Batch.

    The plan partitions the global rollout from the shared `shuffle` generator, the same on every
    rank. Advantages come last, from the `baseline` (gspo/plugs/baselines.py: the group's rewards, or a
    critic's values once per rollout and GAE); a dropped sample gets 0.
    pi_old is computed once per rollout, on the first epoch's minibatch shapes. The first
    minibatch is on-policy (same weights, same shapes): its pi_old is its first training
    forward's own log-probs, detached (ratio exactly 1), so it is not computed here, unless
    routing replay "old_policy" (GSPO sec. 5.3) needs the experts this forward records.
    With use_sampler_logprobs (GSPO sec. 5.4) the sampler's likelihoods (mu) serve as pi_old.
    """
    device, M = rollout.input_ids.device, plan.num_minibatches
    rollout.rewards = scores.rewards[topology.batch_share(rollout.num_sequences)].to(device)  # (n,)
    token_units = stat_units(objective.objective, objective.aggregation)["loss/policy"] == "tokens"  # a share counts
    N = len(scores.rewards)
    chunks = [torch.randperm(N, generator=shuffle).chunk(M) for _ in range(plan.num_epochs)]  # global row numbers
    epochs = [[topology.part(idx, rollout.num_sequences, scores.lengths, token_units) for idx in c] for c in chunks]
    # overlong filtering: the updates train on the completions that ended (every rank keeps the same rows); pi_old,
    # pi_ref and the baseline still see every row, on the full plan
    trained = scores.stopped if plan.mask_truncated_completions else torch.ones(N, dtype=torch.bool)  # (N,)
    updates = epochs if trained.all() else [
        [topology.part(idx[trained[idx]], rollout.num_sequences, scores.lengths, token_units)
         for idx in c if trained[idx].any()] for c in chunks]  # a minibatch left empty: no optimizer step
    first_on_policy = (not objective.use_sampler_logprobs and not routing.records_pi_old and not baseline.needs_pi_old
                       and updates is epochs)  # a filtered first minibatch's forward does not cover its rows
    with torch.no_grad():
        if objective.use_sampler_logprobs:
            rollout.old_logprobs = rollout.sampler_logprobs  # (n, T)
        else:
            parts = epochs[0][1:] if first_on_policy else epochs[0]
            rollout.old_logprobs = routing.logprobs(model, rollout, [p.index for p in parts], logp_kwargs,
                                                    writes=[not p.stand_in for p in parts])  # (n, T)
        rollout.ref_logprobs = reference.logprobs(rollout, [p.index for p in epochs[0]], logp_kwargs,
                                                  writes=[not p.stand_in for p in epochs[0]])  # (n, T) or None
        grouped = replace(scores, valid=group_members(scores, plan))
        stats = baseline.estimate(rollout, grouped, epochs[0], topology)  # rollout.advantages (n,) or (n, T)
    if plan.mask_truncated_completions:
        stats["loss/masked_truncated_frac"] = 1.0 - trained.float().mean().item()
    return Batch(rollout, updates, first_on_policy, stats)


class Learner:
    """One optimizer step per minibatch: policy loss (+ auxiliary term), guard, statistics; then the
    baseline's own step (a critic's value loss; nothing for the group baseline).

    A rollout correction (`correction`) weighs each minibatch's terms by pi_old/mu, from its pi_old
    (for the on-policy minibatch: its own first forward) and the sampler's mu. `loss_kwargs`: the
    objective's options (`loss_options`), `logp_kwargs` the forwards' (`logprob_options`).
    """

    def __init__(self, model, optimizer, scheduler, guard, *, loss_kwargs: dict, logp_kwargs: dict,
                 correction: CorrectionSettings, max_grad_norm: float, topology: Topology, routing: Routing,
                 aux: AuxiliaryTerm, baseline: Baseline, loss_fn=policy_loss, autocast=nullcontext):
        self.model, self.optimizer, self.scheduler, self.guard = model, optimizer, scheduler, guard
        self.autocast = autocast  # the forwards' precision (gspo/plugs/precision.py); backwards run outside it
        self.topology, self.routing, self.aux, self.baseline, self.loss_fn = topology, routing, aux, baseline, loss_fn
        self.max_grad_norm, self.loss_kwargs, self.logp_kwargs = max_grad_norm, loss_kwargs, logp_kwargs
        self.correction = (correction.rollout_correction, correction.rollout_correction_low,
                           correction.rollout_correction_high)
        # what each statistic averages over (and the loss and entropy), for recombining them across ranks
        units = stat_units(loss_kwargs["objective"], loss_kwargs["aggregation"])
        self.units = {**units, **correction_units(correction.rollout_correction), "loss": units["loss/policy"],
                      "entropy": "tokens"}

    def update(self, batch: Batch, i: int, part: Part, *, on_policy: bool, step: int) -> dict:
        """Train minibatch `i` (this rank's `part` of it); returns its statistics (single-process values)."""
        rollout, model = batch.rollout, self.model
        mb = rollout.select(part.index)
        watch = self.routing.watch(mb, part.stand_in, model)
        with watch.replaying():
            with self.autocast(), watch.recording():
                logp, entropy = completion_logprobs(model, mb.input_ids, mb.attention_mask, mb.completion_len,
                                                    with_entropy=True, position_ids=mb.position_ids,
                                                    **self.logp_kwargs)  # (n, t), (n, t)
            if on_policy:  # prepare left this minibatch's pi_old to this forward
                mb.old_logprobs = logp.detach()  # (n, t)
                if not part.stand_in:
                    rollout.old_logprobs[part.index, : mb.completion_len] = mb.old_logprobs
            weight, correction_stats = behaviour_weights(mb.old_logprobs, mb.sampler_logprobs, mb.completion_mask,
                                                         *self.correction)  # (n, t) or None
            loss, stats = self.loss_fn(logp, mb.old_logprobs, mb.advantages, mb.completion_mask,
                                       ref_logprobs=mb.ref_logprobs, correction_weight=weight, **self.loss_kwargs)
            balance, balance_stats = watch.router_loss()  # the routers' load-balancing term (0.0 without)
            loss = loss + balance
            stats.update(correction_stats, **balance_stats)
            self.optimizer.zero_grad(set_to_none=True)
            scaled = loss if self.guard.scaler is None else self.guard.scaler.scale(loss)  # fp16: loss x scale
            self.topology.backward(scaled, part)  # this rank's share of the minibatch's loss
        with self.autocast():  # the SFT term's forward (its backward's ops take their dtypes from that forward)
            term, aux_stats = self.aux.backward(i, model, self.topology.replicated_scale())
        self.topology.average_gradients(model)
        mask = mb.completion_mask
        local = {**stats, "loss": loss.detach(), "entropy": (entropy.detach() * mask).sum() / mask.sum()}
        real = 0.0 if part.stand_in else 1.0  # a stand-in row's statistics count for nothing
        counts = {"sequences": real * mb.num_sequences, "tokens": real * float(mask.sum())}
        shared = self.topology.reduce(local, {k: counts[self.units.get(k, "tokens")] for k in local})
        loss, mean_entropy = shared.pop("loss") + term, shared.pop("entropy")
        if self.guard.scaler is not None:
            self.guard.scaler.unscale_(self.optimizer)  # fp16: the true gradients, before their norm and clip
            aux_stats["precision/loss_scale"] = float(self.guard.scaler.get_scale())
        stats = {**shared, **aux_stats, "grad/norm": grad_norm(model, self.max_grad_norm)}
        step_or_skip(self.optimizer, self.scheduler, self.guard, step, loss, stats["grad/norm"])
        stats["entropy"] = mean_entropy
        stats.update(self.topology.reduce(*watch.after_step()))
        with self.autocast():
            stats.update(self.baseline.update(mb, part, step))  # the critic learns from the same minibatch
        return stats


def mismatch_stats(rollout: Rollout, topology: Topology) -> dict[str, float]:
    """`mismatch/*` of the step's whole rollout, sampler (mu) against the trainer's pi_old; {} without mu.

    Taken after the updates, when every row's pi_old is known (the on-policy minibatch's comes
    from its first training forward). Not logged when pi_old is mu itself (use_sampler_logprobs).
    """
    if rollout.sampler_logprobs is None or rollout.old_logprobs is rollout.sampler_logprobs:
        return {}
    moments, units = mismatch_moments(rollout.old_logprobs, rollout.sampler_logprobs, rollout.completion_mask)
    counts = {"tokens": float(rollout.completion_mask.sum()), "sequences": float(rollout.num_sequences)}
    return mismatch_metrics(topology.reduce(moments, {k: counts[u] for k, u in units.items()}))


def episode_stats(rollout: Rollout, topology: Topology) -> dict[str, float]:
    """`episode/*` of a multi-turn rollout, means over the step's episodes (every rank's); {} for single turns:
    turns, tool calls and tool errors per episode, the share a limit truncated, the share of the tokens after
    the prompts that the environment wrote (never trained), and the environment's reward where it gives one."""
    if rollout.episodes is None:
        return {}
    n, eps = float(len(rollout.episodes)), rollout.episodes
    stats = {"episode/turns_mean": sum(e["turns"] for e in eps) / n,
             "episode/tool_calls": sum(e["tool_calls"] for e in eps) / n,
             "episode/tool_errors": sum(e["tool_errors"] for e in eps) / n,
             "episode/truncated_frac": sum(e["truncated"] for e in eps) / n,
             "episode/observation_token_frac": sum(e["observation_tokens"] for e in eps)
             / max(1, sum(e["tokens"] for e in eps))}
    if "agent_error" in eps[0]:  # agent episodes (gspo/rollout/agents.py)
        stats["episode/agent_errors"] = sum(e["agent_error"] for e in eps) / n
        stats["episode/sequences_mean"] = sum(e["sequences"] for e in eps) / n
        stats["episode/calls_mean"] = sum(e["calls"] for e in eps) / n
    weights = dict.fromkeys(stats, n)
    for name in sorted({name for e in eps for name in e.get("scores", ())}):  # an agent's own scores: reward/<name>
        given = [e["scores"][name] for e in eps if name in e.get("scores", ())]
        stats[f"reward/{name}"], weights[f"reward/{name}"] = sum(given) / len(given), float(len(given))
    weights["episode/observation_token_frac"] = float(sum(e["tokens"] for e in eps))
    rewarded = [e["env_reward"] for e in eps if e["env_reward"] is not None]
    # every rank reduces the same keys; one without rewarded episodes weighs 0, and none anywhere leaves it out
    stats["episode/env_reward_mean"] = sum(rewarded) / len(rewarded) if rewarded else math.nan
    weights["episode/env_reward_mean"] = float(len(rewarded))
    return {k: float(v) for k, v in topology.reduce(stats, weights).items() if not math.isnan(float(v))}


def logprob_options(temperature: float, precision: PrecisionSettings) -> dict:
    """`completion_logprobs` options of a run: every forward (pi_old, pi_ref, training, SFT) uses the same."""
    return dict(temperature=temperature, chunk_size=precision.logprob_chunk_size, packed=precision.padding_free)


def loss_options(objective: ObjectiveSettings, *, norm_length: int, kl_in_reward: bool) -> dict:
    """`policy_loss` options of a run, checked here once (`check_loss_options`), so that the loss of each
    minibatch runs without re-checking them or syncing on its tensors' values (`validate=False`); with
    kl_in_reward (gae) the KL is folded into the rewards instead. `options`: the objective's own, every one
    of them (the run's `objective_options` over the objective's defaults)."""
    own = objective_options(objective.objective, objective.objective_options, "objective_options")
    options = dict(objective=objective.objective, clip_low=objective.clip_low, clip_high=objective.clip_high,
                   aggregation=objective.aggregation, norm_length=norm_length,
                   kl_coef=0.0 if kl_in_reward else objective.kl_coef, kl_estimator=objective.kl_estimator,
                   options=own)
    check_loss_options(**options)
    return {**options, "validate": False}


def step_metrics(scores: Scores, step_stats: list[dict], extra: dict, *, group_size: int, drop_bad: bool,
                 skipped: int, lr: float, t_generate: float, t_rollout: float, t_train: float) -> dict:
    """One step's metrics line (before evaluation): rewards, groups, `extra`, losses and ratios, lengths, time
    (`time/generate_s` is the sampling part of `time/rollout_s`)."""
    rewards, valid, lengths = scores.rewards, scores.valid, scores.lengths
    return {
        "reward/mean": rewards[valid].mean().item(),
        "reward/std": rewards[valid].std().item(),
        **{f"reward/{name}": float(np.nanmean(v.numpy())) if not torch.isnan(v).all() else float("nan")
           for name, v in scores.per_fn.items()},
        **group_stats(rewards, group_size, valid),
        **extra,  # the tasks' weights, the sampler's sync time and mismatch
        **({"reward/dropped": int((~valid).sum())} if drop_bad else {}),
        "guard/skipped_steps": skipped,
        **reduce_stats(step_stats),
        "completion/mean_len": lengths.mean().item(),
        "completion/max_len": lengths.max().item(),
        "completion/truncated_frac": (~scores.stopped).float().mean().item(),
        "prompt/mean_len": scores.prompt_lengths.mean().item(),
        "lr": lr,
        "time/generate_s": t_generate,
        "time/rollout_s": t_rollout,
        "time/train_s": t_train,
        "throughput/tokens_per_s": lengths.sum().item() / (t_rollout + t_train),
    }


def reduce_stats(step_stats: list[dict]) -> dict[str, float]:
    """Average minibatch stats over the step; extremes of the ratio keep their extremes.

    `grad/norm_std` is the spread of the gradient norm across the step's minibatches (GSPO
    sec. 4: token-level ratios make gradients noisier); 0 with a single minibatch.
    """
    out = {}
    for key in step_stats[0] if step_stats else ():  # none: every minibatch was left empty (overlong filtering)
        values = torch.stack([torch.as_tensor(s[key]).float() for s in step_stats])
        if key == "ratio/min":
            out[key] = values.min().item()
        elif key == "ratio/max":
            out[key] = values.max().item()
        else:
            out[key] = values.mean().item()
        if key == "grad/norm":
            out["grad/norm_std"] = values.std().item() if len(values) > 1 else 0.0
    return out


def step_or_skip(optimizer, scheduler, guard, step: int, loss: torch.Tensor, norm: torch.Tensor) -> None:
    """The optimizer and schedule step when loss and gradient norm are finite; otherwise the non-finite
    guard skips it (gradients dropped): weights never take a NaN/inf step, nor does the schedule advance.
    Under fp16 the step goes through the guard's loss scaler (gradients already unscaled), which then
    updates its scale (halved after an overflow)."""
    if torch.isfinite(loss) and torch.isfinite(norm):
        if guard.scaler is not None:
            guard.scaler.step(optimizer)  # the optimizer's step (gradients unscaled, found finite)
        else:
            optimizer.step()
        scheduler.step()
        guard.ok()
    else:
        guard.skip(step, loss, norm)
    # the gradients are spent: freed now, not at the next backward, so the next minibatch's forward, the next
    # rollout's sampling and pi_old do not hold them (SmolLM2, full fine-tuning: 0.5 GiB)
    optimizer.zero_grad(set_to_none=True)
    if guard.scaler is not None:
        guard.scaler.update()


def grad_norm(model, max_norm: float) -> torch.Tensor:
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor


def ended_with_eos(rollout: Rollout, stop_ids: list[int]) -> torch.Tensor:
    """(N,) True where the completion stopped on a stop token rather than at the length limit."""
    T = rollout.completion_len
    completion = rollout.input_ids[:, -T:]  # (N, T)
    # (N,) index of the last token of the model's (an episode's observations are not; a prefix otherwise)
    last = T - 1 - rollout.completion_mask.flip(-1).int().argmax(-1)
    final = completion.gather(1, last[:, None]).squeeze(1)  # (N,)
    return torch.isin(final, torch.tensor(stop_ids, device=final.device))


def token_mean(advantage: torch.Tensor, mask: torch.Tensor) -> float:
    """A sequence's advantage as a number: itself, or the mean over its tokens of per-token ones."""
    return advantage.item() if advantage.dim() == 0 else float(advantage[mask].mean())


def sample_records(rollout: Rollout, count: int, per_fn: dict) -> list[dict]:
    """samples.jsonl's lines: the first `count` rows of this rank's rollout, each with its reward (the weighted
    total, NaN where dropped), each reward function's own value (`per_fn`: name -> (n,) this rank's values, as
    the prompt source scored them; NaN where a function gave none) and its advantage. A multi-turn episode's
    also hold its transcript as ["model" | "env", text] segments (only the model's were trained) and its turns
    and tool calls."""
    records = [{"prompt": rollout.prompts[i], "completion": rollout.completions[i],
                "reward": rollout.rewards[i].item(), "rewards": {name: v[i].item() for name, v in per_fn.items()},
                "advantage": token_mean(rollout.advantages[i], rollout.completion_mask[i])}
               for i in range(min(count, rollout.num_sequences))]
    for i, rec in enumerate(records if rollout.episodes is not None else ()):
        episode = rollout.episodes[i]
        rec.update(transcript=episode["segments"], turns=episode["turns"], tool_calls=episode["tool_calls"],
                   tool_errors=episode["tool_errors"], truncated=episode["truncated"])
    return records
