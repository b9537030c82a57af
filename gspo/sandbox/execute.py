"""One sandboxed run's two processes, the program's and the judge's, started and driven to their end.

Used by gspo.sandbox.runner.run_sandboxed (whose docstring says what the run is). The judge's end
decides the run; the program's process then gets a short grace to leave by itself before its process
group is killed. Both are killed at the wall clock or when a stream passes its output cap.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import shutil
import signal
import subprocess
import time

GRACE_S = 0.5  # how long the program's process may outlive the judge's verdict
LINGER_S = 2.0  # how long to wait, after the kill, for the last process holding a pipe


@dataclasses.dataclass
class Launch:
    """One process to start: its command line, folder, environment, descriptors and stdin."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    pass_fds: tuple[int, ...] = ()
    stdin: int = subprocess.DEVNULL


@dataclasses.dataclass
class Held:
    """What one run holds until it ends: our pipe and memfd descriptors, host folders (weak mode), its memory
    cgroup (a kernel.RunCgroup) and the reading end of the program's set-up pipe; `release` frees them all."""

    fds: list[int] = dataclasses.field(default_factory=list)
    folders: list[str] = dataclasses.field(default_factory=list)
    cgroup: object = None
    setup_file: object = None

    def close_fds(self) -> None:
        """Close our copies once both processes hold theirs, so each side sees the other's end."""
        while self.fds:
            os.close(self.fds.pop())

    def release(self) -> None:
        if self.setup_file is not None:
            self.setup_file.close()
        for fd in self.fds:
            os.close(fd)
        for folder in self.folders:
            remove_tree(folder)
        if self.cgroup is not None:
            self.cgroup.close()


@dataclasses.dataclass
class Ended:
    """How one process ended. `returncode`: its status, negative for a signal (bwrap's 128 + n too);
    `by_itself`: it exited before anyone killed it; `exited_at`: monotonic time it was seen to end."""

    returncode: int | None
    stdout: bytes
    stderr: bytes
    by_itself: bool
    exited_at: float | None


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _kill_group(pid: int) -> None:
    try:  # the leader is alive or a zombie (unreaped) here, so the group id cannot belong to anyone else
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_pair(program: Launch, judge: Launch, deadline: float, cap: int, via_bwrap: bool,
             after_start=lambda: None) -> tuple[Ended, Ended, str | None] | str:
    """Start both, drive them; (program, judge, killed) with killed "timeout", "output_limit" or None,
    or the reason neither could be judged (a start failure). `after_start` runs once both started (the
    caller closes its copies of their descriptors there, so each side sees the other's end)."""
    procs: list[subprocess.Popen] = []
    try:
        for launch in (program, judge):
            procs.append(subprocess.Popen(
                launch.argv, cwd=launch.cwd, env=launch.env, stdin=launch.stdin, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True, pass_fds=launch.pass_fds,
            ))
    except OSError as exc:
        for proc in procs:
            _kill_group(proc.pid)
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        after_start()
        return f"could not start: {exc}"
    after_start()
    try:
        return _drive(procs, deadline, cap, via_bwrap)
    except BaseException:  # e.g. KeyboardInterrupt in the trainer: leave nothing running
        for proc in procs:
            if proc.returncode is None:
                _kill_group(proc.pid)
        raise
    finally:
        for proc in procs:
            proc.stdout.close()
            proc.stderr.close()


