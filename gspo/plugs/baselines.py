"""Baselines: the plug that turns a step's rewards into advantages, with or without a learned critic.

`GroupBaseline` (every sequence estimator: group, batch, none, rloo, reinforce_pp, ...): no model;
each sequence's reward against its group or batch (gspo.algo.advantages), one advantage per sequence.
`CriticBaseline` (advantage_estimator=gae, PPO): a value model (gspo/plugs/critic.py) gives a value per
completion token, computed once per rollout like pi_old; GAE turns the per-token rewards (the
reward on the last token, optionally minus kl_coef * KL per token) and those values into per-token
advantages and returns; the critic is then trained on the policy's minibatches, after the
policy's optimizer step, with its own AdamW and the clipped value loss (gspo/algo/values.py).

A baseline answers, so the trainer never asks which one it holds:
  needs_pi_old             advantages read pi_old (kl_in_reward): prepare computes it for every minibatch
  estimate(rollout, scores, parts)   sets rollout.advantages (and the critic's old_values, returns); stats
  update(mb, part, step)   once per minibatch, after the policy's step; stats
  checkpoint_states()      {file: state} for a checkpoint (every rank calls it; rank 0's is written)
  save(path)               the final critic (rank 0 writes; every rank calls it)
"""

from __future__ import annotations

import torch

from gspo.algo.advantages import gae, group_advantages
from gspo.algo.values import explained_variance_of, token_moments, value_loss
from gspo.checkpoint import CRITIC_FILE, check_finite_state, load_state_file
from gspo.config import AdvantageSettings
from gspo.plugs.critic import completion_values, load_value_model, save_value_model, terminal_rewards, value_model_from
from gspo.plugs.parallel import Part, Topology
from gspo.rollout import Rollout
from gspo.rollout.batch import one_sequence_per_row
from gspo.runtime import NonFiniteGuard
from gspo.step import grad_norm, step_or_skip


def build_baseline(adv: AdvantageSettings, policy, topology: Topology, make_optimizer, checkpoint=None, *,
                   group_size: int, learning_rate: float, max_grad_norm: float, max_consecutive_skips: int,
                   kl_coef: float, packed: bool, trust_remote_code: bool = False):
    """The baseline of `adv` (AdvantageSettings). For gae the critic is built from `adv.critic_model` (loaded with
    `trust_remote_code`) or a copy of the (unwrapped) policy, takes the checkpoint's critic when resuming (before
    fsdp shards it), is wrapped like the policy, and gets `make_optimizer(module, lr) -> (optimizer, scheduler)`.

    What it shares with the run: `group_size` (G, num_generations), `learning_rate` (the critic's where
    critic_learning_rate is None), `max_grad_norm` and `max_consecutive_skips` (the critic's clip and guard),
    `kl_coef` (kl_in_reward's per-token penalty), `packed` (padding_free: the critic's forwards too)."""
    if adv.advantage_estimator != "gae":
        return GroupBaseline(adv.advantage_estimator, group_size)
    if adv.critic_model is None:
        critic = value_model_from(policy)
    else:
        first = next(policy.parameters())  # the policy's dtype and device
        critic = load_value_model(adv.critic_model, dtype=first.dtype, device=first.device,
                                  trust_remote_code=trust_remote_code)
    state = None
    if checkpoint is not None:
        file = checkpoint / CRITIC_FILE
        if not file.is_file():
            raise ValueError(f"resume: {checkpoint} holds no {CRITIC_FILE}, but advantage_estimator=gae trains a "
                             "critic")
        state = load_state_file(file)
        check_finite_state(state, str(file))
        critic.load_state_dict(state["model"])
    critic = topology.wrap(critic)
    optimizer, scheduler = make_optimizer(critic, adv.critic_learning_rate or learning_rate)
    guard = NonFiniteGuard(max_consecutive_skips, "critic steps", "critic_learning_rate")
    if state is not None:
        if topology.sharded:
            topology.load_optimizer_state(critic, optimizer, state["optimizer"])
        else:
            optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        guard.load_state_dict(state["guard"])
    return CriticBaseline(adv, critic, optimizer, scheduler, guard, topology, kl_coef=kl_coef,
                          max_grad_norm=max_grad_norm, packed=packed)


class GroupBaseline:
    """No critic: a registered sequence estimator over the global batch's rewards (N,)."""

    needs_pi_old = False

    def __init__(self, estimator: str, group_size: int):
        self.estimator, self.group_size = estimator, group_size

    def estimate(self, rollout: Rollout, scores, parts: list[Part], topology: Topology) -> dict:
        advantages = group_advantages(scores.rewards, self.group_size, estimator=self.estimator,
                                      valid=scores.valid)  # (N,) every rank the same
        rollout.advantages = advantages[topology.batch_share(rollout.num_sequences)].to(rollout.input_ids.device)
        kept = advantages[scores.valid].double()  # (N_valid,)
        return {"advantages/mean": kept.mean().item(), "advantages/std": kept.std(unbiased=False).item()}

    def update(self, mb: Rollout, part: Part, step: int) -> dict:
        return {}

    def checkpoint_states(self) -> dict:
        return {}

    def save(self, path) -> None:
        pass


