"""The reference policy pi_ref of the KL term (kl_coef > 0), a plug of the trainer:

    reference = reference_policy(cfg.kl_coef, model, topology)  # before the policy is wrapped or trained
    rollout.ref_logprobs = reference.logprobs(rollout, minibatches, logp_kwargs, writes)  # (n, T) or None

none (kl_coef = 0: nothing computed), a frozen copy of the starting policy (full fine-tuning), or the
policy itself with its LoRA adapters off (gspo/plugs/lora.py): the frozen base is the starting policy, so
the KL costs no second model.
"""

from __future__ import annotations

import copy

from gspo.algo.logprobs import minibatch_logprobs
from gspo.plugs.lora import is_peft
from gspo.plugs.parallel import Topology


class NoReference:
    """kl_coef = 0: no pi_ref."""

    def logprobs(self, rollout, minibatches, logp_kwargs, writes=None):
        return None


class FrozenReference:
    """A frozen copy of the starting policy (wrapped like the policy: fsdp shards it too)."""

    def __init__(self, model, topology: Topology):
        self.model = topology.wrap(frozen_copy(model))

    def logprobs(self, rollout, minibatches, logp_kwargs, writes=None):
        return minibatch_logprobs(self.model, rollout, minibatches, logp_kwargs, writes=writes)  # (n, T)


class AdaptersOff:
    """The LoRA policy with its adapters disabled: the frozen base (the bare model, never a DDP wrapper:
    these forwards take no gradient, so nothing is synchronised)."""

    def __init__(self, model):
        self.model = model

    def logprobs(self, rollout, minibatches, logp_kwargs, writes=None):
        with self.model.disable_adapter():
            return minibatch_logprobs(self.model, rollout, minibatches, logp_kwargs, writes=writes)  # (n, T)


def reference_policy(kl_coef: float, model, topology: Topology):
    """The run's reference plug (none at kl_coef 0); `model` is the bare policy as training starts (adapters
    attached)."""
    if kl_coef <= 0:
        return NoReference()
    return AdaptersOff(model) if is_peft(model) else FrozenReference(model, topology)


def frozen_copy(model):
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
