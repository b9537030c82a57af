"""gspo's own KV-cached sampling loop: HF `generate`'s tokens without its per-step costs.

HF `generate` grows its `DynamicCache` with `torch.cat`, copying every layer's whole cache at
every decode step (docs/benchmarks.md O3: 24% of an RL step at T = 1024), and runs a general loop
(logits processors, stopping criteria, output bookkeeping) around each forward. Here the cache is
preallocated once and exposes only its filled prefix, and the loop does only what a rollout needs.

The loop reproduces HF `generate` (transformers 5.24) call for call, so that with the same seed
it samples the same tokens: the same forwards (prefill (N, P), then one (N, 1) forward per new
token except the last, which is never fed back), the same inputs (position ids from the attention
mask's cumsum; an all-ones mask dropped), the same float32 scores, warpers and
`torch.multinomial` draw from the global RNG. Two departures change no token (and only the last bits of a
log-prob: a matmul's rounding depends on its batch): a prompt shared by G rows is prefilled once, and once at
most half of the rows still run, the finished ones leave the forward batch (`_Batch`) while the draw still
covers all N rows, so the global RNG advances as HF's does. MoE routing hooks therefore see what they see
under HF `generate`. Models that need more than a plain per-layer KV cache (sliding-window,
linear-attention or shared-KV layers, encoder-decoders) or FSDP2 sharding (every rank must run
the same number of forwards) are left to HF `generate`: see `unsupported_reason`.

    completion_ids, logprobs = sample(model, prompt_ids, prompt_mask, max_new_tokens=48,
                                      eos_token_ids=[2], pad_token_id=0, temperature=0.7)
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

from gspo.algo.logprobs import is_fsdp2
from gspo.plugs.lora import is_peft, plain_model
from gspo.plugs.moe import has_experts

__all__ = ["PrefixKVLayer", "prefix_cache", "sample", "unsupported_reason"]


class PrefixKVLayer(CacheLayerMixin):
    """One attention layer's KV cache: a buffer allocated once, of which only the filled prefix is seen.

    Buffers are (N, kv_heads, capacity, head_dim), allocated on the first `update` with that
    update's dtype, device and shapes; `update` copies the new keys/values in place at the fill
    offset and returns views `buf[:, :, :filled]`, so nothing is reallocated or concatenated.
    Subclasses HF's `CacheLayerMixin` because `Cache.get_seq_length` / `get_mask_sizes` only
    accept layers of that type; every method the models and mask builders call is defined here.
    """

    is_sliding = False  # masks: a full causal layer
    is_compileable = False  # the returned length grows each step: keep the 2D-mask path
    is_croppable = False

    def __init__(self, capacity: int):
        super().__init__()  # keys / values / is_initialized, as HF's cache code reads them
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1; got {capacity}")
        self.capacity = capacity
        self.filled = 0
        self.key_buffer: Tensor | None = None
        self.value_buffer: Tensor | None = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        n, heads, _, dim = key_states.shape
        self.key_buffer = key_states.new_empty((n, heads, self.capacity, dim))  # (N, H, C, D)
        n, heads, _, dim = value_states.shape  # values may have their own head dim
        self.value_buffer = value_states.new_empty((n, heads, self.capacity, dim))  # (N, H, C, Dv)
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append (N, H, l, D) keys/values; return the (N, H, filled, D) views of everything so far."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.filled, self.filled + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"PrefixKVLayer: {end} positions exceed the preallocated capacity {self.capacity}")
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.filled = end
        self.keys = self.key_buffer[:, :, :end]  # (N, H, filled, D) view, no copy
        self.values = self.value_buffer[:, :, :end]  # (N, H, filled, Dv)
        return self.keys, self.values

    def select_rows(self, index: Tensor) -> None:
        """Row index[i] of the cache becomes row i: (N',) -> N rows repeats one prefill of each distinct prompt,
        (n,) -> n' < n rows drops the rows that finished."""
        self.key_buffer = self.key_buffer.index_select(0, index)  # (N, H, C, D)
        self.value_buffer = self.value_buffer.index_select(0, index)  # (N, H, C, Dv)
        self.keys = self.key_buffer[:, :, : self.filled]
        self.values = self.value_buffer[:, :, : self.filled]

    def get_seq_length(self) -> int:
        return self.filled

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) for the mask builders, asked before this forward's `update`."""
        return self.filled + query_length, 0

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.filled = 0
        self.keys = self.values = None


