"""OpenAI-compatible responses from sampled completions: chat.completion and text_completion objects, their
streamed chunks (server-sent events), tool calls parsed back into `tool_calls`, and log-probs. Every response
carries the prompt's token ids (`prompt_token_ids`) and each choice's sampled ids (`token_ids`), as vLLM's
`return_token_ids` does: a client trains on exactly what was sampled."""

from __future__ import annotations

import json
import math
import secrets
import time

from gspo.rollout.endpoint.engine import Sample

NO_LOGPROB = -9999.0  # OpenAI's value for a log-prob of -inf


def chat_reply(sample: Sample, tools: list | None, style: str) -> tuple[dict, str]:
    """The assistant message of `sample` and its finish reason: with `tools` (the request's schemas), the tool
    calls written in `style` ("hermes": <tool_call>{json}</tool_call>; "text": a line name(argument)) become
    `tool_calls` and leave the content; a malformed call stays in the content as text."""
    message = {"role": "assistant", "content": sample.text}
    if not tools:
        return message, sample.finish_reason
    calls, content = _tool_calls(sample.text, tools, style)
    if not calls:
        return message, sample.finish_reason
    message = {"role": "assistant", "content": content or None, "tool_calls": [
        {"id": "call_" + secrets.token_hex(12), "type": "function",
         "function": {"name": name, "arguments": json.dumps(arguments)}} for name, arguments in calls]}
    return message, "tool_calls"


def _tool_calls(text: str, tools: list, style: str) -> tuple[list[tuple[str, dict]], str]:
    """[(name, arguments)] of the well-formed calls in `text` and the text without them."""
    from gspo.env.tools import find_tool_calls

    known = {t["function"]["name"]: t["function"] for t in tools}
    calls, kept = [], text
    for written, call in find_tool_calls(text, style):
        if call.error is not None or call.name not in known:
            continue
        arguments = call.arguments
        if None in arguments:  # the text style's one unnamed argument: the tool's first parameter
            names = list((known[call.name].get("parameters") or {}).get("properties") or {})
            if not names:
                continue
            arguments = {names[0]: arguments[None]}
        calls.append((call.name, arguments))
        kept = kept.replace(written, "", 1)
    return calls, kept.strip()


def chat_response(samples: list[Sample], replies: list[tuple[dict, str]], prompt_ids: list[int], model: str,
                  tokenizer, logprobs: bool) -> dict:
    """A chat.completion object of one request's choices."""
    return {
        "id": "chatcmpl-" + secrets.token_hex(12), "object": "chat.completion", "created": int(time.time()),
        "model": model, "prompt_token_ids": prompt_ids,
        "choices": [{"index": k, "message": message, "finish_reason": reason,
                     "logprobs": {"content": _chat_logprobs(s, tokenizer)} if logprobs else None,
                     "token_ids": s.token_ids}
                    for k, (s, (message, reason)) in enumerate(zip(samples, replies))],
        "usage": usage([prompt_ids], samples), "weight_version": samples[0].version if samples else None}


def completion_response(samples: list[list[Sample]], prompts: list[list[int]], model: str, tokenizer,
                        logprobs: bool) -> dict:
    """A text_completion object: each prompt's `n` choices in order (index = prompt * n + choice)."""
    choices = [s for per_prompt in samples for s in per_prompt]
    return {
        "id": "cmpl-" + secrets.token_hex(12), "object": "text_completion", "created": int(time.time()),
        "model": model, "prompt_token_ids": prompts[0] if len(prompts) == 1 else prompts,
        "choices": [{"index": k, "text": s.text, "finish_reason": s.finish_reason,
                     "logprobs": _completion_logprobs(s, tokenizer) if logprobs else None, "token_ids": s.token_ids,
                     **({"routed_experts": npy_base64(s.routing)} if s.routing is not None else {}),
                     **({"routed_experts_padding": s.routing_padding} if s.routing_padding is not None else {})}
                    for k, s in enumerate(choices)],
        "usage": usage(prompts, choices), "weight_version": choices[0].version if choices else None}


def npy_base64(array) -> str:
    """An integer array as vLLM returns routed experts: the .npy bytes of it, base64-encoded (no pickle inside)."""
    import base64
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def usage(prompts: list[list[int]], samples: list[Sample]) -> dict:
    prompt = sum(map(len, prompts))
    completion = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else NO_LOGPROB


