"""Generation: sample G completions per prompt (gspo's own decode loop or HF `generate`) into a `Rollout`.

Layout: `input_ids` (N, P+T) are left-padded prompts (width P) followed by right-padded
completions (width T), N = B*G, rows grouped by prompt. The completion mask covers each
completion up to and including its first EOS.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor
from transformers import LogitsProcessorList

from gspo import decode
from gspo.data import TRUNCATIONS
from gspo.logprobs import is_fsdp2


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
    advantages: Tensor | None = None  # (N,)
    old_logprobs: Tensor | None = None  # (N, T)
    ref_logprobs: Tensor | None = None  # (N, T)
    routing: object | None = None  # gspo.moe.RoutingRecord (R, N, P+T, k) aligned with input_ids; -1 = route freely

    @property
    def completion_len(self) -> int:
        return self.completion_mask.shape[1]

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    def trim(self, rows: Tensor) -> tuple[int, int, int]:
        """(left, cut, keep_t): `select(rows)` keeps input columns left:cut and completion columns :keep_t."""
        T = self.completion_len
        attn = self.attention_mask[rows]  # (n, P+T)
        cmask = self.completion_mask[rows]  # (n, T)
        left = int((attn[:, : attn.shape[1] - T].sum(0) > 0).nonzero()[0, 0])  # first prompt column in use
        keep_t = int(cmask.any(0).nonzero()[-1, 0]) + 1  # last completion column in use
        return left, attn.shape[1] - T + keep_t, keep_t

    def select(self, rows: Tensor) -> "Rollout":
        """The rollout restricted to `rows`, with all-padding columns trimmed on both sides."""
        left, cut, keep_t = self.trim(rows)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                v = v[rows]
                if f.name in ("input_ids", "attention_mask"):
                    v = v[:, left:cut]
                elif v.dim() == 2:
                    v = v[:, :keep_t]
            elif isinstance(v, list):
                v = [v[i] for i in rows.tolist()]
            elif v is not None:  # a routing record: rows, then the same columns as input_ids
                v = v.select(rows, slice(left, cut))
            out[f.name] = v
        return replace(self, **out)


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
    greedy: bool = False,
    max_prompt_length: int = 512,
    truncate_prompts: str = "error",
    with_logprobs: bool = False,
    routing_recorder=None,
    row_seeds: list[int] | None = None,
    backend: str = "auto",
) -> Rollout:
    """Sample `num_generations` completions for each prompt (KV-cached decoding).

    No truncation of the distribution unless asked: top_k=0 and top_p=1 sample the full
    softmax(logits / temperature), the distribution the trainer's log-probs are taken over.
    `with_logprobs` keeps the sampler's own log-probs of the chosen tokens.
    `routing_recorder`: `gspo.moe.record_routing(model)`; the experts chosen in the prefill and
    every decode step are kept in `Rollout.routing`, padded to the (N, P+T) layout of `input_ids`
    (the last column, never fed back, is -1: route freely).
    `row_seeds`: one seed per completion (N = len(prompts) * num_generations): each row draws from
    its own generator (`SeededSampler`), so a completion does not depend on which other rows share
    the batch, or the process: the same run on 1 or 8 ranks samples the same tokens.
    `truncate_prompts`: "left" keeps the last max_prompt_length tokens of a longer prompt (see
    `encode_prompts`); "error" refuses it.
    `backend`: a registered generator (GENERATORS): "gspo" runs `gspo.decode.sample` (preallocated
    KV cache, same tokens as HF for the same seed), "hf" runs HF `generate`; "auto" the first
    registered one that can run the model.
    """
    chosen = pick_generator(model, backend)
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, max_prompt_length, device, truncate_prompts)  # (B, P)
    prompt_ids = prompt_ids.repeat_interleave(num_generations, dim=0)  # (N, P)
    prompt_mask = prompt_mask.repeat_interleave(num_generations, dim=0)  # (N, P)
    eos = eos_ids(tokenizer, model)
    pad = pad_id(tokenizer, model)
    seeded = None
    if row_seeds is not None and not greedy:
        if len(row_seeds) != prompt_ids.shape[0]:
            raise ValueError(f"row_seeds: {len(row_seeds)} seeds for {prompt_ids.shape[0]} completions")
        if top_p < 1 or top_k:
            raise ValueError("row_seeds: seeded sampling draws from the full softmax; top_p/top_k are not supported")
        seeded = SeededSampler(row_seeds, temperature, device)
    was_training = model.training
    model.eval()
    with routing_recorder if routing_recorder is not None else nullcontext() as recorder:
        completion_ids, sampler_lp = GENERATORS[chosen].sample(
            model, prompt_ids, prompt_mask, eos=eos, pad=pad, max_new_tokens=max_new_tokens, temperature=temperature,
            top_p=top_p, top_k=top_k, greedy=greedy, seeded=seeded, with_logprobs=with_logprobs)  # (N, T), (N, T)
    model.train(was_training)
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
        prompts=[p for p in prompts for _ in range(num_generations)],
        completions=texts,
        sampler_logprobs=sampler_lp,
        routing=routing,
    )


@dataclass(frozen=True)
class GeneratorBackend:
    """A registered way to sample completions, and what it can do (checked when a Generator is built).

    `sample(model, prompt_ids, prompt_mask, *, eos, pad, max_new_tokens, temperature, top_p, top_k,
    greedy, seeded, with_logprobs) -> (completion ids (N, T), sampler log-probs (N, T) or None)`;
    `unsupported(model)`: why it cannot run `model`, or None.
    """

    sample: object
    unsupported: object
    seeded_rows: bool = True  # honours per-row seeds (SeededSampler)
    routing_record: bool = True  # its forwards can be recorded by gspo.moe.record_routing
    logprobs: bool = True  # returns the sampler's own log-probs (mu)


GENERATORS: dict[str, GeneratorBackend] = {}


def register_generator(name: str, backend: GeneratorBackend) -> GeneratorBackend:
    if name in GENERATORS or name == "auto":
        raise ValueError(f"generator {name!r} is already registered")
    GENERATORS[name] = backend
    return backend


def generator_choices() -> tuple[str, ...]:
    """The values `generation_backend` accepts: "auto" (the first registered one that can run the model) and each name."""
    return ("auto", *GENERATORS)


def pick_generator(model, backend: str) -> str:
    """The registered generator `backend` names, or for "auto" the first that can run `model`."""
    if backend not in generator_choices():
        raise ValueError(f"backend must be one of {', '.join(map(repr, generator_choices()))}; got {backend!r}")
    if backend != "auto":
        reason = GENERATORS[backend].unsupported(model)
        if reason is not None:
            raise ValueError(f"backend={backend!r} cannot run this model: {reason}")
        return backend
    return next(name for name, b in GENERATORS.items() if b.unsupported(model) is None)


def _native_sample(model, prompt_ids, prompt_mask, *, eos, pad, max_new_tokens, temperature, top_p, top_k, greedy,
                   seeded, with_logprobs) -> tuple[Tensor, Tensor | None]:
    """gspo's decode loop (gspo/decode.py): preallocated KV cache, the same tokens as HF for the same seed."""
    return decode.sample(model, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens, eos_token_ids=eos,
                         pad_token_id=pad, temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy,
                         seeded_sampler=seeded, with_logprobs=with_logprobs)


