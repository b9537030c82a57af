"""The registry of policy objectives: what each one receives (`LossInputs`), what the config needs to know of
it (`Objective`: defaults, rules, options) and the check of its options.

An objective's options are the keyword-only parameters of its loss function, with their defaults there (one
source of truth); `objective_options` checks a run's values for them (`objective_options` in the config,
`options=` of `policy_loss`). The built-in objectives are registered in gspo/algo/objectives.py.
"""

from __future__ import annotations

import difflib
import inspect
import math
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor

from gspo.algo.aggregation import AGGREGATIONS


@dataclass(frozen=True)
class LossInputs:
    """What every objective receives, prepared once by `policy_loss`: padding is already zeroed."""

    logp: Tensor  # (N, T) log pi_theta (carries the gradient), 0 on padding
    log_ratio: Tensor  # (N, T) log pi_theta - log pi_old, 0 on padding
    adv: Tensor  # (N,) or (N, T) advantages as given (detached)
    adv_t: Tensor  # (N, T) advantage of every token, 0 on padding
    mask: Tensor  # (N, T) bool, True on completion tokens
    maskf: Tensor  # (N, T) the mask in the log-probs' dtype
    lengths: Tensor  # (N,) completion tokens per sequence
    low: float | None  # ratio clipped to [1 - low, 1 + high]; None for an objective without a hard clip
    high: float | None
    aggregation: str  # one of AGGREGATIONS
    norm_length: int | None  # the constant divisor of seq_mean_token_sum_norm
    weight: Tensor | None = None  # (N, T) detached factor of a rollout correction (algo/correction.py), 0 on padding

    def weigh(self, per_tok: Tensor) -> Tensor:
        """(N, T) per-token terms times the rollout correction's factor (as they are without one)."""
        return per_tok if self.weight is None else per_tok * self.weight

    def weigh_seq(self, per_seq: Tensor) -> Tensor:
        """(N,) per-sequence terms times the correction's factor averaged over each sequence's tokens."""
        return per_seq if self.weight is None else per_seq * (self.weight.sum(-1) / self.lengths)  # 0 on padding


@dataclass(frozen=True)
class Objective:
    """A registered objective: its loss function and what the config needs to know of it."""

    loss: Callable[..., tuple[Tensor, dict[str, Tensor]]]  # (LossInputs, **options) -> (policy loss, stats)
    default_clip: tuple[float | None, float | None]  # (clip_low, clip_high); (None, None): no hard clip
    default_aggregation: str  # one of AGGREGATIONS
    length_neutral: bool  # a sequence-level objective: only seq_mean_token_mean keeps long answers from weighing more
    options: Mapping[str, object]  # option -> default: the keyword-only parameters of `loss` (read-only)
    ratio_unit: str = "tokens"  # what its `ratio/*` and `clip/*` stats average over: "tokens" or "sequences"
    corrects: bool = False  # applies a rollout correction's factor (LossInputs.weigh / weigh_seq) to its terms
    token_advantages: bool = True  # accepts (N, T) per-token advantages (GAE's) as well as (N,)
    log_clip: bool = False  # clip_low/clip_high bound the log-ratio to [-clip_low, clip_high] (gmpo)
    check_options: Callable[..., None] | None = None  # (**options) -> None, a ValueError for values it refuses


OBJECTIVES: dict[str, Objective] = {}
"""The registry, name -> Objective, in registration order; the config's allowed `objective` values."""


def register_objective(name: str, *, default_clip: tuple[float | None, float | None], default_aggregation: str,
                       length_neutral: bool = False, ratio_unit: str = "tokens", corrects: bool = False,
                       token_advantages: bool = True, log_clip: bool = False,
                       check_options: Callable[..., None] | None = None):
    """Decorator: register `loss(x: LossInputs, *, option=default, ...) -> (policy loss, stats)` as `name`.

    default_clip: (clip_low, clip_high) when the config leaves them unset; (None, None) for an objective
    without a hard clip (clip values are then refused); a default clip_low >= 1 means "no lower bound"
    and allows clip_low up to it. length_neutral: only seq_mean_token_mean is accepted (and the KL term is
    averaged the same way), so no sequence weighs more for being longer. `stats` holds 0-d tensors
    (`ratio/*`, `clip/*`); policy_loss adds `loss/*` and `kl/approx`. ratio_unit: what those stats
    average over ("tokens", or "sequences" for one ratio per sequence), so ranks can recombine them.
    corrects: the loss multiplies its per-token terms by `x.weigh(...)` (or per-sequence terms by
    `x.weigh_seq(...)`), so a rollout correction (rollout_correction) can be used with it.
    token_advantages: the loss takes (N, T) advantages too (`x.adv_t`), so advantage_estimator=gae
    (a critic's per-token advantages) can be used with it; False for one advantage per sequence.
    log_clip: clip_low/clip_high bound the log-ratio, [-clip_low, clip_high] (any values >= 0 mean something).
    The loss's keyword-only parameters are its options (each with a default; a run sets them with
    `objective_options`); check_options(**options) refuses values that mean nothing (a ValueError naming them).
    """
    if name in OBJECTIVES:
        raise ValueError(f"objective {name!r} is already registered")
    if default_aggregation not in AGGREGATIONS:
        raise ValueError(f"default_aggregation: unknown {default_aggregation!r}; "
                         f"choose one of {', '.join(AGGREGATIONS)}")
    if length_neutral and default_aggregation != "seq_mean_token_mean":
        raise ValueError("default_aggregation: a length-neutral objective aggregates with seq_mean_token_mean")
    if ratio_unit not in ("tokens", "sequences"):
        raise ValueError(f"ratio_unit: {ratio_unit!r} is not 'tokens' or 'sequences'")

    def add(loss):
        options = {p.name: p.default for p in inspect.signature(loss).parameters.values() if p.kind is p.KEYWORD_ONLY}
        missing = [k for k, v in options.items() if v is inspect.Parameter.empty]
        if missing:
            raise ValueError(f"objective {name!r}: option {missing[0]!r} needs a default (a keyword-only parameter "
                             "of the loss with a default value)")
        if check_options is not None:
            check_options(**options)  # the defaults themselves must pass
        OBJECTIVES[name] = Objective(loss, tuple(default_clip), default_aggregation, length_neutral,
                                     types.MappingProxyType(options), ratio_unit, corrects, token_advantages,
                                     log_clip, check_options)
        return loss

    return add