def _pieces(sample: Sample, tokenizer) -> list[str]:
    """The text each token adds to the completion's (decoded prefixes' differences, within `sample.text`)."""
    out, before = [], ""
    for j in range(len(sample.token_ids)):
        text = tokenizer.decode(sample.token_ids[:j + 1], skip_special_tokens=True)[:len(sample.text)]
        out.append(text[len(before):] if text.startswith(before) else "")
        before = text if text.startswith(before) else before
    return out


def _chat_logprobs(sample: Sample, tokenizer) -> list[dict]:
    return [{"token": tokenizer.decode([t]), "logprob": _logprob(lp), "bytes": list(tokenizer.decode([t]).encode()),
             "top_logprobs": []} for t, lp in zip(sample.token_ids, sample.logprobs)]


def _completion_logprobs(sample: Sample, tokenizer) -> dict:
    pieces = _pieces(sample, tokenizer)
    offsets = [sum(map(len, pieces[:j])) for j in range(len(pieces))]
    return {"tokens": [tokenizer.decode([t]) for t in sample.token_ids],
            "token_logprobs": [_logprob(lp) for lp in sample.logprobs], "top_logprobs": None, "text_offset": offsets}


def chat_chunks(response: dict, tokenizer, include_usage: bool) -> list[dict]:
    """A chat.completion as the chat.completion.chunk objects a streaming client reads: per choice its role, its
    content token by token (each chunk with that token's id, and log-prob when asked), its tool calls, its
    finish reason; then the usage when `include_usage`. The first chunk carries `prompt_token_ids`."""
    head = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"]}
    chunks = [dict(head, prompt_token_ids=response["prompt_token_ids"], choices=[
        {"index": c["index"], "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
        for c in response["choices"]])]
    for c in response["choices"]:
        k, message, lps = c["index"], c["message"], (c["logprobs"] or {}).get("content")
        if "tool_calls" in message:  # the tokens, the content and the calls in one delta
            delta = {"content": message["content"], "tool_calls": [dict(call, index=j) for j, call in
                                                                    enumerate(message["tool_calls"])]}
            chunks.append(dict(head, choices=[{"index": k, "delta": delta, "finish_reason": None, "token_ids":
                                               c["token_ids"], "logprobs": {"content": lps} if lps else None}]))
        else:
            sample = Sample(c["token_ids"], [], c["finish_reason"], message["content"])
            for j, piece in enumerate(_pieces(sample, tokenizer)):
                chunks.append(dict(head, choices=[{"index": k, "delta": {"content": piece}, "finish_reason": None,
                                                   "token_ids": c["token_ids"][j:j + 1],
                                                   "logprobs": {"content": lps[j:j + 1]} if lps else None}]))
        chunks.append(dict(head, choices=[{"index": k, "delta": {}, "finish_reason": c["finish_reason"],
                                           "logprobs": None}]))
    if include_usage:
        chunks.append(dict(head, choices=[], usage=response["usage"]))
    return chunks


def completion_chunks(response: dict, tokenizer, include_usage: bool) -> list[dict]:
    """A text_completion as streamed chunks: each choice's text token by token, then its finish reason."""
    head = {"id": response["id"], "object": "text_completion", "created": response["created"],
            "model": response["model"]}
    chunks = []
    for c in response["choices"]:
        sample = Sample(c["token_ids"], [], c["finish_reason"], c["text"])
        lp = c["logprobs"]
        for j, piece in enumerate(_pieces(sample, tokenizer)):
            part = None if lp is None else {key: lp[key][j:j + 1] for key in ("tokens", "token_logprobs",
                                                                             "text_offset")}
            chunks.append(dict(head, choices=[{"index": c["index"], "text": piece, "finish_reason": None,
                                               "logprobs": part, "token_ids": c["token_ids"][j:j + 1]}]))
        chunks.append(dict(head, choices=[{"index": c["index"], "text": "", "finish_reason": c["finish_reason"],
                                           "logprobs": None}]))
    if chunks:
        chunks[0]["prompt_token_ids"] = response["prompt_token_ids"]
    if include_usage:
        chunks.append(dict(head, choices=[], usage=response["usage"]))
    return chunks


def events(chunks: list[dict]):
    """Server-sent events of `chunks`, then [DONE]."""
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"



__all__ = ["NO_LOGPROB", "chat_chunks", "chat_reply", "chat_response", "completion_chunks", "completion_response",
           "events", "usage"]