def _hf_generate(model, prompt_ids, prompt_mask, *, eos, pad, max_new_tokens, temperature, top_p, top_k, greedy,
                 seeded, with_logprobs) -> tuple[Tensor, Tensor | None]:
    """HF `generate`: completion ids (N, T) and, if asked, the sampler's log-probs (N, T)."""
    sampling = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    if seeded is not None:
        sampling = {"logits_processor": LogitsProcessorList([seeded])}  # argmax of logits/T + Gumbel noise
    out = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        do_sample=not greedy and seeded is None,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad,
        eos_token_id=eos,
        # neutralise distribution-changing defaults a checkpoint's generation_config may carry
        repetition_penalty=1.0, min_p=None, typical_p=1.0, no_repeat_ngram_size=0,
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


register_generator("gspo", GeneratorBackend(_native_sample, decode.unsupported_reason))
register_generator("hf", GeneratorBackend(_hf_generate, lambda model: None))


class SeededSampler:
    """Samples each row from its own generator: the Gumbel-max trick, argmax(logits / T + G).

    With G_v = -log(-log(U_v)), U_v uniform, argmax_v(l_v + G_v) is an exact sample from
    softmax(l) (Gumbel 1954; e.g. Maddison et al. 2014, "A* sampling"). HF runs the argmax (greedy
    decoding) after this processor. Row i draws V uniforms per step from generator i only.
    """

    def __init__(self, seeds: list[int], temperature: float, device):
        self.temperature = temperature
        self.generators = [torch.Generator(device=device).manual_seed(int(s) % 2**63) for s in seeds]

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        V = scores.shape[-1]
        uniform = torch.stack([torch.rand(V, generator=g, device=scores.device) for g in self.generators])  # (N, V)
        gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-12, max=1 - 1e-7)))  # (N, V)
        return scores.float() / self.temperature + gumbel


