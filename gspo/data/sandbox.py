"""Sandboxed code reward: run model-written Python against tests in a separate, confined process.

Model output is never `exec`-ed in the trainer. Each program runs in a fresh interpreter
(`python -I -S -B`: isolated mode, no site-packages, no bytecode written) with an empty stdin
and a minimal environment (PATH, LANG, LC_ALL, HOME=TMPDIR=its working dir; bwrap adds PWD).

The boundary, `sandbox="os"` (the default), is the kernel's, set up by bubblewrap (`bwrap`; the
environment variable GSPO_BWRAP may name another binary). A private mount namespace shows
- read-only: /usr; the host's /bin, /sbin, /lib* (symlinks stay symlinks); the interpreter's real
  prefix (`sys.base_prefix`); a minimal /dev (null, zero, full, random, urandom, tty, a private
  pts). Nothing else of the host: no /etc, /home, /var, no other part of /root, no trainer files;
- /proc of the run's own pid namespace: the host's processes are invisible;
- writable: one directory, the working dir, a tmpfs in memory of max(16 MB, 4 x max_file_mb).
  The program and tests are copied into it through file descriptors, so a run writes nothing on
  the host's disks and leaves nothing behind.
It adds pid, ipc, uts, network (its own loopback only) and, where possible, cgroup namespaces;
`--die-with-parent` and the pid namespace mean that killing a run kills all of it, and
`--new-session` detaches it from any terminal. As root, bwrap makes no user namespace (one made
by root maps the sandbox's uid to root outside) and `setpriv` switches to uid/gid 65534 with no
groups, no capabilities (an empty bounding set too) and no_new_privs. As another user: an
unprivileged user namespace, the trainer's uid inside, every capability dropped and (bwrap >= 0.8)
no nested user namespaces. Either way root's files (/proc/sys, ...) are closed to the program.
Where this does not start, a run raises SandboxUnavailable naming why and the fixes;
`code_reward()` checks when it is built.

Not covered: CPU time, memory and processes are bounded by rlimits and the wall clock only (no
cgroup); the tmpfs's pages are outside RLIMIT_AS (bounded by its size, its inode count only by the
time limit); there is no seccomp filter, so the kernel's whole system-call surface is reachable (as
root, nested user namespaces too) and a kernel bug is an escape; as root, uid 65534 is shared with
any "nobody" process on the host, which could signal or trace the sandbox (not the reverse); the
global files of /proc (cpuinfo, meminfo, ...) are readable.

`sandbox="weak"` runs without bubblewrap, in a host temp dir deleted afterwards: an empty network
namespace (`unshare --net`; as a normal user `unshare --user --map-root-user --net`) and, as root, a
switch to uid 65534 with `setpriv` (keeping CAP_DAC_READ_SEARCH where the interpreter lives where
nobody cannot read, e.g. pyenv under /root, which leaves every read to the audit hook), each where
it works. The file system is then guarded by file permissions and the audit hook only; a
RuntimeWarning names whatever is left to the hook alone.

Both modes, in the child before any model code runs (gspo/data/sandbox_child.py): rlimits RLIMIT_AS
(memory), RLIMIT_CPU, RLIMIT_FSIZE (largest file), RLIMIT_NOFILE, RLIMIT_CORE=0 and RLIMIT_NPROC=0
(no new processes or threads: the child's own limit, so the user's other processes do not matter).
The parent enforces the wall clock and the output cap (pipes read incrementally, at most
`max_output_bytes` kept), kills the run's process group and waits for its pipes to close. An audit
hook refuses process creation, signals to other processes, sockets, ctypes, tracing and heap
walking, and opening, listing or writing anything outside the working dir, the standard library
and a few devices. It is defence in depth, not a boundary: code in the same process can get round
it (sqlite's ATTACH opens files it never sees). `audit_hook=False` turns its policy off, to test
the kernel alone.

Scoring: the program runs first, then the tests, in one namespace; the reward is 1.0 iff both
finish within the limits. Leaving early is a failure, including `sys.exit(0)`, `os._exit(0)`,
an atexit handler or a signal handler in the program (common reward hacks): the child exits 0
only through the sandbox's own exit after the last test. So tests must not call `sys.exit`
themselves (use asserts, or `unittest.main(exit=False)` and check the result). The tests are
deleted before the program starts, though a program that inspects the interpreter's frames could
still read them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gspo.data.sandbox_launch import (
    NOBODY,
    TMPFS_FILES,
    TMPFS_MIN_MB,
    Bwrap,
    boundary,
    bwrap_argv,
    child_env,
    memfd,
    python_path,
    tmpfs_bytes,
    weak_launcher,
)

__all__ = [
    "SANDBOX_MODES",
    "SandboxResult",
    "SandboxUnavailable",
    "run_sandboxed",
    "check_sandbox",
    "network_isolation",
    "describe_sandbox",
    "extract_code",
    "CodeReward",
    "code_reward",
    "code_tests",
]

SANDBOX_MODES = ("os", "weak")
_FAIL_RC = 3  # the program or a test raised (or tried to exit early)
_SETUP_RC = 111  # the sandbox's own setup failed before model code ran
_NOFILE = 64
_RLIMITS = "rlimits AS/CPU/FSIZE/NOFILE, NPROC=0"
_BOOTSTRAP = Path(__file__).with_name("sandbox_child.py").read_text(encoding="utf-8")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """One sandboxed run. `passed` iff program and tests ran to the end within every limit."""

    returncode: int | None  # exit status; negative: killed by that signal; None: never started
    stdout: str  # the first max_output_bytes bytes, decoded as UTF-8 (bad bytes replaced)
    stderr: str
    timed_out: bool
    killed: str | None  # "timeout", "output_limit", "cpu_limit", "signal SIGSEGV", ...; None: exited
    duration_s: float
    error: str | None = None  # the sandbox itself failed; the program was not judged

    @property
    def passed(self) -> bool:
        return self.error is None and self.killed is None and self.returncode == 0


class SandboxUnavailable(ValueError):
    """sandbox="os" was asked for, and this machine cannot set up the operating-system boundary."""


def _check_mode(sandbox) -> None:
    if not isinstance(sandbox, str) or sandbox not in SANDBOX_MODES:
        raise ValueError(f"sandbox must be one of {', '.join(map(repr, SANDBOX_MODES))}, got {sandbox!r}")


def _require_boundary() -> Bwrap:
    box, reason = boundary()
    if box is None:
        raise SandboxUnavailable(
            f"code sandbox: no operating-system boundary here: {reason}; install bubblewrap "
            "(apt-get install bubblewrap), or set sandbox='weak' to accept an in-process audit hook as "
            "the only file-system barrier"
        )
    return box


# ---- what this machine offers -----------------------------------------------------------------

def check_sandbox(sandbox: str = "os") -> None:
    """Raise SandboxUnavailable now where runs in this mode cannot start here (probed once)."""
    _check_mode(sandbox)
    if sandbox == "os":
        _require_boundary()
    else:
        weak_launcher()


def network_isolation(sandbox: str = "os") -> str:
    """'netns' (an empty network namespace) or 'audit_hook' (in-process refusal of sockets only)."""
    check_sandbox(sandbox)
    return "netns" if sandbox == "os" or weak_launcher()[1] else "audit_hook"


def describe_sandbox(sandbox: str = "os") -> str:
    """One line saying which boundary and which other layers a run in this mode gets here."""
    _check_mode(sandbox)
    if sandbox == "os":
        box, reason = boundary()
        if box is None:
            return f"boundary: none ({reason}); sandbox='os' runs raise SandboxUnavailable"
        who = f"uid {NOBODY}" if box.drop else "the trainer's uid in a user namespace"
        if "--disable-userns" in box.flags:
            who += ", no nested user namespaces"
        return (
            "boundary: bubblewrap (private mount namespace, read-only system, one writable tmpfs of "
            f"max({TMPFS_MIN_MB} MB, {TMPFS_FILES} x max_file_mb), no network, pid/ipc/uts namespaces, {who}, "
            f"no capabilities, no new privileges); {_RLIMITS}; audit hook"
        )
    prefix, has_netns, who = weak_launcher()
    net = "empty network namespace" if has_netns else "audit hook only"
    return (
        "boundary: weak (no mount namespace: file permissions and an in-process audit hook are the "
        f"only file-system barrier); runs as: {who}; network: {net}; {_RLIMITS}; audit hook; "
        f"launcher: {' '.join(prefix) or '(none)'}"
    )


# ---- one run ----------------------------------------------------------------------------------

def _check_limits(timeout_s, memory_mb, cpu_s, max_output_bytes, max_file_mb) -> None:
    for name, value, lowest in (
        ("timeout_s", timeout_s, None), ("cpu_s", cpu_s, None), ("memory_mb", memory_mb, 64),
        ("max_output_bytes", max_output_bytes, 1), ("max_file_mb", max_file_mb, 0),
    ):
        if name == "cpu_s" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        if lowest is None and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
        if lowest is not None and value < lowest:
            raise ValueError(f"{name} must be >= {lowest}, got {value!r}")


def _exited(pid: int, deadline: float) -> bool:
    """Wait until `pid` exits or `deadline`; leave it unreaped so its process group id stays ours."""
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def _drive(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, str | None]:
    """Collect at most `cap` bytes per stream until the child ends; kill its group on a limit."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    killed = None
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and killed is None:
            left = deadline - time.monotonic()
            if left <= 0:
                killed = "timeout"
                break
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf, room = bufs[key.fd], cap - len(bufs[key.fd])
                buf += chunk[:room]
                if len(chunk) > room:
                    killed = "output_limit"
                    break
        if killed is None and not _exited(proc.pid, deadline):
            killed = "timeout"
        try:  # the leader is alive or a zombie here, so the group id cannot belong to anyone else
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        # Under bwrap the program is in its own session, killed as its pid namespace's init dies:
        # the pipes close when its last process is gone, so return only then (bounded).
        linger = time.monotonic() + 2.0
        while sel.get_map() and (left := linger - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                if not os.read(key.fd, 65536):
                    sel.unregister(key.fd)
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), killed