def _cache_argument(params) -> str | None:
    """The name under which the model's forward takes a KV cache, or None."""
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def prefix_cache(num_layers: int, capacity: int) -> Cache:
    """An HF `Cache` of `num_layers` `PrefixKVLayer`s holding up to `capacity` positions each."""
    return Cache(layers=[PrefixKVLayer(capacity) for _ in range(num_layers)])


# Generation-config fields that make HF `generate` add a logits processor, stopping criterion or
# decoding mode that `rollout.generate` does not override and this loop does not implement; a
# checkpoint carrying one of them stays on HF `generate`. Value: "inactive" test.
def _off(v) -> bool:
    return v is None or v is False


_HF_ONLY_FIELDS = {
    "guidance_scale": lambda v: v is None or v == 1,
    "sequence_bias": _off,
    "bad_words_ids": _off,
    "min_length": lambda v: not v,
    "min_new_tokens": lambda v: not v,
    "forced_bos_token_id": _off,
    "forced_eos_token_id": _off,
    "remove_invalid_values": _off,
    "exponential_decay_length_penalty": _off,
    "suppress_tokens": lambda v: not v,
    "begin_suppress_tokens": lambda v: not v,
    "top_h": _off,
    "epsilon_cutoff": lambda v: v is None or not 0 < v < 1,
    "eta_cutoff": lambda v: v is None or not 0 < v < 1,
    "watermarking_config": _off,
    "renormalize_logits": _off,
    "max_time": _off,
    "stop_strings": lambda v: not v,
    "num_beams": lambda v: v is None or v == 1,
    "num_return_sequences": lambda v: v is None or v == 1,
    "num_beam_groups": lambda v: v is None or v == 1,
    "penalty_alpha": lambda v: not v,
    "dola_layers": _off,
    "prompt_lookup_num_tokens": _off,
    "token_healing": _off,
    "use_mtp": _off,
}


def _prompt_learning(model) -> bool:
    """A PeftModel whose active adapter adds virtual tokens (prefix / prompt tuning): PEFT's own forward
    and generate insert them; the loop runs the base model, so it would leave them out."""
    configs = getattr(model, "peft_config", {})
    active = getattr(model, "active_adapter", None)
    return bool(getattr(configs.get(active) if isinstance(active, str) else None, "is_prompt_learning", False))


def unsupported_reason(model) -> str | None:
    """Why `sample` cannot stand in for HF `generate` on `model`, or None if it can.

    A PEFT model is run through its base model, whose layers carry the adapters (active as in the
    PeftModel: LoRA and its kin); prompt-learning adapters need PEFT's own forward and stay on HF.
    """
    if is_fsdp2(model):
        return ("the model is FSDP2-sharded: every rank must run the same number of forwards "
                "(HF generate with synced_gpus)")
    if is_peft(model) and _prompt_learning(model):
        return "its PEFT adapter is prompt learning (virtual tokens PEFT's own forward inserts)"
    model = plain_model(model)
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generation_config"):
        return f"{type(model).__name__} is not a Hugging Face generative model"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    params = inspect.signature(model.forward).parameters
    if _cache_argument(params) is None:
        return f"{type(model).__name__}.forward takes no `cache` (or `past_key_values`) argument"
    for name in ("position_ids", "attention_mask"):
        if name not in params:
            return f"{type(model).__name__}.forward takes no `{name}` argument"
    # What HF would build for this model; a plain full-attention KV layer everywhere is what we replace
    probe = DynamicCache(config=config.get_text_config(decoder=True))
    other = [(i, type(layer).__name__) for i, layer in enumerate(probe.layers) if type(layer) is not DynamicLayer]
    if other:
        i, kind = other[0]
        return (f"layer {i} needs a {kind} cache (sliding-window, linear-attention or shared-KV layers "
                f"are left to HF generate); {len(other)} such layer(s)")
    gen = model.generation_config
    active = [k for k, inactive in _HF_ONLY_FIELDS.items() if not inactive(getattr(gen, k, None))]
    if active:
        return f"generation_config sets {active}, which only HF generate implements"
    return None


