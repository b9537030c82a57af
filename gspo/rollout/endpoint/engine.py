"""The endpoint's sampling engine: requests from any thread are queued as `Job`s, and the sampling thread (the
trainer's main thread, or `gspo serve`'s) takes them in batches and samples each batch in one generator call.

Concurrent requests (an agent's episodes, several clients) share one call: the engine waits a short window after
the first request, or until as many requests are waiting as its `expected()` says will come (the episodes of a step
that are still running), so a step's episodes decode together as gspo's own episodes do. Requests that sample
differently (temperature, top_p, seeded or not) go into separate calls; within a call each row stops at its own
`max_tokens` and stop strings, cut from what was sampled (sampling is autoregressive, so a row cut at token k is
exactly a row that stopped there).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace

import torch

from gspo.rollout.batch import completion_mask_from_ids, eos_ids, pad_id
from gspo.rollout.generation import samples_in_inference_mode


@dataclass
class Sample:
    """One sampled completion: its tokens exactly as sampled (a stop token kept) and mu, the sampler's
    log-probs of them."""

    token_ids: list[int]
    logprobs: list[float]  # mu of each token (0.0 where the sampler gives none)
    finish_reason: str  # "stop": a stop token or stop string ended it; "length": max_tokens did
    text: str  # decoded without special tokens, cut before a stop string
    eos: bool = False  # it ends on a stop token (of the model's), which `token_ids` keeps
    version: str | None = None  # the weights' version that sampled it (`Engine.version`)
    routing: object = None  # (fed, R, k) int array: the experts each fed token was routed to (`Job.routing`)
    routing_padding: int | None = None  # "padded": the left-padding positions `routing` starts with


@dataclass
class Job:
    """One request to sample: `n` completions of `prompt_ids`."""

    prompt_ids: list[int]
    n: int = 1
    max_tokens: int = 64
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    seeds: list[int] | None = None  # one per completion (seeded sampling), or None
    offsets: list[int] | None = None  # per completion: tokens its seed's stream sampled before (a later turn)
    stop: tuple[str, ...] = ()  # stop strings: the completion ends with the token that completes one
    routing: bool | str = False  # return the experts every router chose (MoE models): True for each of the row's
    # own tokens but the last (vLLM's routed_experts); "padded": for every position the row was fed at in its call,
    # its left padding and the pad tokens after its end included (what the trainer's own sampler records)
    future: Future = field(default_factory=Future)  # set to list[Sample] (n) or an exception

    def key(self) -> tuple:
        """Jobs with the same key sample in one generator call."""
        return (self.temperature == 0, self.temperature or 1.0, self.top_p, self.top_k, self.min_p,
                self.repetition_penalty, self.seeds is not None)


class Engine:
    """Samples queued Jobs in batches with a registered generator (`gspo.rollout.registry.GENERATORS`).

    `generator`: the GeneratorBackend; `sampler`: what it samples with (the model, a copy, an engine's handle);
    `model`, `tokenizer`: the policy (its device, stop and pad tokens); `with_logprobs`: keep mu;
    `max_rows`: completions per generator call at most; `window_s`: how long the first waiting request waits for
    others (`expected()`: how many may come, to stop waiting sooner; None: wait the window); `max_context`: the
    model's positions (its config's max_position_embeddings by default), which prompt and max_tokens must fit;
    `autocast`: a zero-argument context factory every generator call runs under (a rollout worker's: the trainer's
    bf16 or fp16 autocast, gspo/plugs/precision.py), so the worker samples in the precision the trainer would."""

    def __init__(self, generator, sampler, model, tokenizer, *, with_logprobs: bool = True, max_rows: int = 64,
                 window_s: float = 0.01, max_context: int | None = None, autocast=nullcontext):
        self.generator, self.sampler, self.model, self.tokenizer = generator, sampler, model, tokenizer
        self.autocast = autocast
        self.with_logprobs, self.max_rows, self.window_s = with_logprobs, max_rows, window_s
        self.max_context = max_context or getattr(model.config, "max_position_embeddings", None)
        self.eos, self.pad = eos_ids(tokenizer, model), pad_id(tokenizer, model)
        self.jobs: queue.Queue[list[Job]] = queue.Queue()  # each item: one request's jobs, sampled in one call
        self.expected = lambda: None  # how many requests to wait for (None: the whole window)
        self.version: str | None = None  # the weights' version, set by a weight update (endpoint/weights.py)
        self.calls = 0  # generator calls made
        self.closed: str | None = None  # why no request is taken any more (`close`)
        self.lock = threading.Lock()  # held while sampling (a caller may swap the sampler between calls)

    def submit(self, job: Job) -> Future:
        """Queue `job` (any thread); its future gets the samples once the sampling thread ran it."""
        return self.submit_all([job])[0]

    def submit_all(self, jobs: list[Job]) -> list[Future]:
        """Queue one request's `jobs` as one unit: they are sampled in the same generator call where their keys
        and `max_rows` allow (so a client that sends a whole batch in one request gets the same batch, whatever
        the timing)."""
        if self.closed is not None:
            raise ValueError(f"the endpoint takes no more requests: {self.closed}")
        for job in jobs:
            if not job.prompt_ids:
                raise ValueError("a request's prompt has no tokens")
            if self.max_context is not None and len(job.prompt_ids) + job.max_tokens > self.max_context:
                raise ValueError(f"the prompt ({len(job.prompt_ids)} tokens) and max_tokens ({job.max_tokens}) exceed "
                                 f"the model's context ({self.max_context} positions)")
        self.jobs.put(list(jobs))
        return [job.future for job in jobs]

    def run_once(self, timeout_s: float) -> int:
        """On the sampling thread: wait up to `timeout_s` for a job, gather the others that come within the window
        (or until `expected()` are waiting), and sample them all; the number of jobs sampled (0: none came)."""
        try:
            jobs = self.jobs.get(timeout=timeout_s)
        except queue.Empty:
            return 0
        deadline = time.monotonic() + self.window_s
        while len(jobs) < (self.expected() or float("inf")):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                jobs += self.jobs.get(timeout=left)
            except queue.Empty:
                break
        while True:  # and whatever else is already waiting
            try:
                jobs += self.jobs.get_nowait()
            except queue.Empty:
                break
        groups: dict[tuple, list[Job]] = {}
        for job in jobs:
            groups.setdefault(job.key(), []).append(job)
        for group in groups.values():
            for batch in _batches(group, self.max_rows):
                try:
                    results = self.sample(batch)
                except Exception as err:  # noqa: BLE001  (each request is told; the engine goes on)
                    for job in batch:
                        job.future.set_exception(err)
                    continue
                for job, samples in zip(batch, results):
                    job.future.set_result(samples)
        return len(jobs)

    def close(self, reason: str) -> None:
        """Take no more requests, and fail those waiting (their clients get an error at once, not a hang)."""
        self.closed = reason
        while True:
            try:
                for job in self.jobs.get_nowait():
                    job.future.set_exception(RuntimeError(reason))
            except queue.Empty:
                return

    def serve(self, stop: threading.Event, poll_s: float = 0.1) -> None:
        """Sample whatever comes until `stop` is set (`gspo serve`'s main thread)."""
        while not stop.is_set():
            self.run_once(poll_s)

    @torch.no_grad()
    def sample(self, jobs: list[Job]) -> list[list[Sample]]:
        """One generator call for `jobs` (the same `Job.key`): each job's `n` samples."""
        from gspo.rollout.policy import SeededSampler

        rows = [job.prompt_ids for job in jobs for _ in range(job.n)]
        device = next(self.model.parameters()).device
        width = max(map(len, rows))
        ids = torch.tensor([[self.pad] * (width - len(r)) + r for r in rows], device=device)  # (n, L)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)  # (n, L)
        first = jobs[0]
        greedy, temperature = first.temperature == 0, first.temperature or 1.0
        seeded = None if first.seeds is None or greedy else SeededSampler(  # reshaping refused with seeds (job_of)
            [s for job in jobs for s in job.seeds], temperature, device,
            offsets=[k for job in jobs for k in (job.offsets or [0] * job.n)])
        was_training = self.model.training
        self.model.eval()
        routed = any(job.routing for job in jobs)
        with self.lock, self.autocast(), torch.inference_mode(samples_in_inference_mode(self.sampler, self.model)), \
                _recording(self.sampler if routed else None) as recorder:
            out, lp = self.generator.sample(
                self.sampler, ids, mask, eos=self.eos, pad=self.pad, max_new_tokens=max(j.max_tokens for j in jobs),
                temperature=temperature, top_p=first.top_p, top_k=first.top_k, min_p=first.min_p,
                repetition_penalty=first.repetition_penalty, greedy=greedy, seeded=seeded,
                with_logprobs=self.with_logprobs, group_size=1)  # (n, t) x2
            version = self.version  # a weight update waits for the lock: these weights sampled this call
        self.model.train(was_training)
        self.calls += 1
        keep = completion_mask_from_ids(out, self.eos)  # (n, t) up to and including the first stop token
        record = recorder.record().indices if recorder is not None else None  # (R, n, width + t' - 1, k)
        results, row = [], 0
        for job in jobs:
            samples = []
            for _ in range(job.n):
                tokens = out[row][keep[row]].tolist()
                logprobs = lp[row][keep[row]].tolist() if lp is not None else [0.0] * len(tokens)
                sample = replace(self.finish(tokens, logprobs, job), version=version)
                if job.routing == "padded" and record is not None:  # every position of the row's call
                    sample.routing = record[:, row].permute(1, 0, 2).numpy()  # (width + t' - 1, R, k)
                    sample.routing_padding = width - len(job.prompt_ids)
                elif job.routing and record is not None:  # the row's own fed tokens: its prompt, all kept but the last
                    fed = len(job.prompt_ids) + len(sample.token_ids) - 1
                    start = width - len(job.prompt_ids)
                    sample.routing = record[:, row, start:start + fed].permute(1, 0, 2).numpy()  # (fed, R, k)
                samples.append(sample)
                row += 1
            results.append(samples)
        return results

    def finish(self, tokens: list[int], logprobs: list[float], job: Job) -> Sample:
        """A row's sample cut at the job's max_tokens and stop strings (the token that completes a stop string is
        the last one kept; the text ends before the stop string, as OpenAI's API returns it)."""
        stopped = bool(tokens) and tokens[-1] in self.eos and len(tokens) <= job.max_tokens
        tokens, logprobs = tokens[:job.max_tokens], logprobs[:job.max_tokens]
        if job.stop:
            for end in range(1, len(tokens) + 1):
                text = self.tokenizer.decode(tokens[:end], skip_special_tokens=True)
                hits = [text.find(s) for s in job.stop if s in text]
                if hits:
                    return Sample(tokens[:end], logprobs[:end], "stop", text[:min(hits)],
                                  eos=stopped and end == len(tokens))
        return Sample(tokens, logprobs, "stop" if stopped else "length",
                      self.tokenizer.decode(tokens, skip_special_tokens=True), eos=stopped)


@contextmanager
def _recording(model):
    """`record_routing(model)` where `model` is a module with MoE routers and routing was asked for; else None."""
    from gspo.plugs.moe import find_routers, record_routing

    if model is None or not isinstance(model, torch.nn.Module) or not find_routers(model):
        yield None
        return
    with record_routing(model) as recorder:
        yield recorder


def engine_of(sampler, **kwargs) -> Engine:
    """The Engine of a trainer's `gspo.rollout.Sampler`: its generator, and what that samples with (the policy, its
    copy, an engine's handle), log-probs kept."""
    from gspo.rollout.policy import PolicySampler

    handle = sampler.sampler.model if isinstance(sampler.sampler, PolicySampler) else sampler.sampler
    return Engine(sampler.backend, handle, sampler.model, sampler.tokenizer, with_logprobs=True, **kwargs)


def _batches(jobs: list[Job], max_rows: int) -> list[list[Job]]:
    """`jobs` in runs of at most `max_rows` completions (a job larger than that alone)."""
    out, rows = [[]], 0
    for job in jobs:
        if out[-1] and rows + job.n > max_rows:
            out.append([])
            rows = 0
        out[-1].append(job)
        rows += job.n
    return out


__all__ = ["Engine", "Job", "Sample", "engine_of"]
