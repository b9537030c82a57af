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

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["completion_logprobs", "naive_completion_logprobs", "position_ids_from_mask"]

# Config fields of HF models whose forward modifies logits after the output head
# (Gemma2/3 and NanoChat: softcapping; Cohere: logit_scale; Granite divides / HyperCLOVA X
# multiplies by logits_scaling; MuseSpark: output_multiplier). The chunked path only computes
# `lm_head(hidden)`, so for these models we fall back to the naive path rather than re-implement
# each model's (sometimes contradictory) convention here.
_LOGIT_POSTPROCESS_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")

# Default chunk: as many rows as keep one chunk's fp32 (rows, V) logits at 2**26 elements (256 MiB).
# The backward recomputation holds ~5 such tensors, so the peak is ~1.3 GiB whatever the vocabulary:
# 441 rows at Qwen's V = 151,936; every row at once for the tiny presets (V = 81). BENCHMARKS.md, item 2.
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


def naive_completion_logprobs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_len: int,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Reference path: one full forward, full fp32 logits. Same contract as `completion_logprobs`.

    `chunk_size` is accepted (and validated) only so both functions share a signature.
    """
    _validate(input_ids, attention_mask, completion_len, temperature, chunk_size)
    seq_len, T = input_ids.shape[1], completion_len
    P = seq_len - T
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
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
    """
    _validate(input_ids, attention_mask, completion_len, temperature, chunk_size)
    parts = _chunked_path_parts(model)
    if packed and parts is not None and _contiguous(attention_mask) and bool(attention_mask[:, -completion_len:].any()):
        return _packed_logprobs(*parts, input_ids, attention_mask, completion_len, temperature, chunk_size,
                                with_entropy)
    if parts is None:
        return naive_completion_logprobs(
            model, input_ids, attention_mask, completion_len,
            temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
        )
    backbone, head = parts
    N, seq_len = input_ids.shape
    T = completion_len
    P = seq_len - T

    # MoE backbones (Qwen3-MoE) return router logits only when asked; we do not ask.
    out = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
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


def _packed_logprobs(backbone, head, input_ids: Tensor, attention_mask: Tensor, completion_len: int,
                     temperature: float, chunk_size: int | None, with_entropy: bool):
    """The padding-free path of `completion_logprobs`: the rows' real tokens packed into rows of the longest
    sequence's length (`pack_rows`), the head on real completion tokens only, scattered back into the
    (N, T) layout (0 in padded slots)."""
    N, width = input_ids.shape
    T, device = completion_len, input_ids.device
    mask = attention_mask.bool()  # (N, P+T)
    lengths = mask.sum(-1)  # (N,) real tokens per row
    row, offset, rows = pack_rows(lengths.tolist())
    capacity = int(lengths.max())
    starts = torch.tensor(row, device=device) * capacity + torch.tensor(offset, device=device)  # (N,) flat
    within = position_ids_from_mask(attention_mask)  # (N, P+T) each real token's index within its sequence
    flat = (starts[:, None] + within)[mask]  # (S,) where each real token goes
    packed_ids = input_ids.new_zeros(rows * capacity).index_copy_(0, flat, input_ids[mask])  # (R*C,)
    # free slots at a row's end get position 0 each: every one is a sequence of its own to the mask
    positions = input_ids.new_zeros(rows * capacity).index_copy_(0, flat, within[mask])  # (R*C,)
    # attention_mask=None with restarting position ids: transformers builds the block-causal mask
    out = backbone(input_ids=packed_ids.view(rows, capacity), position_ids=positions.view(rows, capacity),
                   use_cache=False)
    hidden = out.last_hidden_state.reshape(rows * capacity, -1)  # (R*C, H)
    scored = mask[:, width - T :]  # (N, T) real completion tokens
    index = (starts[:, None] + within[:, width - T :])[scored]  # (M,) flat positions of the scored tokens
    logp_m, ent_m = _head_logprobs(head, hidden[index - 1], packed_ids[index], temperature, chunk_size,
                                   with_entropy)  # (M,): token k is predicted at position k - 1
    logp = logp_m.new_zeros(N, T).masked_scatter(scored, logp_m)  # (N, T)
    entropy = ent_m.new_zeros(N, T).masked_scatter(scored, ent_m) if with_entropy else None  # (N, T)
    return logp, entropy