def _num_layers(model) -> int:
    return len(DynamicCache(config=model.config.get_text_config(decoder=True)).layers)


@contextmanager
def _decode_experts(model):
    """HF `generate` switches MoE experts from grouped_mm to batched_mm for decode off CPU; do the same."""
    get = getattr(model, "get_experts_implementation", None)
    original = get() if get is not None else {}
    switch = model.device.type != "cpu" and "grouped_mm" in original.values()
    if switch:
        model.set_experts_implementation({k: "batched_mm" if v == "grouped_mm" else v for k, v in original.items()})
    try:
        yield
    finally:
        if switch:
            model.set_experts_implementation(original)


def _check_sample_arguments(prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int, eos_token_ids: list[int],
                            temperature: float, greedy: bool) -> None:
    """`sample`'s argument checks: a ValueError naming the bad one."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if not greedy and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling; got {temperature}")
    if prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape:
        raise ValueError(f"prompt_ids and prompt_mask must both be (N, P); got {tuple(prompt_ids.shape)} "
                         f"and {tuple(prompt_mask.shape)}")
    if not eos_token_ids:
        raise ValueError("eos_token_ids must name at least one token")


def _score_steps(prompt_mask: Tensor, *, greedy: bool, seeded_sampler, top_k: int, top_p: float, min_p: float,
                 repetition_penalty: float) -> tuple[list, list]:
    """(processors, warpers): HF's own classes, in HF's order, so scores and truncation are HF's to the bit."""
    processors, warpers = [], []
    if repetition_penalty != 1.0:
        from transformers import RepetitionPenaltyLogitsProcessor

        left_padding = (prompt_mask != 0).int().argmax(dim=1)  # (N,) as HF's generate computes it
        processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty, prompt_ignore_length=left_padding))
    if not greedy and seeded_sampler is None:
        from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        if top_k != 0:
            warpers.append(TopKLogitsWarper(top_k=top_k))
        if top_p is not None and top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=top_p))
        if min_p:
            warpers.append(MinPLogitsWarper(min_p=min_p))
    return processors, warpers


def _decode_inputs(prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int,
                   pad_token_id: int) -> tuple[Tensor, Tensor | None, Tensor]:
    """(ids (N, P+max) with room for the completion, mask (N, P+max) or None, prompt position ids (N, P))."""
    N = prompt_ids.shape[0]
    ids = torch.cat([prompt_ids, prompt_ids.new_full((N, max_new_tokens), pad_token_id)], dim=1)  # (N, P+max)
    # HF drops an all-ones mask (SDPA can then use its causal kernel); keep it only with padding
    mask = None
    if not bool(prompt_mask.all()):
        mask = torch.cat([prompt_mask, prompt_mask.new_ones((N, max_new_tokens))], dim=1)  # (N, P+max)
    position_ids = prompt_mask.long().cumsum(-1) - 1  # (N, P) left padding: real tokens count from 0
    position_ids = position_ids.masked_fill(prompt_mask == 0, 0)  # as HF generate fills padding
    return ids, mask, position_ids


def _distinct_rows(model, prompt_ids: Tensor, prompt_mask: Tensor | None) -> tuple[Tensor, Tensor] | None:
    """(first (N',), index (N,)): the first row of each distinct prompt (tokens and mask) and, per row, which of
    those it repeats; None where no prompt repeats, or for an MoE (its routing record and replay follow every
    row through every forward)."""
    if prompt_ids.shape[0] < 2 or has_experts(model):
        return None
    key = prompt_ids if prompt_mask is None else torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], 1)
    distinct, index = torch.unique(key, dim=0, return_inverse=True)  # (N', 2P), (N,)
    if distinct.shape[0] == key.shape[0]:
        return None
    rows = torch.arange(key.shape[0], device=key.device)  # (N,)
    first = torch.full((distinct.shape[0],), key.shape[0], device=key.device).scatter_reduce(0, index, rows, "amin")
    return first, index  # (N',), (N,) into first


