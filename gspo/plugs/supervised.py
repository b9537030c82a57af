"""Supervised NLL of reference completions, for `gspo sft` and for the RL run's `sft_coef` term.

One encoding serves both: a reference is its prompt's tokens, then the reference text's tokens
(no special tokens) and the closing EOS (`reference_ids`), padded with `gspo.rollout.pad_id`. The
loss is the token mean of -log p over the reference tokens, EOS included.

The two callers lay the same tokens out for the forward they run:
- `gspo sft` (`encode_pairs`, `collate`): prompt + answer right-padded as one sequence, with
  labels -100 on prompt and padding; the log-probs of the shifted labels go into `sft_nll`.
- the RL term (`reference_chunks`, `sft_backward`): the rollout layout (prompts encoded and
  left-padded as the sampler encodes them, references right-padded after them), so that the NLL
  (`sft_nll`) is taken with `completion_logprobs` under the temperature the RL loss trains.
  `sft_coef * NLL(reference + EOS | prompt)` joins the policy loss of each minibatch, logged as
  `loss/sft` (the NLL) and `sft/coef` (the coefficient after its schedule, `sft_coef_at`).
"""

from __future__ import annotations

import torch

from gspo.algo import schedules
from gspo.algo.logprobs import completion_logprobs
from gspo.data.rows import where
from gspo.rollout import Rollout, encode_prompts, eos_ids, pad_id


def has_reference(row: dict, column: str) -> bool:
    """True when the row holds a non-empty reference text in `column`."""
    return isinstance(row.get(column), str) and bool(row[column])


def reference_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a reference completion: the text's tokens (no special tokens), then EOS."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_ids(tokenizer)[0]]


# ------------------------------------------------------------------------------- gspo sft
def encode_pairs(tokenizer, rows: list[dict], answer_column: str, max_length: int) -> list[tuple[list[int], int]]:
    """Token ids of prompt + answer + EOS, and where the answer starts; every row needs its answer."""
    eos_ids(tokenizer)  # a tokenizer without eos is refused before any row is read
    out = []
    for i, r in enumerate(rows):
        if answer_column not in r or not isinstance(r[answer_column], str):
            raise ValueError(f"dataset: {where(r, i)}: no text column {answer_column!r} (the SFT target)")
        prompt = tokenizer(r["prompt"])["input_ids"]
        answer = reference_ids(tokenizer, r[answer_column])
        if len(prompt) + len(answer) > max_length:
            raise ValueError(f"dataset: {where(r, i)}: prompt + answer have {len(prompt) + len(answer)} tokens > "
                             f"max_length={max_length}")
        out.append((prompt + answer, len(prompt)))
    return out


