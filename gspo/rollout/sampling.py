"""Sampling G completions per prompt into a `Rollout`: `generate`, the registry of generators
(gspo's own decode loop, HF `generate`), per-row seeded sampling, and the trainer's Sampler plug."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import LogitsProcessorList

from gspo.algo.logprobs import is_fsdp2
from gspo.model_checks import available_memory
from gspo.rollout import decode
from gspo.rollout.batch import (
    Rollout,
    completion_mask_from_ids,
    encode_prompts,
    eos_ids,
    pad_id,
)


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
    backend: str = "auto",
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
    registered one that can run the model.
    `sampler`: what samples instead of `model` itself: a copy of it (`PolicySampler`) or an
    engine's handle (a backend with `start`, e.g. vllm); `model` still gives the device and tokens.
    """
    chosen = pick_generator(model, backend)
    if sampler is None and GENERATORS[chosen].start is not None:
        raise ValueError(f"backend={chosen!r} samples with an engine started for the run: use gspo.rollout.Sampler "
                         "(or pass sampler=)")
    sampler = model if sampler is None else sampler
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
        if top_p < 1 or top_k or min_p or repetition_penalty != 1.0:
            raise ValueError("row_seeds: seeded sampling draws from the full softmax; top_p/top_k/min_p/"
                             "repetition_penalty are not supported")
        seeded = SeededSampler(row_seeds, temperature, device)
    was_training = model.training
    model.eval()
    # inference mode: no version counters or view tracking per op (~5% off sampling on CPU, docs/benchmarks.md
    # section 9); what leaves it (ids, log-probs, the routing record) is rebuilt below by torch.where / cat
    # as normal tensors, which training may save for backward. Not under FSDP2: its all-gather buffers,
    # made here, are written in place again by the training forward ("Inplace update to inference tensor")
    recording = routing_recorder if routing_recorder is not None else nullcontext()
    with torch.inference_mode(not is_fsdp2(model)), recording as recorder:
        completion_ids, sampler_lp = GENERATORS[chosen].sample(
            sampler, prompt_ids, prompt_mask, eos=eos, pad=pad, max_new_tokens=max_new_tokens, temperature=temperature,
            top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty, greedy=greedy,
            seeded=seeded, with_logprobs=with_logprobs, group_size=num_generations)  # (N, T), (N, T)
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
    """A registered way to sample completions, and what it can do (checked when a Sampler is built).

    `sample(sampler, prompt_ids, prompt_mask, *, eos, pad, max_new_tokens, temperature, top_p, top_k,
    min_p, repetition_penalty, greedy, seeded, with_logprobs, group_size) -> (completion ids (N, T),
    sampler log-probs (N, T) or
    None)`, where `sampler` is the model (or its copy) or, with `start`, the engine it returned; rows
    come in groups of `group_size` copies of a prompt. `unsupported(model)`: why it cannot run
    `model`, or None. `start(policy, tokenizer, sampling, rows=, seed=)`: an engine of its own for a run, with
    `push(policy) -> seconds` (load the policy's weights) and `start_s`; None: the run's sampler
    is the policy itself or a copy of it (`PolicySampler`).
    """

    sample: object
    unsupported: object
    seeded_rows: bool = True  # honours per-row seeds (SeededSampler)
    routing_record: bool = True  # its forwards can be recorded by gspo.plugs.moe.record_routing
    logprobs: bool = True  # returns the sampler's own log-probs (mu)
    start: object = None  # (policy, tokenizer, sampling, rows=, seed=) -> an engine; None: PolicySampler


GENERATORS: dict[str, GeneratorBackend] = {}


def register_generator(name: str, backend: GeneratorBackend) -> GeneratorBackend:
    if name in GENERATORS or name == "auto":
        raise ValueError(f"generator {name!r} is already registered")
    GENERATORS[name] = backend
    return backend


def generator_choices() -> tuple[str, ...]:
    """The values `generation_backend` accepts: "auto" (the first registered one that can run the model) and each
    name."""
    return ("auto", *GENERATORS)


