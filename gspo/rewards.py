"""Reward functions: the protocol, built-in verifiers, a reward-model scorer, and batch scoring.

Protocol: `fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]`.
Extra dataset columns arrive as keyword lists aligned with `prompts`; None means "no opinion"
and is skipped when rewards are combined. Metrics use the function's `__name__`.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = [
    "answer_match",
    "format_reward",
    "make_regex_reward",
    "RewardModelReward",
    "get_reward_fn",
    "score_completions",
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
    return regex_reward


# 1.0 iff the completion ends with "#### <number>", optionally followed by whitespace.
format_reward = make_regex_reward(rf"(?s).*{_MARKER}\s*{_NUMBER}\s*", "format")


class RewardModelReward:
    """Scores `prompt + completion` with a sequence-classification reward model (num_labels == 1).

    `model_or_path`: a path loadable by `AutoModelForSequenceClassification` (its tokenizer is
    loaded from the same path unless `tokenizer` is given), or a model object plus `tokenizer`.
    Returns `logits[:, 0]` per text. Texts are right-padded (HF classifiers pool the last
    non-pad token); a tokenizer without a pad token pads with eos, so texts should not end in eos.
    With `max_length`, texts are truncated on the tokenizer's `truncation_side`.
    """

    __name__ = "reward_model"

    def __init__(
        self, model_or_path, *, tokenizer=None, batch_size: int = 16, device="cpu", max_length=None
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
            raise ValueError(f"max_length must be None or an int >= 1, got {max_length!r}")
        if isinstance(model_or_path, (str, bytes)) or hasattr(model_or_path, "__fspath__"):
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            model = AutoModelForSequenceClassification.from_pretrained(model_or_path)
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
        self.model = model.to(device).eval()
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

    See gspo.sandbox (imported on first use, so importing this module stays light).
    """
    from gspo.sandbox import code_tests as sandboxed

    return sandboxed(prompts, completions, **columns)


_BUILTINS: dict[str, RewardFn] = {
    "answer_match": answer_match,
    "format": format_reward,
    "code_tests": code_tests,
}


def get_reward_fn(spec) -> RewardFn:
    """A reward function from a spec.

    Specs: a built-in name ("answer_match", "format", "code_tests": sandboxed Python run against
    the `tests` column, see gspo.sandbox); "rm:<path>", a sequence-classification
    reward model saved at <path> (scored on the CPU, or pass a RewardModelReward object);
    a user's "package.module:function"; or, from Python, the callable itself.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward spec must be a non-empty str, got {spec!r}")
    if spec in _BUILTINS:
        return _BUILTINS[spec]
    if spec.startswith("rm:"):
        return RewardModelReward(spec[3:])
    if ":" not in spec:
        raise ValueError(
            f"unknown reward {spec!r}: use a built-in ({', '.join(sorted(_BUILTINS))}) "
            "or an import path 'package.module:function'"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r}: {err}") from err
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {attr!r} is not callable")
    return fn


def _fn_name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _short(text, limit: int = 200) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def score_completions(
    reward_fns: list,
    weights: list[float] | None,
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
    *,
    drop_bad: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Run every reward fn; return total rewards (N,) float32 and each fn's raw values (N,).

    total[i] = sum_k weights[k] * r_k[i] over the functions that gave a value for sample i (None is
    skipped; a sample every function skipped gets 0.0). Raw values hold NaN for None and are keyed
    by `__name__`, with "_2", "_3", ... added when names clash.

    A function that raises is rerun sample by sample to find the offending prompt/completion.
    By default that, or a NaN/inf value, is an error naming the function and the sample; with
    `drop_bad` the sample's total is NaN instead (the trainer then leaves it out, and counts it).
    A wrong number or type of values is always an error: that is a bug in the function.
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
        try:
            out = fn(prompts, completions, **columns)
        except Exception as err:
            out = _one_by_one(fn, name, err, prompts, completions, columns, drop_bad)
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
            elif isinstance(value, _Failed):
                values.append(math.nan)
                dropped[i] = True
            elif not isinstance(value, numbers.Real):
                raise ValueError(
                    f"reward function {name!r} returned {type(value).__name__} at sample {i}; "
                    "expected a float or None"
                )
            elif not math.isfinite(value):
                if not drop_bad:
                    raise ValueError(
                        f"reward function {name!r} returned non-finite {value} at sample {i} "
                        f"(prompt={_short(prompts[i])}, completion={_short(completions[i])}); "
                        "return None for 'no opinion', or set drop_bad_rewards to drop such samples"
                    )
                values.append(math.nan)
                dropped[i] = True
            else:
                values.append(float(value))
        raw[name] = torch.tensor(values, dtype=torch.float32)  # (N,) NaN where None
        weighted.append(torch.tensor(values, dtype=torch.float64) * float(weight))  # (N,)
    total = torch.nansum(torch.stack(weighted), dim=0).float()  # (N,) all-None samples sum to 0.0
    total[dropped] = math.nan
    return total, raw


class _Failed:
    """Marks a sample on which a reward function raised (dropped under `drop_bad`)."""


def _one_by_one(fn, name, err, prompts, completions, columns, drop_bad: bool) -> list:
    """Rerun `fn` per sample after it raised on the batch: find the offending sample(s)."""
    out = []
    for i in range(len(completions)):
        try:
            value = fn([prompts[i]], [completions[i]], **{k: [v[i]] for k, v in columns.items()})
            out.append(value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else _Failed())
        except Exception as sample_err:
            if not drop_bad:
                raise RuntimeError(
                    f"reward function {name!r} raised {type(sample_err).__name__}: {sample_err}; on sample {i}: "
                    f"prompt={_short(prompts[i])}, completion={_short(completions[i])}"
                ) from sample_err
            out.append(_Failed())
    if not drop_bad or all(isinstance(v, _Failed) for v in out):
        # It raised on the batch but not on any single sample (or on every one): report the batch error.
        raise RuntimeError(f"reward function {name!r} raised {type(err).__name__}: {err} "
                           f"(on the batch of {len(completions)} samples)") from err
    return out
