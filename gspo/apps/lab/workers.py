"""Where the lab's runs execute: worker processes that die with the lab, or one worker in the lab's own process.

`pool(workers)` is a context manager with `submit(fn, *args) -> Future`; each run keeps to one intra-op thread
(`one_thread`), so its numbers do not depend on the machine's core count.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


def one_thread(fn, *args):
    """Run fn on one intra-op thread (restored after): lab numbers must not depend on the core count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(before)


class Inline:
    """A one-worker pool that runs tasks in this process (no start-up cost; monkeypatching works)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args):
        from concurrent.futures import Future

        future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to the caller through the future
            if not isinstance(err, Exception):
                raise
            future.set_exception(err)
        return future


def pool(workers: int):
    """`workers` spawned processes that end with this one (`die_with_parent`); one: `Inline`."""
    if workers == 1:
        return Inline()
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # Workers are spawned by the thread that submits (run_lab's): PR_SET_PDEATHSIG fires when that thread ends.
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=die_with_parent, initargs=(os.getpid(),))


def die_with_parent(parent: int) -> None:
    """Worker initializer: the worker ends when the lab process ends, however it ends (SIGKILL too).

    An orphaned worker would train on, then block for good on the pipe of results no one reads,
    holding its memory. Linux: the kernel SIGKILLs the worker when its parent dies (prctl
    PR_SET_PDEATHSIG; SIGKILL, not SIGTERM, which the trainer would turn into finishing the step and
    a checkpoint the lab never resumes from: it redoes an interrupted run). A parent that died
    before the prctl is seen by getppid() no longer being `parent`. Elsewhere (macOS, Windows: no
    prctl) a daemon thread checks getppid() every second and ends the worker, within a second.
    """
    if not (sys.platform.startswith("linux") and _parent_death_signal(signal.SIGKILL)):
        threading.Thread(target=_watch_parent, args=(parent,), name="lab-parent-watch", daemon=True).start()
    if os.getppid() != parent:
        os._exit(1)


def _parent_death_signal(signum: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, signum) through libc; False where it fails."""
    import ctypes

    PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc, or no prctl in it
        return False


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def as_completed(futures):
    """concurrent.futures.as_completed, imported where it is used."""
    from concurrent.futures import as_completed as completed

    return completed(futures)
