"""Sandboxed code reward: model-written Python in one confined process, its tests in another.

Model output is never `exec`-ed in the trainer. Each run starts two fresh interpreters (`python -I
-S -B`: isolated mode, no site-packages, no bytecode written), each in a sandbox of its own with a
minimal environment (PATH, LANG, LC_ALL, HOME=TMPDIR=its working dir; bwrap adds PWD):

- **the program's process** (child.py) runs the program as `__main__`, then answers
  questions about its names: call this, get that attribute, compare these two objects;
- **the judge** (judge.py) reads the tests from its stdin (never a file the program could
  see), runs them, and asks the program's process whatever they ask of the program's names. Its
  exit status is the verdict: 0 iff the program ran to its end and the tests then ran to theirs.

The verdict is out of the program's reach: the program shares no process, memory, file or pid
namespace with the judge (another bwrap; the judge is also non-dumpable, so no ptrace or
/proc/PID/mem in weak mode either, and seccomp refuses ptrace to the program), and what it sends back over
the channel is decoded as data only (wire.py): numbers, strings, bytes and containers of
them arrive in the judge as the plain built-in types, anything else as a handle whose every operation
is asked of the program again. So rewriting the bootstrap's globals, calling its main again, walking
frames or the heap to a verdict, exiting with status 0 (`sys.exit`, `os._exit`, `exec /bin/true`),
killing or signalling anything: each is at most a program that stops answering, and fails.

What the tests see (the semantics of a separate process):
- the program's global names, bound after it ran and re-bound when a call re-binds them (a global
  mutated in place is seen as it was when last bound), also as `solution.NAME` (`from solution import
  f` works). Names that shadow a builtin (`abs`, `len`, `isinstance`, ...) do not replace the tests'
  builtins: reach them as `solution.abs`.
- data as copies: a list passed to a function and changed there in place is copied back into the
  tests' list (list, dict, set, bytearray arguments); values over ~16 MB (1 MB for a global) and
  cycles arrive as handles.
- the program's objects as handles: calls, attributes, operators, iteration, `len`, `str`, `hash`,
  `isinstance(x, TheirClass)`, `with` all work. A handle compares (`==`, `<`, ...) only with another
  handle; against data it is unequal (and `<` a TypeError): so an object whose `__eq__` says True to
  everything, or a str/int subclass that does, matches no expected value.
- the program's exceptions: raised in the judge as the nearest built-in class, or as a class of the
  same name for the program's own (`except TheirError` works), with the program's traceback as a note.
- not the program's files (the judge has its own folder), and nothing of the judge's may be passed to
  the program but data and handles (no callbacks: TypeError). `type(handle)` is the judge's proxy type.
- tests may end with `unittest.main()`: SystemExit(0) from the tests is a pass, any other code a fail.

The boundary, `sandbox="os"` (the default), is the kernel's, set up by bubblewrap (`bwrap`; the
environment variable GSPO_BWRAP may name another binary), for each of the two processes. A private
mount namespace shows
- read-only: /usr; the host's /bin, /sbin, /lib* (symlinks stay symlinks); the interpreter's real
  prefix (`sys.base_prefix`); a minimal /dev (null, zero, full, random, urandom, tty, a private
  pts). Nothing else of the host: no /etc, /home, /var, no other part of /root, no trainer files;
- /proc of the process's own pid namespace: the host's processes, and the other side, are invisible;
- writable: one directory, the working dir, a tmpfs in memory of max(16 MB, 4 x max_file_mb).
  The program arrives in it through a file descriptor, so a run writes nothing on the host's disks
  and leaves nothing behind.
It adds pid, ipc, uts, network (its own loopback only) and, where possible, cgroup namespaces;
`--die-with-parent` and the pid namespace mean that killing a run kills all of it, and
`--new-session` detaches it from any terminal. As root, bwrap makes no user namespace (one made
by root maps the sandbox's uid to root outside) and `setpriv` switches to uid/gid 65534 with no
groups, no capabilities (an empty bounding set too) and no_new_privs. As another user: an
unprivileged user namespace, the trainer's uid inside, every capability dropped and (bwrap >= 0.8)
no nested user namespaces. Either way root's files (/proc/sys, ...) are closed to the program.
Where this does not start, a run raises SandboxUnavailable naming why and the fixes;
`code_reward()` checks when it is built.

`sandbox="weak"` runs without bubblewrap, in host temp dirs deleted afterwards: an empty network
namespace (`unshare --net`; as a normal user `unshare --user --map-root-user --net`) and, as root, a
switch to uid 65534 with `setpriv` (keeping CAP_DAC_READ_SEARCH where the interpreter lives where
nobody cannot read, e.g. pyenv under /root, which leaves every read to the audit hook), each where
it works. The file system is then guarded by file permissions and the audit hook only; a
RuntimeWarning names whatever is left to the hook alone.

Both modes, in the program's process before the program runs: a seccomp filter (x86_64, aarch64;
gspo.sandbox.kernel) refusing memory held outside the address space (memfd, SysV shm and
message queues, io_uring, userfaultfd, keyrings, bpf), ptrace and process_vm_*, namespaces and
mounts; rlimits RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE (largest file), RLIMIT_NOFILE,
RLIMIT_CORE=0 and RLIMIT_NPROC=0 (no new processes or threads); where the trainer may make one, a
memory cgroup per run capping everything the kernel charges to it (tmpfs and memfd pages too) at
memory_mb + the tmpfs + 32 MB (killed="memory_limit"). The judge gets the same rlimits. The parent
enforces the wall clock and the output cap (pipes read incrementally, at most `max_output_bytes`
kept per stream), kills both process groups and waits for their pipes to close. An audit hook in the
program's process refuses process creation, signals to other processes, sockets, ctypes, tracing and
heap walking, and opening, listing or writing anything outside the working dir, the standard library
and a few devices. It is defence in depth, not a boundary: code in the same process can get round it
(sqlite's ATTACH opens files it never sees). `audit_hook=False` turns its policy off, to test the
kernel alone. `describe_sandbox()` says which of these layers are active here.

Limits that remain. Security: the kernel's system-call surface beyond the seccomp list is reachable,
so a kernel bug is an escape; CPU and processes are bounded by rlimits and the wall clock, memory by
RLIMIT_AS alone where no cgroup can be made (the seccomp list closes the known ways around it, the
tmpfs is bounded by its size, pipes by RLIMIT_NOFILE); as root, uid 65534 is shared with any
"nobody" process on the host, which could signal or trace the sandbox (not the reverse); the global
files of /proc (cpuinfo, meminfo, ...) are readable; in weak mode both processes share the host's
pid namespace, so the program can kill the judge (a failure, never a pass). Reward hacking: the
program decides whatever the tests ask of its own objects: comparisons between two of them, their
`bool`, `len`, `str`, arithmetic and iteration; tests that compare only handles with handles, or test
truthiness alone, can be satisfied by an object built to agree; a program can still special-case the
inputs it is called with: it sees the arguments of every call (an expected value passed as one is
readable to it), never the tests' source. Tests should compare the
program's answers with expected data (`assert f(2) == 4`), as most code datasets do.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gspo.sandbox.execute import Ended, Held, Launch, judged, run_pair
from gspo.sandbox.kernel import HEADROOM_MB, RunCgroup, cgroup_parent, seccomp_filter
from gspo.sandbox.kernel import describe as describe_kernel
from gspo.sandbox.launch import (
    NOBODY,
    TMPFS_FILES,
    TMPFS_MIN_MB,
    Bwrap,
    boundary,
    bwrap_commands,
    child_env,
    memfd,
    python_path,
    tmpfs_bytes,
    weak_commands,
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
    "seccomp_filter",
    "cgroup_parent",
    "extract_code",
    "CodeReward",
    "code_reward",
    "code_tests",
]

SANDBOX_MODES = ("os", "weak")
_FAIL_RC = 3  # the judge: the program or a test raised, or the program's process ended or broke the channel
_SETUP_RC = 111  # the sandbox's own setup failed before model code ran
_NOFILE = 64
_FRAME_CAP = 64 * 2**20  # the largest message between the program's process and the judge
_RLIMITS = "rlimits AS/CPU/FSIZE/NOFILE, NPROC=0"
_HERE = Path(__file__).parent
_WIRE = (_HERE / "wire.py").read_text(encoding="utf-8")
_CHILD = _WIRE + (_HERE / "child.py").read_text(encoding="utf-8")
_JUDGE = _WIRE + (_HERE / "judge.py").read_text(encoding="utf-8")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """One sandboxed run. `passed` iff the judge saw the tests run to their end within every limit."""

    returncode: int | None  # the judge's exit status (0: passed); negative: killed by that signal; None: not started
    stdout: str  # the program's process's stdout, then the judge's (each its first max_output_bytes bytes)
    stderr: str  # the same for stderr: the program's tracebacks, then the tests' and the judge's reason
    timed_out: bool
    killed: str | None  # "timeout", "output_limit", "cpu_limit", "memory_limit", "signal SIGSEGV", ...; None
    duration_s: float
    error: str | None = None  # the sandbox itself failed; the program was not judged
    program_returncode: int | None = None  # the program's process's status (0 once it served the judge)

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
            f"no capabilities, no new privileges); {_layers()}"
        )
    prefix, has_netns, who = weak_launcher()
    net = "empty network namespace" if has_netns else "audit hook only"
    return (
        "boundary: weak (no mount namespace: file permissions and an in-process audit hook are the "
        f"only file-system barrier); runs as: {who}; network: {net}; {_layers()}; "
        f"launcher: {' '.join(prefix) or '(none)'}"
    )


def _layers() -> str:
    return (f"{_RLIMITS}; {describe_kernel()}; audit hook; verdict: the tests run in a judge process the "
            "program cannot reach")


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
    """Run `code` in one confined process and `tests` against it in another (see the module docstring).

    `cpu_s` (each process's CPU time) defaults to `timeout_s` rounded up; `memory_mb` bounds each
    process's address space (and, with a memory cgroup, all the program's process holds). Output
    beyond `max_output_bytes` on any stream kills the run (killed="output_limit"). `sandbox`: "os"
    (bubblewrap; SandboxUnavailable where it cannot start) or "weak". `audit_hook=False` leaves the
    program only the kernel's limits (for testing them); never use it for untrusted code.
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")
    if not isinstance(tests, str):
        raise ValueError(f"tests must be a str, got {type(tests).__name__}")
    _check_limits(timeout_s, memory_mb, cpu_s, max_output_bytes, max_file_mb)
    _check_mode(sandbox)
    box = _require_boundary() if sandbox == "os" else None
    prefix, _, who = weak_launcher() if box is None else ((), False, "")
    cpu = max(1, math.ceil(timeout_s if cpu_s is None else cpu_s))
    limits = [memory_mb * 2**20, cpu, int(max_file_mb * 2**20), _NOFILE]
    filt = seccomp_filter()
    interpreter = [python_path(), "-I", "-S", "-B", "-X", "utf8", "-c"]
    start = time.monotonic()
    held = Held()
    try:
        program, judge = _launches(code, tests, held, box=box, prefix=prefix, who=who, limits=limits, filt=filt,
                                   interpreter=interpreter, audit_hook=audit_hook, memory_mb=memory_mb,
                                   max_file_mb=max_file_mb)
        outcome = run_pair(program, judge, start + timeout_s, max_output_bytes, box is not None, held.close_fds)
        duration = time.monotonic() - start
        if isinstance(outcome, str):
            return SandboxResult(None, "", "", False, None, duration, outcome)
        ended_program, ended_judge, killed = outcome
        killed = judged(ended_program, ended_judge, killed, held.cgroup)
        program_set_up = held.setup_file.read(1) == b"1"  # every writer has ended: this cannot block
    finally:
        held.release()
    stdout = (ended_program.stdout + ended_judge.stdout).decode("utf-8", "replace")
    stderr = (ended_program.stderr + ended_judge.stderr).decode("utf-8", "replace")
    error = None if killed is not None else _setup_error(ended_program, ended_judge, program_set_up)
    return SandboxResult(ended_judge.returncode, stdout, stderr, killed == "timeout", killed, duration, error,
                         ended_program.returncode)


