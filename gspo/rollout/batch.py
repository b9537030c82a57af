"""The rollout batch: sampled completions in one padded layout, and the token rules it needs
(prompt encoding with its length check, stop tokens, the pad id). See gspo/rollout/__init__.py."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

TRUNCATIONS = ("error", "left")  # what a prompt longer than max_prompt_length gets: refused, or cut on the left


@dataclass
class Rollout:
    """One batch of sampled completions and what later stages attach to it."""

    input_ids: Tensor  # (N, P+T)
    attention_mask: Tensor  # (N, P+T)
    completion_mask: Tensor  # (N, T) bool
    prompts: list  # N prompt texts (each repeated G times)
    completions: list  # N completion texts
    sampler_logprobs: Tensor | None = None  # (N, T) log-probs under the sampling distribution
    rewards: Tensor | None = None  # (N,)
    advantages: Tensor | None = None  # (N,), or (N, T) per token (a critic's GAE)
    old_logprobs: Tensor | None = None  # (N, T)
    ref_logprobs: Tensor | None = None  # (N, T)
    old_values: Tensor | None = None  # (N, T) the critic's values when the rollout was made (gae)
    returns: Tensor | None = None  # (N, T) the critic's targets: GAE advantages + old_values
    routing: object | None = None  # plugs.moe.RoutingRecord (R, N, P+T, k) aligned with input_ids; -1 = route freely
    episodes: list | None = None  # multi-turn: N dicts (turns, tool_calls, tool_errors, truncated, env_reward, ...)
    position_ids: Tensor | None = None  # (N, P+T) where a row holds several sequences (an agent episode's calls that
    # do not continue each other): positions restart at each, and a token attends within its own sequence only
    # (gspo.algo.logprobs.segment_mask); None: one sequence per row, positions from the attention mask

    @property
    def completion_len(self) -> int:
        return self.completion_mask.shape[1]

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    def completion_token_ids(self) -> list[list[int]]:
        """Each completion's token ids without padding (the stop token kept): TRL's `completion_ids`."""
        ids = self.input_ids[:, -self.completion_len:]  # (N, T)
        return [row[keep].tolist() for row, keep in zip(ids, self.completion_mask)]

    def trim(self, rows: Tensor) -> tuple[int, int, int]:
        """(left, cut, keep_t): `select(rows)` keeps input columns left:cut and completion columns :keep_t."""
        T = self.completion_len
        attn = self.attention_mask[rows]  # (n, P+T)
        cmask = self.completion_mask[rows]  # (n, T)
        left = int((attn[:, : attn.shape[1] - T].sum(0) > 0).nonzero()[0, 0])  # first prompt column in use
        keep_t = int(cmask.any(0).nonzero()[-1, 0]) + 1  # last completion column in use
        return left, attn.shape[1] - T + keep_t, keep_t

    def select(self, rows: Tensor) -> Rollout:
        """The rollout restricted to `rows`, with all-padding columns trimmed on both sides."""
        left, cut, keep_t = self.trim(rows)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                v = v[rows]
                if f.name in ("input_ids", "attention_mask", "position_ids"):
                    v = v[:, left:cut]
                elif v.dim() == 2:
                    v = v[:, :keep_t]
            elif isinstance(v, list):
                v = [v[i] for i in rows.tolist()]
            elif v is not None:  # a routing record: rows, then the same columns as input_ids
                v = v.select(rows, slice(left, cut))
            out[f.name] = v
        return replace(self, **out)


def step_of(key) -> int:
    """The step of a rollout's key: the step itself for its first sampling round, (step, round) for a later round
    of dynamic sampling (gspo/rounds.py)."""
    return key[0] if isinstance(key, tuple) else key


def key_name(key) -> str:
    """A rollout's key as words: "step 3", or "step 3, sampling round 2"."""
    return f"step {key[0]}, sampling round {key[1] + 1}" if isinstance(key, tuple) else f"step {key}"


def one_sequence_per_row(batch, what: str) -> None:
    """A ValueError naming `what` where a batch's rows hold several sequences (`Rollout.position_ids`), which `what`
    does not read."""
    if getattr(batch, "position_ids", None) is not None:
        raise ValueError(f"agent episodes whose calls do not continue each other (rows of several sequences) cannot "
                         f"be trained with {what} yet; let each call continue the conversation")


