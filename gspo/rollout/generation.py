"""`generate`: G completions per prompt into one padded `Rollout`, by a registered generator (gspo/rollout/registry.py),
and the two built-in generators that sample with the model itself: gspo's own decode loop (gspo/rollout/decode.py)
and HF `generate`."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor
from transformers import LogitsProcessorList

from gspo.algo.logprobs import is_fsdp2
from gspo.rollout import decode
from gspo.rollout.batch import Rollout, completion_mask_from_ids, encode_prompts, eos_ids, pad_id
from gspo.rollout.policy import SeededSampler
from gspo.rollout.registry import GENERATORS, GeneratorBackend, pick_generator


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: list[str],
    num_generations: int,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    greedy: bool = False,
    max_prompt_length: int = 512,
    truncate_prompts: str = "error",
    with_logprobs: bool = False,
    routing_recorder=None,
    row_seeds: list[int] | None = None,
    backend: str | GeneratorBackend = "auto",
    sampler=None,
) -> Rollout:
    """Sample `num_generations` completions for each prompt (KV-cached decoding).

    No truncation of the distribution unless asked: top_k=0, top_p=1, min_p=0 and
    repetition_penalty=1 sample the full softmax(logits / temperature), the distribution the
    trainer's log-probs are taken over.
    `with_logprobs` keeps the sampler's own log-probs of the chosen tokens.
    `routing_recorder`: `gspo.plugs.moe.record_routing(model)`; the experts chosen in the prefill and
    every decode step are kept in `Rollout.routing`, padded to the (N, P+T) layout of `input_ids`
    (the last column, never fed back, is -1: route freely).
    `row_seeds`: one seed per completion (N = len(prompts) * num_generations): each row draws from
    its own generator (`SeededSampler`), so a completion does not depend on which other rows share
    the batch, or the process: the same run on 1 or 8 ranks samples the same tokens.
    `truncate_prompts`: "left" keeps the last max_prompt_length tokens of a longer prompt (see
    `encode_prompts`); "error" refuses it.
    `backend`: a registered generator (GENERATORS): "gspo" runs `gspo.rollout.decode.sample` (preallocated
    KV cache, same tokens as HF for the same seed), "hf" runs HF `generate`; "auto" the first
    registered one that can run the model; or a GeneratorBackend itself (rollout endpoints').
    `sampler`: what samples instead of `model` itself: a copy of it (`PolicySampler`) or an
    engine's handle (a backend with `start`, e.g. vllm); `model` still gives the device and tokens.
    """
    chosen = backend if isinstance(backend, GeneratorBackend) else GENERATORS[pick_generator(model, backend)]
    if sampler is None and chosen.start is not None:
        raise ValueError(f"backend={backend!r} samples with an engine started for the run: use gspo.rollout.Sampler "
                         "(or pass sampler=)")
    engine = sampler is not None and sampler is not model and not isinstance(sampler, torch.nn.Module)
    sampler = model if sampler is None else sampler
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, max_prompt_length, device, truncate_prompts)  # (B, P)
    prompt_ids = prompt_ids.repeat_interleave(num_generations, dim=0)  # (N, P)
    prompt_mask = prompt_mask.repeat_interleave(num_generations, dim=0)  # (N, P)
    eos = eos_ids(tokenizer, model)
    pad = pad_id(tokenizer, model)
    seeded = None if row_seeds is None or greedy else _seeded_rows(
        row_seeds, prompt_ids.shape[0], temperature, device, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty)
    was_training = model.training
    if not engine:  # an engine samples: the policy is not run here (and may be training in another thread)
        model.eval()
    recording = routing_recorder if routing_recorder is not None else nullcontext()
    with torch.inference_mode(samples_in_inference_mode(sampler, model)), recording as recorder:
        completion_ids, sampler_lp = chosen.sample(
            sampler, prompt_ids, prompt_mask, eos=eos, pad=pad, max_new_tokens=max_new_tokens, temperature=temperature,
            top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty, greedy=greedy,
            seeded=seeded, with_logprobs=with_logprobs, group_size=num_generations)  # (N, T), (N, T)
    if not engine:
        model.train(was_training)
    return _rollout(tokenizer, [p for p in prompts for _ in range(num_generations)], prompt_ids, prompt_mask,
                    completion_ids, sampler_lp, recorder, eos=eos, pad=pad)


def samples_in_inference_mode(sampler, model) -> bool:
    """Whether sampling runs in inference mode: no version counters or view tracking per op (~5% off sampling on
    CPU, docs/benchmarks.md section 9); what leaves it (ids, log-probs, the routing record) is rebuilt by
    `_rollout` as normal tensors, which training may save for backward. Not under FSDP2: its all-gather buffers,
    made here, are written in place again by the training forward ("Inplace update to inference tensor"). Not
    under an autocast that caches its casts of trainable float32 weights: inference mode turns that cache off,
    and every decode step would cast every weight again (SmolLM2 under bf16 autocast, 32 rows: sampling 1.26x
    faster with the cache, docs/benchmarks.md section 13); the casts, and the tokens, are the same. What is asked
    about is `sampler` where it is a module (a copy of the policy), else the policy `model` (an engine's handle)."""
    model = sampler if isinstance(sampler, torch.nn.Module) else model
    if is_fsdp2(model):
        return False
    device = next(model.parameters()).device.type
    caching = torch.is_autocast_enabled(device) and torch.is_autocast_cache_enabled()
    return not (caching and any(p.requires_grad and p.dtype == torch.float32 for p in model.parameters()))


def _seeded_rows(row_seeds: list[int], n: int, temperature: float, device, *, top_p: float, top_k: int, min_p: float,
                 repetition_penalty: float) -> SeededSampler:
    """The per-row generators of `row_seeds`, one per completion (n); a ValueError for a count that does not fit
    or a reshaped distribution (seeded sampling draws from the full softmax)."""
    if len(row_seeds) != n:
        raise ValueError(f"row_seeds: {len(row_seeds)} seeds for {n} completions")
    if top_p < 1 or top_k or min_p or repetition_penalty != 1.0:
        raise ValueError("row_seeds: seeded sampling draws from the full softmax; top_p/top_k/min_p/"
                         "repetition_penalty are not supported")
    return SeededSampler(row_seeds, temperature, device)


def _rollout(tokenizer, prompts: list[str], prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
             sampler_lp: Tensor | None, recorder, *, eos, pad: int) -> Rollout:
    """The Rollout of sampled completions (N, T) after prompts (N, P): each completion cut after its first EOS
    (pad after it, mu 0 there), decoded, and the routing `recorder` kept (or None) laid out on input_ids."""
    cmask = completion_mask_from_ids(completion_ids, eos)  # (N, T)
    completion_ids = torch.where(cmask, completion_ids, torch.full_like(completion_ids, pad))
    if sampler_lp is not None:
        sampler_lp = torch.where(cmask, sampler_lp, torch.zeros_like(sampler_lp))
    texts = tokenizer.batch_decode([ids[m].tolist() for ids, m in zip(completion_ids, cmask)], skip_special_tokens=True)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (N, P+T)
    # the record covers positions 0..P+T-2 (the last token is never fed back)
    routing = None
    if recorder is not None:
        record = recorder.record()  # (R, N, l, k)
        if record.shape[1] > input_ids.shape[1] - 1:  # FSDP (synced_gpus): forwards run after this rank finished
            record = record.select(slice(None), slice(0, input_ids.shape[1] - 1))
        routing = record.pad_to(input_ids.shape[1])  # (R, N, P+T, k)
    return Rollout(
        input_ids=input_ids,
        attention_mask=torch.cat([prompt_mask, cmask.long()], dim=1),
        completion_mask=cmask,
        prompts=prompts,
        completions=texts,
        sampler_logprobs=sampler_lp,
        routing=routing,
    )


def sampling_options(s) -> dict:
    """`generate`'s keywords that a SamplingSettings (gspo.config) sets: the completion length, the reshaping of the
    distribution and the prompt limit (rollout workers build the same Sampler, so they sample with the same)."""
    return dict(max_new_tokens=s.max_completion_length, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                min_p=s.min_p, repetition_penalty=s.repetition_penalty, max_prompt_length=s.max_prompt_length,
                truncate_prompts=s.truncate_prompts)


def _native_sample(model, prompt_ids, prompt_mask, *, eos, pad, max_new_tokens, temperature, top_p, top_k, min_p,
                   repetition_penalty, greedy, seeded, with_logprobs, group_size) -> tuple[Tensor, Tensor | None]:
    """gspo's decode loop (gspo/rollout/decode.py): preallocated KV cache, the same tokens as HF for the same seed."""
    return decode.sample(model, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens, eos_token_ids=eos,
                         pad_token_id=pad, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                         repetition_penalty=repetition_penalty, greedy=greedy, seeded_sampler=seeded,
                         with_logprobs=with_logprobs)


def _hf_generate(model, prompt_ids, prompt_mask, *, eos, pad, max_new_tokens, temperature, top_p, top_k, min_p,
                 repetition_penalty, greedy, seeded, with_logprobs, group_size) -> tuple[Tensor, Tensor | None]:
    """HF `generate`: completion ids (N, T) and, if asked, the sampler's log-probs (N, T)."""
    sampling = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p or None}
    if seeded is not None:
        sampling = {"logits_processor": LogitsProcessorList([seeded])}  # argmax of logits/T + Gumbel noise
    out = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        do_sample=not greedy and seeded is None,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad,
        eos_token_id=eos,
        # ours, and neutral values for the distribution-changing defaults a checkpoint's generation_config may carry
        repetition_penalty=repetition_penalty, typical_p=1.0, no_repeat_ngram_size=0,
        **({} if "min_p" in sampling else {"min_p": None}),
        return_dict_in_generate=True,
        output_scores=with_logprobs and seeded is None,
        output_logits=with_logprobs and seeded is not None,
        synced_gpus=is_fsdp2(model),  # FSDP: every rank runs the same number of forwards
        **sampling,
    )
    completion_ids = out.sequences[:, prompt_ids.shape[1]:]  # (N, T) HF pads rows after their EOS
    if not with_logprobs:
        return completion_ids, None
    # out.scores are the processed logits each token was actually sampled from, one (N, V) per step;
    # seeded sampling adds noise to them, so take the raw logits over the temperature instead
    steps = out.scores if seeded is None else [logits.float() / temperature for logits in out.logits]
    sampler_lp = torch.stack([
        torch.log_softmax(s.float(), -1).gather(-1, completion_ids[:, j : j + 1]).squeeze(-1)
        for j, s in enumerate(steps)], dim=1)  # (N, T)
    return completion_ids, sampler_lp


NATIVE = GeneratorBackend(_native_sample, decode.unsupported_reason)  # "gspo" in the registry
HF_GENERATE = GeneratorBackend(_hf_generate, lambda model: None)  # "hf"


__all__ = ["HF_GENERATE", "NATIVE", "generate", "samples_in_inference_mode", "sampling_options"]
