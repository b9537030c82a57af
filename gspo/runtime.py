"""What keeps a run safe to stop and watch (used by trainer.py and sft.py).

The output folder (one run at a time; an earlier run there is an error), SIGINT/SIGTERM turned
into a clean stop, the non-finite-update guard and the progress bar. The rules of a resume live
with the checkpoints (gspo/checkpoint/resume.py); the seeded model set-up in gspo/models.py.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from gspo.checkpoint import clean_stale, remove_tree, umask_modes
from gspo.config import OutputSettings
from gspo.data.rows import stderr_line
from gspo.tracking import METRICS_FILE, SAMPLES_FILE, TENSORBOARD_DIR


def save_model(model, tokenizer, path: Path, state_dict: dict | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, **({"state_dict": state_dict} if state_dict is not None else {}))
    tokenizer.save_pretrained(path)
    umask_modes(path)  # safetensors writes its weights 0600 whatever the umask


LOCK_FILE = ".gspo.lock"
RUN_MARKER = ".gspo-run"  # written as a run starts: the folder holds a gspo run (prepare_output_dir)
MERGED_DIR = "merged"  # a LoRA run's base with the adapters merged in (lora_save_merged)
CRITIC_DIR = "critic"  # a PPO run's trained critic, beside its model (gspo.plugs.critic.save_value_model)
OWN_NAMES = (METRICS_FILE, SAMPLES_FILE, "model", MERGED_DIR, CRITIC_DIR, TENSORBOARD_DIR, "wandb", "plots")
"""What a run writes into its output_dir, besides checkpoint-<step>/ (plots/: `gspo train` draws them at the end)."""


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
            raise ValueError(f"output_dir {out} is in use by another run ({_holder(fd)}); wait for it to end, stop it, "
                             "or choose another output_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                  .encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def lock_holder(out_dir) -> str | None:
    """Who holds `out_dir`'s `run_lock` ("pid 123 on host since ..."), or None when no live process does
    (no lock file; or its run ended, however: the kernel dropped the lock). None where fcntl is missing."""
    try:
        import fcntl

        fd = os.open(Path(out_dir) / LOCK_FILE, os.O_RDONLY)
    except (ImportError, FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # taken (and dropped at close) only if no run holds it
        return None
    except OSError as err:
        if err.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        return _holder(fd)
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    return os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "holder unknown"


def prepare_output_dir(output: OutputSettings, resuming: bool = False, *, resumable: bool = True) -> Path:
    """The run's folder, marked as a gspo run's (RUN_MARKER); an earlier run's files there are an error unless
    overwriting or resuming, and so is a folder holding files but no gspo run (`check_not_foreign`).

    Call it holding `run_lock`: it removes half-written checkpoints, which only a dead run leaves.
    `resumable`: the error suggests --resume (gspo train; not sft).
    """
    out = Path(output.output_dir)
    clean_stale(out) if out.is_dir() else None  # half-written checkpoints of a killed run
    old = [out / METRICS_FILE, out / SAMPLES_FILE, out / CRITIC_DIR, *sorted(out.glob("checkpoint-*"))]
    old = [p for p in old if os.path.lexists(p)]  # a link to a checkpoint (even a dangling one) too
    if not old and not os.path.lexists(out / RUN_MARKER):  # a run from before the marker has these files
        check_not_foreign(out, output.overwrite_output_dir)
    if old and not resuming:
        if not output.overwrite_output_dir:
            resume = "continue it with --resume latest, " if resumable else ""
            raise ValueError(f"output_dir {out} already holds a run ({old[0].name}); {resume}choose another "
                             "output_dir, or set overwrite_output_dir=true to delete it")
        for path in old:
            remove_tree(path)  # a link goes, its target stays
    out.mkdir(parents=True, exist_ok=True)
    if not os.path.lexists(out / RUN_MARKER):
        (out / RUN_MARKER).write_text(f"gspo run since {time.strftime('%Y-%m-%d %H:%M:%S')}; overwrite_output_dir "
                                      "replaces only what gspo writes here\n")
    return out


def check_not_foreign(out: Path, overwrite: bool) -> None:
    """Refuse a folder that is not empty and holds no gspo run: always where gspo would write over an entry
    (OWN_NAMES: a user's model/ is not an earlier run's to replace), else unless `overwrite` (gspo's files then
    go beside the others, which stay untouched)."""
    entries = sorted(p for p in out.iterdir() if p.name != LOCK_FILE) if out.is_dir() else []
    named = [p.name + "/" * p.is_dir() for p in entries]
    clash = [name for p, name in zip(entries, named) if p.name in OWN_NAMES]
    if clash:
        raise ValueError(f"output_dir {out} holds no gspo run, but gspo would write over its {', '.join(clash)}; "
                         "move them, or choose another output_dir")
    if entries and not overwrite:
        shown = ", ".join(named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else "")
        raise ValueError(f"output_dir {out} is not empty and holds no gspo run ({shown}); choose a new or empty "
                         "output_dir, or set overwrite_output_dir=true to write gspo's files beside these")


class TrainingAborted(RuntimeError):
    """The run cannot go on (e.g. every recent update was non-finite); the message says why."""


class TrainingInterrupted(TrainingAborted):
    """SIGINT/SIGTERM arrived; the run stopped at a checkpoint (`step`: the last step it holds)."""

    def __init__(self, signum: int, step: int, checkpoint: Path):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"{signal.Signals(signum).name} after step {step}; checkpoint saved to {checkpoint}; "
                         "continue with --resume latest")


class Terminated(Exception):
    """SIGTERM under torchrun outside the steps' own handling (building the run, the first evaluation): raised so
    the trainer first looks for a lost rank (torchrun SIGTERMs the survivors of one), then ends as SIGTERM would."""

    stops_the_run = True  # raised by a signal handler, maybe inside a reward: gspo.data.rewards lets it through

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextmanager
def sigterm_raises(enabled: bool):
    """Inside: SIGTERM raises `Terminated` (main thread, `enabled` only); the previous handler after."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum, frame):
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is handle:  # SIGTERM ignored once a rank was lost stays so
            signal.signal(signal.SIGTERM, previous)