def policy_backend(backend: str) -> str:
    """The backend that samples with the policy itself: `backend`, or "auto" where it names an engine (vllm)."""
    return "auto" if backend in GENERATORS and GENERATORS[backend].start is not None else backend


def pick_generator(model, backend: str) -> str:
    """The registered generator `backend` names, or for "auto" the first that can run `model`."""
    return choose_generator(model, backend)[0]


def choose_generator(model, backend: str) -> tuple[str, str]:
    """(the generator `pick_generator` takes, why: a line for the log saying which and, for "auto",
    why each one before it was passed over)."""
    if backend not in generator_choices():
        raise ValueError(f"backend must be one of {', '.join(map(repr, generator_choices()))}; got {backend!r}")
    if backend != "auto":
        reason = GENERATORS[backend].unsupported(model)
        if reason is not None:
            raise ValueError(f"backend={backend!r} cannot run this model: {reason}")
        return backend, f"sampler: {backend} (generation_backend={backend!r})"
    passed_over = []
    for name, b in GENERATORS.items():
        reason = b.unsupported(model)
        if reason is None:
            why = "; ".join(f"not {other}: {r}" for other, r in passed_over) or "the first that runs this model"
            return name, f"sampler: {name} (generation_backend='auto': {why})"
        passed_over.append((name, reason))
    raise ValueError("no registered generator can run this model: " + "; ".join(f"{n}: {r}" for n, r in passed_over))


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


register_generator("gspo", GeneratorBackend(_native_sample, decode.unsupported_reason))
register_generator("hf", GeneratorBackend(_hf_generate, lambda model: None))


class SeededSampler:
    """Samples each row from its own generator: the Gumbel-max trick, argmax(logits / T + G).

    With G_v = -log(-log(U_v)), U_v uniform, argmax_v(l_v + G_v) is an exact sample from
    softmax(l) (Gumbel 1954; e.g. Maddison et al. 2014, "A* sampling"). HF runs the argmax (greedy
    decoding) after this processor. Row i draws V uniforms per step from generator i only.
    """

    def __init__(self, seeds: list[int], temperature: float, device):
        self.seeds, self.temperature = list(seeds), temperature  # an engine seeds its own sampler from `seeds`
        self.generators = [torch.Generator(device=device).manual_seed(int(s) % 2**63) for s in seeds]

    def rows(self, index: list[int]) -> SeededSampler:
        """The sampler of rows `index` only, drawing from the same generators (a multi-turn episode's rows that
        are still running: each row's stream goes on where its last turn left it)."""
        view = copy.copy(self)
        view.seeds, view.generators = [self.seeds[i] for i in index], [self.generators[i] for i in index]
        return view

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        V = scores.shape[-1]
        uniform = torch.stack([torch.rand(V, generator=g, device=scores.device) for g in self.generators])  # (N, V)
        gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-12, max=1 - 1e-7)))  # (N, V)
        return scores.float() / self.temperature + gumbel


def sampling_options(s) -> dict:
    """`generate`'s keywords that a SamplingSettings (gspo.config) sets: the completion length, the reshaping of the
    distribution and the prompt limit (rollout workers build the same Sampler, so they sample with the same)."""
    return dict(max_new_tokens=s.max_completion_length, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                min_p=s.min_p, repetition_penalty=s.repetition_penalty, max_prompt_length=s.max_prompt_length,
                truncate_prompts=s.truncate_prompts)


def row_seeds(seed: int, step: int, first_row: int, count: int) -> list[int]:
    """Seeds of rows first_row .. first_row+count-1 of a run's rollout at `step` (global row numbers)."""
    base = (seed * 1_000_003 + step) * 1_000_003
    return [base + first_row + i for i in range(count)]


