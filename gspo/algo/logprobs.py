"""Per-token log-probs (and entropy) of completion tokens from a causal LM.

Rollout layout: `input_ids` (N, P+T) = left-padded prompts (width P) followed by right-padded
completions (width T); `attention_mask` (N, P+T) is 1 on real tokens. The log-prob of
completion token j (position P+j) is read from the logits at position P+j-1.

`completion_logprobs` never holds the full fp32 (N, T, V) logits: it runs the backbone once,
keeps the T hidden states it needs, and applies the output head to `chunk_size` rows at a time.
Under autograd each chunk is checkpointed, so the backward pass recomputes that chunk's logits
instead of keeping them alive. `naive_completion_logprobs` is the plain full-logits reference.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["PackedLayout", "completion_logprobs", "minibatch_logprobs", "naive_completion_logprobs", "packed_layout",
           "padding_free_layout", "position_ids_from_mask"]

# Config fields of HF models whose forward modifies logits after the output head
# (Gemma2/3 and NanoChat: softcapping; Cohere: logit_scale; Granite divides / HyperCLOVA X
# multiplies by logits_scaling; MuseSpark: output_multiplier). The chunked path only computes
# `lm_head(hidden)`, so for these models we fall back to the naive path rather than re-implement
# each model's (sometimes contradictory) convention here.
_LOGIT_POSTPROCESS_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")

# Default chunk: as many rows as keep one chunk's fp32 (rows, V) logits at 2**26 elements (256 MiB).
# The backward recomputation holds ~5 such tensors, so the peak is ~1.3 GiB whatever the vocabulary:
# 441 rows at Qwen's V = 151,936; every row at once for the tiny presets (V = 81). docs/benchmarks.md, item 2.
CHUNK_ELEMENTS = 2**26


def default_chunk_rows(vocab_size: int) -> int:
    """Rows of the output head per chunk when `chunk_size` is None (see CHUNK_ELEMENTS)."""
    return max(1, CHUNK_ELEMENTS // max(1, int(vocab_size)))


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids (N, L) that count only real tokens, as HF `generate` builds them.

    Left padding then does not shift positions: a row's first real token gets position 0.
    Padding slots get 0 (left) or repeat the last real position (right); they are masked anyway.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (N, L)


def _validate(input_ids, attention_mask, completion_len, temperature, chunk_size) -> None:
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a 2-D tensor (N, P+T), got {_describe(input_ids)}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must be a tensor with the shape of input_ids {tuple(input_ids.shape)}, "
            f"got {_describe(attention_mask)}"
        )
    seq_len = input_ids.shape[1]
    if isinstance(completion_len, bool) or not isinstance(completion_len, int):
        raise ValueError(f"completion_len must be an int, got {type(completion_len).__name__}")
    if not 1 <= completion_len <= seq_len - 1:
        raise ValueError(
            f"completion_len must be in 1..{seq_len - 1} (sequence length {seq_len} minus at least one "
            f"prompt token), got {completion_len}"
        )
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be an int >= 1 or None (from the vocabulary size), got {chunk_size!r}")


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__


def _token_logprobs(logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool):
    """fp32 log-prob of `targets` (M,) under `logits` (M, V) / temperature, and entropy (M,)."""
    logits = logits.float()  # (M, V)
    if temperature != 1.0:  # at T = 1 the division would only add a (M, V) copy
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)  # (M, V)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (M,)
    if not with_entropy:
        return logp, None
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (M,)
    return logp, entropy


def segment_mask(attention_mask: Tensor, position_ids: Tensor, dtype) -> Tensor:
    """The additive 4D mask (N, 1, L, L) of rows holding several sequences: query i reads key j <= i of its own
    sequence (a sequence starts where its position is 0 after a real token), real keys only; 0 where it reads,
    the dtype's minimum elsewhere (what eager and sdpa attention both take)."""
    real = attention_mask.bool()  # (N, L)
    starts = (position_ids == 0) & real  # (N, L)
    segment = starts.long().cumsum(-1)  # (N, L) which sequence each position belongs to
    L = attention_mask.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=real.device).tril()  # (L, L)
    reads = causal & (segment[:, :, None] == segment[:, None, :]) & real[:, None, :]  # (N, L, L)
    reads |= torch.eye(L, dtype=torch.bool, device=real.device)  # a padding query reads itself: no empty row
    zero = torch.zeros((), dtype=dtype, device=real.device)
    return torch.where(reads, zero, torch.finfo(dtype).min)[:, None]  # (N, 1, L, L)


