"""Users' reward functions from their import paths: "package.module:function" or "path/to/file.py:function".

`import_reward_fn` is the end of `gspo.data.rewards.get_reward_fn` for a spec that names no built-in;
a module is found as `python -m` finds it (sys.path, else the working directory), a file by its path.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from pathlib import Path

__all__ = ["import_reward_fn"]


def import_reward_fn(spec: str, kind: str = "reward"):
    """The function a "module:function" or "file.py:function" spec names; ValueError where it cannot be had
    (the message names the spec as a `kind`: a reward, a tool, an environment)."""
    module_name, _, attr = spec.partition(":")
    if spec.rpartition(":")[0].endswith(".py"):  # a file: "my_rewards.py:fn", "path/to/rewards.py:fn"
        module_name, _, attr = spec.rpartition(":")
        if not Path(module_name).is_file():
            raise ValueError(f"{kind} {spec!r}: file {module_name} not found (relative to {Path.cwd()})")
    try:
        module = _import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{kind} {spec!r}: cannot import module {module_name!r}: {err}") from err
    except (Exception, SystemExit) as err:  # the module's own code failed as it ran: name where
        raise ValueError(f"{kind} {spec!r}: importing module {module_name!r} raised {type(err).__name__}: {err} "
                         f"({_raised_at(err)})") from err
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"{kind} {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"{kind} {spec!r}: {attr!r} is not callable")
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
