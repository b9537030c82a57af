"""OpenEnv environments (`openenv-core`, the `agents` extra) as agent episodes: `environment: openenv:<module:EnvClass>`
runs an OpenEnv Environment in the trainer's process, `environment: openenv:http://host:port` one served by
openenv-core's server (its WebSocket session, through openenv's GenericEnvClient: no environment code is imported).

An episode is a chat on the run's endpoint (gspo/rollout/agents.py): the row's prompt and the reset observation open
it, the model's reply is the action, the step's observation answers it, until the environment says done (or a limit
ends the episode, truncated). Its rewards, summed, are the episode's reward (the `environment` reward reads them).
The action: an Action with one text field (besides metadata) is the model's reply itself; any other Action is a
tool, `tools=[{"function": {"name": <the Action's class>, "parameters": <its JSON schema>}}]`, and the model acts by
calling it (a reply without a call ends the episode). An observation is shown as its one text field, or as JSON of
its fields (done, reward and metadata left out).
"""

from __future__ import annotations

import asyncio
import json
import typing

SKIP = ("done", "reward", "metadata")  # the base Observation's and Action's fields, not shown or asked for


class OpenEnvAgent:
    """The agent (`agent(client, row)`) of an OpenEnv environment `spec` ("module:EnvClass" or an http(s) URL)."""

    def __init__(self, spec: str):
        from gspo.data.reward_import import import_reward_fn

        self.spec, self.served = spec, spec.startswith(("http://", "https://"))
        if self.served:
            self.env_cls, schema = None, _served_schema(spec)
        else:
            self.env_cls = import_reward_fn(spec, kind="OpenEnv environment")
            schema = _action_class(self.env_cls, spec).model_json_schema()
        fields = {k: v for k, v in (schema.get("properties") or {}).items() if k not in SKIP}
        texts = [k for k, v in fields.items() if v.get("type") == "string"]
        self.text_field = texts[0] if len(fields) == 1 and texts else None  # the reply is the action
        self.tool = None if self.text_field else {"type": "function", "function": {
            "name": schema.get("title", "act"), "description": schema.get("description") or "Act in the environment.",
            "parameters": {"type": "object", "properties": fields,
                           "required": [k for k in schema.get("required", []) if k not in SKIP]}}}
        self.__name__ = "openenv"

    async def __call__(self, client, row: dict) -> float:
        async with _Session(self) as env:
            result = await env.reset()
            reward, messages = float(result.reward or 0.0), [{"role": "user", "content": _opening(row, result)}]
            while not result.done:
                reply = await client.chat.completions.create(model="policy", messages=messages,
                                                             **({"tools": [self.tool]} if self.tool else {}))
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if self.text_field is not None:
                    action, answer = {self.text_field: message.content or ""}, {"role": "user"}
                elif message.tool_calls:
                    call = message.tool_calls[0]
                    action = json.loads(call.function.arguments)
                    answer = {"role": "tool", "tool_call_id": call.id, "name": call.function.name}
                else:  # no action: the model is done
                    break
                result = await env.step(action)
                reward += float(result.reward or 0.0)
                if not result.done:
                    messages.append({**answer, "content": _shown(result.observation)})
            return reward


class _Session:
    """One episode's environment: an instance in this process, or a WebSocket session on the served one."""

    def __init__(self, agent: OpenEnvAgent):
        self.agent, self.env, self.client = agent, None, None

    async def __aenter__(self):
        if self.agent.served:
            from openenv.core.generic_client import GenericEnvClient

            self.client = GenericEnvClient(base_url=self.agent.spec)
            await self.client.connect()
        else:
            self.env = self.agent.env_cls()
        return self

    async def __aexit__(self, *exc) -> None:
        if self.client is not None:
            await self.client.close()
        elif self.env is not None:
            self.env.close()

    async def reset(self):
        if self.client is not None:
            return await self.client.reset()
        return _result(await asyncio.to_thread(self.env.reset))

    async def step(self, action: dict):
        if self.client is not None:
            return await self.client.step(action)
        action = _action_class(self.agent.env_cls, self.agent.spec)(**action)
        return _result(await asyncio.to_thread(self.env.step, action))


def _result(observation):
    """An in-process Observation as the client's StepResult: (observation dict, reward, done)."""
    from openenv.core.client_types import StepResult

    return StepResult(observation=observation.model_dump(), reward=observation.reward, done=observation.done)


def _action_class(env_cls, spec: str):
    """The Action class an Environment's step takes (its type hint, or its generic parameter)."""
    hint = typing.get_type_hints(env_cls.step).get("action") if hasattr(env_cls, "step") else None
    if not isinstance(hint, type):
        bases = [typing.get_args(b) for b in getattr(env_cls, "__orig_bases__", ())]
        hint = next((args[0] for args in bases if args and isinstance(args[0], type)), None)
    if hint is None or not hasattr(hint, "model_json_schema"):
        raise ValueError(f"OpenEnv environment {spec!r}: its step(action) has no Action type (an openenv Environment "
                         "subclass whose step is annotated with its Action class)")
    return hint


def _served_schema(url: str) -> dict:
    """The action schema a served OpenEnv environment publishes (GET /schema)."""
    import httpx

    try:
        response = httpx.get(url.rstrip("/") + "/schema", timeout=10)
        response.raise_for_status()
        return response.json()["action"]
    except (httpx.HTTPError, KeyError, ValueError) as err:
        raise ValueError(f"OpenEnv environment {url!r}: its /schema could not be read ({type(err).__name__}: "
                         f"{str(err)[:200]}); is openenv's server running there?") from None


def _shown(observation: dict) -> str:
    """An observation as the model reads it: its one text field, or JSON of what it holds."""
    fields = {k: v for k, v in observation.items() if k not in SKIP}
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        return next(iter(fields.values()))
    return json.dumps(fields, default=str)


def _opening(row: dict, result) -> str:
    shown = _shown(result.observation)
    prompt = row.get("prompt") if isinstance(row.get("prompt"), str) else ""
    return "\n".join(part for part in (prompt, shown) if part)


def openenv_agent(spec: str) -> OpenEnvAgent:
    return OpenEnvAgent(spec)


__all__ = ["OpenEnvAgent", "openenv_agent"]