class StepAbandoned(Exception):
    """A signal arrived while the step could still be dropped whole (nothing of it applied yet)."""

    stops_the_run = True  # raised by a signal handler, maybe inside a reward: gspo.data.rewards lets it through

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
        """Put back the previous handlers, where this one is still installed (a handler set since, such as
        SIGTERM ignored once another rank was lost, stays)."""
        for signum, handler in self.previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, handler)
        self.previous = {}


class NonFiniteGuard:
    """Counts optimizer steps skipped for a non-finite loss or gradient; aborts after `limit` in a row.

    `scaler`: the loss scale of fp16 training (gspo.plugs.precision.loss_scaler; None: none), which the guarded
    steps go through (`gspo.step.step_or_skip`) and whose state the guard's checkpoint state holds."""

    def __init__(self, limit: int, what: str = "optimizer steps", lr_name: str = "learning_rate", scaler=None):
        self.limit, self.skipped, self.in_a_row = limit, 0, 0
        self.what, self.lr_name = what, lr_name  # named in the abort message (the policy's, or the critic's)
        self.scaler = scaler

    def ok(self) -> None:
        self.in_a_row = 0

    def state_dict(self) -> dict:
        scale = {} if self.scaler is None else {"loss_scale": self.scaler.state_dict()}
        return {"skipped": self.skipped, "in_a_row": self.in_a_row, **scale}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"guard state must be a mapping, got {type(state).__name__}")
        for key in ("skipped", "in_a_row"):  # a checkpoint's JSON, which a user may have edited
            if type(state.get(key)) is not int or state[key] < 0:
                raise ValueError(f"guard {key}={state.get(key)!r} must be an int >= 0")
        self.skipped, self.in_a_row = state["skipped"], state["in_a_row"]
        if "loss_scale" in state and self.scaler is not None:
            scale = state["loss_scale"]
            if not isinstance(scale, dict) or not isinstance(scale.get("scale"), (int, float)) or scale["scale"] <= 0:
                raise ValueError(f"guard loss_scale={scale!r} must be a GradScaler state with a scale > 0")
            self.scaler.load_state_dict(scale)

    def skip(self, step: int, loss: torch.Tensor, norm: torch.Tensor) -> None:
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise TrainingAborted(
                f"step {step}: {self.in_a_row} {self.what} in a row had a non-finite loss ({loss.item()}) or "
                f"gradient norm ({float(norm)}); the weights were not updated by them. Lower {self.lr_name}, check "
                "rewards and inputs, or raise max_consecutive_skips")


def stderr_printer(enabled: bool = True, prefix: str = ""):
    """`say(text)`, which prints `prefix` + text on stderr at once (a notice, or "gspo: loading model ..." as a
    long phase begins); where not enabled (another rank than the main one, progress off) nothing."""
    def say(text: str) -> None:
        if enabled:
            stderr_line(prefix + text)

    return say


class Progress:
    """How far a run is, while it runs; a no-op when disabled.

    On a terminal (stdout a tty) a rich bar with the latest values of the `show` metrics; elsewhere (a log
    file, a batch job, where a bar would stay blank) one line on stderr every `every` steps and at the last:
    `train step 4/20  reward/mean 0.3125  ...  (12 s)`, with the `line` metrics (default: `show`) that step has.
    """

    def __init__(self, total: int, enabled: bool = True, label: str = "train",
                 show: tuple[str, ...] = ("reward/mean", "eval/accuracy"), every: int = 1,
                 line: tuple[str, ...] | None = None):
        self.bar, self.show, self.latest, self.enabled = None, show, {}, enabled
        self.total, self.label, self.every, self.line = total, label, every, line or show
        self.started = time.perf_counter()
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[text]}"), TimeElapsedColumn(), TimeRemainingColumn())
            self.task = self.bar.add_task(label, total=total, text="")
            self.bar.start()

    def update(self, step: int, metrics: dict) -> None:
        if self.bar is not None:
            self.latest.update({k: metrics[k] for k in self.show if k in metrics})
            text = "  ".join(f"{k} {v:.3f}" for k, v in self.latest.items())
            self.bar.update(self.task, completed=step, text=text)
        elif self.enabled and metrics and (step % self.every == 0 or step == self.total):
            values = "".join(f"  {k} {metrics[k]:.4g}" for k in self.line if k in metrics)
            print(f"{self.label} step {step}/{self.total}{values}  ({time.perf_counter() - self.started:.0f} s)",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
