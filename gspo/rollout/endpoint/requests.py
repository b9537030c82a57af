"""OpenAI-compatible requests read into engine Jobs: /v1/chat/completions and /v1/completions bodies checked field by
field (an unknown or unsupported one is a `BadRequest` naming it), chat messages rendered to tokens by the model's
chat template, text from the client tokenized as data (its control tokens spelled out, DESIGN.md "Trust").

Token-in/token-out: a request may carry `prompt_token_ids` (chat) or a token list as `prompt` (completions) instead
of text, and inside a session a conversation that continues an earlier call (its messages, then the assistant
message that call returned) is not rendered again: its tokens are that call's prompt and sampled tokens, exactly,
followed by the template's rendering of the new messages (`gspo.rollout.episodes.chat_observation`), so what
the model sampled is what the trainer reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from gspo.rollout.endpoint.engine import Job


class BadRequest(ValueError):
    """A request the endpoint refuses (HTTP 400): the message names the field and what it accepts."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


# fields read, per route; others are refused by name (OpenAI's that gspo does not do are said so)
CHAT_FIELDS = {"model", "messages", "n", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop",
               "stream", "stream_options", "tools", "tool_choice", "logprobs", "top_logprobs", "seed", "user",
               "prompt_token_ids", "parallel_tool_calls", "return_token_ids", "top_k", "min_p", "repetition_penalty"}
COMPLETION_FIELDS = {"model", "prompt", "n", "temperature", "top_p", "max_tokens", "stop", "stream",
                     "stream_options", "logprobs", "seed", "user", "echo", "return_token_ids", "top_k", "min_p",
                     "repetition_penalty", "return_routed_experts", "seed_offset"}  # top_k, min_p, repetition_penalty:
# vLLM's extra sampling parameters; return_routed_experts (vLLM returns them where its server is started with them)
# and seed_offset: gspo's
NOT_DONE = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "response_format": None,
            "best_of": 1, "suffix": None}  # refused unless they ask for what gspo does anyway


@dataclass
class Limits:
    """What one request may ask for: the server's defaults and caps."""

    max_tokens: int = 64  # when a request gives none
    max_tokens_cap: int = 4096
    max_n: int = 64


@dataclass
class Prompt:
    """A request's prompt as tokens, and for a chat what it continues (`Call`, choice) in its session, if any."""

    token_ids: list[int]
    messages: list[dict] | None = None  # the chat's messages, normalised (`normalise`)
    extends: tuple | None = None  # (the earlier Call, its choice) whose tokens this prompt starts with
    tools: list | None = None  # the request's tool schemas (chat)
    parse_tools: bool = False  # parse tool calls out of the completions (tools given, tool_choice not "none")


@dataclass
class Call:
    """One answered call of a session, as the trainer keeps it: the prompt and each choice's tokens and mu."""

    prompt: Prompt
    samples: list = field(default_factory=list)  # engine.Sample per choice
    replies: list[dict] = field(default_factory=list)  # the assistant message returned per choice, normalised


