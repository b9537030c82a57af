"""Reward functions: the protocol, built-in verifiers, a reward-model scorer, and batch scoring.

Protocol (TRL's): `fn(prompts=..., completions=..., **columns) -> list[float | None]`, called
with keywords (positionally, `fn(prompts, completions, **columns)`, when it names no
`completions` parameter but takes positional ones, e.g. `lambda p, c, **_`). Extra dataset
columns arrive as keyword lists aligned with `prompts`, and `completion_ids` (each completion's
token ids) where the function takes it (by name or **kwargs); None means "no opinion" and is
skipped when rewards are combined. Where the prompts were chat messages, prompts arrive as those
messages and each completion as `[{"role": "assistant", "content": text}]` (TRL's conversational
format), except for functions marked `reads_text` (the built-ins), which always get text.
Metrics use the function's `__name__`. A function with a `check_rows(rows)` method has every train
and held-out row checked by it before training (code_tests: its tests column).
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from gspo.given import is_marker, marker, not_rebuildable

__all__ = [
    "answer_match",
    "math_reward",
    "format_reward",
    "make_regex_reward",
    "RewardModelReward",
    "get_reward_fn",
    "reward_spec",
    "score_completions",
    "RewardError",
]

RewardFn = Callable[..., list]

_MARKER = "####"
# A number as a final answer: optional sign, digits with optional thousands commas, optional decimals.
_NUMBER = r"-?\d+(?:,\d{3})*(?:\.\d+)?"
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def _extract_answer(text: str) -> str | None:
    """Text after the LAST '####', stripped and cut at the first newline; None if absent/empty."""
    idx = text.rfind(_MARKER)
    if idx < 0:
        return None
    answer = text[idx + len(_MARKER) :].strip().split("\n", 1)[0].strip()
    return answer or None


def _as_number(text: str) -> float | None:
    """Finite float value of `text`, or None. Accepts thousands commas ("1,000")."""
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _answers_equal(predicted: str, expected: str) -> bool:
    if predicted == expected:
        return True
    a, b = _as_number(predicted), _as_number(expected)
    return a is not None and b is not None and a == b


def answer_match(
    prompts: list[str], completions: list[str], answer: Sequence, **_
) -> list[float | None]:
    """1.0 where the completion's final answer (after the last '####') equals `answer[i]`, else 0.0.

    Equal means the same string after stripping, or the same number ("932" == "932.0" == "932.00").
    A None in `answer` gives None (no opinion).
    """
    if len(answer) != len(completions):
        raise ValueError(f"answer has {len(answer)} entries, expected {len(completions)} (one per completion)")
    rewards: list[float | None] = []
    for completion, expected in zip(completions, answer):
        if expected is None:
            rewards.append(None)
            continue
        predicted = _extract_answer(completion)
        rewards.append(float(predicted is not None and _answers_equal(predicted, str(expected).strip())))
    return rewards


def reads_text(fn):
    """Mark a reward function as one that reads text only: with a chat dataset it still gets the
    rendered prompts and the completions' text, not TRL's conversational message lists."""
    fn.reads_text = True
    return fn


answer_match = reads_text(answer_match)


_NEEDS_MATH_VERIFY = "the math reward needs math-verify: pip install 'gspo[math]' (or 'math-verify[antlr4_13_2]')"


def math_reward(prompts: list[str], completions: list[str], answer: Sequence, **_) -> list[float | None]:
    """1.0 where the completion's final answer is mathematically equal to `answer[i]` (HF math-verify:
    LaTeX, \\boxed{}, fractions, sets, units stripped), else 0.0; None in `answer` gives None.

    The gold answer may be plain ("1/2", "0.5") or LaTeX ("\\frac{1}{2}", "$x^2$"). math-verify's own
    time limits use signal.alarm, which works only in the main thread: they are on there
    (reward_timeout_s: 0) and off in the trainer's reward thread, whose reward_timeout_s bounds the call.
    Needs the `math` extra: pip install 'gspo[math]'.
    """
    try:
        from math_verify import parse, verify
    except ImportError as err:
        raise ImportError(_NEEDS_MATH_VERIFY) from err
    if len(answer) != len(completions):
        raise ValueError(f"answer has {len(answer)} entries, expected {len(completions)} (one per completion)")
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold_cache: dict[str, list] = {}
    rewards: list[float | None] = []
    for completion, expected in zip(completions, answer):
        if expected is None:
            rewards.append(None)
            continue
        expected = str(expected).strip()
        if expected not in gold_cache:
            # LaTeX is only read inside math delimiters: a bare "\\frac{1}{2}" gold is wrapped in $...$
            gold = parse(expected, parsing_timeout=limit)
            gold_cache[expected] = gold or parse(f"${expected}$", parsing_timeout=limit)
        gold = gold_cache[expected]
        if not gold:
            raise ValueError(f"math reward: math-verify cannot read the gold answer {expected!r}")
        predicted = parse(completion, parsing_timeout=limit)
        rewards.append(float(bool(predicted) and verify(gold, predicted, timeout_seconds=limit)))
    return rewards


math_reward.__name__ = "math"  # metrics read reward/math; the import path stays gspo.data.rewards:math_reward
math_reward = reads_text(math_reward)


def make_regex_reward(pattern: str, name: str) -> RewardFn:
    """Reward fn named `name`: 1.0 where the WHOLE completion matches `pattern` (re.fullmatch), else 0.0.

    Use inline flags for multi-line text, e.g. `(?s).*DONE\\s*` matches any completion ending in DONE.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be a non-empty identifier-like string (it names metrics), got {name!r}")
    if not isinstance(pattern, str):
        raise ValueError(f"pattern must be a str, got {type(pattern).__name__}")
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {err}") from err

    def regex_reward(prompts: list[str], completions: list[str], **_) -> list[float | None]:
        return [float(compiled.fullmatch(c) is not None) for c in completions]

    regex_reward.__name__ = regex_reward.__qualname__ = name
    regex_reward.__doc__ = f"1.0 where the whole completion matches {pattern!r}, else 0.0."
    return reads_text(regex_reward)


