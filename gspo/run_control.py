"""What keeps a training run safe to stop, resume and watch (used by trainer.py and sft.py).

The output folder (one run at a time, an earlier run there is an error), the settings a checkpoint
must agree with to resume, SIGINT/SIGTERM turned into a clean stop, the non-finite-update guard,
and the progress bar. (The seeded model set-up every run starts from: `gspo.models.seeded_model`.)
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from gspo.checkpoint import clean_stale, list_checkpoints, remove_checkpoint
from gspo.config import to_dict
from gspo.multitask import saved_tasks
from gspo.rewards import reward_spec
from gspo.tracking import METRICS_FILE, SAMPLES_FILE


def save_model(model, tokenizer, path: Path, state_dict: dict | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, **({"state_dict": state_dict} if state_dict is not None else {}))
    tokenizer.save_pretrained(path)


LOCK_FILE = ".gspo.lock"


@contextmanager
def run_lock(out_dir, enabled: bool = True):
    """Hold an advisory lock (fcntl.flock) on `out_dir/.gspo.lock` for the run's life.

    A second run into the same folder gets a ValueError naming the holder (pid, host, start time).
    The kernel drops the lock when its process ends, however it ends, so a killed run's lock file
    never blocks the next run. Creates `out_dir`. Where fcntl is missing (Windows) nothing is locked.
    """
    out = Path(out_dir)
    if not enabled:
        yield
        return
    if out.exists() and not out.is_dir():
        raise ValueError(f"output_dir {out} is a file, not a folder")
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise OSError(err.errno, f"output_dir {out} cannot be written ({err.strerror})", err.filename) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "holder unknown"
            raise ValueError(f"output_dir {out} is in use by another run ({holder}); wait for it to end, stop it, "
                             "or choose another output_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                  .encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def prepare_output_dir(cfg, resuming: bool = False) -> Path:
    """The run's folder; an earlier run's files there are an error unless overwriting or resuming.

    Call it holding `run_lock`: it removes half-written checkpoints, which only a dead run leaves.
    """
    out = Path(cfg.output_dir)
    clean_stale(out) if out.is_dir() else None  # half-written checkpoints of a killed run
    old = [out / METRICS_FILE, out / SAMPLES_FILE, *sorted(out.glob("checkpoint-*"))]
    old = [p for p in old if p.exists()]
    if old and not resuming:
        if not cfg.overwrite_output_dir:
            raise ValueError(f"output_dir {out} already holds a run ({old[0].name}); continue it with --resume latest, "
                             "choose another output_dir, or set overwrite_output_dir=true to delete it")
        for path in old:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return out


# Settings that may change when resuming: where and how much is logged, not what is computed.
RESUME_MAY_CHANGE = ("max_steps", "output_dir", "overwrite_output_dir", "resume_from_checkpoint", "progress",
                     "save_steps", "save_total_limit", "eval_steps", "log_samples_steps", "log_samples_count",
                     "tensorboard", "wandb", "wandb_project", "max_consecutive_skips", "dist_timeout_s",
                     "distributed",  # checkpoints hold full weights and optimizer state in one layout
                     "generation_backend")  # both samplers draw the same tokens for the same seed


def saved_config(cfg, world_size: int = 1) -> dict:
    """The config as JSON: reward functions passed as Python callables become "module:name".

    Two settings are stored as they act: the global batch (per-device batch x world size), and
    seeded_sampling (always on under torchrun), so a run can resume on another number of ranks.
    """
    out = to_dict(cfg)
    out["per_device_batch_size"] *= world_size
    out["seeded_sampling"] = cfg.seeded_sampling or world_size > 1
    out["reward_funcs"] = [reward_spec(f) for f in out["reward_funcs"]]
    out["tasks"] = saved_tasks(out["tasks"])  # the same for each task's reward functions
    return out


def check_resumable(saved: dict, cfg, step: int, world: int = 1) -> None:
    """A resumed run must compute what the checkpointed one did: same settings, and steps left to run."""
    now = saved_config(cfg, world)
    changed = sorted(k for k in set(saved) | set(now) if k not in RESUME_MAY_CHANGE and saved.get(k) != now.get(k))
    if changed:
        def describe(k: str) -> str:
            if k == "per_device_batch_size":  # stored as the global batch, so other world sizes can resume
                return (f"global batch (per_device_batch_size x processes)={saved.get(k)!r} "
                        f"(now {cfg.per_device_batch_size} x {world} = {now.get(k)!r})")
            return f"{k}={saved.get(k)!r} (now {now.get(k)!r})"

        raise ValueError("resume: the checkpoint was made with other settings: " + ", ".join(map(describe, changed)))
    if step >= cfg.max_steps:
        raise ValueError(f"resume: the checkpoint is at step {step} and max_steps={cfg.max_steps}: nothing left to "
                         "run (raise max_steps to train further)")


def discard_newer_checkpoints(out_dir: Path, step: int, allowed: bool) -> None:
    """Resuming from an older checkpoint abandons the newer ones: only with overwrite_output_dir."""
    newer = [c for c in list_checkpoints(out_dir) if int(c.name.rsplit("-", 1)[1]) > step]
    if newer and not allowed:
        raise ValueError(f"resume: {newer[-1].name} is newer than checkpoint-{step}; resume from latest, or set "
                         "overwrite_output_dir=true to delete the newer checkpoints")
    for path in newer:
        remove_checkpoint(path)


class TrainingAborted(RuntimeError):
    """The run cannot go on (e.g. every recent update was non-finite); the message says why."""


class TrainingInterrupted(TrainingAborted):
    """SIGINT/SIGTERM arrived; the run stopped at a checkpoint (`step`: the last step it holds)."""

    def __init__(self, signum: int, step: int, checkpoint: Path):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"{signal.Signals(signum).name} after step {step}; checkpoint saved to {checkpoint}; "
                         "continue with --resume latest")


class StepAbandoned(Exception):
    """A signal arrived while the step could still be dropped whole (nothing of it applied yet)."""

    stops_the_run = True  # raised by a signal handler, maybe inside a reward: gspo.rewards lets it through

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class StopSignals:
    """Turns SIGINT/SIGTERM into a clean stop; a second one stops at once.

    While `abandonable` is set (the trainer sets it from sampling through pi_old, before the step's
    first optimizer step), a signal raises `StepAbandoned` right away, even out of a wait on a hung
    reward function: the trainer then checkpoints the last completed step and exits. Otherwise the
    step in flight is finished first. Installed only in the main thread (Python delivers signals
    there); `restore` puts back the previous handlers.
    """

    def __init__(self):
        self.requested, self.previous, self.abandonable = 0, {}, False
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested:  # second signal: do what the previous handler would have done
            self.restore()
            signal.raise_signal(signum)
            return
        self.requested = signum
        if self.abandonable:
            self.abandonable = False
            print(f"\n{signal.Signals(signum).name}: dropping this unfinished step and saving a checkpoint of the "
                  "last completed one (send it again to stop at once)", file=sys.stderr, flush=True)
            raise StepAbandoned(signum)
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}


class NonFiniteGuard:
    """Counts optimizer steps skipped for a non-finite loss or gradient; aborts after `limit` in a row."""

    def __init__(self, limit: int):
        self.limit, self.skipped, self.in_a_row = limit, 0, 0

    def ok(self) -> None:
        self.in_a_row = 0

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict) -> None:
        self.skipped, self.in_a_row = state["skipped"], state["in_a_row"]

    def skip(self, step: int, loss: torch.Tensor, norm: torch.Tensor) -> None:
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise TrainingAborted(
                f"step {step}: {self.in_a_row} optimizer steps in a row had a non-finite loss ({loss.item()}) or "
                f"gradient norm ({float(norm)}); the weights were not updated by them. Lower learning_rate, check "
                "rewards and inputs, or raise max_consecutive_skips")


class Progress:
    """A rich progress bar showing the latest values of a few metrics; a no-op when disabled."""

    def __init__(self, total: int, enabled: bool = True, label: str = "train",
                 show: tuple[str, ...] = ("reward/mean", "eval/accuracy")):
        self.bar, self.show, self.latest = None, show, {}
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[text]}"), TimeElapsedColumn(), TimeRemainingColumn())
            self.task = self.bar.add_task(label, total=total, text="")
            self.bar.start()

    def update(self, step: int, metrics: dict) -> None:
        if self.bar is None:
            return
        self.latest.update({k: metrics[k] for k in self.show if k in metrics})
        text = "  ".join(f"{k} {v:.3f}" for k, v in self.latest.items())
        self.bar.update(self.task, completed=step, text=text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
