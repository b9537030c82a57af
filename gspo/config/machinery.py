"""The machinery of configs: sections and their checks, YAML files and `key=value` overrides, types, help.

A config class is plain dataclass sections put together (gspo.config.shared, gspo.config.train). Each field
carries its documentation as a string literal right below it; `field_docs` reads those strings from the
source, so `gspo train --help` prints them. Nothing here imports torch (`gspo --help` stays fast).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import re
import sys
import textwrap
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import yaml

from gspo.aliases import translate
from gspo.config.trl import read_trl

S = TypeVar("S")

CHECKS: dict[type, Callable] = {}
"""Section (or config class) -> its check, registered beside it with `@checks`."""


def checks(cls: type) -> Callable:
    """Register the decorated function as the check of section `cls` (it receives `section(cfg, cls)`)."""
    def register(fn: Callable) -> Callable:
        CHECKS[cls] = fn
        return fn
    return register


def section(cfg, cls: type[S]) -> S:
    """The fields of section `cls` of a config, as a `cls` of their own: a plug built from it sees those only."""
    return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


def sections(cls: type) -> list[type]:
    """The sections `cls` is made of, in the order its fields come (`cls` itself last where it adds fields)."""
    return [k for k in reversed(cls.__mro__) if dataclasses.is_dataclass(k)]


def validate(cfg) -> None:
    """Check choices, ranges and consistency before anything is loaded: each section's check on that
    section's fields, then the config class's own checks across sections.

    Allowed values are read from the registries that own them (objectives, advantage estimators, generators),
    modules that import nothing of gspo outside their own package, imported inside the checks so that `import
    gspo.config` stays free of torch; names the runtime keys its code by are written in the config itself
    (`check_implemented`). A config class with no registered check (gspo.apps.lab.LabConfig) brings its own
    `validate` method.
    """
    check_durations(cfg)
    if type(cfg) not in CHECKS:
        return cfg.validate()
    for cls in sections(type(cfg)):
        if cls in CHECKS:
            CHECKS[cls](cfg if cls is type(cfg) else section(cfg, cls))


MAX_DURATION_S = 7 * 24 * 3600
"""The longest any duration field (a name ending in _s: seconds) may be: a week. Beyond ~9e9 s a timeout no
longer fits the C types that threads, sockets and process groups wait with (an OverflowError mid-run)."""


def check_durations(cfg) -> None:
    """ValueError for a field named *_s (a duration in seconds) above MAX_DURATION_S, naming it and the bound."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name.endswith("_s") and isinstance(value, (int, float)) and value > MAX_DURATION_S:
            raise ValueError(f"config: {f.name}={value:g} is more than a week ({MAX_DURATION_S} s); lower it")