# 1.0 iff the completion ends with "#### <number>", optionally followed by whitespace.
format_reward = make_regex_reward(rf"(?s).*{_MARKER}\s*{_NUMBER}\s*", "format")

_INTEGER = re.compile(r"-?\d+")


@reads_text
def last_number(prompts: list[str], completions: list[str], answer: list, **_) -> list[float | None]:
    """1.0 where the last integer in the completion equals the `answer` column's (an int, or a str of
    one), else 0.0; None where the answer is not an integer. For models that answer in words: "The
    sum is 12." scores 1 for answer 12, as does "12"."""
    rewards: list[float | None] = []
    for completion, expected in zip(completions, answer, strict=True):
        try:
            target = int(str(expected).strip())
        except ValueError:
            rewards.append(None)
            continue
        found = _INTEGER.findall(completion)
        last = found[-1] if found else ""
        rewards.append(float(0 < len(last) <= 1000 and int(last) == target))  # 1000: int() refuses 4300+ digits
    return rewards


class RewardModelReward:
    """Scores `prompt + completion` with a sequence-classification reward model (num_labels == 1).

    `model_or_path`: a path loadable by `AutoModelForSequenceClassification` (its tokenizer is
    loaded from the same path unless `tokenizer` is given), or a model object plus `tokenizer`.
    Returns `logits[:, 0]` per text. Texts are right-padded (HF classifiers pool the last
    non-pad token); a tokenizer without a pad token pads with eos, so texts should not end in eos.
    With `max_length`, texts are truncated on the tokenizer's `truncation_side`. The model is
    scored on `device` (a torch device or gspo's names: auto is cuda where available) in `dtype`
    (float32, bfloat16, float16, or auto: a checkpoint's own dtype, a model object's as it is).
    """

    __name__ = "reward_model"
    reads_text = True  # it scores prompt + completion as one text (a chat prompt rendered by the template)

    def __init__(
        self, model_or_path, *, tokenizer=None, batch_size: int = 16, device="cpu", max_length=None,
        dtype: str = "float32",
    ):
        from gspo.models import DTYPES, resolve_device

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
            raise ValueError(f"max_length must be None or an int >= 1, got {max_length!r}")
        if isinstance(model_or_path, (str, bytes)) or hasattr(model_or_path, "__fspath__"):
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            model = AutoModelForSequenceClassification.from_pretrained(model_or_path, dtype=DTYPES[dtype])
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(model_or_path)
        else:
            model = model_or_path
            if tokenizer is None:
                raise ValueError("tokenizer is required when model_or_path is a model object, not a path")
        num_labels = getattr(model.config, "num_labels", None)
        if num_labels != 1:
            raise ValueError(
                f"model_or_path must be a reward model with num_labels == 1, got num_labels={num_labels}"
            )
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise ValueError("tokenizer has neither a pad token nor an eos token to pad with")
            tokenizer.pad_token = tokenizer.eos_token
        # HF classifiers find each row's last real token by comparing ids with config.pad_token_id.
        model.config.pad_token_id = tokenizer.pad_token_id
        device = resolve_device(device) if isinstance(device, str) else torch.device(device)
        self.model = model.to(device=device, **({} if dtype == "auto" else {"dtype": DTYPES[dtype]})).eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.device = device
        self.max_length = max_length

    def __call__(self, prompts: list[str], completions: list[str], **_) -> list[float | None]:
        if len(prompts) != len(completions):
            raise ValueError(f"prompts has {len(prompts)} entries but completions has {len(completions)}")
        texts = [p + c for p, c in zip(prompts, completions)]
        scores: list[float | None] = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(
                    texts[start : start + self.batch_size],
                    return_tensors="pt",
                    padding=True,
                    padding_side="right",  # real tokens keep positions 0..len-1 without position_ids
                    truncation=self.max_length is not None,
                    max_length=self.max_length,
                ).to(self.device)
                logits = self.model(**enc).logits  # (b, 1)
                scores.extend(logits[:, 0].float().tolist())
        return scores


