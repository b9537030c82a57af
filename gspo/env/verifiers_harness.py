"""gspo's harness for verifiers environments (verifiers 0.4.0, `verifiers.v1`): the chat loop in the trainer's
process, with the task's MCP tools, every model call through the rollout's interception endpoint.

verifiers' own harnesses (bash, null) run their loop as a script `uv` prepares in the runtime, which installs
packages from the network on first use; gspo runs offline, so its runs use this one (verifiers loads it as the
harness id "gspo_verifiers_harness", this module's name there: a module exporting one Harness subclass). The
loop: send the conversation with the tools' schemas; run each tool call the reply makes through its MCP server and
send the results back; stop at a reply without a call (or when verifiers refuses a turn: max_turns).
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack

import verifiers.v1 as vf


class GspoChatConfig(vf.HarnessConfig):
    pass


class GspoChatHarness(vf.Harness[GspoChatConfig]):
    APPENDS_SYSTEM_PROMPT = True  # the task's system prompt as a system message of its own
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        from openai import APIStatusError, AsyncOpenAI
        from verifiers.v1.dialects.chat import message_to_wire
        from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages += [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [
            message_to_wire(m) for m in prompt or ()]
        async with AsyncExitStack() as stack:
            client = await stack.enter_async_context(AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0))
            tools, dispatch, servers = [], {}, {}
            if mcp_urls:
                spec = {"mcpServers": {name: {"url": url, "timeout": self.config.tool_timeout}
                                       for name, url in mcp_urls.items()}}
                tools, dispatch, servers = await connect_mcp(spec, stack)
            while True:
                try:
                    reply = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                                 **({"tools": tools} if tools else {}))
                except APIStatusError:
                    if trace.stop_condition is not None:  # verifiers refused the turn (max_turns, a stop hook)
                        break
                    raise
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": await _run_tool(call, dispatch, servers, call_mcp)})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


async def _run_tool(call, dispatch: dict, servers: dict, call_mcp) -> str:
    """A tool call's result as the model reads it; a tool's failure is its text (the model reads it)."""
    if call.function.name not in dispatch:
        return f"error: unknown tool {call.function.name!r}"
    try:
        result = await call_mcp(servers, dispatch, call.function.name, json.loads(call.function.arguments or "{}"))
    except Exception as err:  # noqa: BLE001  (bad arguments, the tool raised: the model reads it)
        return f"error: {type(err).__name__}: {err}"
    return result if isinstance(result, str) else json.dumps(result)


__all__ = ["GspoChatHarness"]
