"""verifiers environments (the `agents` extra) as agent episodes: `environment: verifiers:<taskset id>`.

Built against verifiers 0.4.0, the version that installs here. Its interface is `verifiers.v1` (an Env over a
Taskset of Tasks with their rewards and MCP toolsets, run by a Harness through an interception endpoint);
`verifiers.load_environment` and SingleTurnEnv / MultiTurnEnv / ToolEnv / Rubric, the interface issue 50 names,
are not in it (docs/agents.md). The taskset id is what `verifiers.v1.load_environment` takes: a module that
exports one Taskset subclass (`__all__`).

Each episode: the row's columns fill the taskset's TaskData fields (prompt, answer, ...) of its first task (its
config and tools kept), verifiers runs it with gspo's harness (gspo/env/verifiers_harness.py: the chat loop in
this process) against the episode's session on the run's endpoint, and the task's rewards score it: the episode's
reward is verifiers' weighted total, each reward function's score logged as `reward/<name>`. A trace that failed
(an error verifiers recorded) is the agent's error: one line, the episode scores 0.
"""

from __future__ import annotations

import os
from contextlib import asynccontextmanager

KEY_VARIABLE = "GSPO_AGENT_API_KEY"  # how verifiers reads the endpoint's secret (a variable's name); a name with
# API_KEY in it, which verifiers' subprocess runtime keeps from the processes it starts (tool servers)
HARNESS = "gspo_verifiers_harness"  # verifiers imports a harness by a top-level module name (a dotted one is looked
# up under its own package first, which fails): gspo's is registered under this one (`_register_harness`)


class VerifiersAgent:
    """The agent (`agent(client, row)`) of the verifiers taskset `spec`."""

    def __init__(self, spec: str, max_turns: int = 8):
        import verifiers.v1 as vf

        _register_harness()
        self.spec = spec
        try:
            self.env = vf.load_environment(vf.SingleAgentEnvConfig(
                taskset=vf.TasksetConfig(id=spec),
                agent=vf.AgentConfig(harness={"id": HARNESS}, runtime=vf.SubprocessConfig(), max_turns=max_turns)))
        except (ImportError, AttributeError, TypeError, ValueError) as err:
            raise ValueError(f"verifiers environment {spec!r}: {type(err).__name__}: {str(err).splitlines()[0][:240]}"
                             " (a taskset id: a module exporting one verifiers.v1 Taskset subclass)") from None
        self.template = next(iter(self.env.taskset), None)
        if self.template is None:
            raise ValueError(f"verifiers environment {spec!r}: its taskset has no tasks (gspo fills the first task's "
                             "data from each row)")
        self.fields = set(type(self.template.data).model_fields) - {"idx", "id", "name"}
        self.__name__ = "verifiers"

    @asynccontextmanager
    async def serving(self):
        """Around one step's episodes: verifiers' tool servers and interception endpoint."""
        async with self.env.serving():
            yield

    async def __call__(self, client, row: dict) -> dict:
        import verifiers.v1 as vf

        os.environ[KEY_VARIABLE] = client.api_key
        task = self.template.with_data(**{k: v for k, v in row.items() if k in self.fields})
        context = vf.ModelContext(model="policy", client=vf.EvalClientConfig(base_url=str(client.base_url).rstrip("/"),
                                                                             api_key_var=KEY_VARIABLE))
        episode = await self.env.run_episode(task, context)
        trace = episode.traces[0] if episode.traces else None
        if trace is None or not trace.ok or not episode.ok:
            errors = (trace.errors if trace is not None else []) or episode.errors
            raise RuntimeError(f"verifiers recorded {errors[0].type}: {errors[0].message[:200]}" if errors else
                               "verifiers' episode failed without an error")
        scores = {name: float(r.score) for name, r in trace.rewards.items() if r is not None}
        return {"reward": float(trace.reward), **scores}


def _register_harness() -> None:
    import sys

    from gspo.env import verifiers_harness

    sys.modules.setdefault(HARNESS, verifiers_harness)


def verifiers_agent(spec: str) -> VerifiersAgent:
    return VerifiersAgent(spec)


__all__ = ["VerifiersAgent", "verifiers_agent"]
