"""Sessions: one per agent episode. Every call made through a session's base URL is recorded with its tokens and
mu, and the episode's limits are enforced on it: a call past max_calls, the episode's token budget or its
wall-clock deadline is refused (HTTP 409) and the session is over, marked truncated. Sessions are made by the
trainer (`Sessions.open`); a URL naming any other session is refused (404)."""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field

from gspo.rollout.endpoint.requests import BadRequest, Call, Prompt


@dataclass(frozen=True)
class SessionLimits:
    """An agent episode's limits; reaching one ends the episode as truncated, never the run."""

    max_calls: int = 8  # calls to the endpoint
    max_tokens: int = 256  # the model's and the observations' tokens after each sequence's first prompt
    timeout_s: float = 60.0  # wall-clock seconds from the episode's start


@dataclass
class Sequence:
    """One training sequence of an episode: a prompt, then the model's tokens (trained, with mu) and the
    observations between its calls (read, never trained)."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    model: list[bool] = field(default_factory=list)  # True: sampled (trained); False: an observation
    logprobs: list[float] = field(default_factory=list)  # mu of the model's tokens, 0.0 for observations
    calls: int = 0

    def context(self) -> list[int]:
        return self.prompt_ids + self.tokens


def extend(sequences: list[Sequence], prompt_ids: list[int], sample) -> None:
    """Add a call's sample to the sequence whose tokens its prompt continues (the longest such; what follows them in
    the prompt is an observation), or start a new sequence with it."""
    best = max((s for s in sequences if len(s.context()) <= len(prompt_ids) and
                prompt_ids[:len(s.context())] == s.context()), key=lambda s: len(s.context()), default=None)
    if best is None:
        best = Sequence(list(prompt_ids))
        sequences.append(best)
    seen = prompt_ids[len(best.context()):]
    best.tokens += seen + sample.token_ids
    best.model += [False] * len(seen) + [True] * len(sample.token_ids)
    best.logprobs += [0.0] * len(seen) + list(sample.logprobs)
    best.calls += 1


def observed(sequences: list[Sequence], prompt_ids: list[int]) -> int:
    """The observation tokens a call's prompt adds to the sequence it continues (0 where it starts one)."""
    lengths = [len(s.context()) for s in sequences if len(s.context()) <= len(prompt_ids) and
               prompt_ids[:len(s.context())] == s.context()]
    return len(prompt_ids) - max(lengths) if lengths else 0


@dataclass
class Session:
    """One episode's calls, in the order they were answered."""

    id: str
    seed: int | None  # the k-th call samples with seed * 1_000_003 + k (None: unseeded)
    limits: SessionLimits
    calls: list[Call] = field(default_factory=list)
    sequences: list[Sequence] = field(default_factory=list)  # the calls merged (`extend`), in order
    tokens: int = 0  # counted against limits.max_tokens
    asked: int = 0  # calls admitted
    tool_calls: int = 0  # tool calls the model wrote, parsed into `tool_calls` of the replies
    started: float = field(default_factory=time.monotonic)
    over: str | None = None  # why the episode ended: "max_calls", "max_tokens", "timeout"

    def admit(self, job, prompt: Prompt) -> None:
        """Check a call against the limits before it samples (its max_tokens cut to the budget left), or refuse it
        (BadRequest 409) and end the episode."""
        if self.over is None and self.asked >= self.limits.max_calls:
            self.over = "max_calls"
        elif self.over is None and time.monotonic() - self.started > self.limits.timeout_s:
            self.over = "timeout"
        left = self.limits.max_tokens - self.tokens - observed(self.sequences, prompt.token_ids)
        if self.over is None and left <= 0:
            self.over = "max_tokens"
        if self.over is not None:
            raise BadRequest(f"this episode is over ({self.over} reached): its transcript is kept, truncated",
                             status=409)
        job.max_tokens = min(job.max_tokens, left)
        self.asked += 1

    def next_seed(self) -> int | None:
        return None if self.seed is None else self.seed * 1_000_003 + self.asked

    def record(self, call: Call) -> None:
        self.tokens += observed(self.sequences, call.prompt.token_ids) + max(len(s.token_ids) for s in call.samples)
        for sample in call.samples:
            extend(self.sequences, call.prompt.token_ids, sample)
        self.calls.append(call)
        if self.tokens >= self.limits.max_tokens:
            self.over = self.over or "max_tokens"


class Sessions:
    """The open sessions of a run, by id (thread-safe: opened by the trainer, used by the server's handlers)."""

    def __init__(self):
        self.open_ones: dict[str, Session] = {}
        self.lock = threading.Lock()

    def open(self, limits: SessionLimits, seed: int | None = None) -> Session:
        session = Session(secrets.token_hex(8), seed, limits)
        with self.lock:
            self.open_ones[session.id] = session
        return session

    def get(self, sid: str) -> Session:
        with self.lock:
            session = self.open_ones.get(sid)
        if session is None:
            raise BadRequest(f"no open session {sid!r:.40}", status=404)
        return session

    def close(self, session: Session) -> None:
        with self.lock:
            self.open_ones.pop(session.id, None)


__all__ = ["Sequence", "Session", "SessionLimits", "Sessions", "extend", "observed"]
