"""Metric sinks: every run writes `metrics.jsonl`; tensorboard and wandb are optional.

`metrics.jsonl` holds one JSON object per line, `{"step": 3, "reward/mean": 0.5, ...}`, with
namespaced metric names (`loss/policy`, `clip/high_frac`, `moe/expert_change_frac/layer_0`).
The file is strict JSON, so `jq` and pandas read it: a non-finite value (NaN, +-inf) or None is
written as `null`, and `read_jsonl` gives it back as `float("nan")`. The sign of an infinity is
lost on purpose: both mean "this step diverged", and the plot skips the point either way.

Optional sinks follow the null-object pattern (as in nanoGPT): `MetricsLogger` holds a list of
small sink objects, each with `log(step, metrics)` and `close()`, and calls them all; nothing in
the training loop asks "is wandb on?".

Example:
    with MetricsLogger("runs/demo", tensorboard=True) as logger:
        logger.log(step, {"reward/mean": rewards.mean(), "loss/policy": loss})
"""

from __future__ import annotations

import json
import math
import numbers
import os
import pathlib
import stat
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TENSORBOARD_DIR = "tensorboard"


# ---------------------------------------------------------------------------
# value conversion


def _to_float(name: str, value: Any) -> float:
    """One metric value as a Python float; None becomes NaN (written as null)."""
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"metric {name!r} must be a scalar, got a tensor of shape {tuple(value.shape)}"
            )
        value = value.detach().reshape(()).item()
    elif hasattr(value, "item") and hasattr(value, "shape"):  # numpy scalar or 0-d array
        if getattr(value, "size", 1) != 1:
            raise ValueError(f"metric {name!r} must be a scalar, got an array of shape {value.shape}")
        value = value.item()
    if not isinstance(value, numbers.Real):  # bools pass, as 0.0 / 1.0
        raise ValueError(f"metric {name!r} must be a real number, got {type(value).__name__}")
    return float(value)


def _jsonable(value: Any) -> Any:
    """A sample field as plain JSON: tensors/arrays become lists or numbers, non-finite -> None."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    elif hasattr(value, "tolist") and hasattr(value, "shape"):  # numpy array or scalar
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _dumps(record: dict) -> str:
    # allow_nan=False: a NaN that slipped through must fail loudly, not write invalid JSON.
    return json.dumps(record, allow_nan=False, ensure_ascii=False)


# ---------------------------------------------------------------------------
# reading and rewriting JSONL files


def _iter_records(path: pathlib.Path) -> Iterator[tuple[str, dict]]:
    """Yield (raw line, parsed object) for each non-blank line of a JSONL file.

    A last line without a trailing newline that does not parse is a write torn by a crash:
    it is skipped. Any other malformed line raises ValueError.
    """
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        torn_tail = i == len(lines) - 1  # only the last piece can lack its newline
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            if torn_tail:
                return
            raise ValueError(f"{path}: line {i + 1} is not valid JSON ({err.msg})") from err
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: line {i + 1} is not a JSON object")
        yield line, obj


def read_jsonl(path: str | os.PathLike, *, null_as_nan: bool = True) -> list[dict]:
    """Read a JSONL file into a list of dicts.

    With `null_as_nan` (default), top-level `null` values become `float("nan")`, undoing how
    `MetricsLogger` writes non-finite metrics. Pass False for samples files, where None means
    "no value" (e.g. a reward function with no opinion).
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such JSONL file: {path}")
    out = []
    for _, obj in _iter_records(path):
        if null_as_nan:
            obj = {k: (math.nan if v is None else v) for k, v in obj.items()}
        out.append(obj)
    return out


def _atomic_write_lines(path: pathlib.Path, lines: list[str]) -> None:
    """Replace `path` (which exists) with `lines` so a crash leaves either the old or the new file, never
    half; the new file keeps the old one's mode (mkstemp's own is 0600)."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), stat.S_IMODE(path.stat().st_mode))
            f.writelines(line + "\n" for line in lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def truncate_jsonl(path: str | os.PathLike, after_step: int) -> int:
    """Keep only the lines of `path` with `step <= after_step` (atomic); return how many were kept.

    Used when resuming from a checkpoint at step k: lines logged after k by the crashed run
    would otherwise appear twice. Kept lines are copied byte for byte. A missing file is a no-op.
    """
    if isinstance(after_step, bool) or not isinstance(after_step, int) or after_step < 0:
        raise ValueError(f"after_step must be an int >= 0, got {after_step!r}")
    path = pathlib.Path(path)
    if not path.exists():
        return 0
    kept = [
        line
        for line, obj in _iter_records(path)
        if isinstance(obj.get("step"), int) and obj["step"] <= after_step
    ]
    _atomic_write_lines(path, kept)
    return len(kept)


def _repair_tail(path: pathlib.Path) -> None:
    """Before appending: a last line cut short by a crash is dropped, a complete one gets its newline."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
    _atomic_write_lines(path, [line for line, _ in _iter_records(path)])


# ---------------------------------------------------------------------------
# sinks: each has log(step, metrics) and close(); metrics are already plain floats