def _remove_tree(path: str) -> None:
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


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _execute(argv, cwd, env, pass_fds, start, timeout_s, cap, via_bwrap) -> SandboxResult:
    """Start `argv`, drive it to its end or a limit, and judge how it ended."""
    try:
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, pass_fds=pass_fds,
        )
    except OSError as exc:
        return SandboxResult(None, "", "", False, None, time.monotonic() - start, f"could not start: {exc}")
    with proc:
        try:
            out, err, killed = _drive(proc, start + timeout_s, cap)
        except BaseException:  # e.g. KeyboardInterrupt in the trainer: leave nothing running
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
            raise
    rc = proc.returncode
    if via_bwrap and rc is not None and rc > 128 and rc - 128 in signal.valid_signals():
        rc = 128 - rc  # bwrap reports a child killed by signal n as 128 + n
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    if killed is None and rc is not None and rc < 0:
        killed = "cpu_limit" if rc == -signal.SIGXCPU else f"signal {_signal_name(-rc)}"
    error = None
    launcher_failed = rc not in (0, _FAIL_RC) and stderr.startswith(("bwrap:", "unshare:", "setpriv:"))
    if killed is None and (rc == _SETUP_RC or launcher_failed):
        error = f"sandbox setup failed (exit {rc}): {stderr[-2000:]}"
    return SandboxResult(rc, stdout, stderr, killed == "timeout", killed, time.monotonic() - start, error)


