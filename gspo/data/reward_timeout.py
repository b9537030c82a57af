"""One call of a reward function under reward_timeout_s, on the thread that scores, as TRL calls rewards.

Why on that thread: open-r1's rewards (math-verify's parse and verify) arm `signal.alarm` for their own
time limits, and Python refuses `signal.signal` on every thread but the main one ("Math-Verify 'parse'
function doesn't support threaded environment"). So on the main thread (where the trainer scores) the
function runs right there, and a watchdog thread interrupts it when its time is up: it sends the main
thread a signal of gspo's own (`signal.pthread_kill`; a real-time signal, SIGUSR2 where there is none,
never math-verify's SIGALRM, whose alarms run untouched), whose handler raises `TimeUp` there. A real
signal rather than `_thread.interrupt_main`, because it also ends a wait in a system call (a sleep, a
socket read); a BaseException, because rewards (math-verify among them) catch Exception. The call is
stopped, not left running: no thread of it is left behind. Not chosen: a timer of SIGALRM's own
(setitimer), which math-verify's alarm(n) and alarm(0) would replace and cancel; running the function
in a thread and retrying on the main one when it fails there, which leaves such rewards with no limit.

Elsewhere (a thread of the user's, say the API called from one; or the signal taken by a handler of
someone else's) the call runs in a daemon thread of its own that is abandoned when its time is up
(Python cannot stop a thread); rewards that set signal handlers fail there, and their error says so.

Either way a call stuck in C code that holds the GIL (a catastrophic regex) runs no Python code, signal
handlers included, and one that swallows `TimeUp` (a bare `except:`) goes on: faulthandler's C watchdog
(`gil_watchdog`) then ends the process.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import threading
import time

__all__ = ["DEADLINE_SIGNAL", "TimeUp", "call_limited", "gil_watchdog", "interruptible"]

DEADLINE_SIGNAL = getattr(signal, "SIGRTMAX", None) or getattr(signal, "SIGUSR2", None)
"""The watchdog's signal: a real-time one where the platform has them (torchrun and SLURM use SIGUSR1/2)."""


class TimeUp(BaseException):
    """Raised on the main thread by the watchdog's signal: the reward call's time is up."""


def interruptible() -> bool:
    """Whether a call on this thread can be interrupted at its deadline: the main thread, a platform that can send
    it a signal, and that signal free (no handler of someone else's; nor gspo's own: a reward that scores rewards)."""
    return (DEADLINE_SIGNAL is not None and hasattr(signal, "pthread_kill")
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(DEADLINE_SIGNAL) == signal.SIG_DFL)


def call_limited(target, timeout_s: float, name: str) -> bool:
    """`target()` (which keeps its own result) within `timeout_s`; True where the time ran out first.

    On the main thread the call is interrupted then (`TimeUp` raised inside it, which `target` must let
    through); on another thread it runs in a daemon thread of its own, abandoned then.
    """
    with gil_watchdog(timeout_s):  # armed first: even start() waits for the GIL
        if interruptible():
            return _Deadline(timeout_s).run(target)
        worker = threading.Thread(target=target, name=f"gspo-reward-{name}", daemon=True)
        worker.start()
        worker.join(timeout_s)  # interruptible: a signal handler that raises ends the wait
        return worker.is_alive()


class _Deadline:
    """One call on the main thread, interrupted by a watchdog thread's signal at `timeout_s`.

    The handler raises at most once, and only while the call runs (`live`, which it and the call's end clear on
    the main thread alone). The previous handler (SIG_DFL: the signal would end the process) is put back only
    after the watchdog has ended and a signal it sent has been handled.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.done = threading.Event()  # the call is over: the watchdog sends nothing
        self.live = self.sent = self.received = False

    def run(self, target) -> bool:
        # A stop signal's handler (gspo.runtime.StopSignals) may raise anywhere in here, start() included: the
        # handler is installed inside the try, and the watchdog is joined only where it started (a watchdog that
        # starts after `done` is set sends nothing), so the finally neither fails nor hides that exception.
        alarm = _alarm_handler()
        previous = signal.getsignal(DEADLINE_SIGNAL)
        watchdog = threading.Thread(target=self._watch, args=(threading.get_ident(),), daemon=True,
                                    name="gspo-reward-deadline")
        try:
            signal.signal(DEADLINE_SIGNAL, self._handle)
            self.live = True
            watchdog.start()
            try:
                target()
            finally:
                self.live = False  # from here on the handler raises nothing
            return False
        except TimeUp:
            if alarm is not None and _alarm_handler() is not alarm:  # stopped inside math-verify's alarm, before
                signal.alarm(0)                                        # it put back the handler it found
                signal.signal(signal.SIGALRM, alarm)
            return True
        finally:
            self.done.set()
            if watchdog.is_alive():  # False where start() was cut short before the thread ran: it sends nothing
                watchdog.join()
            settle_by = time.monotonic() + 1.0
            while self.sent and not self.received and time.monotonic() < settle_by:
                time.sleep(0.001)  # a system call: the signal sent is handled on its return
            signal.signal(DEADLINE_SIGNAL, previous)

    def _watch(self, main: int) -> None:
        if not self.done.wait(self.timeout_s):
            self.sent = True
            signal.pthread_kill(main, DEADLINE_SIGNAL)

    def _handle(self, signum, frame) -> None:
        if not self.sent:  # not the watchdog's: what the default action (SIG_DFL, checked) does, ending the process
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        self.received = True
        if self.live:
            self.live = False
            raise TimeUp


def _alarm_handler():
    return signal.getsignal(signal.SIGALRM) if hasattr(signal, "SIGALRM") else None


@contextlib.contextmanager
def gil_watchdog(timeout_s: float):
    """Last resort for a function stuck in C code that holds the GIL (a catastrophic regex, say):
    no Python thread, signal handler included, runs again, so neither the wait nor the interrupt above
    returns. faulthandler's watchdog is a C thread: past 2 x timeout_s + 5 s it prints every thread's
    stack and ends the process with status 1. Disarmed as soon as the call returns."""
    try:
        stream = sys.__stderr__
        stream.fileno()  # faulthandler writes to a file descriptor
    except (AttributeError, OSError, ValueError):  # no real stderr (pythonw, some embedders): no watchdog
        yield
        return
    try:  # armed inside the try: a stop signal's exception right after arming still disarms it
        faulthandler.dump_traceback_later(2 * timeout_s + 5, exit=True, file=stream)
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
