"""The plugs of the trainer, as `typing.Protocol`s: what the loop may ask of each (docs/design.md).

Every plug is built once before the loop, from its own config section, and has a do-nothing twin, so
`gspo/trainer.py` never asks which case it is in. These Protocols are the whole contract: a class
satisfies one by having its methods (no base class, no registration), and a test may swap in its own.

    plug            built by                        implementations
    Sampler         gspo.rollout.Sampler            one class over the GENERATORS registry (gspo, hf, vllm)
    Routing         gspo.plugs.routing.build_routing      NoRouting, MoERouting
    PromptSource    gspo.data.source.prompt_source  SingleTask, TaskMixture
    AuxiliaryTerm   gspo.plugs.auxiliary.auxiliary_term   NoTerm, SFTTerm
    Baseline        gspo.plugs.baselines.build_baseline   GroupBaseline, CriticBaseline
    Reference       gspo.plugs.reference.reference_policy NoReference, FrozenReference, AdaptersOff
    Rounds          gspo.run.build_run              OneRound, DynamicSampling (gspo/rounds.py)

The Topology (one process, DDP, FSDP2: gspo/plugs/parallel.py) is one concrete class, not a Protocol: its
single-process case is the identity of every collective.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: this module imports nothing at run time
    import torch

    from gspo.plugs.parallel import Part, Topology
    from gspo.rollout import Rollout

__all__ = ["AuxiliaryTerm", "Baseline", "PromptSource", "Reference", "Rounds", "Routing", "RoutingWatch", "Sampler"]


@runtime_checkable
class Sampler(Protocol):
    """Samples G completions per prompt from the policy (or its copy, or an engine, or a worker process) into one
    padded Rollout. The trainer's feed (gspo/rollout/feed.py) asks for a step's rollout with `request`, maybe
    steps early (max_staleness), and takes it with `receive`."""

    name: str  # the backend that samples: gspo, hf, vllm, workers

    def request(self, prompts: list[str], step, first_row: int, rows: list | None = None) -> None:
        """Rollout `step`'s prompts (this rank's) and their data rows (an environment's episodes start from them):
        sampled now or later, with the weights of the latest `sync`. `step`: a step, or (step, round) for a later
        round of dynamic sampling (gspo.rollout.batch.step_of); seeded rows are numbered from `first_row`."""

    def receive(self, step, wait: bool = True) -> Rollout | None:
        """Rollout `step`, with the sampler's log-probs (mu) where the run needs them; None without `wait` when it
        is not here yet."""

    def version_of(self, step) -> int | None:
        """How many `sync`s the weights that sampled rollout `step` had seen; None: sampled in the trainer's
        process."""

    def rng_after(self, step):
        """The sampler's own random state after sampling rollout `step` (a worker's), for checkpoints; None:
        none."""

    def sync(self, policy) -> dict:
        """Load the policy's new weights after the updates (nothing when the sampler is the policy); time/sync_s."""

    def close(self) -> None:
        """Release an engine or the workers; nothing otherwise."""


@runtime_checkable
class RoutingWatch(Protocol):
    """One minibatch's routing: replay around its forward and backward, drift measured around its update."""

    def replaying(self) -> AbstractContextManager: ...

    def recording(self) -> AbstractContextManager: ...

    def router_loss(self) -> tuple[torch.Tensor | float, dict]:
        """(the routers' load-balancing term to add to the loss, its moe/aux_loss statistic); (0.0, {}) without."""

    def after_step(self) -> tuple[dict, dict]:
        """(moe/* statistics, their weights) of the update just taken."""


@runtime_checkable
class Routing(Protocol):
    """MoE routing replay and the drift meter; a no-op on dense models."""

    records_pi_old: bool  # the pi_old forward records experts (old_policy replay): every minibatch's pi_old is computed
    records_sampling: bool  # the sampler records experts (rollout replay)

    def sampling_recorder(self, sampler=None):
        """A context manager recording the sampler's experts, or None."""

    def logprobs(self, model, rollout: Rollout, minibatches: list, logp_kwargs: dict, writes=None) -> torch.Tensor:
        """pi_old log-probs (N, T), minibatch by minibatch (recording or replaying experts where configured)."""

    def watch(self, mb: Rollout, stand_in: bool = False, model=None) -> RoutingWatch: ...


@runtime_checkable
class PromptSource(Protocol):
    """Where prompts come from (a single task is a one-task mixture) and how they are scored and evaluated."""

    @property
    def train_rows(self) -> list[list[dict]]: ...

    @property
    def eval_rows(self) -> list[list[dict]]: ...

    def next(self, n: int) -> list[dict]:
        """The next n prompt rows (the same on every rank)."""

    def score(self, rows: list[dict], prompts: list[str], completions: list[str], group_size: int, *,
              drop_bad: bool = False, offset: int = 0, timeout_s: float | None = None,
              completion_ids: list[list[int]] | None = None,
              episodes: list[dict] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Rewards (N,) and each reward function's raw values (N,); `episodes`: a multi-turn rollout's."""

    def observe(self, rewards: torch.Tensor, valid: torch.Tensor, group_size: int) -> dict[str, float]:
        """Per-task metrics of the latest batch (and, under dynamic weighting, new weights)."""

    def evaluate(self, model, tokenizer) -> dict[str, float]:
        """eval/* metrics on the held-out rows."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict, past_end: bool = False) -> None: ...


@runtime_checkable
class AuxiliaryTerm(Protocol):
    """A loss beside the policy loss that shares its optimizer step (the SFT term)."""

    def begin_step(self, step: int, rows: list[dict]) -> None: ...

    def backward(self, i: int, model, scale: float) -> tuple[Any, dict]:
        """Backpropagate minibatch i's part; (its detached loss, its statistics)."""


@runtime_checkable
class Baseline(Protocol):
    """Turns a step's rewards into advantages: the group's rewards, or PPO's critic (fitted on the same minibatches)."""

    needs_pi_old: bool  # advantages read pi_old (kl_in_reward): prepare computes it for every minibatch

    def estimate(self, rollout: Rollout, scores, parts: list[Part], topology: Topology) -> dict:
        """Set rollout.advantages ((n,) or (n, T)); advantages/* statistics."""

    def update(self, mb: Rollout, part: Part, step: int) -> dict:
        """Once per minibatch, after the policy's step (a critic's value loss); statistics."""

    def checkpoint_states(self) -> dict: ...

    def save(self, path) -> None: ...


@runtime_checkable
class Reference(Protocol):
    """pi_ref of the KL term: none, a frozen copy, or LoRA's base with the adapters off."""

    def logprobs(self, rollout: Rollout, minibatches: list, logp_kwargs: dict, writes=None) -> torch.Tensor | None:
        """pi_ref log-probs (N, T), or None without a KL term."""


@runtime_checkable
class Rounds(Protocol):
    """Stages 1-2 of a step, sample and score: the step's groups, sampled in one round (OneRound) or, with
    dynamic_sampling, in as many as fill it with groups whose rewards do not all agree (DynamicSampling)."""

    def draw(self, step: int) -> Any:
        """Step `step`'s gspo.rounds.Drawn: this rank's examples, rollout and reward values, every rank's Scores,
        and the step's sampling statistics."""