class JsonlSink:
    """Appends `{"step": step, **metrics}` lines to a file, flushing after each."""

    def __init__(self, path: pathlib.Path):
        _repair_tail(path)
        self._file = open(path, "a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step}
        record.update({k: (v if math.isfinite(v) else None) for k, v in metrics.items()})
        self._file.write(_dumps(record) + "\n")
        self._file.flush()  # a crash loses at most the line being written

    def write_lines(self, lines: list[str]) -> None:
        self._file.write("".join(line + "\n" for line in lines))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars to a tensorboard event file via `torch.utils.tensorboard.SummaryWriter`."""

    def __init__(self, log_dir: pathlib.Path, purge_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError("tensorboard=True needs `pip install tensorboard`") from err
        # purge_step hides events a crashed run wrote at or after the resume step.
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Metrics to a Weights & Biases run."""

    def __init__(self, project: str | None, run_name: str | None, config: dict | None, dir: pathlib.Path):
        try:
            import wandb
        except ImportError as err:
            raise ImportError("wandb=True needs `pip install wandb`") from err
        self._run = wandb.init(project=project, name=run_name, config=config, dir=str(dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


def check_trackers(tensorboard: bool = False, wandb: bool = False) -> None:
    """ValueError (naming the setting) where an optional sink is asked for but its package cannot be
    imported: the trainer calls it before a run creates anything (MetricsLogger's own ImportError would
    come after metrics.jsonl exists, an empty file that then blocks the rerun)."""
    import importlib

    for asked, name, module in ((tensorboard, "tensorboard", "torch.utils.tensorboard"), (wandb, "wandb", "wandb")):
        if not asked:
            continue
        try:
            importlib.import_module(module)
        except Exception as err:  # ImportError, or a broken install failing inside its own import
            raise ValueError(f"config: {name}=true needs the {name} package, which cannot be imported "
                             f"({type(err).__name__}: {err}); pip install {name}, or set {name}=false") from None


# ---------------------------------------------------------------------------


class MetricsLogger:
    """Writes metrics to `output_dir/metrics.jsonl` and to any optional sinks.

    Args:
        output_dir: run directory (created if needed).
        tensorboard: also write tensorboard events under `output_dir/tensorboard/`.
        wandb: also log to Weights & Biases (`wandb_project`, `run_name`, `config` go to `wandb.init`).
        enabled: False on non-zero ranks of a distributed run: nothing is created or written,
            and the optional packages are not imported.
        truncate_after_step: when resuming from a checkpoint at step k, first drop lines with
            step > k from metrics.jsonl and samples.jsonl (rewritten atomically). Without it,
            an existing metrics.jsonl is appended to and its lines are kept.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        *,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str | None = None,
        run_name: str | None = None,
        config: dict | None = None,
        enabled: bool = True,
        truncate_after_step: int | None = None,
    ):
        if truncate_after_step is not None and (
            isinstance(truncate_after_step, bool)
            or not isinstance(truncate_after_step, int)
            or truncate_after_step < 0
        ):
            raise ValueError(f"truncate_after_step must be None or an int >= 0, got {truncate_after_step!r}")
        self.output_dir = pathlib.Path(output_dir)
        self.enabled = enabled
        self._sinks: list = []
        self._samples: JsonlSink | None = None
        self._closed = False
        if not enabled:
            return  # the null logger: every call below finds no sinks
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if truncate_after_step is not None:
            for name in (METRICS_FILE, SAMPLES_FILE):
                truncate_jsonl(self.output_dir / name, truncate_after_step)
        self._sinks.append(JsonlSink(self.output_dir / METRICS_FILE))
        if tensorboard:
            purge = None if truncate_after_step is None else truncate_after_step + 1
            self._sinks.append(TensorBoardSink(self.output_dir / TENSORBOARD_DIR, purge_step=purge))
        if wandb:
            self._sinks.append(WandbSink(wandb_project, run_name, config, self.output_dir))

    @property
    def metrics_path(self) -> pathlib.Path:
        return self.output_dir / METRICS_FILE

    @property
    def samples_path(self) -> pathlib.Path:
        return self.output_dir / SAMPLES_FILE

    def _check_open(self, step: Any) -> None:
        if self._closed:
            raise RuntimeError("MetricsLogger is closed")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")

    def log(self, step: int, metrics: dict[str, float | int | torch.Tensor]) -> None:
        """Log one line of scalars; tensors / numpy scalars become floats, non-finite -> null."""
        self._check_open(step)
        if not self.enabled:
            return  # skip the .item() calls too: they would sync the device for nothing
        if not isinstance(metrics, dict):
            raise ValueError(f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
        clean: dict[str, float] = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not name or name == "step":
                raise ValueError(f"metric names must be non-empty strings other than 'step', got {name!r}")
            clean[name] = _to_float(name, value)
        for sink in self._sinks:
            sink.log(int(step), clean)

    def log_samples(self, step: int, records: list[dict]) -> None:
        """Append records (e.g. prompt / completion / reward, and `rewards`: {reward function: value}) to
        samples.jsonl, each tagged with `step`; a non-finite number, in a nested dict or list too, is null."""
        self._check_open(step)
        if not isinstance(records, (list, tuple)) or not all(isinstance(r, dict) for r in records):
            raise ValueError("records must be a list of dicts")
        if not self.enabled or not records:
            return
        lines = []
        for i, record in enumerate(records):
            if "step" in record and record["step"] != step:
                raise ValueError(f"records[{i}] has step={record['step']!r}, but log_samples got step={step}")
            line = _jsonable({"step": int(step), **{k: v for k, v in record.items() if k != "step"}})
            try:
                lines.append(_dumps(line))
            except (TypeError, ValueError) as err:
                raise ValueError(f"records[{i}] is not JSON-serialisable: {err}") from err
        if self._samples is None:  # opened lazily: runs that log no samples get no empty file
            self._samples = JsonlSink(self.samples_path)
        self._samples.write_lines(lines)

    def close(self) -> None:
        """Close every sink; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for sink in self._sinks + ([self._samples] if self._samples else []):
            sink.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