def job_of(body: dict, route: str, limits: Limits, prompt_ids: list[int], seed_base: int | None,
           first_choice: int = 0) -> Job:
    """The engine Job of a checked `body` whose prompt is `prompt_ids`. Seeds (sampling at a temperature over the
    full distribution only): the body's `seed` S seeds choice j of the response (prompts in order, `n` each;
    this prompt's first is `first_choice`) with S + j, so one request seeded S samples what n requests seeded S,
    S+1, ... would; gspo's extension: `seed` as a list, one per choice. Without one, a session's `seed_base`
    (each choice seed_base * 1_000_003 + k)."""
    n = _int(body, "n", 1, 1, limits.max_n)
    cap = limits.max_tokens_cap
    max_tokens = _int(body, "max_completion_tokens", None, 1, cap) if route == "chat" else None
    max_tokens = max_tokens or _int(body, "max_tokens", limits.max_tokens, 1, cap)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise BadRequest("top_p must be in (0, 1]", "top_p")
    top_k = _int(body, "top_k", 0, -1, 1 << 30)
    top_k = 0 if top_k == -1 else top_k  # vLLM's "off"
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    repetition_penalty = _number(body, "repetition_penalty", 1.0, 1e-6, 100.0)
    reshaped = top_p < 1 or top_k or min_p or repetition_penalty != 1.0
    seed = body.get("seed")
    if isinstance(seed, list):
        if not all(type(x) is int for x in seed):
            raise BadRequest("seed must be an integer or a list of integers, one per choice", "seed")
        if len(seed) < first_choice + n:
            raise BadRequest(f"seed: {len(seed)} seeds for {first_choice + n} or more choices (one per choice)",
                             "seed")
        seeds = seed[first_choice:first_choice + n]
    elif seed is not None and type(seed) is not int:
        raise BadRequest(f"seed must be an integer; got {seed!r:.40}", "seed")
    elif seed is not None:
        seeds = [seed + first_choice + k for k in range(n)]
    else:
        seeds = None if seed_base is None else [seed_base * 1_000_003 + k for k in range(n)]
    if seeds is not None and seed is not None and reshaped and temperature > 0:
        raise BadRequest("seed: seeded sampling draws from the full distribution; top_p, top_k, min_p and "
                         "repetition_penalty reshape it", "seed")
    seeds = None if temperature == 0 or reshaped else seeds
    offsets = body.get("seed_offset")  # gspo's: tokens each choice's seed already sampled (an episode's later turn)
    if offsets is not None:
        offsets = [offsets] * (first_choice + n) if type(offsets) is int else offsets
        if seed is None or not isinstance(offsets, list) or len(offsets) < first_choice + n or not all(
                type(k) is int and 0 <= k <= 1 << 20 for k in offsets):
            raise BadRequest("seed_offset: with a seed, a count of tokens (or one per choice) that each choice's "
                             "seed already sampled", "seed_offset")
        offsets = offsets[first_choice:first_choice + n]
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a string or a list of up to 4 non-empty strings", "stop")
    routing = body.get("return_routed_experts")
    if routing not in (None, True, False, "padded"):
        raise BadRequest("return_routed_experts must be true, false or \"padded\"", "return_routed_experts")
    return Job(prompt_ids, n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
               repetition_penalty=repetition_penalty, seeds=seeds, offsets=offsets if seeds else None, stop=tuple(stop),
               routing=routing or False)


def check_fields(body, route: str) -> None:
    """Refuse a body that is not an object, or has a field this route does not read (named)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    known = CHAT_FIELDS if route == "chat" else COMPLETION_FIELDS
    for name, value in body.items():
        if name in NOT_DONE:
            if value not in (NOT_DONE[name], None):
                raise BadRequest(f"{name} is not supported by gspo's endpoint (it samples the model's own "
                                 "distribution, which the trainer's log-probs are taken over)", name)
        elif name not in known:
            raise BadRequest(f"unknown field {name!r} for /v1/{'chat/' if route == 'chat' else ''}completions; "
                             f"accepted: {', '.join(sorted(known))}", name)
    if body.get("logprobs") not in (None, False, True, 0) or body.get("top_logprobs") not in (None, 0):
        raise BadRequest("logprobs: the sampled tokens' log-probs only (logprobs: true for chat, 0 for completions); "
                         "top alternatives (top_logprobs, logprobs > 0) are not returned", "logprobs")


def completion_prompts(body: dict, tokenizer) -> list[list[int]]:
    """The token ids of each prompt of a /v1/completions body: text (tokenized as written: a completion prompt
    is the caller's raw text, its own markup included), a token list, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_tokens(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) or _is_tokens(p) for p in prompt):
        raise BadRequest("prompt must be a string, a list of token ids, or a non-empty list of either", "prompt")
    out = [p if not isinstance(p, str) else tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompt]
    _check_ids(out, tokenizer, "prompt")
    return out


def chat_prompt(body: dict, tokenizer, template_kwargs: dict | None, calls: list[Call]) -> Prompt:
    """The prompt of a /v1/chat/completions body: `prompt_token_ids` as given, or its messages continuing an
    earlier call of the session (`calls`), or rendered afresh by the chat template (with `tools`)."""
    from gspo.rollout.episodes import chat_observation, control_tokens, encode_data

    tools, parse = _tools(body)
    messages = [normalise(m, k) for k, m in enumerate(_list(body, "messages"))]
    if "prompt_token_ids" in body:
        ids = body["prompt_token_ids"]
        if not _is_tokens(ids):
            raise BadRequest("prompt_token_ids must be a non-empty list of token ids", "prompt_token_ids")
        _check_ids([ids], tokenizer, "prompt_token_ids")
        return Prompt(list(ids), messages, None, tools, parse)
    if not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise BadRequest("the model's tokenizer has no chat template: use /v1/completions", "messages")
    kwargs = dict(template_kwargs or {}, **({"tools": tools} if tools else {}))
    controls = control_tokens(tokenizer)
    earlier = _continued(messages, calls)
    if earlier is not None:
        call, k = earlier
        sample, after = call.samples[k], messages[len(call.prompt.messages) + 1:]
        stop = tokenizer.decode(sample.token_ids[-1:]) if sample.eos else None
        shown = chat_observation(tokenizer, [_template_message(m) for m in after], kwargs, stop, controls=controls)
        ids = call.prompt.token_ids + sample.token_ids + encode_data(tokenizer, shown, controls)
        return Prompt(ids, messages, earlier, tools, parse)
    marked = [_template_message(m, controls) for m in messages]
    try:
        text = tokenizer.apply_chat_template(marked, add_generation_prompt=messages[-1]["role"] != "assistant",
                                             tokenize=False, **kwargs)
    except Exception as err:  # noqa: BLE001  (a template's own error: raise_exception(...), a missing key)
        raise BadRequest(f"the chat template could not render these messages: {type(err).__name__}: "
                         f"{str(err)[:200]}", "messages") from None
    return Prompt(encode_data(tokenizer, text, controls), messages, None, tools, parse)


def normalise(message, k: int) -> dict:
    """An OpenAI chat message as gspo compares and renders it: role, content as one text (parts joined), and an
    assistant's tool calls as [(name, arguments as a dict)]."""
    if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant",
                                                                    "tool"):
        raise BadRequest(f"messages[{k}] must be an object with a role of system, developer, user, assistant or "
                         "tool", "messages")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise BadRequest(f"messages[{k}].content: only text parts are supported", "messages")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise BadRequest(f"messages[{k}].content must be text or a list of text parts", "messages")
    out = {"role": "system" if message["role"] == "developer" else message["role"], "content": content or ""}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [_read_call(c, k) for c in calls]
    if message["role"] == "tool" and isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _read_call(call, k: int) -> tuple[str, dict]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(f"messages[{k}].tool_calls: each is {{type: function, function: {{name, arguments}}}}",
                         "messages")
    arguments = function.get("arguments") or "{}"
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        raise BadRequest(f"messages[{k}].tool_calls: arguments of {function['name']!r} are not JSON",
                         "messages") from None
    if not isinstance(arguments, dict):
        raise BadRequest(f"messages[{k}].tool_calls: arguments must be a JSON object", "messages")
    return function["name"], arguments


