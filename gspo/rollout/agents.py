"""Agent episodes: an agent written against an OpenAI client runs once per episode, on the run's endpoint
(gspo/rollout/endpoint), and what it sampled is trained (docs/agents.md).

    async def agent(client, row) -> float | dict | None:   # or a plain def, with a sync client
        reply = await client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...                                                  # as many calls as it likes: tool loops, sub-agents
        return 1.0 if ... else 0.0                           # or None: the reward functions score the transcript

Each episode gets a client whose base_url is its own session on the endpoint; every call is recorded with its
token ids and mu. Calls whose prompt continues an earlier call's tokens are merged into one sequence (the earlier
completions as model tokens, what came between as observation tokens: gspo's episodes' layout); a call that does
not continue starts another sequence of the episode. The step's episodes run concurrently (asyncio, at most
agent_concurrency at once) while the trainer's thread samples their calls in batches. A limit (agent_max_calls,
max_episode_tokens, agent_timeout_s) ends an episode as truncated; an agent that raises is one line naming it and
the row, and its episode scores 0 (`episode/agent_errors`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import secrets
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field

from gspo.rollout.episodes import Episode

logger = logging.getLogger(__name__)


# how long the first call waits for the other running episodes' calls (all of them come: it stops waiting then); an
# episode busy elsewhere (its tool) costs the others this much once
AGENT_WINDOW_S = 0.1


@dataclass
class AgentOutcome:
    """How one agent episode ended."""

    reward: float | None = None  # the agent's reward (None: left to the reward functions)
    scores: dict = field(default_factory=dict)  # a dict's other numbers ({"reward": 1, "correct": 1}): reward/<name>
    error: str | None = None  # the agent raised: one line
    truncated: str | None = None  # a limit ended it: max_calls, max_tokens, timeout


# environments from other projects' hubs, run as agents: "prefix:spec" -> "module:function" making the agent of spec
ADAPTERS = {"openenv": "gspo.env.openenv:openenv_agent", "verifiers": "gspo.env.verifiers:verifiers_agent"}


def agent_of(settings) -> tuple[object, str] | None:
    """The agent of an EpisodeSettings (gspo.config) and its name for messages: `agent`'s function, or the adapter
    of an `environment: openenv:...` / `verifiers:...`; None for other runs."""
    import importlib

    if settings.agent is not None:
        return load_agent(settings.agent), settings.agent
    prefix, _, spec = (settings.environment or "").partition(":")
    if prefix not in ADAPTERS:
        return None
    module, _, name = ADAPTERS[prefix].partition(":")
    try:
        make = getattr(importlib.import_module(module), name)
        return make(spec), settings.environment
    except ImportError as err:
        raise ValueError(f"environment {settings.environment!r} needs the agents extra (pip install 'gspo[agents]'): "
                         f"{err}") from None


def load_agent(spec: str):
    """The agent function `spec` names ("module:function"), checked: callable with two parameters (client, row)."""
    from gspo.data.reward_import import import_reward_fn

    fn = import_reward_fn(spec, kind="agent")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise ValueError(f"agent {spec!r}: an agent is called as agent(client, row); "
                         f"{getattr(fn, '__name__', fn)!r} takes {inspect.signature(fn)}") from None
    return fn


class AgentRunner:
    """The run's endpoint (a loopback server that requires a fresh secret) and the agent episodes of each step."""

    def __init__(self, agent, spec: str, engine, tokenizer, *, template_kwargs: dict | None, tool_style: str,
                 limits, concurrency: int, max_tokens: int):
        from gspo.rollout.endpoint.requests import Limits
        from gspo.rollout.endpoint.server import Endpoint, Server, need

        need("agents", "fastapi", "uvicorn", "openai")
        self.agent, self.spec, self.limits, self.concurrency = agent, spec, limits, concurrency
        self.secret = secrets.token_hex(16)
        self.endpoint = Endpoint(engine, tokenizer, model_name="policy", template_kwargs=template_kwargs,
                                 tool_style=tool_style, limits=Limits(max_tokens=max_tokens))
        self.server = Server(self.endpoint, "127.0.0.1", 0, secret=self.secret.encode(), open_loopback=False)
        self.threads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gspo-agents")

    def run(self, rows: list[dict], seeds: list[int] | None) -> list[tuple[AgentOutcome, object]]:
        """One episode per row (the trainer's thread samples their calls meanwhile): (outcome, session) each."""
        sessions = [self.endpoint.sessions.open(self.limits, None if seeds is None else seeds[i])
                    for i in range(len(rows))]
        running = [len(rows)]
        engine = self.endpoint.engine
        engine.expected, window = lambda: min(running[0], self.concurrency), engine.window_s
        engine.window_s = AGENT_WINDOW_S
        done = self.threads.submit(asyncio.run, self._episodes(rows, sessions, running))
        try:
            while not done.done():
                engine.run_once(0.05)
            outcomes = done.result()
        except BaseException:  # the run stops (a signal, an error): the agents' calls fail now and their thread ends
            engine.close("the run stopped while its agents were running")
            raise
        finally:
            engine.expected, engine.window_s = lambda: None, window
            for session in sessions:
                self.endpoint.sessions.close(session)
        return list(zip(outcomes, sessions))

    async def _episodes(self, rows: list[dict], sessions: list, running: list[int]) -> list[AgentOutcome]:
        gate = asyncio.Semaphore(self.concurrency)
        serving = getattr(self.agent, "serving", None)  # what an adapter keeps up around a step (verifiers' tools)

        async def one(i: int) -> AgentOutcome:
            async with gate:
                try:
                    return await self._episode(rows[i], sessions[i], i)
                finally:
                    running[0] -= 1

        async with serving() if serving is not None else nullcontext():
            return await asyncio.gather(*(one(i) for i in range(len(rows))))

    async def _episode(self, row: dict, session, i: int) -> AgentOutcome:
        import openai

        url = f"{self.server.url}/sessions/{session.id}/v1"
        timeout = self.limits.timeout_s
        try:
            if inspect.iscoroutinefunction(self.agent) or inspect.iscoroutinefunction(type(self.agent).__call__):
                async with openai.AsyncOpenAI(base_url=url, api_key=self.secret, max_retries=0,
                                              timeout=timeout) as client:
                    out = await asyncio.wait_for(self.agent(client, row), timeout)
            else:
                with openai.OpenAI(base_url=url, api_key=self.secret, max_retries=0, timeout=timeout) as client:
                    out = await asyncio.wait_for(asyncio.to_thread(self.agent, client, row), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            session.over = session.over or "timeout"
            return AgentOutcome(truncated=session.over)
        except Exception as err:  # noqa: BLE001  (the agent's bug, or a limit it did not catch)
            if session.over is not None:
                return AgentOutcome(truncated=session.over)
            first = (str(err).splitlines() or [""])[0][:200]
            line = f"agent {self.spec!r} raised {type(err).__name__}: {first} (episode {i}, row {row!r:.80})"
            logger.warning(line)
            return AgentOutcome(error=line)
        try:
            return AgentOutcome(*_reward(out), truncated=session.over)
        except ValueError as err:
            line = f"agent {self.spec!r}: {err} (episode {i}, row {row!r:.80})"
            logger.warning(line)
            return AgentOutcome(error=line)

    def close(self) -> None:
        self.server.close()
        self.threads.shutdown(wait=False)


def _reward(out) -> tuple[float | None, dict]:
    """(the reward an agent returned, its other scores): a number, a dict with "reward" (and other numbers, each
    logged as reward/<name>), or None (the reward functions decide)."""
    values = dict(out) if isinstance(out, dict) else {"reward": out}
    bad = [k for k, v in values.items() if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                                             or not math.isfinite(v))]
    if bad or not all(isinstance(k, str) for k in values):
        raise ValueError(f"returned {out!r:.80}; an agent returns a finite number, a dict of them with \"reward\", "
                         "or None")
    reward = values.pop("reward", None)
    return (None if reward is None else float(reward)), {k: float(v) for k, v in values.items() if v is not None}