def join_rollouts(parts: list[Rollout], pad: int) -> Rollout:
    """One Rollout of `parts` (rows in order) in one padded layout: each part's prompts padded on the left
    and its completions on the right to the widest (`pad` ids, mask 0, log-probs 0), as one sampler would
    have laid out all the rows. Parts carry sampled fields only (no rewards or advantages yet); a routing
    record is widened with -1 (route freely) like input_ids, so it stays aligned with it."""
    P = max(r.input_ids.shape[1] - r.completion_len for r in parts)
    T = max(r.completion_len for r in parts)

    def widen(v: Tensor, left: int, right: int, value) -> Tensor:  # (n, w) -> (n, left + w + right)
        return torch.cat([v.new_full((v.shape[0], left), value), v, v.new_full((v.shape[0], right), value)], dim=1)

    joined = {}
    for f in fields(Rollout):
        values = [getattr(r, f.name) for r in parts]
        if all(v is None for v in values):
            joined[f.name] = None
        elif any(v is None for v in values):
            raise ValueError(f"join_rollouts: {f.name} is set in some parts only")
        elif f.name == "routing":  # (R, n, P_i+T_i, k) each: widened on the same columns as input_ids
            layers = values[0].layers
            if any(v.layers != layers for v in values):
                raise ValueError("join_rollouts: the routing records come from different routers")
            indices = [torch.cat([v.indices.new_full((*v.indices.shape[:2], P - (v.shape[1] - r.completion_len),
                                                      v.top_k), -1), v.indices,
                                  v.indices.new_full((*v.indices.shape[:2], T - r.completion_len, v.top_k), -1)],
                                 dim=2) for v, r in zip(values, parts)]  # (R, n, P+T, k) each
            joined[f.name] = type(values[0])(torch.cat(indices, dim=1), layers)  # (R, N, P+T, k)
        elif isinstance(values[0], list):
            joined[f.name] = [x for v in values for x in v]
        elif f.name in ("input_ids", "attention_mask", "position_ids"):  # prompt columns, then completion columns
            fill = pad if f.name == "input_ids" else 0
            joined[f.name] = torch.cat([widen(v, P - (v.shape[1] - r.completion_len), T - r.completion_len, fill)
                                        for v, r in zip(values, parts)])  # (N, P+T)
        elif values[0].dim() == 2:  # completion columns
            joined[f.name] = torch.cat([widen(v, 0, T - v.shape[1], 0) for v in values])  # (N, T)
        else:
            joined[f.name] = torch.cat(values)  # (N,)
    return Rollout(**joined)


def completion_mask_from_ids(completion_ids: Tensor, eos_token_ids: list[int]) -> Tensor:
    """(N, T) bool: True up to and including the first EOS of each row (all True if none)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))  # (N, T)
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
    return ~after_eos


def eos_ids(tokenizer, model=None) -> list[int]:
    """The stop tokens: the model's generation config's, else (or without a model) the tokenizer's eos."""
    gen_eos = model.generation_config.eos_token_id if model is not None else None
    ids = gen_eos if gen_eos is not None else tokenizer.eos_token_id
    ids = ids if isinstance(ids, list) else [ids]
    if not ids or ids[0] is None:
        raise ValueError("tokenizer: no eos token: completions could never end")
    return ids


def encode_prompts(tokenizer, prompts: list[str], max_prompt_length: int, device, truncate: str = "error"
                   ) -> tuple[Tensor, Tensor]:
    """Left-padded prompt ids and mask (B, P), P <= max_prompt_length.

    A longer prompt is a ValueError, or with truncate="left" keeps its last max_prompt_length
    tokens (as TRL truncates). The trainer checks every prompt before training
    (`gspo.data.check_prompt_lengths`), so the error here is a last guard.
    """
    if truncate not in TRUNCATIONS:
        raise ValueError(f"truncate must be one of {', '.join(TRUNCATIONS)}, got {truncate!r}")
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    ids, mask = enc["input_ids"], enc["attention_mask"]  # (B, P0)
    lengths = mask.sum(-1)  # (B,)
    if int(lengths.max()) > max_prompt_length:
        if truncate == "error":
            i = int(lengths.argmax())
            raise ValueError(f"max_prompt_length: prompt {i} has {int(lengths[i])} tokens > {max_prompt_length}: "
                             f"{prompts[i]!r:.80}")
        ids, mask = ids[:, -max_prompt_length:], mask[:, -max_prompt_length:]  # left padding: the ends are real
    if int(lengths.min()) == 0:
        raise ValueError(f"dataset: prompt {int(lengths.argmin())} encodes to no tokens")
    return ids.to(device), mask.to(device)


def pad_id(tokenizer, model=None) -> int:
    """The id every layout is padded with (rollouts, SFT batches, references): the tokenizer's pad
    token, else the first stop token (`eos_ids`)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids(tokenizer, model)[0]