def keeps_sampler_logprobs(cfg, engine: bool = False) -> bool:
    """Whether a run keeps the sampler's log-probs (mu): it trains on them (use_sampler_logprobs, a
    rollout correction), or mu may differ from pi_old (a copy, a lag, stale workers, an engine), or log_mismatch."""
    return bool(cfg.use_sampler_logprobs or cfg.rollout_correction != "none" or cfg.sampler_dtype
                or cfg.sampler_lag or cfg.max_staleness or cfg.log_mismatch or engine)


class PolicySampler:
    """The sampler of the gspo and hf backends: the policy itself, or a copy of its weights.

    A copy when `sampler_dtype` differs from the policy's (a low-precision stand-in for an
    inference engine's numerics) or `sampler_lag` = k > 0 (a stand-in for asynchronous training:
    rollout s samples with the weights the updates of rollout s - 1 - k left, the initial ones
    until then). `push(policy)` after each rollout's updates; without a copy it does nothing and the
    sampled tokens are those of the policy itself, bit for bit.
    """

    def __init__(self, policy, tokenizer=None, sampling=None):
        """`sampling`: the run's SamplingSettings (gspo.config); None: the policy itself."""
        from gspo.models import DTYPES

        own = next(policy.parameters()).dtype
        self.dtype = DTYPES[sampling.sampler_dtype] if sampling is not None and sampling.sampler_dtype else own
        self.lag = sampling.sampler_lag if sampling is not None else 0
        self.start_s = 0.0
        self.pending: deque = deque()  # the lag's newer weights, oldest first
        if self.dtype == own and self.lag == 0:
            self.model = policy
            return
        if is_fsdp2(policy):
            raise ValueError("sampler_dtype/sampler_lag: the sampler copy needs the full weights, which fsdp shards; "
                             "use distributed=ddp (or one process)")
        t0 = time.perf_counter()
        self.model = copy.deepcopy(policy).to(self.dtype).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.start_s = time.perf_counter() - t0

    @torch.no_grad()
    def push(self, policy) -> float:
        """Load the policy's weights (k rollouts later with a lag); seconds taken (0.0 without a copy)."""
        if self.model is policy:
            return 0.0
        t0 = time.perf_counter()
        state = policy.state_dict()
        if self.lag:
            self.pending.append({k: v.detach().to(self.dtype, copy=True) for k, v in state.items()})
            state = self.pending.popleft() if len(self.pending) > self.lag else None
        if state is not None:
            self.model.load_state_dict(state)  # cast into the copy's dtype
        return time.perf_counter() - t0


_LOWER = "lower num_generations (or per_device_batch_size, max_completion_length)"


def sampling_bytes(config, n: int, new_tokens: int, dtype_bytes: int) -> int:
    """A lower bound of the memory that sampling `n` sequences of `new_tokens` tokens takes: the KV cache
    of the new tokens alone (the prompts' share left out) in every full-attention layer, plus one step's
    float32 logits (n, V). Where the config does not size the cache plainly (no head counts, latent
    attention), the logits alone. `config`: the model's (its text config for a multimodal one).
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(config, "layer_types", None)
    layers = sum(t == "full_attention" for t in types) if types else getattr(config, "num_hidden_layers", 0)
    attention_heads = getattr(config, "num_attention_heads", None)
    heads = getattr(config, "num_key_value_heads", None) or attention_heads  # (G)QA: the cache's heads
    head_dim = getattr(config, "head_dim", None) or (
        getattr(config, "hidden_size", 0) // attention_heads if attention_heads else None)
    window = getattr(config, "sliding_window", None)
    tokens = min(new_tokens, window) if not types and isinstance(window, int) and window > 0 else new_tokens
    kv = 0
    if layers and heads and head_dim and not hasattr(config, "kv_lora_rank"):
        kv = n * tokens * layers * 2 * heads * head_dim * dtype_bytes  # keys and values
    return kv + n * (getattr(config, "vocab_size", None) or 0) * 4


def available_bytes(device: torch.device) -> int | None:
    """Memory free for tensors on `device` (CUDA: free plus cached by torch; CPU: available RAM plus free swap,
    `gspo.model_checks.available_memory`), or None where it cannot be read (then nothing is refused)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        return available_memory()
    return None


