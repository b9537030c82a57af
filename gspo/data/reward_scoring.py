"""Batch scoring: every reward function run on a batch, their weighted total, and their failures.

`score_completions` calls each function (on copies of its inputs, under a time limit: on the main
thread, interrupted there when its time is up, see gspo.data.reward_timeout), checks its values
(None, NaN, inf, beyond float32), and reruns it sample by sample after a failure to name the
offending sample; `RewardError` is what it raises. Re-exported by gspo.data.rewards, which holds
the protocol the functions follow.
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
import threading
import time

import torch
from torch import Tensor

from gspo.data.reward_timeout import TimeUp, call_limited, gil_watchdog, interruptible

__all__ = ["RewardError", "reward_names", "score_completions"]


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
    `_TIMED_OUT`. Without a timeout the call runs here, in the caller's thread; with one it runs here
    too on the main thread, interrupted when its time is up, and elsewhere in a daemon thread that is
    left behind then (gspo.data.reward_timeout.call_limited).
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
            if getattr(exc, "stops_the_run", False) or isinstance(exc, TimeUp):  # the trainer's signals, the deadline
                raise
            box["error"] = exc

    if not timeout_s:
        target()
    elif call_limited(target, timeout_s, _fn_name(fn)):
        return None, _TIMED_OUT
    return box.get("value"), box.get("error")


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
    is stopped (on the main thread, where it runs: rewards that set signal handlers, as math-verify
    does, work there) or abandoned in its own thread (called from another thread). A function that
    raises is rerun sample by sample, one after another, to find the offending prompt/completion;
    one that times out is rerun on every sample at once (up to 8 threads, one shared deadline), to
    find the samples it hangs on (those that fail in a thread for want of the main thread are rerun
    on it, one after another). By default a failing sample,
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
    weights = _checked_inputs(reward_fns, weights, prompts, completions, columns, chat, completion_ids)
    raw: dict[str, Tensor] = {}
    weighted = []
    dropped = torch.zeros(n, dtype=torch.bool)  # (N,)
    for fn, weight, name in zip(reward_fns, weights, reward_names(reward_fns)):
        fn_prompts, fn_completions, fn_columns = _inputs(fn, prompts, completions, columns, chat, completion_ids)
        out, error = _call(fn, fn_prompts, fn_completions, fn_columns, timeout_s)
        if error is not None:
            batch = _Failure(name, error, timeout_s, f"the batch of {n} samples")
            out = _one_by_one(fn, batch, fn_prompts, fn_completions, fn_columns, drop_bad, timeout_s)
        values = _checked_values(name, out, dropped, drop_bad, prompts, completions)
        raw[name] = torch.tensor(values, dtype=torch.float32)  # (N,) NaN where None
        weighted.append(torch.tensor(values, dtype=torch.float64) * float(weight))  # (N,)
    return _weighted_total(weighted, dropped, drop_bad, weights, prompts, completions), raw


def _checked_inputs(reward_fns, weights, prompts, completions, columns, chat, completion_ids) -> list[float]:
    """`score_completions`' inputs checked (one entry per completion everywhere); the weights (default: 1 each)."""
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
    return weights


def reward_names(reward_fns: list) -> list[str]:
    """The names `score_completions` gives the functions' values (reward/<name>): each `__name__`, with "_2",
    "_3", ... added while a function before it holds the name. Example: [math, format, math] -> math, format,
    math_2."""
    names: list[str] = []
    for fn in reward_fns:
        base = name = _fn_name(fn)
        suffix = 2
        while name in names:
            name, suffix = f"{base}_{suffix}", suffix + 1
        names.append(name)
    return names


def _checked_values(name: str, out, dropped: Tensor, drop_bad: bool, prompts, completions) -> list[float]:
    """One function's values as floats (NaN for None and for dropped samples, which are marked in `dropped`).

    A wrong number or type of values is a ValueError; so is a value float32 cannot hold, unless `drop_bad`.
    """
    n = len(completions)
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
        elif isinstance(converted := _as_float(value), float) and abs(converted) <= _F32_MAX:
            values.append(converted)
        elif drop_bad:  # NaN, inf, beyond float32 (1e39, 10**400), or a value float() fails on
            values.append(math.nan)
            dropped[i] = True
        else:
            raise ValueError(f"reward function {name!r} {_bad_value(value, converted, i, prompts, completions)}; "
                             "return None for 'no opinion', or set drop_bad_rewards to drop such samples")
    return values


