"""Auxiliary-term plugs: losses beside the policy loss that share its optimizer step.

`SFTTerm` (sft_coef > 0, docs/multitask.md): minibatch i also fits part i of the batch's
reference answers, coef * NLL(reference | prompt), with its own forward outside routing replay.
`NoTerm` is its do-nothing twin. A term answers `begin_step(step, rows)` once per step and
`backward(i, model, scale)` once per minibatch, returning (its detached loss, its stats).
"""

from __future__ import annotations

from gspo.step import logprob_options
from gspo.supervised import reference_chunks, require_references, sft_backward, sft_coef_at


def auxiliary_term(cfg, tokenizer, device, train_rows: list[list[dict]]):
    """The configured term: `SFTTerm` when sft_coef > 0 (some training row must have a reference), else `NoTerm`."""
    if cfg.sft_coef <= 0:
        return NoTerm()
    require_references(train_rows, cfg.sft_column)
    return SFTTerm(cfg, tokenizer, device)


class NoTerm:
    def begin_step(self, step: int, rows: list[dict]) -> None:
        pass

    def backward(self, i: int, model, scale: float) -> tuple[float, dict]:
        return 0.0, {}


class SFTTerm:
    """coef * NLL of the references, the coefficient on `sft_schedule` over the run."""

    def __init__(self, cfg, tokenizer, device):
        self.cfg, self.tokenizer, self.device = cfg, tokenizer, device
        self.coef, self.refs = 0.0, None
        self.logp_kwargs = logprob_options(cfg)  # the NLL under the distribution the RL loss trains

    def begin_step(self, step: int, rows: list[dict]) -> None:
        """This step's coefficient and references: the global batch's rows with a reference, in M parts.

        Under torchrun every rank fits the whole (small) part i and takes 1/world of its gradient.
        """
        cfg = self.cfg
        self.coef = sft_coef_at(step, cfg.max_steps, cfg.sft_coef, cfg.sft_schedule)
        self.refs = reference_chunks(rows, self.tokenizer, cfg.num_minibatches, cfg.sft_column,
                                     max_prompt_length=cfg.max_prompt_length, device=self.device,
                                     truncate_prompts=cfg.truncate_prompts) if self.coef > 0 else None

    def backward(self, i: int, model, scale: float) -> tuple[object, dict]:
        """Backpropagate coef * NLL of reference part i (gradients add to the policy loss's)."""
        if self.refs is None:  # the schedule reached 0, or no row of this batch has a reference
            return 0.0, {}
        term, nll = sft_backward(model, self.refs[i], self.coef * scale, **self.logp_kwargs)
        return term, {"loss/sft": nll, "sft/coef": self.coef}