def row_seeds(seed: int, step: int, first_row: int, count: int) -> list[int]:
    """Seeds of rows first_row .. first_row+count-1 of a run's rollout at `step` (global row numbers)."""
    base = (seed * 1_000_003 + step) * 1_000_003
    return [base + first_row + i for i in range(count)]


def pad_id(tokenizer, model=None) -> int:
    """The id every layout is padded with (rollouts, SFT batches, references): the tokenizer's pad
    token, else the first stop token (`eos_ids`)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids(tokenizer, model)[0]


class Generator:
    """The sampling plug of the trainer: G completions per prompt from the policy being trained.

    Built once; `sample(prompts, step, first_row)` returns this rank's `Rollout` with the sampler's
    own log-probs (mu) when asked, the experts it used when `recorder` is given, and per-row seeds
    (global row numbers from `first_row`) when `seeded`. `sync(policy)` after the updates: a
    no-op here, the sampler is the policy itself (an inference engine would load the new weights).
    """

    def __init__(self, model, tokenizer, cfg, *, seeded: bool, recorder=lambda: None, records: bool = False):
        self.model, self.tokenizer, self.cfg, self.seeded, self.recorder = model, tokenizer, cfg, seeded, recorder
        name = pick_generator(model, cfg.generation_backend)
        backend = GENERATORS[name]
        needs = {"seeded_rows": seeded, "routing_record": records, "logprobs": cfg.use_sampler_logprobs}
        missing = [what for what, needed in needs.items() if needed and not getattr(backend, what)]
        if missing:
            raise ValueError(f"generation_backend={name!r} cannot provide {', '.join(missing)}, which this run "
                             "needs (seeded_sampling or torchrun, routing_replay=rollout, use_sampler_logprobs)")

    def sample(self, prompts: list[str], step: int, first_row: int) -> Rollout:
        cfg, G = self.cfg, self.cfg.num_generations
        return generate(self.model, self.tokenizer, prompts, G, max_new_tokens=cfg.max_completion_length,
                        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                        max_prompt_length=cfg.max_prompt_length, truncate_prompts=cfg.truncate_prompts,
                        with_logprobs=cfg.use_sampler_logprobs,
                        routing_recorder=self.recorder(),
                        row_seeds=row_seeds(cfg.seed, step, first_row, len(prompts) * G) if self.seeded else None,
                        backend=cfg.generation_backend)

    def sync(self, policy) -> None:
        pass