def _prefill(model, prompt_ids: Tensor, prompt_mask: Tensor | None, position_ids: Tensor, max_new_tokens: int):
    """The prompts' forward (N, P) into a fresh `prefix_cache`: (its output, the keyword arguments every later
    forward gets: that cache, and logits of the last position only where the model can keep just those).
    A prompt that repeats (a group's G rows) is run once and its cache and logits repeated for every row."""
    P = prompt_ids.shape[1]
    # the last token is never fed back: P + max_new_tokens - 1 positions ever enter the cache
    cache = prefix_cache(_num_layers(model), P + max_new_tokens - 1)
    params = inspect.signature(model.forward).parameters
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    extra[_cache_argument(params)] = cache  # transformers >= 5.20 names it `cache`, earlier 5.x `past_key_values`
    shared = _distinct_rows(model, prompt_ids, prompt_mask)
    if shared is not None:
        first, index = shared
        prompt_ids, position_ids = prompt_ids[first], position_ids[first]  # (N', P)
        prompt_mask = None if prompt_mask is None else prompt_mask[first]  # (N', P)
    with _contiguous_head_input(model):
        out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids, use_cache=True,
                    return_dict=True, **extra)
    if any(layer.filled != P for layer in cache.layers):
        raise ValueError(f"{type(model).__name__} did not fill gspo's KV cache in every layer; use backend='hf'")
    if shared is not None:
        for layer in cache.layers:
            layer.select_rows(index)
        out.logits = out.logits.index_select(0, index)  # (N, 1 or P, V)
    return out, extra


@contextmanager
def _contiguous_head_input(model):
    """The output head gets a contiguous input. With `logits_to_keep=1` the models slice `hidden[:, -1:, :]`, a
    (N, 1, H) view whose rows lie P positions apart; against a head that does not require grad (a sampler copy, a
    frozen LoRA base) torch's matmul then runs it as a batched product with the (V, H) head copied once per row:
    SmolLM2's prefill head on 32 rows took 3.2 s that way against 0.015 s on the same rows made contiguous (one
    thread, bf16; the same in float32, 0.33 s against 0.04 s). A head that requires grad gets the folded product
    either way, with the same result."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        yield
        return
    handle = head.register_forward_pre_hook(lambda _module, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def _choose(logits: Tensor, prefix: Tensor, processors: list, warpers: list, *, seeded_sampler, greedy: bool,
            temperature: float, with_logprobs: bool) -> tuple[Tensor, Tensor | None]:
    """(token (N,), scores (N, V) it was chosen from, or None) for one step's float32 logits (N, V)."""
    for process in processors:
        logits = process(prefix, logits)  # (N, V) e.g. repeated tokens' logits rescaled
    if seeded_sampler is not None:
        token = seeded_sampler(prefix, logits).argmax(-1)  # (N,) argmax(logits / T + Gumbel)
        scores = logits / temperature if with_logprobs else None  # (N, V) the distribution sampled
    elif greedy:
        scores = logits
        token = scores.argmax(-1)  # (N,)
    else:
        scores = logits / temperature if temperature != 1.0 else logits  # (N, V)
        for warp in warpers:
            scores = warp(prefix, scores)  # (N, V) -inf outside the top-k / top-p set
        token = torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1)  # (N,)
    return token, scores


class _Batch:
    """Which of the N rows the decode forward still runs. HF keeps every row to the end, feeding padding to the
    finished ones; one runaway answer then costs N rows per step (SmolLM2 at T = 128: 31 of 32 rows done after
    ~20 steps, the batch of 32 running to step 127). Once at most half of the batch is unfinished, the finished
    rows leave it: their KV cache rows are dropped (at most log2(N) copies). An MoE keeps every row: its
    routing record and replay follow every row through every forward."""

    def __init__(self, model, n: int, cache: Cache, device):
        self.rows = torch.arange(n, device=device)  # (n,) the rows of N in the forward batch
        self.n = n
        self.cache = cache
        self.shrinks = not has_experts(model)

    def drop_finished(self, unfinished: Tensor) -> None:
        """`unfinished` (N,): keep only the unfinished rows once they are at most half of the batch."""
        if not self.shrinks:
            return
        running = unfinished[self.rows]  # (n,)
        if int(running.sum()) * 2 > running.numel():
            return
        keep = running.nonzero().squeeze(1)  # (n',) positions in the batch
        for layer in self.cache.layers:
            layer.select_rows(keep)
        self.rows = self.rows[keep]

    def full(self, logits: Tensor) -> Tensor:
        """(n, V) logits of the batch -> (N, V), zeros for the rows that left (their token becomes padding)."""
        if self.rows.numel() == self.n:
            return logits
        out = logits.new_zeros((self.n, logits.shape[-1]))  # (N, V)
        out[self.rows] = logits
        return out


