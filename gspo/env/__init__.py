"""Environments of multi-turn episodes (docs/samplers.md): the model takes a turn, the environment answers
with an observation (tokens the model reads and is never trained on), maybe a reward, and whether the
episode is over. `gspo.rollout.episodes.sample_episodes` runs them into one Rollout whose completion mask
covers the model's own tokens only.

An environment is any object with these two methods (no base class):

    class Guess:
        def reset(self, row: dict) -> str:             # the episode's first text: its prompt
            self.answer = row["answer"]
            return row["prompt"]

        def step(self, model_turn: str) -> Turn:        # the model's turn, as text
            if model_turn.strip() == self.answer:
                return Turn(reward=1.0, done=True)
            return Turn(observation=" no, again: ")

`ToolEnvironment` is the built-in one: tools are plain Python functions (gspo/env/tools.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from gspo.config import check_implemented
from gspo.env.tools import (
    BUILTIN_TOOLS,
    STYLES,
    Toolbox,
    ToolCall,
    ToolResult,
    load_tools,
    parse_tool_calls,
    python_tool,
    tool_schema,
)


@dataclass
class Turn:
    """An environment's answer to one model turn."""

    observation: str | list[str] | None = None  # text appended after the model's turn (read, never trained);
    # None: nothing. It is data: a control token's text in it (<|im_end|>) is spelled out in ordinary tokens. A
    # list alternates markup the environment writes, tokenized as written, and data: [markup, data, markup, ...]
    messages: list[dict] | None = None  # or chat messages ({"role": "tool", "content": ...}) rendered after the
    # model's turn with the tokenizer's chat template, the next assistant turn opened (`chat_observation`); their
    # texts are data, the template's markers around them its tokens
    reward: float | None = None  # this step's reward; an episode's reward is the sum of its steps' (None: none)
    done: bool = False  # the episode is over (so is it when there is no observation)
    info: dict = field(default_factory=dict)  # counts summed over the episode, e.g. tool_calls, tool_errors


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: dict) -> str:
        """Start an episode for a data row; its first text (the prompt the model continues)."""

    def step(self, model_turn: str) -> Turn:
        """Answer the model's turn (its text, special tokens left out)."""


# how a tool's result is shown to the model in a text prompt, per call style (a chat prompt gets tool messages)
OBSERVATIONS = {"hermes": "\n<tool_response>\n{text}\n</tool_response>\n", "text": "\nresult: {text}\n"}
check_implemented(STYLES, OBSERVATIONS, "gspo.env.OBSERVATIONS")


class ToolEnvironment:
    """Tool calling as an environment: each model turn's calls are run and their results are the observation;
    a turn without a call ends the episode (its reward comes from the reward functions, on the transcript).

    A row whose prompt was chat messages (rendered by the chat template, gspo.data.rows.render_prompts) is
    answered in the chat: one {"role": "tool"} message per call, rendered by the same template. A text
    prompt is answered with `OBSERVATIONS[style]` text: its markers markup, the results data (Turn.observation)."""

    def __init__(self, tools: list, *, style: str = "hermes", timeout_s: float = 5.0, max_output_chars: int = 1000):
        self.toolbox = Toolbox(tools, style=style, timeout_s=timeout_s, max_output_chars=max_output_chars)
        self.chat = False

    def reset(self, row: dict) -> str:
        from gspo.data.rows import MESSAGES

        self.chat = MESSAGES in row
        return row["prompt"]

    def step(self, model_turn: str) -> Turn:
        results = self.toolbox.run(model_turn)
        if not results:
            return Turn(done=True)
        info = {"tool_calls": len(results), "tool_errors": sum(r.error is not None for r in results)}
        if self.chat:
            return Turn(messages=[{"role": "tool", "name": r.name or "", "content": r.text} for r in results],
                        info=info)
        head, tail = OBSERVATIONS[self.toolbox.style].split("{text}")
        parts = [head]  # [markup, data, markup, ...]: the format's markers stay tokens, the tools' text is data
        for r in results:
            parts += [r.text, tail + head]
        return Turn(observation=parts[:-1] + [tail], info=info)


def environment_factory(settings, sandbox: str = "os"):
    """A no-argument callable making one fresh environment per episode, from an EpisodeSettings (gspo.config);
    None for single-turn runs. Specs are imported here, so a bad one is an error before any sampling;
    `sandbox` (the run's RewardSettings.sandbox) is where the built-in `python` tool runs code, checked here."""
    from gspo.data.reward_import import import_reward_fn

    if settings.environment is None or settings.environment.startswith(("openenv:", "verifiers:")):
        return None  # none, or another project's environment, run as an agent (gspo/rollout/agents.py)
    if settings.environment == "tools":
        if "python" in settings.tools:
            from gspo.sandbox.runner import check_sandbox

            check_sandbox(sandbox)  # SandboxUnavailable names why and the fixes
        tools = load_tools(settings.tools, sandbox, settings.tool_timeout_s)
        Toolbox(tools, style=settings.tool_call_style)  # checked now: named functions
        return lambda: ToolEnvironment(tools, style=settings.tool_call_style, timeout_s=settings.tool_timeout_s,
                                       max_output_chars=settings.tool_max_output_chars)
    make = import_reward_fn(settings.environment, kind="environment")
    try:
        env = make()
    except Exception as err:  # not a class or factory of no arguments (os:system), or one that fails
        raise ValueError(f"environment {settings.environment!r}: calling it with no arguments raised "
                         f"{type(err).__name__}: {str(err)[:200]} (an environment is a class, or a function, that "
                         "makes one with no arguments)") from err
    missing = [name for name in ("reset", "step") if not callable(getattr(env, name, None))]
    if missing:
        raise ValueError(f"environment {settings.environment!r}: {type(env).__name__} has no {missing[0]}() method "
                         "(an environment has reset(row) -> str and step(model_turn) -> gspo.env.Turn)")
    return make


def chat_template_kwargs(template_kwargs: dict | None, settings) -> dict | None:
    """The keywords chat prompts and tool messages are rendered with: chat_template_kwargs (a DataSettings'),
    and for the built-in tool environment (an EpisodeSettings `settings`) the tools' JSON schemas as `tools`,
    which a template with tool support writes into the prompt (Qwen's system block), unless given there."""
    if settings.environment != "tools" or "tools" in (template_kwargs or {}):
        return template_kwargs
    return {**(template_kwargs or {}), "tools": [tool_schema(fn) for fn in load_tools(settings.tools)]}


__all__ = ["BUILTIN_TOOLS", "OBSERVATIONS", "STYLES", "Environment", "ToolCall", "ToolEnvironment", "ToolResult",
           "Toolbox", "Turn", "chat_template_kwargs", "environment_factory", "load_tools", "parse_tool_calls",
           "python_tool", "tool_schema"]
