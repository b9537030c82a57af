"""Tool calling: tools are plain Python functions with type hints; the model's calls are parsed from its turn,
run with a timeout, and their results (or what went wrong) become the next observation.

Two formats of a call (`style`):
  hermes  the chat-template format of Qwen and Hermes models:
          <tool_call>{"name": "calc", "arguments": {"expression": "12*34"}}</tool_call>
  text    a short one for models without a template (or a vocabulary without <, >, braces): a line that is
          nothing but the call, calc(12*34) (the text inside the outer parentheses is the function's one
          argument; a JSON object there gives several by name)

Built-in tools, named in `tools:` by their name alone (`BUILTIN_TOOLS`): `python` runs model-written code in
gspo's code sandbox (gspo/sandbox/runner.py: another process behind bubblewrap, or the weak mode, as the run's
`sandbox` setting says) and returns what it printed; its traceback or the limit that stopped it otherwise.

A malformed call (bad JSON, JSON past the parser's limits, an unknown tool, wrong arguments), a tool that raises
(SystemExit included) or returns what str() cannot show, one that does not return within `timeout_s` and a
result longer than `max_output_chars` are observations the model reads, counted in the call's `error` (a result
cut short is not an error: `truncated`); nothing of it ends the run.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import typing
from dataclasses import dataclass, field

from gspo.config import BUILTIN_TOOL_NAMES, TOOL_CALL_STYLES, check_implemented

STYLES = TOOL_CALL_STYLES  # the config's names (gspo/config/sampling.py); parse_tool_calls reads each
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_TEXT = re.compile(r"^[ \t]*([A-Za-z_][A-Za-z0-9_]*)\((.*)\)[ \t]*$", re.M)  # a whole line: name(argument)
_COERCE = {int: int, float: float, str: str, bool: lambda v: v if isinstance(v, bool) else str(v).lower() == "true"}


@dataclass
class ToolCall:
    """One call parsed from a model's turn: the tool's name and arguments, or why it could not be read."""

    name: str | None
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # a malformed call: the reason, shown to the model


@dataclass
class ToolResult:
    """What one call gave: the text the model reads and whether it went wrong."""

    name: str | None
    text: str
    error: str | None = None  # "malformed", "unknown tool", "bad arguments", "raised", "timed out"
    truncated: bool = False


def parse_tool_calls(text: str, style: str = "hermes") -> list[ToolCall]:
    """Every tool call in `text`, in order; [] when the turn calls no tool."""
    if style not in STYLES:
        raise ValueError(f"tool call style must be one of {STYLES}; got {style!r}")
    if style == "text":
        return [_text_call(name, body.strip()) for name, body in _TEXT.findall(text)]
    calls = []
    for body in _HERMES.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall(None, error=f"the call is not JSON ({err.msg} at character {err.pos})"))
            continue
        except (ValueError, RecursionError) as err:  # JSON past the parser's limits: nested too deep, too many digits
            calls.append(ToolCall(None, error=f"the call cannot be read ({_describe(err)})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(ToolCall(None, error='a call is a JSON object {"name": ..., "arguments": {...}}'))
        elif not isinstance(call.get("arguments", {}), dict):
            calls.append(ToolCall(call["name"], error="arguments must be a JSON object"))
        else:
            calls.append(ToolCall(call["name"], call.get("arguments", {})))
    return calls


def find_tool_calls(text: str, style: str = "hermes") -> list[tuple[str, ToolCall]]:
    """Every tool call in `text` with the text that writes it: [(written, call)], in order."""
    pattern = _TEXT if style == "text" else _HERMES
    return list(zip((m.group(0) for m in pattern.finditer(text)), parse_tool_calls(text, style)))


def _text_call(name: str, body: str) -> ToolCall:
    if body.startswith("{"):
        try:
            arguments = json.loads(body)
        except json.JSONDecodeError as err:
            return ToolCall(name, error=f"the arguments are not JSON ({err.msg})")
        except (ValueError, RecursionError) as err:  # past the parser's limits, as in parse_tool_calls
            return ToolCall(name, error=f"the arguments cannot be read ({_describe(err)})")
        if not isinstance(arguments, dict):
            return ToolCall(name, error="arguments must be a JSON object")
        return ToolCall(name, arguments)
    return ToolCall(name, {None: body})  # the one argument, named when the tool is known


class Toolbox:
    """The tools an episode may call, by function name; `run(turn)` answers every call in a model's turn."""

    def __init__(self, tools: list, *, style: str = "hermes", timeout_s: float = 5.0, max_output_chars: int = 1000):
        if style not in STYLES:
            raise ValueError(f"tool call style must be one of {STYLES}; got {style!r}")
        self.tools = {}
        for fn in tools:
            if not callable(fn) or not getattr(fn, "__name__", "").isidentifier():
                raise ValueError(f"a tool is a named Python function; got {fn!r}")
            self.tools[fn.__name__] = fn
        self.style, self.timeout_s, self.max_output_chars = style, timeout_s, max_output_chars

    def run(self, turn: str) -> list[ToolResult]:
        """The result of every call in `turn`, in order ([] when it calls none)."""
        return [self.call(c) for c in parse_tool_calls(turn, self.style)]

    def call(self, call: ToolCall) -> ToolResult:
        if call.error is not None:
            return ToolResult(call.name, f"error: {call.error}", "malformed")
        fn = self.tools.get(call.name)
        if fn is None:
            return ToolResult(call.name, f"error: no tool named {call.name!r} (tools: {', '.join(self.tools)})",
                              "unknown tool")
        try:
            kwargs = _arguments(fn, call.arguments)
        except (TypeError, ValueError, RecursionError) as err:  # RecursionError: repr of deeply nested arguments
            return ToolResult(call.name, f"error: {err}", "bad arguments")
        text, error = _call_with_timeout(fn, kwargs, self.timeout_s + getattr(fn, "grace_s", 0.0))
        if error == "timed out":
            return ToolResult(call.name, f"error: {call.name} did not return within {self.timeout_s:g} s", error)
        if error is not None:
            return ToolResult(call.name, f"error: {call.name} {error}", "raised")
        if len(text) > self.max_output_chars:
            return ToolResult(call.name, text[: self.max_output_chars] + " ... (cut)", truncated=True)
        return ToolResult(call.name, text)