def collate(pairs: list[tuple[list[int], int]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, mask and labels (-100 on prompt and padding). Shapes (b, L)."""
    width = max(len(ids) for ids, _ in pairs)
    ids = torch.full((len(pairs), width), pad)  # (b, L)
    labels = torch.full((len(pairs), width), -100)  # (b, L)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)  # (b, L)
    for i, (seq, start) in enumerate(pairs):
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, start : len(seq)] = torch.tensor(seq[start:])
        mask[i, : len(seq)] = 1
    return ids, mask, labels


def labelled_nll(model, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`sft_nll` of a right-padded batch: ids, mask (b, L) and labels (b, L), -100 where a token is not
    trained (the prompt, padding; a demonstration episode's tool output)."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()  # (b, L-1, V): token t+1 at t
    targets = labels[:, 1:]  # (b, L-1), -100 off the trained tokens
    logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)  # (b, L-1)
    return sft_nll(logp, targets != -100)  # token mean over the trained tokens


# ------------------------------------------------------------------------------- the RL run's term
def sft_nll(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the reference tokens: -sum(logp * mask) / sum(mask).

    logprobs: (n, T) log-probs of the reference tokens (e.g. `completion_logprobs`); mask: (n, T)
    bool, True on reference tokens (the closing EOS included). A token mean, like `gspo sft`'s loss.
    Example: p = (1/2, 1/4 | 1/8), NLL = (ln 2 + ln 4 + ln 8) / 3 = 2 ln 2.
    """
    if logprobs.shape != mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and mask {tuple(mask.shape)} must have the same shape")
    mask = mask.bool()
    count = mask.sum()
    if count == 0:
        raise ValueError("mask selects no reference token")
    return -torch.where(mask, logprobs, 0.0).sum() / count  # where, not *: a masked -inf must not give NaN


def sft_coef_at(step: int, max_steps: int, coef: float, schedule: str = "constant") -> float:
    """The SFT coefficient at RL step `step` (1-based): `schedules.schedule` over `max_steps`, no warmup.

    linear: coef * (1 - (step - 1) / max_steps); cosine: coef * (1 + cos(pi (step - 1) / max_steps)) / 2.
    Example: coef 0.5, max_steps 4, linear: 0.5, 0.375, 0.25, 0.125.
    """
    return schedules.schedule(schedule, step - 1, max_steps, peak=coef)


def require_references(row_lists: list[list[dict]], column: str) -> None:
    """ValueError unless some training row has a reference text in `column` (sft_coef > 0 needs one)."""
    if not any(has_reference(r, column) for rows in row_lists for r in rows):
        raise ValueError(f"config: sft_coef > 0 but no training row has a text column {column!r} (sft_column); "
                         "built-in tasks have `solution`")


def reference_chunks(rows: list[dict], tokenizer, num_chunks: int, column: str, *, max_prompt_length: int,
                     device, truncate_prompts: str = "error") -> list[Rollout] | None:
    """Prompt + reference + EOS of the rows with a `column` text, in the rollout layout, in `num_chunks` parts.

    Part j goes with minibatch j: references i = j, j + M, j + 2M, ...; with fewer references than
    parts, part j holds reference j mod n, so every minibatch has one. None when no row has a
    reference. Each part is a `Rollout` trimmed of all-padding columns (only ids and masks set).
    """
    refs = [r for r in rows if has_reference(r, column)]
    if not refs:
        return None
    eos_ids(tokenizer)  # a tokenizer without eos is refused before anything is encoded
    pad = pad_id(tokenizer)
    prompts = [r["prompt"] for r in refs]
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, max_prompt_length, device,
                                             truncate_prompts)  # (n, P)
    answers = [reference_ids(tokenizer, r[column]) for r in refs]
    T = max(len(a) for a in answers)
    answer_ids = torch.full((len(refs), T), pad, dtype=prompt_ids.dtype)  # (n, T)
    answer_mask = torch.zeros(len(refs), T, dtype=torch.bool)  # (n, T)
    for i, a in enumerate(answers):
        answer_ids[i, : len(a)] = torch.tensor(a)
        answer_mask[i, : len(a)] = True
    answer_ids, answer_mask = answer_ids.to(device), answer_mask.to(device)
    full = Rollout(input_ids=torch.cat([prompt_ids, answer_ids], dim=1),  # (n, P+T)
                   attention_mask=torch.cat([prompt_mask, answer_mask.long()], dim=1),  # (n, P+T)
                   completion_mask=answer_mask, prompts=prompts, completions=[r[column] for r in refs])
    n = len(refs)
    parts = [list(range(j, n, num_chunks)) if n >= num_chunks else [j % n] for j in range(num_chunks)]
    return [full.select(torch.tensor(p, device=device)) for p in parts]


def sft_backward(model, ref: Rollout, coef: float, **logp_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Backpropagate coef * NLL(reference | prompt) now (gradients add to the policy loss's).

    Its own forward, so the trainer runs it outside any routing replay. Returns (coef * NLL, NLL),
    detached. `logp_kwargs`: temperature and chunk_size, as for the policy's log-probs, so the
    NLL is taken under the same distribution the RL loss trains.
    """
    logp, _ = completion_logprobs(model, ref.input_ids, ref.attention_mask, ref.completion_len,
                                  **logp_kwargs)  # (n, T)
    nll = sft_nll(logp, ref.completion_mask)
    term = coef * nll
    term.backward()
    return term.detach(), nll.detach()