def episode_of(outcome: AgentOutcome, session, first_prompt: list[int]) -> tuple[Episode, list[int]]:
    """The Episode the trainer keeps of an agent episode (its sequences in one row), and where in its tokens each
    sequence after the first starts (that sequence's prompt: read, never trained; positions restart there).

    An episode without calls keeps its row's prompt and no tokens."""
    sequences = session.sequences or []
    if not sequences:
        kept, starts = Episode(prompt_ids=list(first_prompt)), []
    else:
        first, starts = sequences[0], []
        kept = Episode(prompt_ids=first.prompt_ids, tokens=list(first.tokens), model=list(first.model),
                       logprobs=list(first.logprobs))
        for other in sequences[1:]:
            starts.append(len(kept.tokens))
            kept.tokens += other.prompt_ids + other.tokens
            kept.model += [False] * len(other.prompt_ids) + other.model
            kept.logprobs += [0.0] * len(other.prompt_ids) + other.logprobs
    kept.turns = len(session.calls)
    kept.reward = 0.0 if outcome.error is not None else outcome.reward
    kept.truncated = outcome.truncated is not None
    kept.done = True
    kept.info = {"calls": len(session.calls), "tool_calls": session.tool_calls}
    return kept, starts


class agent_runner:  # noqa: N801  (used as a function: evaluation's episode runner)
    """Evaluation's stand-in for `generate` with an agent: each completion an agent episode on an endpoint of its own
    over `model` (the policy itself), greedy or at the asked temperature whatever the agent asks, the run's
    limits; `close()` stops the endpoint."""

    def __init__(self, agent, name: str, model, tokenizer, episodes, sampling, template_kwargs: dict | None):
        from gspo.plugs.precision import current_autocast
        from gspo.rollout.endpoint.engine import Engine
        from gspo.rollout.registry import GENERATORS, pick_generator, policy_backend

        engine = Engine(GENERATORS[pick_generator(model, policy_backend(sampling.generation_backend))], model, model,
                        tokenizer, autocast=current_autocast(next(model.parameters()).device))  # the evaluation's
        self.model, self.tokenizer = model, tokenizer
        self.runner = AgentRunner(agent, name, engine, tokenizer, template_kwargs=template_kwargs,
                                  tool_style=episodes.tool_call_style, limits=session_limits(episodes),
                                  concurrency=episodes.agent_concurrency, max_tokens=sampling.max_completion_length)

    def __call__(self, prompts, copies, *, rows, greedy=False, temperature=1.0, row_seeds=None, **_):
        self.runner.endpoint.overrides = {"temperature": 0.0 if greedy else temperature}
        episode_rows = [row for row in rows for _ in range(copies)]
        return agent_rollout(self.runner.run(episode_rows, row_seeds), episode_rows, self.tokenizer, self.model, True)

    def close(self) -> None:
        self.runner.close()