def _weighted_total(weighted: list[Tensor], dropped: Tensor, drop_bad: bool, weights, prompts,
                    completions) -> Tensor:
    """The (N,) float32 total of the functions' weighted (N,) float64 values: NaN where dropped, or where the sum
    is beyond float32 and `drop_bad` (else that is a ValueError)."""
    total64 = torch.nansum(torch.stack(weighted), dim=0)  # (N,) all-None samples sum to 0.0
    beyond = (total64.abs() > _F32_MAX) & ~dropped  # (N,) a weighted sum float32 would make inf
    if beyond.any() and not drop_bad:
        i = int(beyond.nonzero()[0])
        raise ValueError(f"{_sample(i, prompts, completions)} has the weighted reward "
                         f"{float(total64[i]):g} (reward_weights {list(weights)}), {_BEYOND}; lower reward_weights, "
                         "or set drop_bad_rewards to drop such samples")
    total = total64.float()  # (N,)
    total[dropped | beyond] = math.nan
    return total


_F32_MAX = float(torch.finfo(torch.float32).max)  # rewards are float32 tensors: a larger one would become inf
_BEYOND = "beyond float32's range (|r| <= 3.4e+38)"


def _as_float(value) -> float | BaseException | None:
    """float(value); inf for an int beyond float's range; the exception where the value's own conversion fails."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf
    except Exception as err:  # a value's own __float__ is user code: its error goes into the message
        return err


def _bad_value(value, converted, i: int, prompts, completions) -> str:
    where = _sample(i, prompts, completions)
    if isinstance(converted, BaseException):
        return (f"returned {type(value).__name__} at {where}, which cannot be read as a float "
                f"({type(converted).__name__}: {converted})")
    if _is_nonfinite(value):
        return f"returned non-finite {value} at {where}"
    return f"returned {_show(value)} at {where}, {_BEYOND}"


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
            cause = None if error is _TIMED_OUT else error
            raise RewardError(failure.message() + "; fix the function, or set drop_bad_rewards=true to drop such "
                              "samples" + _ABANDONED * (error is _TIMED_OUT) + _main_thread_hint(error)) from cause
        out.append(failure)
    if all(isinstance(v, _Failure) for v in out):
        raise RewardError(f"{batch.message()}, and on every one of the {n} samples alone (first: "
                          f"{out[0].message()}): a bug in the function rather than bad samples"
                          + _ABANDONED * (batch.error is _TIMED_OUT) + _main_thread_hint(out[0].error)) from None
    if not any(isinstance(v, _Failure) for v in out):
        hint = "; raise reward_timeout_s" + _ABANDONED if batch.error is _TIMED_OUT else ""
        raise RewardError(f"{batch.message()}, but on no sample alone{hint}") from (
            None if batch.error is _TIMED_OUT else batch.error)
    return out


_ABANDONED = (" (a call that timed out in a thread of its own is abandoned: Python cannot stop a thread, which may "
              "still run)")


def _main_thread_hint(error) -> str:
    """What to do about a function that set a signal handler off the main thread (Python allows that nowhere else;
    math-verify's parse and verify do, for their own timeouts, and say so in an error of their own)."""
    while error is not None and error is not _TIMED_OUT:
        if isinstance(error, ValueError) and "signal only works in main thread" in str(error):
            return ("; it sets signal handlers (math-verify's timeouts do), which Python allows on the main thread "
                    "only: score from the main thread, as gspo's trainer does (or turn the function's own timeouts "
                    "off: math-verify's parsing_timeout=None, timeout_seconds=None)")
        error = error.__cause__ or error.__context__
    return ""


def _probe_at_once(fn, calls: list, timeout_s) -> list:
    """`_call` results of `fn` on each sample, up to 8 at a time in daemon threads, all by one deadline.

    Calls not finished by the deadline read as timed out (and are left running). On the main thread, calls
    that failed in a thread only because they set signal handlers are made again there, each under `timeout_s`.
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
    with gil_watchdog(timeout_s):
        for _ in range(min(8, len(calls))):
            threading.Thread(target=work, name=f"gspo-reward-probe-{_fn_name(fn)}", daemon=True).start()
        for _ in calls:
            if not finished.acquire(timeout=max(0.0, deadline - time.monotonic())):
                break
    if interruptible():  # what failed in a thread for want of the main thread: on it, one call after another
        return [_call(fn, *calls[i], timeout_s) if _main_thread_hint(error) else (value, error)
                for i, (value, error) in enumerate(results)]
    return list(results)
