"""Auxiliary-term plugs: losses beside the policy loss that share its optimizer step.

`SFTTerm` (sft_coef > 0, docs/multitask.md): minibatch i also fits part i of the batch's
reference answers, coef * NLL(reference | prompt), with its own forward outside routing replay.
`NoTerm` is its do-nothing twin. A term answers `begin_step(step, rows)` once per step and
`backward(i, model, scale)` once per minibatch, returning (its detached loss, its stats).
"""

from __future__ import annotations

from gspo.config import SFTTermSettings
from gspo.plugs.supervised import reference_chunks, require_references, sft_backward, sft_coef_at


def auxiliary_term(term: SFTTermSettings, tokenizer, device, train_rows: list[list[dict]], *, logp_kwargs: dict,
                   max_steps: int, num_minibatches: int, max_prompt_length: int, truncate_prompts: str):
    """The configured term: `SFTTerm` when sft_coef > 0 (some training row must have a reference), else `NoTerm`."""
    if term.sft_coef <= 0:
        return NoTerm()
    require_references(train_rows, term.sft_column)
    return SFTTerm(term, tokenizer, device, logp_kwargs=logp_kwargs, max_steps=max_steps,
                   num_minibatches=num_minibatches,
                   prompts=dict(max_prompt_length=max_prompt_length, truncate_prompts=truncate_prompts))


class NoTerm:
    def begin_step(self, step: int, rows: list[dict]) -> None:
        pass

    def backward(self, i: int, model, scale: float) -> tuple[float, dict]:
        return 0.0, {}


class SFTTerm:
    """coef * NLL of the references, the coefficient on `sft_schedule` over the run."""

    def __init__(self, term: SFTTermSettings, tokenizer, device, *, logp_kwargs: dict, max_steps: int,
                 num_minibatches: int, prompts: dict):
        self.term, self.tokenizer, self.device, self.prompts = term, tokenizer, device, prompts
        self.max_steps, self.num_minibatches = max_steps, num_minibatches
        self.coef, self.refs = 0.0, None
        self.logp_kwargs = logp_kwargs  # the NLL under the distribution the RL loss trains

    def begin_step(self, step: int, rows: list[dict]) -> None:
        """This step's coefficient and references: the global batch's rows with a reference, in M parts.

        Under torchrun every rank fits the whole (small) part i and takes 1/world of its gradient.
        """
        term = self.term
        self.coef = sft_coef_at(step, self.max_steps, term.sft_coef, term.sft_schedule)
        self.refs = reference_chunks(rows, self.tokenizer, self.num_minibatches, term.sft_column, device=self.device,
                                     **self.prompts) if self.coef > 0 else None

    def backward(self, i: int, model, scale: float) -> tuple[object, dict]:
        """Backpropagate coef * NLL of reference part i (gradients add to the policy loss's)."""
        if self.refs is None:  # the schedule reached 0, or no row of this batch has a reference
            return 0.0, {}
        term, nll = sft_backward(model, self.refs[i], self.coef * scale, **self.logp_kwargs)
        return term, {"loss/sft": nll, "sft/coef": self.coef}