def _launches(code: str, tests: str, held: Held, *, box: Bwrap | None, prefix, who: str, limits: list[int],
              filt: bytes | None, interpreter: list[str], audit_hook: bool, memory_mb: int,
              max_file_mb: float) -> tuple[Launch, Launch]:
    """The program's process and the judge, ready to start: their channel's pipes, the tests (the judge's stdin)
    and the program's source made here, each kept in `held`."""
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    setup_r, setup_w = os.pipe()  # one byte once the program's process is set up (see child)
    held.fds += [requests_r, requests_w, replies_r, replies_w, setup_w]
    held.setup_file = os.fdopen(setup_r, "rb")
    tests_fd = memfd("tests", tests.encode("utf-8", "surrogatepass"))  # the judge's stdin: never a file
    held.fds.append(tests_fd)
    source = code.encode("utf-8", "surrogatepass")
    program_args = [*limits, int(audit_hook), _SETUP_RC, requests_r, replies_w, _FRAME_CAP, setup_w]
    judge_args = [*limits, _FAIL_RC, _SETUP_RC, requests_w, replies_r, _FRAME_CAP]
    if box is not None:
        program_cmd, judge_cmd, ptmp, jtmp, source_fd = bwrap_commands(box, source, max_file_mb, held.fds)
        cwd, program_fds = "/", (source_fd, requests_r, replies_w, setup_w)
    else:
        program_cmd, judge_cmd, ptmp, jtmp = weak_commands(prefix, who, source, held.folders)
        cwd, program_fds = None, (requests_r, replies_w, setup_w)
    program_argv = [*program_cmd, *interpreter, _CHILD, ptmp, *map(str, program_args), filt.hex() if filt else "-"]
    if cgroup_parent()[0] is not None:
        held.cgroup = RunCgroup((memory_mb + HEADROOM_MB) * 2**20 + tmpfs_bytes(max_file_mb))
        program_argv = held.cgroup.wrap(program_argv)
    program = Launch(program_argv, cwd or ptmp, child_env(ptmp), program_fds)
    judge = Launch([*judge_cmd, *interpreter, _JUDGE, *map(str, judge_args)], cwd or jtmp, child_env(jtmp),
                   (requests_w, replies_r), stdin=tests_fd)
    return program, judge