def python_tool(sandbox: str = "os", timeout_s: float = 5.0, memory_mb: int = 512):
    """The built-in tool `python`: a function python(code) that runs `code` as a program in the code sandbox
    (`sandbox`: "os" or "weak", gspo.sandbox.runner.run_sandboxed; the program gets `timeout_s` and `memory_mb`)
    and returns its stdout; a program that raised adds its traceback, one stopped by a limit says which. The
    code failing is the model's to read, not a tool error; a sandbox that cannot start is (it raises)."""
    from gspo.sandbox.runner import run_sandboxed

    def python(code: str) -> str:
        """Run a Python program and return what it prints.

        Args:
            code: the program; print() what you want to see
        """
        result = run_sandboxed(code, timeout_s=timeout_s, memory_mb=memory_mb, sandbox=sandbox)
        if result.error is not None:
            raise RuntimeError(result.error)
        if result.killed is not None:
            return f"{result.stdout}(stopped: {result.killed})"
        if not result.passed:  # it raised: its traceback from the program's own frames on
            lines = result.stderr.splitlines()
            first = next((i for i, line in enumerate(lines) if 'File "solution.py"' in line), len(lines))
            shown = [line for line in lines[first:] if not line.startswith("sandbox:")]
            return result.stdout + "\n".join(["Traceback (most recent call last):", *shown])
        return result.stdout

    python.grace_s = 5.0  # the sandbox enforces timeout_s itself; its start and teardown get this much more
    return python


BUILTIN_TOOLS = {"python": python_tool}
"""Tools named by their name alone in `tools:`; each a maker called with the run's (sandbox, tool_timeout_s)."""
check_implemented(BUILTIN_TOOL_NAMES, BUILTIN_TOOLS, "gspo.env.tools.BUILTIN_TOOLS")