def unregister_objective(name: str) -> None:
    """Remove objective `name` from the registry (e.g. one a test registered)."""
    if OBJECTIVES.pop(name, None) is None:
        raise ValueError(f"objective {name!r} is not registered")


@contextmanager
def registered_objective(name: str, loss, **spec) -> Iterator[Objective]:
    """`register_objective(name, **spec)(loss)` for the duration of a `with` block, then unregistered."""
    register_objective(name, **spec)(loss)
    try:
        yield OBJECTIVES[name]
    finally:
        OBJECTIVES.pop(name, None)


class _Column(Mapping):
    """Read-only view name -> one field of every registered objective (always in step with OBJECTIVES)."""

    def __init__(self, field: str):
        self._field = field

    def __getitem__(self, name: str):
        return getattr(OBJECTIVES[name], self._field)

    def __iter__(self):
        return iter(OBJECTIVES)

    def __len__(self) -> int:
        return len(OBJECTIVES)

    def __repr__(self) -> str:
        return repr(dict(self))


DEFAULT_CLIP = _Column("default_clip")
"""name -> (clip_low, clip_high) defaults: the ratio is clipped to [1 - low, 1 + high]."""
DEFAULT_AGGREGATION = _Column("default_aggregation")
"""name -> the aggregation used when `aggregation` is None."""


def get_objective(name: str) -> Objective:
    """The registered objective `name`; a ValueError naming the registered ones otherwise."""
    if name not in OBJECTIVES:
        raise ValueError(f"objective: unknown {name!r}; choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def objective_options(objective: str, options: Mapping | None = None, field: str = "options") -> dict:
    """All options of `objective`, its defaults updated with `options`, checked: a name it does not have is
    refused (naming it, the objective's options and the closest, or the objective it belongs to), a value must
    have its default's type (an int is taken for a float), then the objective's own check. `field`: the name
    the messages give the mapping (policy_loss's `options`, the config's `objective_options`).

    Example: objective_options("sapo", {"sapo_tau_pos": 2}) == {"sapo_tau_pos": 2.0, "sapo_tau_neg": 1.05}
    """
    spec = get_objective(objective)
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ValueError(f"{field}: expected a mapping of option names to values, got {type(options).__name__}")
    for name in options:
        if name not in spec.options:
            raise ValueError(f"{field}: {_not_an_option(objective, spec, name)}")
    full = {**spec.options, **{k: _typed(field, objective, k, v, spec.options[k]) for k, v in options.items()}}
    if spec.check_options is not None:
        try:
            spec.check_options(**full)
        except ValueError as err:
            raise ValueError(f"{field}: {objective}: {err}") from None
    return full


def _not_an_option(objective: str, spec: Objective, name) -> str:
    """Why `name` is refused: whose option it is, or the closest of the objective's own."""
    has = f"its options: {', '.join(spec.options)}" if spec.options else "it has none"
    message = f"{name!r} is not an option of objective {objective!r} ({has})"
    owners = [o for o, s in OBJECTIVES.items() if name in s.options]
    if owners:
        return f"{message}; it is an option of {', '.join(owners)}"
    close = difflib.get_close_matches(str(name), list(spec.options), n=1)
    return f"{message}; did you mean {close[0]!r}?" if close else message


def _typed(field: str, objective: str, name: str, value, default):
    """`value` for option `name` if it has the type of its default (an int for a float becomes that float)."""
    kind = type(default)
    if default is None:
        return value
    wrong = isinstance(value, bool) != (kind is bool) or not isinstance(value, (int, float) if kind is float else kind)
    if wrong:
        raise ValueError(f"{field}: {objective}'s {name}={value!r} has the wrong type: expected {kind.__name__}")
    if kind is float:
        try:
            value = float(value)
        except OverflowError:
            raise ValueError(f"{field}: {objective}'s {name} is too large for a float") from None
        if not math.isfinite(value):
            raise ValueError(f"{field}: {objective}'s {name}={value!r} must be a finite number")
    return value
