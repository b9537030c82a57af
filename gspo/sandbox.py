"""Sandboxed code reward: run model-written Python against tests in a separate, limited process.

Model output is never `exec`-ed in the trainer. Each program runs in a fresh interpreter
(`python -I -S -B`: isolated mode, no site-packages, no bytecode written) started with an empty
stdin, a minimal environment (PATH, LANG, LC_ALL, HOME=TMPDIR=the sandbox dir) and a fresh
temporary working directory that is deleted afterwards. The layers, strongest first:

- Kernel, always: resource limits set in the child before any model code runs: RLIMIT_AS
  (memory), RLIMIT_CPU, RLIMIT_FSIZE (largest file), RLIMIT_NOFILE, RLIMIT_CORE=0, and
  RLIMIT_NPROC=0 (no new processes or threads; the limit applies to the child alone, so the
  user's other processes do not matter). The parent enforces the wall-clock limit and the output
  cap (pipes read incrementally, at most `max_output_bytes` kept) and kills the child's whole
  process group.
- Kernel, where it works (probed once, see `describe_sandbox()`): an empty network namespace
  (`unshare --net`; as a normal user `unshare --user --map-root-user --net`), and, when the trainer
  runs as root, a switch to uid/gid 65534 (nobody) with `setpriv`, which makes RLIMIT_NPROC bite
  (root ignores it) and makes the kernel refuse writes outside the sandbox dir. If the interpreter
  lives where nobody cannot read it (pyenv under /root), nobody keeps CAP_DAC_READ_SEARCH, so
  reads are then guarded by the audit hook only, as they are for a non-root trainer.
- Defence in depth, not a security boundary: a `sys.addaudithook` hook in the child refuses
  process creation, signals to other processes, every socket operation, ctypes, tracing and heap
  walking (gc), opening files for writing outside the sandbox dir, and opening or listing anything
  outside the sandbox dir, the Python standard library and a few devices (so the user's home,
  /proc/<pid>/environ and /etc are unreadable). Where no network namespace is available, this
  hook is the only network barrier and a warning says so. Python code in the same process can,
  with effort, get around an audit hook; for hostile code use a container or VM as well.

Scoring: the program runs first, then the tests, in one namespace; the reward is 1.0 iff both
finish within the limits. Leaving early is a failure, including `sys.exit(0)`, `os._exit(0)`,
an atexit handler or a signal handler in the program (common reward hacks): the child exits 0
only through the sandbox's own exit after the last test. So tests must not call `sys.exit`
themselves (use asserts, or `unittest.main(exit=False)` and check the result). The tests are
deleted from disk before the program starts, though a program that inspects the interpreter's
frames could still read them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

__all__ = [
    "SandboxResult",
    "run_sandboxed",
    "network_isolation",
    "describe_sandbox",
    "extract_code",
    "CodeReward",
    "code_tests",
]

_NOBODY = 65534
_FAIL_RC = 3  # the program or a test raised (or tried to exit early)
_SETUP_RC = 111  # the sandbox's own setup failed before model code ran
_NOFILE = 64

# Runs in the child as `python -c`. argv: sandbox dir, memory bytes, cpu s, file bytes, max open
# files, policy flag (1: the full audit policy), failure status, setup-failure status.
# The audit hook is also the only holder of the real os._exit: the run ends with status 0 only
# when _main itself reports the tests passed; any other ending (an exception or SystemExit that
# escapes, a signal handler, the end of the script) reaches interpreter shutdown, where the hook
# exits with the failure status. The hook binds everything it uses as default arguments, so
# replacing builtins or module attributes from the program does not change its decisions.
_BOOTSTRAP = r'''
import builtins, os, posix, resource, sys, linecache, traceback, pathlib

def _limits(mem, cpu, fsize, nofile):
    R = resource
    for res, soft, hard in ((R.RLIMIT_CORE, 0, 0), (R.RLIMIT_AS, mem, mem), (R.RLIMIT_CPU, cpu, cpu + 1),
                            (R.RLIMIT_FSIZE, fsize, fsize), (R.RLIMIT_NOFILE, nofile, nofile),
                            (R.RLIMIT_NPROC, 0, 0)):
        cap = R.getrlimit(res)[1]
        if cap != R.RLIM_INFINITY:
            hard = min(hard, cap)
            soft = min(soft, hard)
        R.setrlimit(res, (soft, hard))

def _make_hook(reads, writes, policy, real_exit, fail, main_code, main_globals, me):
    deny = frozenset({
        "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
        "subprocess.Popen", "os.killpg", "os.symlink", "os.link", "os.chown", "os.setxattr",
        "os.removexattr", "resource.setrlimit", "resource.prlimit", "gc.get_objects",
        "gc.get_referrers", "gc.get_referents", "sys._current_frames", "sys.settrace", "sys.setprofile"})
    # posix: only a re-import (after deleting it from sys.modules) fires this event: a fresh _exit
    blocked_imports = frozenset({"ctypes", "_ctypes", "readline", "_testcapi", "_testinternalcapi", "posix"})
    path_events = frozenset({"os.mkdir", "os.rmdir", "os.remove", "os.chmod", "os.utime"})
    wflags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    pure = pathlib.PurePath

    def hook(event, args, _deny=deny, _blocked=blocked_imports, _pathev=path_events, _wflags=wflags,
             _reads=reads, _writes=writes, _policy=policy, _exit=real_exit, _fail=fail, _code=main_code,
             _globals=main_globals, _frame=sys._getframe, _me=me, _cwd=posix.getcwd, _pid=posix.getpid,
             _str=str, _bytes=bytes, _int=int, _type=type, _isinstance=isinstance, _PE=PermissionError,
             _pure=pure, _pfspath=pure.__fspath__, _pstr=pure.__str__):
        def check(path, write):
            t = _type(path)
            if t is _bytes:
                path = path.decode("utf-8", "surrogateescape")
            elif t is not _str:
                # pathlib objects whose methods nobody replaced, so this string is the one opened
                if not (_isinstance(path, _pure) and t.__fspath__ is _pfspath and t.__str__ is _pstr):
                    raise _PE("sandbox: only str, bytes and pathlib paths may be opened")
                path = _pstr(path)
            if not path.startswith("/"):
                path = _cwd() + "/" + path
            parts = []
            for part in path.split("/"):
                if part == "..":
                    if parts:
                        parts.pop()
                elif part and part != ".":
                    parts.append(part)
            path = "/" + "/".join(parts)
            for root in (_writes if write else _reads):
                if path == root or path.startswith(root + "/"):
                    return
            raise _PE("sandbox: " + ("writing " if write else "reading ") + path + " is not allowed")

        if event == "gspo.sandbox.exit":
            caller = _frame(1)
            if caller.f_code is _code and caller.f_globals is _globals:
                _exit(args[0])
            raise _PE("sandbox: only the sandbox ends the run")
        if event == "cpython._PySys_ClearAuditHooks":
            _exit(_fail)  # interpreter shutdown: the run did not end through _main
        if not _policy:
            return
        if event in _deny or event.startswith(("socket.", "ctypes.")):
            raise _PE("sandbox: " + event + " is not allowed")
        if event == "open":
            path, mode, flags = args
            if _type(path) is _int:
                return  # a descriptor that is already open
            if mode is None and not (_type(path) in (_str, _bytes) and path[:1] in ("/", b"/")):
                raise _PE("sandbox: os.open needs an absolute path")  # its dir_fd is not audited
            check(path, bool(flags & _wflags))
        elif event == "os.listdir" or event == "os.scandir":
            if _type(args[0]) is not _int:
                check("." if args[0] is None else args[0], False)
        elif event in _pathev or event == "os.truncate":
            if _type(args[0]) is _int and event != "os.truncate":
                raise _PE("sandbox: " + event + " on a descriptor is not allowed")
            if event != "os.truncate" and args[-1] not in (None, -1):  # -1: no dir_fd given
                raise _PE("sandbox: dir_fd is not allowed")
            if _type(args[0]) is not _int:
                check(args[0], True)
        elif event == "os.rename":
            if args[2] not in (None, -1) or args[3] not in (None, -1):
                raise _PE("sandbox: dir_fd is not allowed")
            check(args[0], True)
            check(args[1], True)
        elif event == "os.kill":
            if args[0] != _pid():
                raise _PE("sandbox: signalling other processes is not allowed")
        elif event == "import":
            if args[0].partition(".")[0] in _blocked:
                raise _PE("sandbox: importing " + args[0] + " is not allowed")
        elif event == "object.__setattr__" and args[0] is _me[0]:
            raise _PE("sandbox: the audit hook cannot be changed")
        elif event == "sqlite3.connect" and args[0] != ":memory:":
            check(args[0], True)

    me.append(hook)
    return hook

def _refused_exit(*args):
    raise PermissionError("sandbox: os._exit is not allowed; only the sandbox ends the run")

def _main():
    tmp, (mem, cpu, fsize, nofile, policy, fail, setup_fail) = sys.argv[1], map(int, sys.argv[2:])
    try:
        _limits(mem, cpu, fsize, nofile)
        sources = []
        for name in ("solution.py", "tests.py"):
            with open(tmp + "/" + name, "rb") as f:
                sources.append(f.read().decode("utf-8", "replace"))
            os.unlink(tmp + "/" + name)
        stdlib = tuple(os.path.realpath(p) for p in sys.path if p)
        devices = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/stdout", "/dev/stderr")
        reads = (tmp,) + stdlib + devices + ("/usr/share/zoneinfo",)
        writes = (tmp, "/dev/null", "/dev/stdout", "/dev/stderr")
        sys.addaudithook(_make_hook(reads, writes, policy, posix._exit, fail, _main.__code__, globals(), []))
    except BaseException:
        traceback.print_exc()
        posix._exit(setup_fail)
    os._exit = posix._exit = _refused_exit
    program, tests = sources
    # Bound now: the program may replace builtins and module attributes before these are used.
    _exec, _compile, _print_exc, _audit = builtins.exec, builtins.compile, traceback.print_exc, sys.audit
    _SystemExit, _BaseException, _stderr = SystemExit, BaseException, sys.__stderr__
    linecache.cache["solution.py"] = (len(program), None, program.splitlines(True), "solution.py")
    main = type(sys)("__main__")
    sys.modules["__main__"] = main
    code = fail
    try:
        _exec(_compile(program, "solution.py", "exec"), main.__dict__)
        del program
        _exec(_compile(tests, "tests.py", "exec"), main.__dict__)
        code = 0
    except _SystemExit:
        _stderr.write("sandbox: the program exited before the tests finished\n")
    except _BaseException:
        _print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr, _stderr, sys.__stdout__):
            try:
                stream.flush()
            except _BaseException:
                pass
        _audit("gspo.sandbox.exit", code)

_main()
'''


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


def _python() -> str:
    if not sys.executable:
        raise RuntimeError("the sandbox needs sys.executable to start a fresh Python interpreter")
    # The real interpreter, not a venv shim, so a dropped uid only needs to read the stdlib.
    return os.path.realpath(sys.executable)


def _probe(prefix: list[str]) -> bool:
    """True if `prefix python` starts here and imports the trainer's own standard library."""
    try:
        done = subprocess.run(
            [*prefix, _python(), "-I", "-S", "-B", "-c", "import os; print(os.path.realpath(os.__file__))"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, cwd=tempfile.gettempdir(),
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    # An interpreter that cannot read its own prefix falls back to another stdlib (e.g. /usr/lib).
    return done.returncode == 0 and done.stdout.strip() == os.path.realpath(os.__file__)


@functools.lru_cache(maxsize=None)
def _launcher() -> tuple[tuple[str, ...], bool, str]:
    """(command prefix, has a network namespace, user description): the strongest that works here."""
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    root = os.geteuid() == 0
    netns = []
    if unshare:
        netns = [unshare, "--net"] if root else [unshare, "--user", "--map-root-user", "--net"]
    drops: list[tuple[list[str], str]] = []
    if root and setpriv:
        drop = [setpriv, f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups", "--no-new-privs"]
        caps = ["--inh-caps=-all,+dac_read_search", "--ambient-caps=-all,+dac_read_search"]
        drops = [(drop, f"uid {_NOBODY}"), (drop + caps, f"uid {_NOBODY} + CAP_DAC_READ_SEARCH")]
    user = "root (NPROC and file permissions do not bind root)" if root else "the trainer's user"
    candidates = [(netns + d, n) for d, n in drops] + drops + [(netns, user), ([], user)]
    tried = set()
    for prefix, who in candidates:
        if tuple(prefix) in tried:
            continue
        tried.add(tuple(prefix))
        if _probe(prefix):
            has_netns = bool(unshare) and bool(prefix) and prefix[0] == unshare
            weak = [] if has_netns else ["the network"]
            if who is user and root:
                weak.append("process creation and writes outside the sandbox dir (root is not dropped)")
            if weak:
                warnings.warn(
                    f"gspo.sandbox: {' and '.join(weak)} are guarded only by an in-process audit hook, "
                    "which is not a security boundary (unshare or setpriv is missing or failed)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return tuple(prefix), has_netns, who
    raise RuntimeError(f"the sandbox cannot start {_python()} even without isolation")


def network_isolation() -> str:
    """'netns' (an empty network namespace) or 'audit_hook' (in-process refusal of sockets only)."""
    return "netns" if _launcher()[1] else "audit_hook"


def describe_sandbox() -> str:
    """One line saying which isolation mechanisms are active on this machine."""
    prefix, has_netns, who = _launcher()
    net = "empty network namespace" if has_netns else "audit hook only"
    launcher = " ".join(prefix) or "(none)"
    return f"network: {net}; runs as: {who}; rlimits AS/CPU/FSIZE/NOFILE, NPROC=0; launcher: {launcher}"


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
) -> SandboxResult:
    """Run `code`, then `tests`, in a fresh limited interpreter (see the module docstring).

    `cpu_s` defaults to `timeout_s` rounded up. Output beyond `max_output_bytes` on either stream
    kills the run (killed="output_limit"). `audit_hook=False` leaves only the kernel's limits
    (for testing them); never use it for untrusted code.
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")
    if not isinstance(tests, str):
        raise ValueError(f"tests must be a str, got {type(tests).__name__}")
    _check_limits(timeout_s, memory_mb, cpu_s, max_output_bytes, max_file_mb)
    cpu = max(1, math.ceil(timeout_s if cpu_s is None else cpu_s))
    prefix, _, who = _launcher()
    tmp = os.path.realpath(tempfile.mkdtemp(prefix="gspo-sandbox-"))
    start = time.monotonic()
    try:
        for name, text in (("solution.py", code), ("tests.py", tests)):
            with open(os.path.join(tmp, name), "w", encoding="utf-8", errors="surrogatepass") as f:
                f.write(text)
        if who.startswith(f"uid {_NOBODY}"):
            os.chown(tmp, _NOBODY, _NOBODY)
        argv = [
            *prefix, _python(), "-I", "-S", "-B", "-X", "utf8", "-c", _BOOTSTRAP,
            tmp, *(str(int(v)) for v in (memory_mb * 2**20, cpu, max_file_mb * 2**20, _NOFILE, audit_hook,
                                         _FAIL_RC, _SETUP_RC)),
        ]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": tmp,
               "TMPDIR": tmp}
        try:
            proc = subprocess.Popen(
                argv, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True,
            )
        except OSError as exc:
            elapsed = time.monotonic() - start
            return SandboxResult(None, "", "", False, None, elapsed, f"could not start: {exc}")
        with proc:
            try:
                out, err, killed = _drive(proc, start + timeout_s, max_output_bytes)
            except BaseException:  # e.g. KeyboardInterrupt in the trainer: leave nothing running
                if proc.returncode is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                raise
        rc = proc.returncode
    finally:
        _remove_tree(tmp)
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    if killed is None and rc is not None and rc < 0:
        killed = "cpu_limit" if rc == -signal.SIGXCPU else f"signal {signal.Signals(-rc).name}"
    error = None
    launcher_failed = rc not in (0, _FAIL_RC) and stderr.startswith(("unshare:", "setpriv:"))
    if killed is None and (rc == _SETUP_RC or launcher_failed):
        error = f"sandbox setup failed (exit {rc}): {stderr[-2000:]}"
    return SandboxResult(rc, stdout, stderr, killed == "timeout", killed, time.monotonic() - start, error)


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
    as does a sandbox failure (with a warning). Up to `workers` programs run at once.
    Example row: {"prompt": "Write add(a, b).", "tests": "assert add(2, 3) == 5"}.
    """

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
    ):
        _check_limits(timeout_s, memory_mb, cpu_s, max_output_bytes, max_file_mb)
        if workers is not None and (type(workers) is not int or workers < 1):
            raise ValueError(f"workers must be None or an int >= 1, got {workers!r}")
        if not isinstance(tests_column, str) or not tests_column:
            raise ValueError(f"tests_column must be a non-empty str, got {tests_column!r}")
        self.limits = dict(
            timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s,
            max_output_bytes=max_output_bytes, max_file_mb=max_file_mb,
        )
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

        def run(job):
            program, test = job
            return None if test is None else run_sandboxed(program, test, **self.limits)

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


# The built-in behind get_reward_fn("code_tests"): default limits, tests in the "tests" column.
code_tests = CodeReward()
