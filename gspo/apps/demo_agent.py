"""The agent of `gspo demo --agent`, written against the `openai` client only: a tool loop with a calculator offered
as `tools=[...]` (docs/agents.md). The same file trains any model gspo loads (`agent=gspo.apps.demo_agent:agent`)
and runs against `gspo serve` (`python -m gspo.apps.demo_agent URL`)."""

from __future__ import annotations

import re

CALC = {"type": "function", "function": {
    "name": "calc", "description": "The value of a+b, a-b or a*b of two non-negative integers.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 12+30"}},
                   "required": ["expression"]}}}
_EXPRESSION = re.compile(r"^\s*(\d{1,12})\s*([+\-*])\s*(\d{1,12})\s*$")


def calc(expression: str) -> str:
    match = _EXPRESSION.match(expression)
    if match is None:
        return "error: expected a+b, a-b or a*b of integers"
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


async def agent(client, row: dict, *, model: str = "policy", max_calls: int = 2) -> float:
    """Ask; run each tool call the reply makes and send its result back; stop at a reply without one. 1.0 where the
    last number of the final reply is the row's answer."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(max_calls):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=[CALC])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            expression = _arguments(call.function.arguments).get("expression", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result: {calc(expression)}\n"})
    found = re.findall(r"-?\d+", messages[-1].get("content") or "")
    return float(bool(found) and found[-1] == str(row["answer"]).strip())


def _arguments(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


if __name__ == "__main__":  # the same agent against any OpenAI-compatible server: python -m gspo.apps.demo_agent URL
    import asyncio
    import sys

    import openai

    async def main(url: str) -> None:
        async with openai.AsyncOpenAI(base_url=url, api_key="-") as client:
            model = (await client.models.list()).data[0].id
            rows = [{"prompt": "1234+5678=", "answer": "6912"}, {"prompt": "4321+1111=", "answer": "5432"}]
            scores = [await agent(client, row, model=model) for row in rows]
            print(f"{model}: rewards {scores}")

    asyncio.run(main(sys.argv[1]))