@torch.no_grad()
def sample(model, prompt_ids: Tensor, prompt_mask: Tensor, *, max_new_tokens: int, eos_token_ids: list[int],
           pad_token_id: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
           repetition_penalty: float = 1.0, greedy: bool = False, seeded_sampler=None,
           with_logprobs: bool = False) -> tuple[Tensor, Tensor | None]:
    """Sample completions of left-padded prompts (N, P) -> (completion_ids (N, T), logprobs (N, T) or None).

    Token choice as HF `generate`: `greedy` takes argmax(logits); `seeded_sampler` (called as
    `seeded_sampler(input_ids, logits)`, e.g. `rollout.SeededSampler`) returns scores whose argmax
    is taken; otherwise scores = logits / temperature, then top-k (if top_k != 0), top-p (if < 1),
    min-p (if > 0), and one `torch.multinomial(softmax(scores), 1)` per step from the global RNG.
    `repetition_penalty` != 1 first rescales the logits of every token already in the row (prompt and
    completion, padding left out), greedy too, as HF's processor does.
    Stops when every row has emitted an EOS or after `max_new_tokens`; T is the number of tokens
    produced, and rows that finished earlier hold `pad_token_id` after their EOS.
    `logprobs[:, t]` is log_softmax of the scores token t was chosen from (the processed scores;
    for `seeded_sampler` logits / temperature, the distribution it samples), at that token.
    The caller puts the model in eval mode; `unsupported_reason(model)` must be None. A PeftModel
    runs through its base model, the adapters active.
    """
    model = plain_model(model)
    _check_sample_arguments(prompt_ids, prompt_mask, max_new_tokens, eos_token_ids, temperature, greedy)
    processors, warpers = _score_steps(prompt_mask, greedy=greedy, seeded_sampler=seeded_sampler, top_k=top_k,
                                       top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty)
    N, P = prompt_ids.shape
    device = prompt_ids.device
    eos = torch.tensor(eos_token_ids, device=device)
    ids, mask, position_ids = _decode_inputs(prompt_ids, prompt_mask, max_new_tokens, pad_token_id)
    next_position = position_ids[:, -1:] + 1  # (N, 1)
    logprobs = torch.zeros(N, max_new_tokens, device=device) if with_logprobs else None  # (N, max)
    unfinished = torch.ones(N, dtype=torch.bool, device=device)  # (N,)
    out, extra = _prefill(model, prompt_ids, None if mask is None else mask[:, :P], position_ids, max_new_tokens)
    batch = _Batch(model, N, next(v for v in extra.values() if isinstance(v, Cache)), device)
    T = max_new_tokens
    with _decode_experts(model):
        for t in range(max_new_tokens):
            # (N, V) float32 scores, copied as HF does: frees a full-prompt logits tensor, joins devices
            logits = batch.full(out.logits[:, -1].to(device=device, dtype=torch.float32, copy=True))  # (N, V)
            del out
            token, scores = _choose(logits, ids[:, : P + t], processors, warpers, seeded_sampler=seeded_sampler,
                                    greedy=greedy, temperature=temperature, with_logprobs=with_logprobs)
            token = torch.where(unfinished, token, pad_token_id)  # finished rows emit padding, as HF
            if with_logprobs:
                logprobs[:, t] = torch.log_softmax(scores, -1).gather(-1, token[:, None]).squeeze(-1)
            ids[:, P + t] = token
            unfinished &= ~torch.isin(token, eos)
            if t == max_new_tokens - 1 or not bool(unfinished.any()):
                T = t + 1
                break
            batch.drop_finished(unfinished)
            rows = batch.rows  # (n,)
            out = model(  # noqa: F841  (read at the loop's top next step; ruff loses it after `del out`)
                input_ids=token[rows, None], attention_mask=None if mask is None else mask[rows, : P + t + 1],
                position_ids=next_position[rows] + t, use_cache=True, return_dict=True, **extra)
    completion_ids = ids[:, P : P + T].clone()  # (N, T)
    return completion_ids, logprobs[:, :T].clone() if with_logprobs else None