def _setup_error(ended_program: Ended, ended_judge: Ended, program_set_up: bool) -> str | None:
    """Why the sandbox's own set-up failed (its status, or a launcher's complaint), or None.

    The program's own exit status is the program's to choose: it says "set-up failed" only from a
    process that never got as far as the program.
    """
    for ended in (ended_judge,) if program_set_up else (ended_program, ended_judge):
        text = ended.stderr.decode("utf-8", "replace")
        launcher = ended.returncode not in (0, _FAIL_RC) and text.startswith(("bwrap:", "unshare:", "setpriv:", "sh:"))
        if ended.returncode == _SETUP_RC or launcher:
            return f"sandbox setup failed (exit {ended.returncode}): {text[-2000:]}"
    return None


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

    def check_rows(self, rows: list[dict]) -> None:
        """Every row's tests, before training (`gspo.data.source.prompt_source` calls it): None (no
        opinion), a non-empty str or a list of str, as `results` reads them; else a ValueError naming
        the row (its file and line)."""
        column = self.tests_column
        for i, row in enumerate(rows):
            value = row.get(column)
            try:
                _tests_text(value, i, column)
            except ValueError:
                text = isinstance(value, (str, list, tuple)) and all(isinstance(v, str) for v in value)
                problem = ("is empty: with no tests any program that runs would score 1" if text else
                           f"must be a non-empty string or a list of strings, got {type(value).__name__} {value!r:.80}")
                raise ValueError(f"dataset: {getattr(row, 'where', f'row {i}')}: {column} {problem}") from None

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
                warnings.warn(f"code_tests: sample {i} was not judged: {result.error}", RuntimeWarning, stacklevel=2)
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