def _mask_and_positions(model, attention_mask: Tensor, position_ids: Tensor | None) -> dict:
    """The forward's attention mask and positions: the 2D mask and positions counted from it, or for rows of
    several sequences (`position_ids` given) their positions and the 4D `segment_mask`."""
    if position_ids is None:
        return {"attention_mask": attention_mask, "position_ids": position_ids_from_mask(attention_mask)}
    dtype = next(model.parameters()).dtype
    return {"attention_mask": segment_mask(attention_mask, position_ids, dtype), "position_ids": position_ids}


def naive_completion_logprobs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_len: int,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    position_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Reference path: one full forward, full fp32 logits. Same contract as `completion_logprobs`.

    `chunk_size` is accepted (and validated) only so both functions share a signature.
    """
    _validate(input_ids, attention_mask, completion_len, temperature, chunk_size)
    seq_len, T = input_ids.shape[1], completion_len
    P = seq_len - T
    out = model(input_ids=input_ids, use_cache=False, **_mask_and_positions(model, attention_mask, position_ids))
    logits = out.logits[:, P - 1 : seq_len - 1]  # (N, T, V): position P+j-1 predicts token P+j
    logp, entropy = _token_logprobs(logits, input_ids[:, P:], temperature, with_entropy)
    return logp, entropy


def is_fsdp2(model) -> bool:
    """True for a model sharded at the root by FSDP2 `fully_shard`."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def _chunked_path_parts(model):
    """(backbone, head) for the chunked path, or None when the model needs the naive path."""
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:  # e.g. a DDP wrapper or a plain nn.Module
        return None
    if is_fsdp2(model):  # the root's pre-forward hook (which unshards its params) would be skipped
        return None
    backbone, head = get_decoder(), get_head()
    if head is None or backbone is model or backbone is None:
        return None
    configs = [getattr(model, "config", None)]
    if configs[0] is not None and hasattr(configs[0], "get_text_config"):
        configs.append(configs[0].get_text_config())
    for cfg in configs:
        for field in _LOGIT_POSTPROCESS_FIELDS:
            if getattr(cfg, field, None) not in (None, 1, 1.0):
                return None
    if getattr(backbone, "lm_head_multiplier", None) not in (None, 1, 1.0):  # Falcon-H1
        return None
    return backbone, head