class CriticBaseline:
    """PPO's learned baseline: values once per rollout, GAE, the critic fitted on every minibatch."""

    def __init__(self, adv: AdvantageSettings, critic, optimizer, scheduler, guard: NonFiniteGuard,
                 topology: Topology, *, kl_coef: float, max_grad_norm: float, packed: bool):
        self.critic, self.optimizer, self.scheduler, self.guard, self.topology = (critic, optimizer, scheduler, guard,
                                                                                  topology)
        self.gamma, self.lam, self.clip = adv.gae_gamma, adv.gae_lambda, adv.value_clip
        self.whiten = adv.whiten_advantages
        self.vf_coef, self.max_grad_norm = adv.vf_coef, max_grad_norm
        self.kl_reward_coef = kl_coef if adv.kl_in_reward else 0.0  # 0: the KL stays in the loss (or is off)
        self.needs_pi_old = adv.kl_in_reward
        self.packed = packed  # the critic's forwards padding-free too (padding_free)

    def estimate(self, rollout: Rollout, scores, parts: list[Part], topology: Topology) -> dict:
        """Per-token advantages (n, T), old_values and returns of this rank's rows; `advantages/*` and
        `value/explained_var` of the whole rollout (before whitening, over the valid rows' tokens)."""
        mask = rollout.completion_mask  # (n, T)
        valid = torch.isfinite(rollout.rewards)  # (n,) a dropped sample: no reward, no advantage, not fitted
        keep = mask & valid[:, None]  # (n, T)
        with torch.no_grad():
            values = self._values(rollout, parts)  # (n, T) float32
        rewards = terminal_rewards(torch.where(valid, rollout.rewards, 0.0).float(), mask)  # (n, T)
        if self.kl_reward_coef:  # InstructGPT: r_t - beta * (log pi_old - log pi_ref), the k1 estimate per token
            rewards = rewards - self.kl_reward_coef * (rollout.old_logprobs - rollout.ref_logprobs).float()
        advantages, returns = gae(rewards, values, mask, self.gamma, self.lam)  # (n, T) each
        moments = token_moments(keep, adv=advantages, ret=returns, err=returns - values)
        count = float(keep.sum())
        m = topology.reduce(moments, dict.fromkeys(moments, count))  # the whole rollout's token means
        mean, std = float(m["adv"]), max(float(m["adv_sq"]) - float(m["adv"]) ** 2, 0.0) ** 0.5
        if self.whiten:  # PPO: advantages normalised over the batch's tokens
            advantages = (advantages - mean) / (std + 1e-8)
        rollout.advantages = torch.where(keep, advantages, 0.0)  # (n, T)
        rollout.old_values, rollout.returns = values, returns  # (n, T)
        return {"advantages/mean": mean, "advantages/std": std, "value/explained_var": explained_variance_of(m),
                "value/returns_mean": float(m["ret"])}

    def _values(self, rollout: Rollout, parts: list[Part]) -> torch.Tensor:
        """(n, T) values, minibatch by minibatch on training's trimmed shapes (fsdp: every rank runs each forward)."""
        one_sequence_per_row(rollout, "a critic (advantage_estimator: gae)")
        out = torch.zeros(rollout.completion_mask.shape, dtype=torch.float32, device=rollout.input_ids.device)
        for part in parts:
            mb = rollout.select(part.index)
            values = completion_values(self.critic, mb.input_ids, mb.attention_mask, mb.completion_len,
                                       self.packed)  # (n, t)
            if not part.stand_in:  # a stand-in row's forward is only there for fsdp's collectives
                out[part.index, : mb.completion_len] = values
        return out

    def update(self, mb: Rollout, part: Part, step: int) -> dict:
        """One critic step on minibatch `mb` (this rank's `part`): the clipped value loss, a token mean."""
        keep = mb.completion_mask & torch.isfinite(mb.rewards)[:, None]  # (n, t)
        fitted = bool(keep.any())  # every row dropped: the forward runs (fsdp), nothing is fitted
        values = completion_values(self.critic, mb.input_ids, mb.attention_mask, mb.completion_len,
                                   self.packed)  # (n, t)
        loss, stats = value_loss(values, mb.old_values, mb.returns, keep if fitted else mb.completion_mask, self.clip)
        self.optimizer.zero_grad(set_to_none=True)
        self.topology.backward(self.vf_coef * loss * fitted, part.by_tokens())  # its share of the token mean
        self.topology.average_gradients(self.critic)
        tokens = 0.0 if part.stand_in else float(keep.sum())
        shared = self.topology.reduce(stats, dict.fromkeys(stats, tokens))
        norm = grad_norm(self.critic, self.max_grad_norm)
        # the critic's own non-finite guard: its weights never take a NaN step
        step_or_skip(self.optimizer, self.scheduler, self.guard, step, torch.as_tensor(shared["loss/value"]), norm)
        return {**shared, "value/grad_norm": norm, "value/skipped_steps": self.guard.skipped}

    def checkpoint_states(self) -> dict:
        full = self.topology.full_state(self.critic, self.optimizer)  # fsdp: gathered onto rank 0
        if not self.topology.is_main:
            return {}
        model = full["model_state_dict"] if self.topology.sharded else self.critic.state_dict()
        optimizer = full["optimizer_state_dict"] if self.topology.sharded else self.optimizer.state_dict()
        return {CRITIC_FILE: {"model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict(),
                              "guard": self.guard.state_dict()}}

    def save(self, path) -> None:
        state = self.topology.full_weights(self.critic)  # fsdp: every rank helps gather; None when not sharded
        if self.topology.is_main:
            save_value_model(self.critic, path, state_dict=state)
