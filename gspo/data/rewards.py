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

Here: the built-in functions and their registry, the reward-model scorer, `get_reward_fn` and
`reward_spec`. Re-exported from beside it: `score_completions` and `RewardError` (running the
functions, gspo.data.reward_scoring) and `import_reward_fn` (users' "module:function" specs,
gspo.data.reward_import).
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import threading
from collections.abc import Callable, Sequence

import torch

from gspo.data.reward_import import import_reward_fn
from gspo.data.reward_scoring import RewardError, score_completions
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
    time limits (5 s a parse or comparison) use signal.alarm, which works only on the main thread: they
    are on there (where gspo calls rewards, reward_timeout_s or not) and off on another thread (gspo's
    API called from one), where reward_timeout_s alone bounds the call.
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

    See gspo.sandbox.runner (imported on first use, so importing this module stays light).
    """
    from gspo.sandbox.runner import code_tests as sandboxed

    return sandboxed(prompts, completions, **columns)


code_tests = reads_text(code_tests)

def overlong_penalty(length: int, max_length: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong penalty (arXiv 2503.14476, sec. 3.4) of one answer of `length` tokens: 0 up to
    `max_length - buffer` tokens, then falling linearly by `factor / buffer` a token, to -`factor` at
    `max_length` (and beyond it). Example: max_length 10, buffer 4, factor 1: lengths 6, 7, 8, 10 -> 0, -0.25,
    -0.5, -1."""
    free = max_length - buffer  # tokens an answer may take before the penalty starts
    return 0.0 - factor * min(max(length - free, 0), buffer) / buffer  # 0.0 - x: 0 where x is 0, not -0.0


class OverlongReward:
    """The soft overlong penalty as a reward function (`overlong_penalty: {buffer, factor}` adds it to a run's
    reward_funcs with weight 1): each completion's penalty from its token count, logged as reward/overlong."""

    __name__ = "overlong"

    def __init__(self, max_length: int, buffer: int, factor: float):
        if not 1 <= buffer <= max_length:
            raise ValueError(f"overlong_penalty: buffer={buffer!r} must be between 1 and max_completion_length "
                             f"({max_length})")
        if not (math.isfinite(factor) and factor >= 0):
            raise ValueError(f"overlong_penalty: factor={factor!r} must be a finite number >= 0")
        self.max_length, self.buffer, self.factor = max_length, buffer, float(factor)

    def __call__(self, prompts, completions, completion_ids, **_) -> list[float]:
        return [overlong_penalty(len(ids), self.max_length, self.buffer, self.factor) for ids in completion_ids]


def overlong_terms(rewards, max_length: int) -> list:
    """The reward terms a run (its RewardSettings `rewards`) adds to every task's functions, as (function, weight):
    DAPO's soft overlong penalty (`overlong_penalty`, weight 1: its factor is its scale), or none."""
    if rewards.overlong_penalty is None:
        return []
    return [(OverlongReward(max_length, **rewards.overlong_penalty), 1.0)]


def with_terms(settings, terms: list):
    """`settings` (a RewardSettings or a TaskSpec) with `terms` appended to its reward functions and weights."""
    if not terms:
        return settings
    weights = settings.reward_weights or [1.0] * len(settings.reward_funcs)
    return dataclasses.replace(settings, reward_funcs=[*settings.reward_funcs, *(fn for fn, _ in terms)],
                               reward_weights=[*weights, *(w for _, w in terms)])


def environment(prompts: list[str], completions: list[str], env_reward: list | None = None,
                **_) -> list[float | None]:
    """The sum of the environment's step rewards over each episode (None where it gave none): the reward of
    multi-turn runs whose environment scores the episode itself (gspo/env)."""
    if env_reward is None:
        raise ValueError("reward 'environment' reads the rewards an environment gives; this run has no environment "
                         "(set `environment`, or use another reward)")
    return list(env_reward)


_BUILTINS: dict[str, RewardFn] = {
    "environment": environment,
    "answer_match": answer_match,
    "math": math_reward,
    "format": format_reward,
    "code_tests": code_tests,
    "last_number": last_number,
}


def reward_options(rewards) -> dict:
    """The keyword arguments of `get_reward_fn` that a RewardSettings sets: code_tests' sandbox, a reward model's
    place."""
    return {"sandbox": rewards.sandbox, "rm_device": rewards.reward_model_device,
            "rm_dtype": rewards.reward_model_dtype}


def get_reward_fn(spec, *, sandbox: str = "os", rm_device: str = "cpu", rm_dtype: str = "float32") -> RewardFn:
    """A reward function from a spec.

    Specs: a built-in name ("answer_match", "math": math-verify against the `answer` column,
    "format", "code_tests": sandboxed Python run against the `tests` column, see
    gspo.sandbox.runner); "rm:<path>", a sequence-classification
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
        from gspo.sandbox.runner import code_reward

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
    return import_reward_fn(spec)


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