def run_sandboxed(
    code: str,
    tests: str = "",
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    cpu_s: float | None = None,
    max_output_bytes: int = 65536,
    max_file_mb: float = 16,
    audit_hook: bool = True,
    sandbox: str = "os",
) -> SandboxResult:
    """Run `code`, then `tests`, in a fresh confined interpreter (see the module docstring).

    `cpu_s` defaults to `timeout_s` rounded up. Output beyond `max_output_bytes` on either stream
    kills the run (killed="output_limit"). `sandbox`: "os" (bubblewrap; SandboxUnavailable where it
    cannot start) or "weak". `audit_hook=False` leaves only the kernel's limits (for testing them);
    never use it for untrusted code.
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")
    if not isinstance(tests, str):
        raise ValueError(f"tests must be a str, got {type(tests).__name__}")
    _check_limits(timeout_s, memory_mb, cpu_s, max_output_bytes, max_file_mb)
    _check_mode(sandbox)
    cpu = max(1, math.ceil(timeout_s if cpu_s is None else cpu_s))
    numbers = [str(int(v)) for v in (memory_mb * 2**20, cpu, max_file_mb * 2**20, _NOFILE, audit_hook,
                                     _FAIL_RC, _SETUP_RC)]
    sources = {"solution.py": code.encode("utf-8", "surrogatepass"),
               "tests.py": tests.encode("utf-8", "surrogatepass")}
    child = [python_path(), "-I", "-S", "-B", "-X", "utf8", "-c", _BOOTSTRAP]
    start = time.monotonic()
    if sandbox == "os":
        box = _require_boundary()
        tmp = f"/tmp/gspo-sandbox-{secrets.token_hex(6)}"  # exists only in the run's mount namespace
        fds: list[int] = []
        try:
            for data in sources.values():
                fds.append(memfd("source", data))
            boxed = bwrap_argv(box, tmp, tmpfs_bytes(max_file_mb), list(zip(fds, sources)))
            argv = [*boxed, *child, tmp, *numbers]
            return _execute(argv, "/", child_env(tmp), fds, start, timeout_s, max_output_bytes, True)
        finally:
            for fd in fds:
                os.close(fd)
    prefix, _, who = weak_launcher()
    tmp = os.path.realpath(tempfile.mkdtemp(prefix="gspo-sandbox-"))
    try:
        for name, data in sources.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        if who.startswith(f"uid {NOBODY}"):
            os.chown(tmp, NOBODY, NOBODY)
        argv = [*prefix, *child, tmp, *numbers]
        return _execute(argv, tmp, child_env(tmp), (), start, timeout_s, max_output_bytes, False)
    finally:
        _remove_tree(tmp)


# ---- the reward -------------------------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_OPEN_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*)\Z", re.DOTALL)


def extract_code(completion: str) -> str:
    """The program in a completion: the last ```python (or ```py) block, else the last untagged
    ``` block, else an unclosed ```python block cut off at the end, else the whole text."""
    blocks = _FENCE.findall(completion)
    for wanted in ({"python", "python3", "py"}, {""}):
        chosen = [body for tag, body in blocks if tag.lower() in wanted]
        if chosen:
            return chosen[-1]
    tail = _OPEN_FENCE.search(completion)
    return tail.group(1) if tail else completion


def _tests_text(value, index: int, column: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = "\n".join(value)
    if not isinstance(value, str):
        raise ValueError(
            f"{column}[{index}] must be a str, a list of str or None, got {type(value).__name__}"
        )
    if not value.strip():
        raise ValueError(f"{column}[{index}] is empty: with no tests any program that runs would score 1")
    return value


class CodeReward:
    """Reward 1.0 where the completion's program passes its tests in the sandbox, else 0.0.

    Tests come from the dataset column `tests_column`: Python source (usually asserts) or a list
    of lines, run after the program in the same namespace; a None entry gives None (no opinion),
    as does a sandbox failure (with a warning). Up to `workers` programs run at once. `sandbox`:
    "os" or "weak" (see the module docstring); the first batch checks it, `code_reward()` at once.
    Example row: {"prompt": "Write add(a, b).", "tests": "assert add(2, 3) == 5"}.
    """

    reads_text = True  # a program is text: a chat dataset's completions arrive as their text

    __name__ = "code_tests"

    def __init__(
        self,
        *,
        timeout_s: float = 10.0,
        memory_mb: int = 1024,
        cpu_s: float | None = None,
        max_output_bytes: int = 65536,
        max_file_mb: float = 16,
        workers: int | None = None,
        tests_column: str = "tests",
        sandbox: str = "os",
    ):
        _check_limits(timeout_s, memory_mb, cpu_s, max_output_bytes, max_file_mb)
        _check_mode(sandbox)
        if workers is not None and (type(workers) is not int or workers < 1):
            raise ValueError(f"workers must be None or an int >= 1, got {workers!r}")
        if not isinstance(tests_column, str) or not tests_column:
            raise ValueError(f"tests_column must be a non-empty str, got {tests_column!r}")
        self.limits = dict(
            timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s,
            max_output_bytes=max_output_bytes, max_file_mb=max_file_mb,
        )
        self.sandbox = sandbox
        self.workers = workers if workers is not None else min(8, os.cpu_count() or 1)
        self.tests_column = tests_column

    def results(self, completions: list[str], tests: list) -> list[SandboxResult | None]:
        """One SandboxResult per completion (None where its tests are None), in order."""
        if len(tests) != len(completions):
            raise ValueError(
                f"{self.tests_column} has {len(tests)} entries, expected {len(completions)} "
                "(one per completion)"
            )
        column = self.tests_column
        programs = [extract_code(c) for c in completions]
        jobs = [(program, _tests_text(t, i, column)) for i, (program, t) in enumerate(zip(programs, tests))]
        if any(test is not None for _, test in jobs):
            check_sandbox(self.sandbox)  # here, not in each worker: one clear error for the batch

        def run(job):
            program, test = job
            return None if test is None else run_sandboxed(program, test, sandbox=self.sandbox, **self.limits)

        if not jobs:
            return []
        with ThreadPoolExecutor(max_workers=min(self.workers, len(jobs))) as pool:
            return list(pool.map(run, jobs))

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float | None]:
        if len(prompts) != len(completions):
            raise ValueError(f"prompts has {len(prompts)} entries but completions has {len(completions)}")
        if self.tests_column not in columns:
            raise ValueError(
                f"tests_column {self.tests_column!r} is not among the dataset columns {sorted(columns)}; "
                "the code reward reads each completion's tests from it"
            )
        rewards: list[float | None] = []
        for i, result in enumerate(self.results(completions, columns[self.tests_column])):
            if result is not None and result.error is not None:
                warnings.warn(f"code_tests: sample {i} was not judged: {result.error}", RuntimeWarning)
                result = None
            rewards.append(None if result is None else float(result.passed))
        return rewards


def code_reward(sandbox: str = "os", **limits) -> CodeReward:
    """A CodeReward (`limits`: its keyword arguments) whose sandbox is checked now, so a trainer
    refuses before training starts: SandboxUnavailable where `sandbox` cannot run here."""
    reward = CodeReward(sandbox=sandbox, **limits)
    check_sandbox(sandbox)
    return reward


# The built-in behind get_reward_fn("code_tests"): default limits, tests in the "tests" column.
# Built without probing, so importing this module works on a machine without bubblewrap.
code_tests = CodeReward()