def coerce_fields(cfg) -> None:
    """Type-check every field as the config is built, from Python too: TrainConfig(learning_rate="abc") is an
    error naming the field, not a failure deep in training. An int given for a float becomes that float, a
    string for a list a one-item list. Choices, ranges and consistency: `validate` (make_config, gspo.Trainer)."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        setattr(cfg, f.name, _coerce(f.name, getattr(cfg, f.name), hints[f.name]))


def field_docs(cls) -> dict[str, str]:
    """Field name -> the docstring written under it (searching base classes too)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                        and isinstance(nxt.value.value, str)):
                    docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def config_help(cls) -> str:
    """One block per field (name, type, default and its docstring), under a heading per section."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    owners = {f: k for k in sections(cls) for f in getattr(k, "__annotations__", {})}  # the last declaration wins
    lines, heading = [], None
    for f in dataclasses.fields(cls):
        owner = owners[f.name]
        if owner is not heading:
            heading = owner
            title = (owner.__doc__ or "").strip().splitlines()[0] if owner is not cls else f"{cls.__name__}'s own"
            lines.append(f"\n [{owner.__name__.removesuffix('Settings').lower()}] {title}")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  {f.name} ({_type_name(hints[f.name])}, default {default!r})")
        lines.append(textwrap.fill(docs.get(f.name, ""), width=96, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


SECRET_FIELDS = ("rollout_secret",)
"""Fields that hold a secret: never saved or logged (`to_dict`), refused as command-line overrides (`ps` shows
a process's arguments to every user of the machine)."""
HIDDEN = "<hidden>"


def load_config(cls, path: str | Path | None = None, overrides: list[str] | None = None, defaults: dict | None = None):
    """Build `cls` from `defaults`, then an optional YAML file, then `key=value` overrides (which win)."""
    values: dict = dict(defaults or {})
    if path is not None:
        values.update(_read_yaml_file(Path(path)))
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        if key.strip() in SECRET_FIELDS:
            raise ValueError(f"override {key.strip()}=...: a secret on the command line is visible to every user of "
                             "this machine (ps); put it in the config file, a file (rollout_secret_file) or the "
                             "environment (GSPO_ROLLOUT_SECRET)")
        values[key.strip()] = _yaml_value(raw, f"override {item!r}") if raw.strip() else None
    return make_config(cls, values)


def utf8_text(data: bytes, where: str) -> str:
    """`data` decoded as UTF-8 (a byte-order mark dropped); else a ValueError naming `where`, line and column.
    Config files and data files (gspo.data.rows) are read with it."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        column = err.start - data.rfind(b"\n", 0, err.start)
        raise ValueError(f"{where} line {line}: not UTF-8 text (byte {data[err.start]:#04x} at column {column})"
                         ) from None


def _read_yaml_file(path: Path) -> dict:
    """The mapping in a YAML config file; every problem is a ValueError naming the file (and line)."""
    if not path.is_file():
        raise ValueError(f"config: file not found: {path}" + (" (it is a folder)" if path.is_dir() else ""))
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"config: {path}: cannot be read ({err.strerror})") from None
    text = utf8_text(data, f"config: {path}")
    loaded = _yaml_value(text, f"config: {path}") or {}
    if not isinstance(loaded, dict):
        raise ValueError(f"config: {path} must hold a mapping of field: value, got {type(loaded).__name__}")
    return loaded


class _YAML12Floats(yaml.SafeLoader):
    """PyYAML's safe loader, reading 1e-3 (no dot, as YAML 1.2 and JSON allow) as a float, not a string,
    and refusing a key given twice in one mapping (PyYAML keeps the last silently; YAML forbids it)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<` merges may be overridden; complex keys are left to PyYAML
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    problem=f"duplicate key {key!r}, first given on line {seen[key] + 1}",
                    problem_mark=key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_YAML12Floats.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _yaml_value(text: str, where: str):
    """yaml.safe_load (exponent floats included), with a syntax error as one line: where, line, column, problem."""
    try:
        return yaml.load(text, Loader=_YAML12Floats)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{where}{at}: invalid YAML ({problem})") from None
    except RecursionError:
        raise ValueError(f"{where}: invalid YAML (nested too deeply)") from None


def own_names(values: dict, cls) -> dict:
    """`values` with other names of `cls`'s settings (gspo.aliases: former names, TRL's) read into its own;
    a name given with the setting it stands for is an error (`renamed`: the same for a TrainConfig). TRL's
    names gspo has no setting for (gspo.config.trl): dropped where the value means what gspo does, else an
    error saying what gspo does instead; one note lists TRL's defaults that such a config does not get."""
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None
                for f in dataclasses.fields(cls)}
    return read_trl(values, translate(values, defaults), defaults)


def known_names(values: dict, cls) -> dict:
    """`own_names(values, cls)`, each a field of `cls`: an unknown key is an error naming the closest field."""
    names = [f.name for f in dataclasses.fields(cls)]
    out = own_names(values, cls)
    for key in out:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"config: unknown key {key!r}{hint}")
    return out


def takes_other_names(cls):
    """Class decorator (after @dataclass): `cls(**values)` reads other names and refuses an unknown key as
    `make_config` does (`known_names`), where the dataclass's own __init__ raised a bare TypeError:
    TrainConfig(beta=0.04) is TrainConfig(kl_coef=0.04), as GRPOTrainer(beta=0.04) is."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **values):
        init(self, *args, **known_names(values, cls))

    cls.__init__ = __init__
    return cls


def make_config(cls, values: dict):
    """Type-check a mapping against the dataclass and build it, then validate."""
    hints = typing.get_type_hints(cls)
    kwargs = {key: _coerce(key, value, hints[key]) for key, value in known_names(values, cls).items()}
    cfg = cls(**kwargs)
    validate(cfg)
    return cfg


def to_dict(cfg, keep_secrets: bool = False) -> dict:
    """Field -> value, its lists and mappings copied (the rest: plain values, or a reward function or instance given
    from Python, kept as it is: `dataclasses.asdict` would deep-copy a stateful reward, its model and all). A
    secret (SECRET_FIELDS) that is set reads "<hidden>", so what is saved or logged never holds it; `keep_secrets`
    for a dict that only builds another config in this process."""
    def copied(value):
        if isinstance(value, dict):
            return {k: copied(v) for k, v in value.items()}
        return type(value)(map(copied, value)) if isinstance(value, (list, tuple)) else value

    return {f.name: HIDDEN if f.name in SECRET_FIELDS and getattr(cfg, f.name) is not None and not keep_secrets
            else copied(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def check_choice(cfg, name: str, choices) -> None:
    """ValueError unless `cfg.<name>` is one of `choices` (a tuple, or a registry's names)."""
    value = getattr(cfg, name)
    if value not in choices:
        raise ValueError(f"config: {name}={value!r} is not one of {', '.join(map(str, choices))}")


def check_positive(cfg, *names: str, allow_zero: bool = False) -> None:
    """ValueError unless each `cfg.<name>` is > 0 (>= 0 with allow_zero); None (an automatic value) passes."""
    for name in names:
        value = getattr(cfg, name)
        if value is None:  # an optional setting left to its automatic value
            continue
        if value < 0 or (value == 0 and not allow_zero):
            raise ValueError(f"config: {name}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def check_implemented(names, implemented, owner: str) -> None:
    """RuntimeError unless `implemented` (a registry's keys) holds exactly `names`, allowed values the config
    writes down. The module that implements them calls this at import: the names are written once, in the config
    (which imports no runtime module), and a name without its implementation fails at once, not mid-run."""
    if set(implemented) != set(names):
        raise RuntimeError(f"{owner} implements {', '.join(map(str, implemented))} but the config allows "
                           f"{', '.join(map(str, names))}: implement each allowed name, or allow it in gspo/config")


def prefixed(check, *args) -> None:
    """Run another module's check; its ValueError is raised again as a config error."""
    try:
        check(*args)
    except ValueError as err:
        raise ValueError(f"config: {err}") from None


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


_FLOAT_MAX = sys.float_info.max


def _digits(value: int) -> str:
    """A huge int for a message, by its first digits and its length (str() refuses ints of over 4300 digits)."""
    digits = math.floor(math.log10(abs(value))) + 1  # log10 takes ints of any size
    return f"{'-' if value < 0 else ''}{abs(value) // 10 ** (digits - 6)}... ({digits} digits)"


def _coerce(key: str, value, tp):
    """Check `value` against annotation `tp`; ints are accepted for floats."""
    options = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else (tp,)
    if value is None:
        if type(None) in options:
            return None
        raise ValueError(f"config: {key} may not be null (expected {_type_name(tp)})")
    for option in options:
        if option is type(None):
            continue
        if option is float and isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, int) and not -_FLOAT_MAX <= value <= _FLOAT_MAX:  # float(value): an OverflowError
                raise ValueError(f"config: {key}={_digits(value)} is too large for a float")
            if not math.isfinite(value):
                raise ValueError(f"config: {key}={value!r} must be a finite number")
            return float(value)
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is bool and isinstance(value, bool):
            return value
        if option is str and isinstance(value, str):
            return value
        if option is list and isinstance(value, (list, tuple)):
            return list(value)
        if option is list and isinstance(value, str):
            return [value]
        if option is dict and isinstance(value, dict):
            return value
    raise ValueError(f"config: {key}={value!r} has the wrong type: expected {_type_name(tp)}")