def completion_logprobs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_len: int,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    packed: bool = False,
    position_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (N, T) fp32 of the completion tokens, and their entropy (N, T) fp32 or None.

    input_ids, attention_mask: (N, P+T); completion_len: T. Logits are divided by `temperature`
    before the softmax (match the sampler's temperature). Values at padded completion slots are
    finite but meaningless: the caller masks them.

    The output head runs on `chunk_size` rows of the (N*T, H) hidden states at a time (None: as
    many as keep a chunk's logits at CHUNK_ELEMENTS, `default_chunk_rows(V)`); with grad
    enabled each chunk is checkpointed so the backward recomputes its logits. Models whose forward
    changes logits after the head (softcapping, logit scales) and models without
    `get_decoder`/`get_output_embeddings` (e.g. wrapped in DDP) or sharded by FSDP2 at the root
    take the naive path instead. Note: the chunked path calls the backbone module directly,
    bypassing the top-level module's forward and its hooks.

    `packed` (padding-free): the rows' real tokens go through the backbone packed several to a row
    (`pack_rows`) with per-sequence position ids, which transformers turns into a block-causal mask
    (sdpa and eager, tested; flash attention reads the same position ids, untested here), and the
    head runs on the real completion tokens only; padded slots are 0. Same values as the padded
    path to float tolerance (tests/test_packing.py). Rows must be a rollout's layout (left-padded
    prompt, right-padded completion: real tokens contiguous) with at least one completion token;
    otherwise, or without the chunked path's parts, the padded path runs.

    `position_ids` (N, P+T): rows holding several sequences (Rollout.position_ids), positions restarting at each;
    a token reads its own sequence only (packed: transformers' block-causal mask from the restarts; padded:
    `segment_mask`). None: one sequence per row.
    """
    _validate(input_ids, attention_mask, completion_len, temperature, chunk_size)
    parts = _chunked_path_parts(model)
    layout = _layout(attention_mask, completion_len) if packed and parts is not None else None
    if layout is not None:
        return _packed_logprobs(*parts, layout, input_ids, attention_mask, completion_len, temperature, chunk_size,
                                with_entropy, position_ids)
    if parts is None:
        return naive_completion_logprobs(
            model, input_ids, attention_mask, completion_len,
            temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy, position_ids=position_ids,
        )
    backbone, head = parts
    N, seq_len = input_ids.shape
    T = completion_len
    P = seq_len - T

    # MoE backbones (Qwen3-MoE) return router logits only when asked; we do not ask.
    out = backbone(input_ids=input_ids, use_cache=False, **_mask_and_positions(backbone, attention_mask, position_ids))
    hidden = out.last_hidden_state[:, P - 1 : seq_len - 1]  # (N, T, H)
    hidden = hidden.reshape(N * T, hidden.shape[-1])  # (N*T, H)
    targets = input_ids[:, P:].reshape(N * T)  # (N*T,)
    logp, entropy = _head_logprobs(head, hidden, targets, temperature, chunk_size, with_entropy)  # (N*T,)
    return logp.view(N, T), entropy.view(N, T) if with_entropy else None  # (N, T)


def _head_logprobs(head, hidden: Tensor, targets: Tensor, temperature: float, chunk_size: int | None,
                   with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """Log-probs (M,) of `targets` (M,) and entropy (M,) from hidden states (M, H), `chunk_size` rows of
    the head at a time; under autograd each chunk is checkpointed (its (rows, V) logits rebuilt in backward)."""
    if chunk_size is None:
        chunk_size = default_chunk_rows(head.weight.shape[0])

    def chunk_fn(h: Tensor, tgt: Tensor):
        return _token_logprobs(head(h), tgt, temperature, with_entropy)  # (rows,), (rows,) | None

    use_ckpt = torch.is_grad_enabled() and hidden.requires_grad
    logps, ents = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        h, tgt = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if use_ckpt:
            # Saves only h (rows, H); the (rows, V) logits are rebuilt during backward.
            logp, ent = checkpoint(chunk_fn, h, tgt, use_reentrant=False)
        else:
            logp, ent = chunk_fn(h, tgt)
        logps.append(logp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents) if with_entropy else None  # (M,), (M,) | None


def _contiguous(attention_mask: Tensor) -> bool:
    """Each row's real tokens form one run (left padding, then tokens, then right padding)."""
    mask = attention_mask.bool()  # (N, L)
    runs = mask[:, 0].long() + (mask[:, 1:] & ~mask[:, :-1]).sum(-1)  # (N,) runs of real tokens per row
    return bool((runs == 1).all())


def pack_rows(lengths: list[int]) -> tuple[list[int], list[int], int]:
    """First-fit decreasing: (row, offset) of each sequence in rows of capacity max(lengths), and the
    number of rows. Rows as long as the longest sequence keep attention's cost per row what the
    padded layout pays, while the rows' count falls with the padding."""
    width = max(lengths)
    free: list[int] = []  # room left in each row
    row, offset = [0] * len(lengths), [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r, room in enumerate(free) if room >= lengths[i]), len(free))
        if r == len(free):
            free.append(width)
        row[i], offset[i] = r, width - free[r]
        free[r] -= lengths[i]
    return row, offset, len(free)


@dataclass(frozen=True)
class PackedLayout:
    """Where each real token of an (N, L) batch sits in the padding-free rows (`pack_rows`): flat slot
    `row * capacity + offset + its index within its sequence`. Per-token tensors move between the two
    layouts with `pack` and `unpack` (routing records do: gspo/plugs/routing.py)."""

    slots: Tensor  # (N, L) int64: each real token's flat slot in (rows * capacity), -1 at padding
    rows: int
    capacity: int

    def pack(self, x: Tensor, fill=0) -> Tensor:
        """(N, L, *) -> (rows, capacity, *): real tokens' entries at their slots, `fill` in free slots."""
        real = self.slots >= 0  # (N, L)
        out = x.new_full((self.rows * self.capacity, *x.shape[2:]), fill)  # (R*C, *)
        out[self.slots[real]] = x[real]
        return out.view(self.rows, self.capacity, *x.shape[2:])  # (R, C, *)

    def unpack(self, y: Tensor, fill=0) -> Tensor:
        """(rows, capacity, *) -> (N, L, *): each real token's entry back in its place, `fill` at padding."""
        real = self.slots >= 0  # (N, L)
        out = y.new_full((*self.slots.shape, *y.shape[2:]), fill)  # (N, L, *)
        out[real] = y.reshape(self.rows * self.capacity, *y.shape[2:])[self.slots[real]]
        return out

    def inputs(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None) -> dict:
        """Backbone keywords of the packed rows: ids and per-sequence position ids (free slots: position 0
        each, a sequence of its own to the mask; `position_ids`: a row's own, restarting where it holds several
        sequences); attention_mask None, so transformers builds the block-causal mask from the restarts."""
        positions = position_ids_from_mask(attention_mask) if position_ids is None else position_ids  # (N, L)
        return {"input_ids": self.pack(input_ids), "position_ids": self.pack(positions), "use_cache": False}