def _drive(procs: list[subprocess.Popen], deadline: float, cap: int, via_bwrap: bool):
    """Read both processes' output until the judge ends (plus GRACE_S), the deadline or an output cap; then kill
    both groups and wait for them and their pipes. (program, judge, killed) as `run_pair` returns them."""
    bufs = {}
    with selectors.DefaultSelector() as sel:
        for i, proc in enumerate(procs):
            for stream in (proc.stdout, proc.stderr):
                bufs[stream.fileno()] = bytearray()
                sel.register(stream.fileno(), selectors.EVENT_READ, ("out", i))
            sel.register(os.pidfd_open(proc.pid), selectors.EVENT_READ, ("exit", i))
        exited, killed = _watch(sel, bufs, len(procs), deadline, cap)
        for proc in procs:
            _kill_group(proc.pid)
        for proc in procs:
            proc.wait()
        _linger(sel)
    ended = []
    for i, proc in enumerate(procs):
        rc = proc.returncode
        if via_bwrap and rc is not None and rc > 128 and rc - 128 in signal.valid_signals():
            rc = 128 - rc  # bwrap reports a child killed by signal n as 128 + n
        ended.append(Ended(rc, bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]),
                           i in exited and rc is not None, exited.get(i)))
    return ended[0], ended[1], killed


def _watch(sel: selectors.BaseSelector, bufs: dict, count: int, deadline: float,
           cap: int) -> tuple[dict[int, float], str | None]:
    """The loop of `_drive` while the processes run: ({index: when its pidfd became readable (it ended, still
    unreaped)}, killed: "timeout", "output_limit" or None). The last process is the judge."""
    exited: dict[int, float] = {}
    killed = None
    judge, end = count - 1, deadline
    while killed is None:
        left = end - time.monotonic()
        if left <= 0:
            if judge not in exited:
                killed = "timeout"
            break
        if judge in exited and len(exited) == count and not _has_output(sel):
            break  # everyone ended and every pipe is closed
        ready = sel.select(left)
        seen_at = time.monotonic()  # one time per batch: a program that ended with its judge did not end after it
        for key, _ in ready:
            kind, i = key.data
            if kind == "exit":
                exited[i] = seen_at
                sel.unregister(key.fd)
                os.close(key.fd)
                if i == judge:  # the verdict is in: the rest may take GRACE_S more, deadline or not
                    end = exited[i] + GRACE_S
                continue
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fd)
                continue
            buf, room = bufs[key.fd], cap - len(bufs[key.fd])
            buf += chunk[:room]
            if len(chunk) > room:
                killed = "output_limit"
                break
    return exited, killed


def _linger(sel: selectors.BaseSelector) -> None:
    """After the kill: drain the pipes until they close (bounded by LINGER_S), then close the pidfds left.

    Under bwrap each side runs in its own session, killed as its pid namespace's init dies: the
    pipes close when its last process is gone, so return only then.
    """
    linger = time.monotonic() + LINGER_S
    while _has_output(sel) and (left := linger - time.monotonic()) > 0:
        for key, _ in sel.select(left):
            if key.data[0] == "exit":
                sel.unregister(key.fd)
                os.close(key.fd)
            elif not os.read(key.fd, 65536):
                sel.unregister(key.fd)
    for key in list(sel.get_map().values()):
        if key.data[0] == "exit":
            os.close(key.fd)


def _has_output(sel: selectors.BaseSelector) -> bool:
    return any(key.data[0] == "out" for key in sel.get_map().values())


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):  # the program removed permissions a non-root trainer needs
        for root, dirs, _ in os.walk(path):
            for d in [root, *(os.path.join(root, d) for d in dirs)]:
                if not os.path.islink(d):
                    try:
                        os.chmod(d, 0o700)
                    except OSError:
                        pass
        shutil.rmtree(path, ignore_errors=True)


def judged(program: Ended, judge: Ended, killed: str | None, cgroup) -> str | None:
    """What stopped the run early (beyond the wall clock and the output cap), if anything."""
    if killed is not None:
        return killed
    if cgroup is not None and cgroup.oom_killed():  # a kernel.RunCgroup
        return "memory_limit"
    verdict_at = judge.exited_at if judge.exited_at is not None else float("inf")
    for ended in (program, judge):  # a signal the program's process got after the verdict changes nothing
        if ended.by_itself and ended.returncode < 0 and (ended is judge or ended.exited_at <= verdict_at):
            return "cpu_limit" if ended.returncode == -signal.SIGXCPU else f"signal {signal_name(-ended.returncode)}"
    return None