def _template_message(message: dict, controls=None) -> dict:
    """A normalised message as chat templates read it (transformers' format: tool calls' arguments a dict); its
    content is data (`mark_data`: control tokens' text spelled out by encode_data)."""
    from gspo.rollout.episodes import mark_data

    out = {"role": message["role"], "content": mark_data(message["content"], controls)}
    if "tool_calls" in message:
        out["tool_calls"] = [{"type": "function", "function": {"name": name, "arguments": args}}
                             for name, args in message["tool_calls"]]
    if "name" in message:
        out["name"] = message["name"]
    return out


def _continued(messages: list[dict], calls: list[Call]) -> tuple[Call, int] | None:
    """The latest (call, choice) whose messages and returned reply `messages` starts with, followed by at least
    one new message; None if none."""
    for call in reversed(calls):
        before = call.prompt.messages
        if before is None or len(messages) <= len(before) + 1 or messages[:len(before)] != before:
            continue
        for k, reply in enumerate(call.replies):
            if messages[len(before)] == reply:
                return call, k
    return None


def _tools(body: dict) -> tuple[list | None, bool]:
    tools, choice = body.get("tools"), body.get("tool_choice", "auto")
    if tools is None:
        return None, False
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function" and isinstance(
            t.get("function"), dict) and isinstance(t["function"].get("name"), str) for t in tools):
        raise BadRequest("tools must be a list of {type: function, function: {name, description, parameters}}",
                         "tools")
    if choice not in ("auto", "none"):
        raise BadRequest(f"tool_choice={choice!r:.60}: only auto and none (gspo does not constrain decoding to force "
                         "a call)", "tool_choice")
    return (tools, True) if choice == "auto" else (None, False)


def _list(body: dict, name: str) -> list:
    value = body.get(name, [])
    if not isinstance(value, list):
        raise BadRequest(f"{name} must be a list", name)
    return value


def _int(body: dict, name: str, default, low: int, high: int):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadRequest(f"{name} must be an integer in [{low}, {high}]; got {value!r:.40}", name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise BadRequest(f"{name} must be a number in [{low}, {high}]; got {value!r:.40}", name)
    return float(value)


def _is_tokens(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _check_ids(prompts: list[list[int]], tokenizer, name: str) -> None:
    size = len(tokenizer)
    for ids in prompts:
        bad = [t for t in ids if not 0 <= t < size]
        if bad:
            raise BadRequest(f"{name}: token id {bad[0]} is outside the vocabulary (0 .. {size - 1})", name)
        if not ids:
            raise BadRequest(f"{name}: a prompt has no tokens", name)


__all__ = ["BadRequest", "Call", "Limits", "Prompt", "chat_prompt", "check_fields", "completion_prompts", "job_of",
           "normalise"]