def packed_layout(attention_mask: Tensor) -> PackedLayout | None:
    """The padding-free layout of a batch, or None where some row's real tokens are not contiguous (not a
    rollout's layout: left padding, tokens, right padding)."""
    if not _contiguous(attention_mask):
        return None
    mask = attention_mask.bool()  # (N, L)
    lengths = mask.sum(-1)  # (N,) real tokens per row
    row, offset, rows = pack_rows(lengths.tolist())
    capacity, device = int(lengths.max()), attention_mask.device
    starts = torch.tensor(row, device=device) * capacity + torch.tensor(offset, device=device)  # (N,) flat
    slots = (starts[:, None] + position_ids_from_mask(attention_mask)).masked_fill(~mask, -1)  # (N, L)
    return PackedLayout(slots, rows, capacity)


def padding_free_layout(model, attention_mask: Tensor, completion_len: int) -> PackedLayout | None:
    """The layout `completion_logprobs(model, ..., packed=True)` runs this batch in, or None where it runs
    padded: a model without the chunked path's parts, rows whose real tokens are not contiguous, or no
    completion token at all."""
    return None if _chunked_path_parts(model) is None else _layout(attention_mask, completion_len)


def _layout(attention_mask: Tensor, completion_len: int) -> PackedLayout | None:
    """`packed_layout`, or None where no row has a completion token (no head to run)."""
    return packed_layout(attention_mask) if bool(attention_mask[:, -completion_len:].any()) else None


def _packed_logprobs(backbone, head, layout: PackedLayout, input_ids: Tensor, attention_mask: Tensor,
                     completion_len: int, temperature: float, chunk_size: int | None, with_entropy: bool,
                     position_ids: Tensor | None = None):
    """The padding-free path of `completion_logprobs`: the backbone on `layout`'s rows, the head on real
    completion tokens only, scattered back into the (N, T) layout (0 in padded slots)."""
    N, width = input_ids.shape
    T = completion_len
    inputs = layout.inputs(input_ids, attention_mask, position_ids)  # (R, C) ids and positions
    hidden = backbone(**inputs).last_hidden_state.reshape(layout.rows * layout.capacity, -1)  # (R*C, H)
    scored = attention_mask[:, width - T :].bool()  # (N, T) real completion tokens
    index = layout.slots[:, width - T :][scored]  # (M,) flat slots of the scored tokens
    logp_m, ent_m = _head_logprobs(head, hidden[index - 1], inputs["input_ids"].view(-1)[index], temperature,
                                   chunk_size, with_entropy)  # (M,): token k is predicted at slot k - 1
    logp = logp_m.new_zeros(N, T).masked_scatter(scored, logp_m)  # (N, T)
    entropy = ent_m.new_zeros(N, T).masked_scatter(scored, ent_m) if with_entropy else None  # (N, T)
    return logp, entropy


def minibatch_logprobs(model, rollout, minibatches, logp_kwargs: dict, *, writes=None, around=None) -> Tensor:
    """(N, T) log-probs of a rollout's completions, computed minibatch by minibatch on the trimmed shapes
    training uses (the dense pi_old, pi_ref; gspo.plugs.routing.MoERouting wraps it to record or replay experts).

    `minibatches`: (n,) row-index tensors of `rollout` (a gspo.rollout.Rollout); `writes`: one bool per
    minibatch, False for a forward that must run but whose result is not kept (a stand-in row);
    `around(j, idx, mb, keep)`: a context manager each forward runs inside (None: nothing around it).
    """
    out = torch.zeros(rollout.completion_mask.shape, dtype=torch.float32, device=rollout.input_ids.device)  # (N, T)
    for j, idx in enumerate(minibatches):
        mb = rollout.select(idx)
        keep = writes is None or writes[j]
        with nullcontext() if around is None else around(j, idx, mb, keep):
            logp, _ = completion_logprobs(model, mb.input_ids, mb.attention_mask, mb.completion_len,
                                          position_ids=mb.position_ids, **logp_kwargs)  # (n, t)
        if keep:
            out[idx, : mb.completion_len] = logp
    return out