def session_limits(episodes):
    """The SessionLimits of an EpisodeSettings (gspo.config): agent_max_calls, max_episode_tokens, agent_timeout_s."""
    from gspo.rollout.endpoint.sessions import SessionLimits

    return SessionLimits(max_calls=episodes.agent_max_calls, max_tokens=episodes.max_episode_tokens,
                         timeout_s=episodes.agent_timeout_s)


def agent_rollout(results: list, rows: list[dict], tokenizer, model, with_logprobs: bool):
    """The Rollout of a step's agent episodes (`AgentRunner.run`'s results, one per row): each row an episode (its
    first prompt left-padded, its tokens right-padded, the model's tokens in the completion mask; several sequences
    in a row with `position_ids` restarting at each), and the episodes' records with the agent's error and the
    number of sequences."""
    import torch

    from gspo.algo.logprobs import position_ids_from_mask
    from gspo.rollout.batch import pad_id
    from gspo.rollout.episodes import episode_rollout

    kept = [episode_of(outcome, session, tokenizer(row["prompt"])["input_ids"])
            for (outcome, session), row in zip(results, rows)]
    episodes = [episode for episode, _ in kept]
    pad, device = pad_id(tokenizer, model), next(model.parameters()).device
    P = max(len(e.prompt_ids) for e in episodes)
    ids = torch.tensor([[pad] * (P - len(e.prompt_ids)) + e.prompt_ids for e in episodes], device=device)  # (N, P)
    mask = torch.tensor([[0] * (P - len(e.prompt_ids)) + [1] * len(e.prompt_ids) for e in episodes],
                        device=device)  # (N, P)
    rollout = episode_rollout(episodes, [row["prompt"] for row in rows], ids, mask, tokenizer, pad, with_logprobs,
                              None)
    if any(starts for _, starts in kept):
        positions = position_ids_from_mask(rollout.attention_mask)  # (N, P+T)
        for n, (episode, starts) in enumerate(kept):
            for start, end in zip(starts, starts[1:] + [len(episode.tokens)]):
                positions[n, P + start : P + end] = torch.arange(end - start, device=device)  # a sequence of its own
        rollout.position_ids = positions  # (N, P+T)
    for rec, (_, starts), (outcome, _) in zip(rollout.episodes, kept, results):
        rec.update(agent_error=outcome.error is not None, sequences=1 + len(starts), calls=rec["turns"],
                   scores=outcome.scores)
    return rollout


__all__ = ["ADAPTERS", "AgentOutcome", "AgentRunner", "agent_of", "agent_rollout", "agent_runner", "episode_of",
           "load_agent", "session_limits"]