def load_tools(specs: list, sandbox: str = "os", timeout_s: float = 5.0) -> list:
    """The tool functions `specs` name: a built-in name (BUILTIN_TOOLS) or "module:function" each."""
    from gspo.data.reward_import import import_reward_fn

    return [BUILTIN_TOOLS[spec](sandbox, timeout_s) if spec in BUILTIN_TOOLS else import_reward_fn(spec, kind="tool")
            for spec in specs]


_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


def tool_schema(fn) -> dict:
    """The JSON schema a chat template shows the model for tool `fn` ({"type": "function", "function": {name,
    description, parameters}}): transformers' `get_json_schema` where the docstring describes every argument
    (Google style, "Args:"), else one from the type hints alone, described by the docstring's first line."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception:  # noqa: BLE001  (DocstringParsingException, TypeError: an undocumented or odd signature)
        pass
    params = inspect.signature(fn).parameters
    try:
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError):
        hints = {}
    properties = {name: {"type": _JSON_TYPES[hints[name]]} if hints.get(name) in _JSON_TYPES else {}
                  for name in params}
    required = [name for name, p in params.items() if p.default is inspect.Parameter.empty]
    doc = (inspect.getdoc(fn) or "").strip().splitlines()
    return {"type": "function", "function": {"name": fn.__name__, "description": doc[0] if doc else "",
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


def _arguments(fn, arguments: dict) -> dict:
    """`arguments` as keyword arguments of `fn`, each coerced to its annotated type (int, float, str, bool)."""
    params = inspect.signature(fn).parameters
    if None in arguments:  # the text style's one argument: the function's first parameter
        if not params:
            raise ValueError(f"{fn.__name__} takes no arguments")
        arguments = {next(iter(params)): arguments[None]}
    unknown = set(arguments) - set(params)
    if unknown:
        raise ValueError(f"{fn.__name__} has no argument {sorted(unknown)[0]!r} (it takes {', '.join(params)})")
    try:
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError):  # an annotation that does not resolve: taken as it comes
        hints = {}
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in arguments]
    if missing:
        raise ValueError(f"{fn.__name__} needs argument {missing[0]!r}")
    out = {}
    for name, value in arguments.items():
        kind = hints.get(name)
        try:
            out[name] = _COERCE[kind](value) if kind in _COERCE else value
        except (TypeError, ValueError):
            raise ValueError(f"{fn.__name__}: argument {name!r} must be {kind.__name__}; got {value!r}") from None
    return out


def _call_with_timeout(fn, kwargs: dict, timeout_s: float) -> tuple[str | None, str | None]:
    """(the result as text, None), (None, what went wrong: "raised ExcType: message", "returned T, whose str()
    raised ...") or (None, "timed out"). The call and the str() of its result run in a daemon thread: a tool (or
    a __str__) that hangs is left behind (Python cannot stop a thread), the episode goes on."""
    box: dict = {}

    def target():
        # BaseException: a tool's SystemExit or KeyboardInterrupt is its failure too, shown to the model, which
        # decides what to do next (uncaught, it would end this thread silently: a call that "returned None")
        try:
            value = fn(**kwargs)
        except BaseException as exc:  # noqa: BLE001
            box["error"] = f"raised {_describe(exc)}"
            return
        try:
            box["text"] = str(value)
        except BaseException as exc:  # noqa: BLE001  (an int over 4300 digits, a __str__ that raises)
            box["error"] = f"returned {type(value).__name__}, whose str() raised {_describe(exc)}"

    worker = threading.Thread(target=target, name=f"gspo-tool-{fn.__name__}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return None, "timed out"
    return box.get("text"), box.get("error")


def _describe(exc: BaseException) -> str:
    """"ExcType: message" (the message cut to 200 characters; left out where its own str() raises)."""
    try:
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    except BaseException:  # noqa: BLE001
        return type(exc).__name__


__all__ = ["BUILTIN_TOOLS", "STYLES", "ToolCall", "ToolResult", "Toolbox", "find_tool_calls", "load_tools",
           "parse_tool_calls", "python_tool", "tool_schema"]