def code_tests(prompts: list[str], completions: list[str], **columns) -> list[float | None]:
    """1.0 where the completion's Python program passes the `tests` column in a sandbox, else 0.0.

    See gspo.data.sandbox (imported on first use, so importing this module stays light).
    """
    from gspo.data.sandbox import code_tests as sandboxed

    return sandboxed(prompts, completions, **columns)


code_tests = reads_text(code_tests)

_BUILTINS: dict[str, RewardFn] = {
    "answer_match": answer_match,
    "math": math_reward,
    "format": format_reward,
    "code_tests": code_tests,
    "last_number": last_number,
}


def reward_options(cfg) -> dict:
    """The keyword arguments of `get_reward_fn` that a config sets: code_tests' sandbox, a reward model's place."""
    return {"sandbox": cfg.sandbox, "rm_device": getattr(cfg, "reward_model_device", "cpu"),
            "rm_dtype": getattr(cfg, "reward_model_dtype", "float32")}


def get_reward_fn(spec, *, sandbox: str = "os", rm_device: str = "cpu", rm_dtype: str = "float32") -> RewardFn:
    """A reward function from a spec.

    Specs: a built-in name ("answer_match", "math": math-verify against the `answer` column,
    "format", "code_tests": sandboxed Python run against the `tests` column, see
    gspo.data.sandbox); "rm:<path>", a sequence-classification
    reward model saved at <path> (scored on `rm_device` in `rm_dtype`, or pass a RewardModelReward object);
    a user's "package.module:function" (found on sys.path, else in the working directory, as `python -m`
    finds it) or "path/to/file.py:function"; or, from Python, the callable itself.
    `sandbox` ("os" or "weak") is the isolation code_tests gets; with "os" a machine that offers
    no operating-system boundary refuses code_tests here, before any training.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward spec must be a non-empty str, got {spec!r}")
    if is_marker(spec):  # an instance or lambda a run was given from Python (reward_spec)
        raise not_rebuildable("reward", spec, "pass the same reward functions again (gspo.Trainer(reward_funcs=...)), "
                                              "or name importable ones as 'module:function'")
    if spec == "code_tests":
        from gspo.data.sandbox import code_reward

        return code_reward(sandbox)
    if spec == "math":
        try:
            import math_verify  # noqa: F401  (checked here, before any training)
        except ImportError:
            raise ValueError(_NEEDS_MATH_VERIFY) from None
    if spec in _BUILTINS:
        return _BUILTINS[spec]
    if spec.startswith("rm:"):
        return RewardModelReward(spec[3:], device=rm_device, dtype=rm_dtype)
    if ":" not in spec:
        raise ValueError(
            f"unknown reward {spec!r}: use a built-in ({', '.join(sorted(_BUILTINS))}) "
            "or an import path 'package.module:function'"
        )
    module_name, _, attr = spec.partition(":")
    if spec.rpartition(":")[0].endswith(".py"):  # a file: "my_rewards.py:fn", "path/to/rewards.py:fn"
        module_name, _, attr = spec.rpartition(":")
        if not Path(module_name).is_file():
            raise ValueError(f"reward {spec!r}: file {module_name} not found (relative to {Path.cwd()})")
    try:
        module = _import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r}: {err}") from err
    except (Exception, SystemExit) as err:  # the module's own code failed as it ran: name where
        raise ValueError(f"reward {spec!r}: importing module {module_name!r} raised {type(err).__name__}: {err} "
                         f"({_raised_at(err)})") from err
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {attr!r} is not callable")
    return fn


def _import_module(name: str):
    """The module of a reward spec: a file path ending in .py, or a module name found on sys.path or else in the
    working directory, as `python -m` would find it (the `gspo` script's sys.path holds its own folder instead).
    The folder found is appended to sys.path, for the module's own imports of its neighbours; appended, so that
    a neighbour named like an installed package never shadows it."""
    if name.endswith(".py"):
        path = Path(name).resolve()
        known = sys.modules.get(path.stem)
        if known is not None and Path(getattr(known, "__file__", None) or "/").resolve() == path:
            return known  # a second function of the same file
        _importable(path.parent)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        owned = sys.modules.setdefault(path.stem, module) is module  # for pickle, dataclasses, the next spec
        try:
            spec.loader.exec_module(module)
        except BaseException:
            if owned:
                del sys.modules[path.stem]
            raise
        return module
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        top = name.partition(".")[0]
        if err.name != top or not any((Path.cwd() / f).exists() for f in (f"{top}.py", top)):
            raise  # not a module of the working directory (or one that imports a missing module)
    _importable(Path.cwd())
    return importlib.import_module(name)


def _importable(folder: Path) -> None:
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
        importlib.invalidate_caches()


def _raised_at(err: BaseException) -> str:
    """'<file> line <n>': the innermost frame of `err`'s traceback (a SyntaxError: its own file and line)."""
    if isinstance(err, SyntaxError):
        return f"{err.filename} line {err.lineno}"
    frames = traceback.extract_tb(err.__traceback__)
    return f"{frames[-1].filename} line {frames[-1].lineno}" if frames else "no traceback"


def reward_spec(fn) -> str:
    """The spec a saved config records for a reward function: a spec string unchanged; a callable by the
    import path `get_reward_fn` reads back to that very function ("module:qualname"), else by its built-in
    name; an instance, a lambda or a nested function as "object:module:name" (gspo.given), which names it
    but is refused when read back without it."""
    if isinstance(fn, str):
        return fn
    module, name = getattr(fn, "__module__", None) or type(fn).__module__, getattr(fn, "__qualname__", None)
    if name is not None and getattr(sys.modules.get(module), name, None) is fn:
        return f"{module}:{name}"
    builtin = [key for key, value in _BUILTINS.items() if value is fn]
    return builtin[0] if builtin else marker(f"{module}:{name or type(fn).__qualname__ + '(...)'}")


def _fn_name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _short(text, limit: int = 200) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RewardError(RuntimeError):
    """A reward function failed: it raised, exited, or did not return within the time limit.

    The message names the function and, where one is to blame, the sample.
    """


_TIMED_OUT = object()  # _call's error when the function did not return in time


def _call(fn, prompts, completions, columns, timeout_s):
    """`fn` on deep copies of its inputs (a reward cannot alter the rollout): (value, error).

    error is None, the BaseException it raised (SystemExit and KeyboardInterrupt included), or
    `_TIMED_OUT`. With a timeout the call runs in a daemon thread, so a hung function can be left
    behind (Python cannot stop a thread: it keeps running in the background); without one it runs
    here, in the caller's thread. A function stuck in C code that holds the GIL cannot be left
    behind either way (see `score_completions`).
    """
    args = copy.deepcopy((prompts, completions, columns))
    box: dict = {}

    def target():
        try:
            if _by_keyword(fn):
                box["value"] = fn(prompts=args[0], completions=args[1], **args[2])
            else:  # a function with its own names for the two, e.g. `lambda p, c, **_`
                box["value"] = fn(args[0], args[1], **args[2])
        except BaseException as exc:  # noqa: B036 - reported to the trainer, which decides
            if getattr(exc, "stops_the_run", False):  # the trainer's own signal handling (gspo.run), not fn's
                raise
            box["error"] = exc

    if not timeout_s:
        target()
    else:
        worker = threading.Thread(target=target, name=f"gspo-reward-{_fn_name(fn)}", daemon=True)
        with _gil_watchdog(timeout_s):  # armed first: even start() waits for the GIL
            worker.start()
            worker.join(timeout_s)  # interruptible: a signal handler that raises ends the wait
        if worker.is_alive():
            return None, _TIMED_OUT
    return box.get("value"), box.get("error")


@contextlib.contextmanager
def _gil_watchdog(timeout_s: float):
    """Last resort for a function stuck in C code that holds the GIL (a catastrophic regex, say):
    no Python thread, signal handler included, runs again, so the wait above never returns.
    faulthandler's watchdog is a C thread: past 2 x timeout_s + 5 s it prints every thread's
    stack and ends the process with status 1. Disarmed as soon as the wait returns."""
    try:
        stream = sys.__stderr__
        stream.fileno()  # faulthandler writes to a file descriptor
    except (AttributeError, OSError, ValueError):  # no real stderr (pythonw, some embedders): no watchdog
        yield
        return
    faulthandler.dump_traceback_later(2 * timeout_s + 5, exit=True, file=stream)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def score_completions(
    reward_fns: list,
    weights: list[float] | None,
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
    *,
    drop_bad: bool = False,
    timeout_s: float | None = None,
    chat: list | None = None,
    completion_ids: list[list[int]] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Run every reward fn; return total rewards (N,) float32 and each fn's raw values (N,).

    total[i] = sum_k weights[k] * r_k[i] over the functions that gave a value for sample i (None is
    skipped; a sample every function skipped gets 0.0). Raw values hold NaN for None and are keyed
    by `__name__`, with "_2", "_3", ... added when names clash. Each function gets deep copies of
    prompts, completions and columns, so editing them in place changes nothing here.

    `timeout_s` (None or 0: no limit) bounds each call: a function that has not returned by then
    is abandoned. A function that raises is rerun sample by sample, one after another, to find the
    offending prompt/completion; one that times out is rerun on every sample at once (up to 8
    threads, one shared deadline), to find the samples it hangs on. By default a failing sample,
    or a value float32 cannot hold (NaN, inf, 1e39, 10**400; or a weighted total beyond it), is a
    `RewardError`/ValueError naming the function and the sample; with
    `drop_bad` the sample's total is NaN instead (the trainer leaves it out, and counts it). Always
    errors: a function that fails on every sample (a bug in it, not bad samples), one that fails on
    the batch but on no single sample, SystemExit / KeyboardInterrupt / other BaseExceptions (a
    reward must return, not end the run), and a wrong number or type of values.

    `chat` (each sample's prompt as chat messages, `gspo.data.rows.chat_prompts`) switches the
    functions not marked `reads_text` to TRL's conversational format; `completion_ids` (each
    completion's token ids) reach the functions that take them.
    """
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"prompts has {len(prompts)} entries but completions has {n}")
    if not reward_fns:
        raise ValueError("reward_fns must contain at least one reward function")
    for name, values in columns.items():
        if len(values) != n:
            raise ValueError(
                f"column {name!r} has {len(values)} entries, expected {n} (one per completion)"
            )
    clash = sorted({"prompts", "completions", "completion_ids"} & set(columns))
    if clash:
        raise ValueError(f"dataset column(s) {clash} clash with the reward call's own arguments; rename them")
    for name, given in (("chat", chat), ("completion_ids", completion_ids)):
        if given is not None and len(given) != n:
            raise ValueError(f"{name} has {len(given)} entries, expected {n} (one per completion)")
    if weights is None:
        weights = [1.0] * len(reward_fns)
    if len(weights) != len(reward_fns):
        raise ValueError(f"weights has {len(weights)} entries but there are {len(reward_fns)} reward functions")
    if not all(isinstance(w, numbers.Real) and math.isfinite(w) for w in weights):
        raise ValueError(f"weights must be finite numbers, got {list(weights)}")

    raw: dict[str, Tensor] = {}
    weighted = []
    dropped = torch.zeros(n, dtype=torch.bool)  # (N,)
    for fn, weight in zip(reward_fns, weights):
        base = name = _fn_name(fn)
        suffix = 2
        while name in raw:
            name, suffix = f"{base}_{suffix}", suffix + 1
        fn_prompts, fn_completions, fn_columns = _inputs(fn, prompts, completions, columns, chat, completion_ids)
        out, error = _call(fn, fn_prompts, fn_completions, fn_columns, timeout_s)
        if error is not None:
            batch = _Failure(name, error, timeout_s, f"the batch of {n} samples")
            out = _one_by_one(fn, batch, fn_prompts, fn_completions, fn_columns, drop_bad, timeout_s)
        if not isinstance(out, (list, tuple)):
            raise ValueError(
                f"reward function {name!r} must return a list of {n} values, got {type(out).__name__}"
            )
        if len(out) != n:
            raise ValueError(
                f"reward function {name!r} returned {len(out)} values, expected {n} (one per completion)"
            )
        values = []
        for i, value in enumerate(out):
            if value is None:
                values.append(math.nan)
            elif isinstance(value, _Failure):
                values.append(math.nan)
                dropped[i] = True
            elif not isinstance(value, numbers.Real):
                raise ValueError(
                    f"reward function {name!r} returned {type(value).__name__} at sample {i}; "
                    "expected a float or None"
                )
            elif not abs(value) <= _F32_MAX:  # NaN, inf, or beyond float32 (1e39, 10**400): compared, not converted
                if not drop_bad:
                    where = _sample(i, prompts, completions)
                    problem = (f"returned non-finite {value} at {where}" if _is_nonfinite(value)
                               else f"returned {_show(value)} at {where}, {_BEYOND}")
                    raise ValueError(f"reward function {name!r} {problem}; return None for 'no opinion', or set "
                                     "drop_bad_rewards to drop such samples")
                values.append(math.nan)
                dropped[i] = True
            else:
                values.append(float(value))
        raw[name] = torch.tensor(values, dtype=torch.float32)  # (N,) NaN where None
        weighted.append(torch.tensor(values, dtype=torch.float64) * float(weight))  # (N,)
    total64 = torch.nansum(torch.stack(weighted), dim=0)  # (N,) all-None samples sum to 0.0
    beyond = (total64.abs() > _F32_MAX) & ~dropped  # (N,) a weighted sum float32 would make inf
    if beyond.any() and not drop_bad:
        i = int(beyond.nonzero()[0])
        raise ValueError(f"{_sample(i, prompts, completions)} has the weighted reward "
                         f"{float(total64[i]):g} (reward_weights {list(weights)}), {_BEYOND}; lower reward_weights, "
                         "or set drop_bad_rewards to drop such samples")
    total = total64.float()  # (N,)
    total[dropped | beyond] = math.nan
    return total, raw


_F32_MAX = float(torch.finfo(torch.float32).max)  # rewards are float32 tensors: a larger one would become inf
_BEYOND = "beyond float32's range (|r| <= 3.4e+38)"


def _is_nonfinite(value) -> bool:
    try:
        return not math.isfinite(value)
    except OverflowError:  # an int too large for a float is finite
        return False


def _show(value) -> str:
    """A reward value for a message: an int too long to print whole by its number of digits."""
    if isinstance(value, numbers.Integral) and abs(value) > 10**20:
        try:
            return f"an int of {len(str(abs(int(value))))} digits"
        except ValueError:  # past Python's limit on printing ints
            return "an int of over 4300 digits"
    try:
        return repr(float(value))
    except OverflowError:
        return f"a {type(value).__name__} beyond float's range"


def _inputs(fn, prompts, completions, columns, chat, completion_ids) -> tuple[list, list, dict]:
    """What `fn` is called with: text, or TRL's conversational format where the prompts were chats
    (unless `fn` reads text); `completion_ids` added where its signature takes them."""
    if chat is not None and not getattr(fn, "reads_text", False):
        prompts = chat
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    if completion_ids is not None and _takes(fn, "completion_ids"):
        columns = {**columns, "completion_ids": completion_ids}
    return prompts, completions, columns


def _by_keyword(fn) -> bool:
    """TRL calls rewards with keywords (`def f(completions, **kwargs)` is the common form): so does
    gspo where `fn` names a `completions` parameter or takes no positional one; else positionally."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return any(p.name == "completions" and p.kind is not p.POSITIONAL_ONLY for p in params) or not positional


def _takes(fn, name: str) -> bool:
    """Whether `fn` accepts a keyword `name` (a parameter of that name, or **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature: do not guess
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == name and p.kind is not p.POSITIONAL_ONLY) for p in params)


class _Failure:
    """One failed call of a reward function: what it raised, or that it timed out, and on what."""

    def __init__(self, name: str, error, timeout_s, where: str):
        self.name, self.error, self.timeout_s, self.where = name, error, timeout_s, where

    @property
    def fatal(self) -> bool:
        """SystemExit, KeyboardInterrupt and the like: never a bad sample, always an error."""
        return self.error is not _TIMED_OUT and not isinstance(self.error, Exception)

    def message(self) -> str:
        if self.error is _TIMED_OUT:
            return (f"reward function {self.name!r} did not return within reward_timeout_s={self.timeout_s:g} s "
                    f"on {self.where}")
        what = f"{type(self.error).__name__}: {self.error}" if str(self.error) else type(self.error).__name__
        if self.fatal:
            return (f"reward function {self.name!r} raised {what} on {self.where}: a reward function must return "
                    "its values, not exit or interrupt the run")
        return f"reward function {self.name!r} raised {what} on {self.where}"


def _sample(i: int, prompts, completions) -> str:
    return f"sample {i} (prompt={_short(prompts[i])}, completion={_short(completions[i])})"


def _one_by_one(fn, batch: _Failure, prompts, completions, columns, drop_bad: bool, timeout_s) -> list:
    """Rerun `fn` per sample after it failed on the batch: find the offending sample(s)."""
    if batch.fatal:
        raise RewardError(batch.message()) from batch.error
    n = len(completions)
    one = [([prompts[i]], [completions[i]], {k: [v[i]] for k, v in columns.items()}) for i in range(n)]
    if batch.error is _TIMED_OUT:
        results = _probe_at_once(fn, one, timeout_s)
    else:
        results = [_call(fn, *args, timeout_s) for args in one]
    out = []
    for i, (value, error) in enumerate(results):
        if error is None and not (isinstance(value, (list, tuple)) and len(value) == 1):
            error = ValueError(f"returned {value!r:.80} for a single sample (expected a list of one value)")
        if error is None:
            out.append(value[0])
            continue
        failure = _Failure(batch.name, error, timeout_s, _sample(i, prompts, completions))
        if failure.fatal:
            raise RewardError(failure.message()) from error
        if not drop_bad:
            raise RewardError(failure.message() + "; fix the function, or set drop_bad_rewards=true to drop such "
                              "samples" + _ABANDONED * (error is _TIMED_OUT)) from (None if error is _TIMED_OUT else error)
        out.append(failure)
    if all(isinstance(v, _Failure) for v in out):
        raise RewardError(f"{batch.message()}, and on every one of the {n} samples alone (first: "
                          f"{out[0].message()}): a bug in the function rather than bad samples"
                          + _ABANDONED * (batch.error is _TIMED_OUT)) from None
    if not any(isinstance(v, _Failure) for v in out):
        hint = "; raise reward_timeout_s" + _ABANDONED if batch.error is _TIMED_OUT else ""
        raise RewardError(f"{batch.message()}, but on no sample alone{hint}") from (
            None if batch.error is _TIMED_OUT else batch.error)
    return out


_ABANDONED = " (a call that timed out is abandoned: Python cannot stop its thread, which may still run)"


def _probe_at_once(fn, calls: list, timeout_s) -> list:
    """`_call` results of `fn` on each sample, up to 8 at a time in daemon threads, all by one deadline.

    Calls not finished by the deadline read as timed out (and are left running).
    """
    results = [(None, _TIMED_OUT)] * len(calls)
    todo, lock, finished = list(range(len(calls)))[::-1], threading.Lock(), threading.Semaphore(0)

    def work():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            results[i] = _call(fn, *calls[i], None)  # already in a thread of its own
            finished.release()

    deadline = time.monotonic() + timeout_s
    with _gil_watchdog(timeout_s):
        for _ in range(min(8, len(calls))):
            threading.Thread(target=work, name=f"gspo-reward-probe-{_fn_name(fn)}", daemon=True).start()
        for _ in calls:
            if not finished.acquire(timeout=max(0.0, deadline - time.monotonic())):
                break
    return list(results)