def check_sampling_memory(sampler, B: int, G: int, T: int) -> None:
    """Refuse, before training, a rollout of B prompts x G completions of up to T tokens whose lower bound
    (`sampling_bytes`) exceeds the memory available on the sampler's device: a ValueError naming num_generations."""
    param, config = next(sampler.parameters()), getattr(sampler, "config", None)
    if config is None:  # not a transformers model: nothing to size it by
        return
    need = sampling_bytes(config, B * G, T, param.element_size())
    have = available_bytes(param.device)
    if have is not None and need > have:
        raise ValueError(f"config: per_device_batch_size={B} x num_generations={G} = {B * G} sequences of up to {T} "
                         f"new tokens need at least {need / 2**30:.1f} GiB to sample (KV cache and logits), more "
                         f"than the {have / 2**30:.1f} GiB available on {param.device}; {_LOWER}")


def out_of_memory(err: BaseException) -> bool:
    """torch's out-of-memory errors: CUDA's OutOfMemoryError, the CPU allocator's "not enough memory" /
    "can't allocate memory", MPS's "out of memory", Python's MemoryError."""
    return isinstance(err, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(err, RuntimeError) and any(s in str(err) for s in ("out of memory", "not enough memory",
                                                                      "can't allocate memory")))


class Sampler:
    """The sampling plug of the trainer: G completions per prompt from the policy being trained.

    Built once, from the policy's current weights; `sample(prompts, step, first_row)` returns this
    rank's `Rollout` with the sampler's own log-probs (mu) when `with_logprobs`, the experts it
    used when `recorder` is given (called with the model that samples), and per-row seeds (global
    row numbers from `first_row`) when `seeded`. `sync(policy)` after the updates loads the new
    weights into the sampler (an engine, a copy; nothing when the sampler is the policy itself)
    and returns `time/sync_s`.
    """

    def __init__(self, model, tokenizer, cfg, *, seeded: bool, recorder=lambda model: None, records: bool = False):
        """The plug's builder: it reads the run's TrainConfig; the sampler keeps its SamplingSettings (and
        EpisodeSettings: with an environment every sequence is a multi-turn episode, its chat messages rendered
        with chat_template_kwargs, its python tool in `sandbox`) only."""
        from gspo.config import EpisodeSettings, SamplingSettings, section
        from gspo.env import chat_template_kwargs, environment_factory
        from gspo.rollout.episodes import EpisodeLimits

        sampling, episodes = section(cfg, SamplingSettings), section(cfg, EpisodeSettings)
        self.make_env = environment_factory(episodes, cfg.sandbox)  # None: single-turn
        self.template_kwargs = chat_template_kwargs(cfg.chat_template_kwargs, episodes)
        self.limits = EpisodeLimits.of(episodes, sampling.max_completion_length)
        self.model, self.tokenizer, self.seeded, self.recorder = model, tokenizer, seeded, recorder
        self.options = sampling_options(sampling)
        self.group_size, self.seed = cfg.num_generations, cfg.seed
        self.name, self.reason = choose_generator(model, sampling.generation_backend)  # reason: a line for the log
        backend = GENERATORS[self.name]
        with_logprobs = keeps_sampler_logprobs(cfg, engine=backend.start is not None)
        needs = {"seeded_rows": seeded, "routing_record": records, "logprobs": with_logprobs}
        missing = [what for what, needed in needs.items() if needed and not getattr(backend, what)]
        if missing:
            raise ValueError(f"generation_backend={self.name!r} cannot provide {', '.join(missing)}, which this run "
                             "needs (seeded_sampling or torchrun, routing_replay=rollout, the sampler's log-probs)")
        self.with_logprobs, self.synced, self.records = with_logprobs, False, records
        B, G = cfg.per_device_batch_size, cfg.num_generations
        # an engine holds whole episodes: room for the prompt and max_episode_tokens after it
        engine = sampling if self.make_env is None else dataclasses.replace(
            sampling, max_completion_length=max(sampling.max_completion_length, episodes.max_episode_tokens))
        self.sampler = (backend.start(model, tokenizer, engine, rows=B * G, seed=cfg.seed) if backend.start
                        else PolicySampler(model, tokenizer, sampling))
        if isinstance(self.sampler, PolicySampler):  # an engine sizes its own memory (vllm_gpu_memory_utilization)
            check_sampling_memory(self.sampler.model, B, G, sampling.max_completion_length)

    def request(self, prompts: list[str], step: int, first_row: int, rows: list | None = None) -> None:
        """Remember step `step`'s prompts (and their data rows, which start episodes); `receive(step)` samples
        them (in this process nothing runs ahead)."""
        self.asked = (prompts, step, first_row, rows)

    def receive(self, step: int, wait: bool = True) -> Rollout | None:
        """Step `step`'s rollout, sampled now from the prompts `request` gave (None without `wait`)."""
        prompts, asked, first_row, rows = self.asked
        assert asked == step, (asked, step)
        return self.sample(prompts, step, first_row, rows) if wait else None

    def rng_after(self, step: int) -> None:
        """Nothing: this sampler draws from the trainer's random state, which the checkpoint holds."""

    def version_of(self, step: int) -> None:
        """None: sampled in this process from the weights the step trains (or sampler_lag's copy, a fixed lag)."""

    def sample(self, prompts: list[str], step: int, first_row: int, rows: list | None = None) -> Rollout:
        G = self.group_size
        sampler = self.sampler.model if isinstance(self.sampler, PolicySampler) else self.sampler
        seeds = row_seeds(self.seed, step, first_row, len(prompts) * G) if self.seeded else None
        try:
            if self.make_env is not None:  # one episode per sequence, G per row, each with its own environment
                rows = rows if rows is not None else [{"prompt": p} for p in prompts]  # prompts alone: rows of them
                return self.episodes(sampler, [row for row in rows for _ in range(G)], seeds)
            return generate(self.model, self.tokenizer, prompts, G, **self.options, with_logprobs=self.with_logprobs,
                            routing_recorder=self.recorder(sampler), row_seeds=seeds, backend=self.name,
                            sampler=sampler)
        except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError
            if not out_of_memory(err):
                raise
            text = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise ValueError(f"step {step}: sampling {len(prompts) * G} sequences (per_device_batch_size="
                             f"{len(prompts)} x num_generations={G}) ran out of memory ({text}); {_LOWER}") from None

    def episodes(self, sampler, rows: list, seeds: list[int] | None) -> Rollout:
        """Multi-turn episodes of `rows` (one per sequence) sampled by `sampler` (gspo/rollout/episodes.py)."""
        from gspo.rollout.episodes import sample_episodes

        options = {k: v for k, v in self.options.items() if k not in ("max_new_tokens", "max_prompt_length",
                                                                      "truncate_prompts")}
        rollout, _ = sample_episodes(GENERATORS[self.name], sampler, self.model, self.tokenizer,
                                     [self.make_env() for _ in rows], rows, self.limits,
                                     max_prompt_length=self.options["max_prompt_length"],
                                     truncate_prompts=self.options["truncate_prompts"], seeds=seeds,
                                     with_logprobs=self.with_logprobs, chat_template_kwargs=self.template_kwargs,
                                     recorder=(lambda: self.recorder(sampler)) if self.records else None, **options)
        return rollout

    def sync(self, policy) -> dict:
        """Load the updated policy into the sampler; {"time/sync_s": seconds}, and on the first call
        `time/sampler_start_s` (the engine's start-up, or making the copy; 0 for the policy itself)."""
        stats = {"time/sync_s": self.sampler.push(policy)}
        if not self.synced:
            stats["time/sampler_start_s"], self.synced = self.sampler.start_s, True
        return stats

    def close(self) -> None:
        """Shut down an engine this Sampler started (vllm: one per process at a time); nothing otherwise."""
        close = getattr(self.sampler, "close", None)
        if close is not None:
            close()
