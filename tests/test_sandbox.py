"""Sandboxed code reward: hostile programs are contained within their limits, correct ones score 1.

Each hostile case asserts three things: the run failed (reward 0), the harm did not happen
(no file written, no secret printed, no connection made, no process signalled or left behind)
and it ended within its time limit. The OS boundary's cases run with the audit hook on and off,
so the kernel alone is shown to hold; where cheap, a control run (the weak sandbox without its
hook, or no sandbox) shows the same program does the harm, so the test can fail.
"""

import collections
import decimal
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

from gspo.data.rewards import get_reward_fn
from gspo.sandbox import execute
from gspo.sandbox import runner as sandbox
from gspo.sandbox.runner import (
    CodeReward,
    SandboxUnavailable,
    code_reward,
    describe_sandbox,
    extract_code,
    network_isolation,
    run_sandboxed,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="uses Linux rlimits and namespaces")


def _no_os_boundary() -> str | None:
    try:
        sandbox.check_sandbox("os")
    except SandboxUnavailable as exc:
        return str(exc)
    return None


NO_OS = _no_os_boundary() if sys.platform == "linux" else "not Linux"
MODE = "weak" if NO_OS else "os"  # without bubblewrap the scoring and limit tests use the weak sandbox
needs_os = pytest.mark.skipif(NO_OS is not None, reason=f"needs bubblewrap (CI has it): {NO_OS}")
HOOK = pytest.mark.parametrize("audit_hook", [True, False], ids=["hook", "kernel_only"])

SMALL = dict(timeout_s=5.0, memory_mb=256)
ADD = "def add(a, b):\n    return a + b\n"


def run(code: str, tests: str = "", **limits):
    return run_sandboxed(textwrap.dedent(code), textwrap.dedent(tests), **{"sandbox": MODE, **SMALL, **limits})


def unsandboxed(program: str) -> subprocess.CompletedProcess:
    """The control: the same program in a plain interpreter, no sandbox at all."""
    return subprocess.run([sys.executable, "-I", "-S", "-c", textwrap.dedent(program)],
                          capture_output=True, text=True, timeout=30)


def kernel_refuses_forks() -> bool:
    # RLIMIT_NPROC binds any user but root; the OS boundary and weak's setpriv never run as root.
    return MODE == "os" or os.geteuid() != 0 or "runs as: uid" in describe_sandbox("weak")


@pytest.fixture
def open_dir():
    """A world-writable, world-readable dir outside the sandbox: only the sandbox stands in the way."""
    path = tempfile.mkdtemp(prefix="gspo-outside-")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def outside_dirs(open_dir):
    """open_dir, and where we may make one, a world-writable dir inside the interpreter's prefix,
    which the OS boundary shows read-only (a system python run by a normal user: open_dir only)."""
    try:
        visible = tempfile.mkdtemp(prefix="gspo-visible-", dir=os.path.realpath(sys.base_prefix))
    except OSError:
        yield [open_dir]
        return
    os.chmod(visible, 0o777)
    yield [open_dir, visible]
    shutil.rmtree(visible, ignore_errors=True)


# ---- scoring ---------------------------------------------------------------------------------

def test_correct_code_scores_one_and_wrong_code_zero():
    reward = CodeReward(**SMALL, workers=2, sandbox=MODE)
    completions = [
        f"Here you go:\n```python\n{ADD}```\nDone.",  # fenced
        ADD,  # bare program
        "def add(a, b):\n    return a - b\n",  # wrong
        "```python\ndef add(a, b) return a\n```",  # syntax error
        ADD,
    ]
    check = "assert add(2, 3) == 5"
    tests = [check, check, check, check, [check, "assert add(-1, 1) == 1"]]  # a list of lines too
    assert reward(["p"] * 5, completions, tests=tests) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert reward.__name__ == "code_tests"


def test_result_details():
    ok = run("print('hello')\n" + ADD, "assert add(1, 1) == 2")
    assert ok.passed and ok.returncode == 0 and ok.stdout == "hello\n" and ok.stderr == ""
    assert ok.killed is None and not ok.timed_out and ok.error is None and 0 < ok.duration_s < 5
    bad = run("print('hello')\n" + ADD, "assert add(1, 1) == 3")
    assert not bad.passed and bad.returncode == sandbox._FAIL_RC and bad.killed is None
    assert bad.stdout == "hello\n" and "AssertionError" in bad.stderr
    assert 'File "tests.py", line 1' in bad.stderr


def test_files_inside_the_sandbox_dir_work_and_the_dir_is_removed():
    r = run(
        """
        import os
        os.mkdir("d")
        with open("d/f.txt", "w") as f:
            f.write("fine")
        print(os.getcwd(), sorted(os.listdir(".")))
        def read():
            return open("d/f.txt").read()
        def lock():
            os.chmod("d", 0)  # cleanup must still work
        """,
        # the tests run in the judge's process, in a folder of its own: they see the program's names, not its files
        "assert read() == 'fine'\nlock()\nimport os\nassert not os.path.exists('d')",
    )
    assert r.passed, r.stderr
    workdir, listing = r.stdout.split(" ", 1)
    assert listing == "['d']\n"  # solution.py and tests.py were deleted before the program ran
    assert os.path.basename(workdir).startswith("gspo-sandbox-") and not os.path.exists(workdir)


@needs_os
@pytest.mark.parametrize("max_file_mb, tmpfs_mb", [(2, 16), (8, 32)])  # max(16 MB, 4 x max_file_mb)
def test_the_working_dir_is_a_tmpfs_bounded_by_max_file_mb(max_file_mb, tmpfs_mb):
    # A file-writing loop fills the run's own tmpfs, never a disk; 1 MB files fill it exactly.
    program = """
        import errno
        block, total, stop = b"x" * 2**20, 0, None
        for i in range(40):  # 40 MB wanted
            try:
                with open(f"f{i}", "wb") as f:
                    f.write(block)
                total += len(block)
            except OSError as err:
                stop = errno.errorcode[err.errno]
                break
        print(total // 2**20, stop)
        """
    r = run(program, "assert stop is None", max_file_mb=max_file_mb)
    assert r.stdout == f"{tmpfs_mb} ENOSPC\n" and not r.passed and r.duration_s < 5


@pytest.mark.parametrize(
    "program",
    [
        "import sys\nsys.exit(0)",
        "import os\nos._exit(0)",
        "raise SystemExit(0)",
        "import atexit, os\natexit.register(lambda: os._exit(0))",
        "import os\nos.execv('/bin/true', ['true'])",  # replaces the sandbox with a process exiting 0
    ],
)
def test_exiting_early_does_not_pass(program):
    # The classic reward hack: leave with status 0 before the (failing) tests run.
    r = run(program, "assert False, 'the tests ran'")
    assert not r.passed and r.returncode == sandbox._FAIL_RC and r.killed is None


def test_a_function_raising_systemexit_does_not_pass():
    r = run("def f():\n    raise SystemExit(0)\n", "assert f() == 1")
    assert not r.passed and "exited before the tests finished" in r.stderr


TAMPERING = {
    # keep the real SystemExit, then make the sandbox's own `except SystemExit` miss it
    "builtins": "import builtins\nE = SystemExit\nbuiltins.SystemExit = builtins.BaseException = ValueError\n"
    "def f():\n    raise E(0)\n",
    # a handler raising SystemExit(0) every 0.1 ms, also while the sandbox finishes up
    "signal": "import signal\nE = SystemExit\ndef h(*a):\n    raise E(0)\nsignal.signal(signal.SIGALRM, h)\n"
    "signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0001)\n",
    "fake_exit_event": "import sys\nsys.audit('gspo.sandbox.runner.exit', 0)",
    "exit_event_from_the_sandbox_frame": "import sys\n"
    "sys._getframe(1).f_locals['_audit']('gspo.sandbox.runner.exit', 0)",
    "replaced_stdout": "import sys\nE = SystemExit\nclass Out:\n    def write(self, s):\n        pass\n"
    "    def flush(self):\n        raise E(0)\nsys.stdout = Out()\n",
}


@pytest.mark.parametrize("name", sorted(TAMPERING))
def test_tampering_with_the_sandbox_exit_does_not_pass(name):
    r = run(TAMPERING[name], "assert f() == 1" if name == "builtins" else "assert False")
    # The sandbox reports the failure status; or, for "signal", the program's own 0.1 ms timer may outlive its
    # handler (interpreter shutdown puts the default action back) and kill it by SIGALRM first, which is also
    # a failure. Which one comes first is timing: under load CI has seen the second.
    own_timer = name == "signal" and r.killed == "signal SIGALRM" and r.returncode == -signal.SIGALRM
    assert not r.passed and (r.returncode == sandbox._FAIL_RC or own_timer), r


# ---- forged verdicts (issue 31): the verdict is the judge's, in a process the program cannot reach -----
# Each of these scored 1.0 at bbf266e (where the tests ran in the program's own process) with the audit
# hook off, and all but exec_true and gc_referrers_exit with it on too: the bootstrap's globals, reached
# through a frame, gave its main and limits to call again over emptied files; the hook's defaults held
# the real os._exit; an object equal to anything, or a program's own `abs`, answered the tests' question.

REWRITE_AND_RERUN = "g['_limits'] = lambda *a: None\nopen(sys.argv[1] + '/solution.py', 'w').close()\n" \
    "open(sys.argv[1] + '/tests.py', 'w').close()\ng['_main']()\n"
FORGERIES = {
    "frame_reentry": "import sys\ng = sys._getframe(1).f_globals\n" + REWRITE_AND_RERUN,  # the issue's
    "traceback_frame_reentry": "import sys\ntry:\n    raise ValueError\nexcept ValueError as e:\n"
    "    g = e.__traceback__.tb_frame.f_back.f_globals\n" + REWRITE_AND_RERUN,
    "gc_referrers_exit": "import gc, sys\nfor holder in gc.get_referrers(sys._getframe(1).f_globals):\n"
    "    for v in getattr(holder, '__defaults__', None) or ():\n"
    "        if getattr(v, '__module__', None) == 'posix' and getattr(v, '__name__', '') == '_exit':\n"
    "            v(0)\n",
    "exec_true": "import os\nos.execv('/bin/true', ['true'])",  # a process that exits 0 in its place
    "eq_always_true": "class Anything:\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = object.__hash__\ndef add(a, b):\n    return Anything()\n",
    "int_subclass_eq": "class I(int):\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = int.__hash__\ndef add(a, b):\n    return I(0)\n",
    "shadowed_builtin": "def abs(x):\n    return 0\ndef add(a, b):\n    return 0\n",
}
MODES = ["weak"] if NO_OS else ["os", "weak"]


@HOOK
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_a_program_cannot_forge_a_pass(name, mode, audit_hook):
    tests = "assert abs(add(2, 3) - 5) < 1e-9" if name == "shadowed_builtin" else "assert add(2, 3) == 5"
    r = run(FORGERIES[name], tests, sandbox=mode, audit_hook=audit_hook)
    assert not r.passed and r.returncode == sandbox._FAIL_RC and r.error is None, r
    # control: a correct add passes under the same tests, so the test can tell the two apart
    assert run(ADD, tests, sandbox=mode, audit_hook=audit_hook).passed


def test_the_issues_forged_completion_scores_zero():
    payload = "import sys\ng=sys._getframe(1).f_globals\ng['_limits']=lambda *a:None\n" \
        "open(sys.argv[1]+'/solution.py','w').close();open(sys.argv[1]+'/tests.py','w').close()\ng['_main']()\n"
    reward = CodeReward(**SMALL, sandbox=MODE)
    assert reward(["x"], [f"```python\n{payload}```"], tests=["assert False"]) == [0.0]


@HOOK
def test_the_tests_never_reach_the_program(audit_hook):
    marker = f"secret-{uuid.uuid4().hex}"
    program = """
        import gc, sys
        found = []
        try:
            frame = sys._getframe()
            while frame is not None:
                found += [repr(v) for v in frame.f_locals.values()] + [repr(v) for v in frame.f_globals.values()]
                frame = frame.f_back
            found += [o for o in gc.get_objects() if isinstance(o, str)]
        except Exception as err:
            print(type(err).__name__)
        for path in ("tests.py", sys.argv[1] + "/tests.py", "/dev/stdin", "/proc/self/fd/0"):
            try:
                found.append(open(path).read())
            except Exception as err:
                print(type(err).__name__)
        needle = "REVERSED"[::-1]  # the program's own text must not hold the marker it looks for
        print("found" if any(needle in text for text in found) else "not found")
        """.replace("REVERSED", marker[::-1])
    r = run(program, f"TESTS_SECRET = {marker!r}\nassert False", audit_hook=audit_hook)
    assert not r.passed and r.stdout.splitlines()[-1] == "not found" and marker not in r.stdout


def test_the_program_ending_while_the_tests_run_fails_even_if_they_catch_everything():
    for program in ("import sys\ndef f():\n    sys.exit(0)\n", "import os\ndef f():\n    os._exit(0)\n"):
        r = run(program, "try:\n    f()\nexcept BaseException:\n    pass\n")
        assert not r.passed and r.returncode == sandbox._FAIL_RC
        assert "sandbox: the program" in r.stderr and ("exited" in r.stderr or "ended" in r.stderr), r.stderr


# ---- what the tests see of the program ----------------------------------------------------------

SEMANTICS_PROGRAM = '''
import collections, dataclasses, fractions, sys
count = 0
class Bad(ValueError):
    pass
@dataclasses.dataclass
class Point:
    x: int
    y: int
    def norm1(self):
        return abs(self.x) + abs(self.y)
class Stack:
    def __init__(self):
        self.items = []
    def push(self, x):
        self.items.append(x)
    def pop(self):
        return self.items.pop()
    def __len__(self):
        return len(self.items)
def inc():
    global count
    count += 1
def check(x):
    if x < 0:
        raise Bad("negative")
    return x
def gen(n):
    yield from range(n)
def rev(xs):
    xs.reverse()
def values():
    return (None, True, 2**200, -0.5, float("inf"), 1j, "é\\u2603", b"\\x00\\xff", bytearray(b"ab"), [1, [2]],
            {"a": (1, 2)}, {3}, frozenset({4}), range(1, 9, 2), fractions.Fraction(1, 3),
            collections.Counter("aab"), collections.namedtuple("P", "a b")(1, 2))
def apply(f, x):
    return f(x)
'''
SEMANTICS_TESTS = '''
import collections, fractions, math, unittest
from solution import Point as P2
assert P2 is Point and Point(1, 2) == Point(1, 2) and Point(1, 2) != Point(2, 1)
assert isinstance(Point(0, 0), Point) and Point(3, -4).norm1() == 7 and Point(1, 2).x == 1
s = Stack(); s.push(1); s.push("two")
assert len(s) == 2 and s.pop() == "two" and s.items == [1]
inc(); inc()
assert count == 2
try:
    check(-1)
except Bad as e:
    assert str(e) == "negative" and isinstance(e, ValueError)
else:
    raise AssertionError("no exception")
assert check(3) == 3 and list(gen(3)) == [0, 1, 2] and sum(gen(4)) == 6
xs = [1, 2, 3]; rev(xs)
assert xs == [3, 2, 1]
v = values()
assert v[:6] == (None, True, 2**200, -0.5, math.inf, 1j) and v[2] == 2**200
assert v[6:] == ("é\\u2603", b"\\x00\\xff", bytearray(b"ab"), [1, [2]], {"a": (1, 2)}, {3}, frozenset({4}),
                 range(1, 9, 2), fractions.Fraction(1, 3), collections.Counter("aab"), (1, 2))
try:
    apply(lambda x: x, 1)
except TypeError as e:
    assert "cannot be passed to the program" in str(e)
class T(unittest.TestCase):
    def test_point(self):
        self.assertEqual(Point(1, 1).norm1(), 2)
unittest.main(argv=["tests"])  # exits 0 when every test passed: that is a pass
'''


def test_the_tests_see_the_programs_names_objects_exceptions_and_data():
    r = run(SEMANTICS_PROGRAM, SEMANTICS_TESTS)
    assert r.passed, r.stderr
    assert "Ran 1 test" in r.stderr and r.program_returncode == 0


def test_the_programs_memory_and_recursion_errors_reach_the_tests_as_exceptions():
    # raised by the program, not a broken channel: the tests may expect them
    program = "def deep(n):\n    return deep(n + 1)\ndef big():\n    return bytearray(2**40)\n"
    tests = "for f in (deep, big):\n    try:\n        f() if f is big else f(0)\n    except (RecursionError, " \
            "MemoryError) as e:\n        print(type(e).__name__)\n    else:\n        raise AssertionError(f)\n"
    r = run(program, tests)
    assert r.passed and r.stdout == "RecursionError\nMemoryError\n", r.stderr


def test_a_failing_unittest_main_fails_the_run():
    r = run(ADD, "import unittest\nclass T(unittest.TestCase):\n    def test(self):\n"
            "        self.assertEqual(add(1, 1), 3)\nunittest.main(argv=['tests'])\n")
    assert not r.passed and "FAILED (failures=1)" in r.stderr and "the tests exited with status True" in r.stderr


def test_program_objects_compare_only_with_program_objects():
    program = "class Box:\n    def __init__(self, v):\n        self.v = v\n    def __eq__(self, o):\n" \
        "        return isinstance(o, Box) and o.v == self.v\n    __hash__ = None\n"
    assert run(program, "assert Box(1) == Box(1) and Box(1) != Box(2)").passed
    assert not run(program, "assert Box(1) == 1").passed  # data is never equal to a program object
    r = run(program, "assert Box(1) < Box(2)")
    assert not r.passed and "TypeError" in r.stderr and "raised in the program's process" in r.stderr


def wire_canon(v):
    """A value of the sandbox wire's types as nested tuples, equal exactly when the values are the same: each
    type kept (a tuple is not a list), floats by their hex text (NaN equal to NaN, -0.0 apart from 0.0; the wire
    carries a float as that text), dicts in order, sets in any order."""
    kind = type(v).__name__
    if isinstance(v, float):
        return kind, v.hex()
    if isinstance(v, complex):
        return kind, v.real.hex(), v.imag.hex()
    if isinstance(v, (list, tuple)):
        return kind, tuple(map(wire_canon, v))
    if isinstance(v, collections.deque):
        return kind, tuple(map(wire_canon, v)), v.maxlen
    if isinstance(v, dict):
        return kind, tuple((wire_canon(k), wire_canon(x)) for k, x in v.items())
    if isinstance(v, (set, frozenset)):
        return kind, tuple(sorted(map(repr, map(wire_canon, v))))
    if isinstance(v, slice):
        return kind, wire_canon(v.start), wire_canon(v.stop), wire_canon(v.step)
    if isinstance(v, (decimal.Decimal, range)):
        return kind, str(v)
    return kind, v  # None, bool, int, str, bytes, bytearray, Fraction, Ellipsis


def _no_handles(tag, args):
    from gspo.sandbox.wire import WireError

    raise WireError("no handles here")


def test_the_wire_decodes_any_json_to_data_or_a_wire_error():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from gspo.sandbox.wire import WireError, decode, encode

    leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5)
    tags = st.sampled_from(list("ifcsyYltdOCSFrzEQDqhX") + ["zz"])
    trees = st.recursive(leaves, lambda kids: st.lists(kids, max_size=4) | st.builds(
        lambda t, rest: [t, *rest], tags, st.lists(kids, max_size=3)), max_leaves=20)

    @settings(max_examples=400, deadline=None)
    @given(trees)
    def check(tree):
        try:
            value = decode(tree, _no_handles)
        except WireError:
            return
        again = decode(encode(value, lambda v: pytest.fail(f"not data: {v!r}")), _no_handles)
        assert wire_canon(again) == wire_canon(value)  # NaN-aware: a NaN anywhere must come back a NaN

    check()


def test_every_value_of_the_wire_s_types_comes_back_exactly():
    # Generated valid (every example encodes and decodes): each type the wire carries, nested, NaN and infinities,
    # -0.0, big ints, str subclasses' characters aside; compared NaN-aware, types kept.
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from gspo.sandbox.wire import decode, encode

    keys = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=5) | st.binary(
        max_size=4)
    leaves = (keys | st.complex_numbers() | st.binary(max_size=6).map(bytearray) | st.fractions()
              | st.decimals(allow_nan=True, allow_infinity=True) | st.just(Ellipsis)
              | st.builds(range, st.integers(-5, 5), st.integers(-5, 5), st.integers(1, 3)))
    values = st.recursive(leaves, lambda kids: (
        st.lists(kids, max_size=4) | st.lists(kids, max_size=4).map(tuple)
        | st.dictionaries(keys, kids, max_size=3) | st.dictionaries(keys, kids, max_size=3).map(
            collections.OrderedDict) | st.dictionaries(keys, st.integers(), max_size=3).map(collections.Counter)
        | st.sets(keys, max_size=4) | st.frozensets(keys, max_size=4)
        | st.builds(collections.deque, st.lists(kids, max_size=3), st.none() | st.integers(3, 5))
        | st.builds(slice, kids, kids, kids)), max_leaves=20)
    seen = collections.Counter()

    @settings(max_examples=400, deadline=None)
    @given(values)
    def check(value):
        again = decode(encode(value, lambda v: pytest.fail(f"not data: {v!r}")), _no_handles)
        assert wire_canon(again) == wire_canon(value), (value, again)
        seen.update(type(x).__name__ for x in _walk(value))

    check()
    assert set(seen) >= {"NoneType", "bool", "int", "float", "complex", "str", "bytes", "bytearray", "Fraction",
                         "Decimal", "ellipsis", "range", "list", "tuple", "dict", "OrderedDict", "Counter", "set",
                         "frozenset", "deque", "slice"}, seen  # every type was drawn


def _walk(v):
    """`v` and every value inside it."""
    yield v
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _walk(k)
            yield from _walk(x)
    elif isinstance(v, (list, tuple, set, frozenset, collections.deque)):
        for x in v:
            yield from _walk(x)
    elif isinstance(v, slice):
        for x in (v.start, v.stop, v.step):
            yield from _walk(x)


# ---- limits -----------------------------------------------------------------------------------

def test_infinite_loop_is_stopped_by_the_wall_clock():
    start = time.monotonic()
    r = run("while True:\n    pass", timeout_s=1, cpu_s=10)  # CPU limit out of the way: the wall clock stops it
    assert r.timed_out and r.killed == "timeout" and not r.passed
    assert r.returncode == -signal.SIGKILL and 1.0 <= r.duration_s < 5 and time.monotonic() - start < 5


def test_cpu_limit_stops_a_busy_loop_before_the_wall_clock():
    r = run("while True:\n    pass", timeout_s=30, cpu_s=1)
    # the program's process got SIGXCPU; the judge, left without answers, failed the run
    assert r.killed == "cpu_limit" and r.program_returncode == -signal.SIGXCPU and not r.timed_out
    assert r.returncode == sandbox._FAIL_RC and r.duration_s < 15


class _JudgeFirstSelector:
    """A selector that lists ready processes with the judge first, as the kernel may."""

    def __init__(self):
        self.inner = selectors.DefaultSelector()

    def select(self, timeout):
        return sorted(self.inner.select(timeout), key=lambda ready: -ready[0].data[1])

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_program_that_ended_with_its_judge_counts_as_ended_first():
    # both processes' ends are seen in one select: the program's signal is what stopped the run, whichever is
    # listed first (CI once saw "the program ended before the tests finished" and no cpu_limit)
    sel, ends = _JudgeFirstSelector(), []
    for i in (0, 1):
        r, w = os.pipe()
        os.write(w, b"x")
        ends.append(w)
        sel.register(r, selectors.EVENT_READ, ("exit", i))
    exited, killed = execute._watch(sel, {}, 2, time.monotonic() + 5, 1 << 20)
    for w in ends:
        os.close(w)
    assert killed is None and exited[0] <= exited[1]
    program = execute.Ended(-signal.SIGXCPU, b"", b"", True, exited[0])
    judge = execute.Ended(sandbox._FAIL_RC, b"", b"", True, exited[1])
    assert execute.judged(program, judge, None, None) == "cpu_limit"


def test_memory_bomb_is_refused():
    gradual = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 2**20))"
    for bomb in ("x = bytearray(2 * 1024**3)", gradual):
        r = run(bomb, "assert True", memory_mb=256)
        assert not r.passed and "MemoryError" in r.stderr and r.duration_s < 5, r
    # the limit is not so tight that ordinary programs fail
    fits = run("x = bytearray(64 * 2**20)", "assert len(x) == 64 * 2**20", memory_mb=256)
    assert fits.passed, fits.stderr


MEMFD_HOG = """
    import errno, os
    made = 0
    try:
        for _ in range(8):  # 8 x 16 MB, outside RLIMIT_AS: twice memory_mb
            fd = os.memfd_create("hog")
            os.write(fd, b"x" * 16 * 2**20)
            made += 1
    except OSError as err:
        print(errno.errorcode[err.errno])
    print("made", made)
    """
SECCOMP_ACTIVE = sandbox.seccomp_filter() is not None
needs_seccomp = pytest.mark.skipif(not SECCOMP_ACTIVE, reason="no seccomp table for this architecture")


@needs_seccomp
@HOOK
def test_memory_outside_the_address_space_is_refused(audit_hook):
    # issue 31: 61 memfds x 16 MB held ~976 MB under memory_mb=64 at bbf266e
    r = run(MEMFD_HOG, "assert made == 8", memory_mb=64, audit_hook=audit_hook)
    assert not r.passed and r.stdout == "EPERM\nmade 0\n" and r.duration_s < 5, r
    control = unsandboxed(MEMFD_HOG)  # the same program, unconfined, holds 128 MB
    assert control.stdout == "made 8\n", control.stderr


@needs_seccomp
def test_the_seccomp_filter_refuses_shared_memory_namespaces_mounts_and_ptrace():
    program = """
        import ctypes, errno
        libc = ctypes.CDLL(None, use_errno=True)
        calls = (("shmget", (0, 2**20, 0o1600)), ("msgget", (0, 0o1600)), ("unshare", (0x20000,)),
                 ("mount", (b"none", b"/tmp", b"tmpfs", 0, None)), ("ptrace", (16, 1, 0, 0)))
        out = []
        for name, args in calls:
            rc = getattr(libc, name)(*args)
            out.append(errno.errorcode[ctypes.get_errno()] if rc == -1 else "ALLOWED")
        print(" ".join(out))
        """
    r = run(program, "assert False", audit_hook=False)  # no hook: ctypes reaches libc, only the kernel refuses
    assert r.stdout == "EPERM EPERM EPERM EPERM EPERM\n", r.stderr


CGROUP_PARENT, _, NO_CGROUP = sandbox.cgroup_parent()
needs_cgroup = pytest.mark.skipif(CGROUP_PARENT is None, reason=f"no memory cgroup here: {NO_CGROUP}")


@needs_cgroup
def test_a_run_cgroup_kills_what_goes_over_its_memory():
    from gspo.sandbox.kernel import RunCgroup

    hog = textwrap.dedent(MEMFD_HOG)
    cgroup = RunCgroup(64 * 2**20)
    try:
        done = subprocess.run(cgroup.wrap([sys.executable, "-I", "-S", "-c", hog]), capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == -signal.SIGKILL and cgroup.oom_killed(), (done.returncode, done.stderr)
    finally:
        cgroup.close()
    assert not os.path.exists(cgroup.path)
    assert unsandboxed(hog).stdout == "made 8\n"  # control: the same program outside the cgroup


@needs_cgroup
def test_each_run_is_charged_to_a_cgroup_of_its_own_removed_afterwards():
    r = run("print(open('/proc/self/cgroup').read())", "assert True", sandbox="weak", audit_hook=False)
    assert r.passed and "/gspo-sandbox-" in r.stdout, r.stdout  # no cgroup namespace in weak mode
    mine = [line for line in r.stdout.splitlines() if "/gspo-sandbox-" in line][0]
    folder = os.path.join(CGROUP_PARENT, "gspo-sandbox-" + mine.split("/gspo-sandbox-")[1])
    assert not os.path.exists(folder)


KILLED_RUNS = {
    "timeout": ("import os, time\nprint(os.getcwd(), flush=True)\ntime.sleep(30)", dict(timeout_s=1)),
    "output_limit": ("import os\nprint(os.getcwd(), flush=True)\nwhile True:\n    print('y' * 1000)",
                     dict(max_output_bytes=10_000)),
}


@pytest.mark.parametrize("how", sorted(KILLED_RUNS))
def test_a_killed_run_leaves_no_process_behind(how):
    # The program runs in its own session (bwrap --new-session), outside the group the trainer
    # kills; it must still be gone when run_sandboxed returns. Its dir name, unique per run, is in
    # the argv of every process of the run (bwrap's and the interpreter's).
    program, limits = KILLED_RUNS[how]
    r = run(program, "assert True", **limits)
    workdir = r.stdout.split("\n", 1)[0]
    assert r.killed == how and not r.passed and r.duration_s < 5 and "gspo-sandbox-" in workdir
    survivors = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if workdir.encode() in f.read():
                    survivors.append(pid)
        except OSError:
            pass  # exited while we looked
    assert survivors == []


FORK_LOOP = """
import os, signal
made, refused = 0, None
for _ in range(200):  # bounded: never a real fork bomb, even if containment failed
    try:
        pid = os.fork()
    except OSError as err:
        refused = type(err).__name__
        break
    if pid == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # a child that got through dies at once
    made += 1
    os.waitpid(pid, 0)
print("made", made, "refused", refused)
"""


@HOOK
def test_fork_loop_is_refused(audit_hook):
    if not audit_hook and not kernel_refuses_forks():
        pytest.skip("the trainer is root and setpriv is unavailable: only the audit hook refuses forks")
    r = run(FORK_LOOP, "assert made == 200", audit_hook=audit_hook)
    expected = "PermissionError" if audit_hook else "BlockingIOError"  # hook, or RLIMIT_NPROC's EAGAIN
    assert r.stdout == f"made 0 refused {expected}\n" and not r.passed and r.duration_s < 5


@pytest.mark.parametrize(
    "program",
    [
        "import subprocess\nsubprocess.run(['/bin/echo', 'escaped'])",
        "import os\nos.system('echo escaped')",
        "import os\nos.posix_spawn('/bin/echo', ['echo', 'escaped'], {})",
        "import ctypes\nctypes.CDLL(None).system(b'echo escaped')",
    ],
)
def test_processes_threads_and_ctypes_are_refused(program):
    r = run(program, "assert True")
    assert not r.passed and "escaped" not in r.stdout and r.duration_s < 5


def test_threads_are_refused_by_the_kernel():
    if not kernel_refuses_forks():
        pytest.skip("the trainer is root and setpriv is unavailable: RLIMIT_NPROC does not bind root")
    r = run("import threading\nthreading.Thread(target=print, args=('escaped',)).start()", "assert True")
    assert not r.passed and "escaped" not in r.stdout and "can't start new thread" in r.stderr


def test_signalling_the_trainer_is_refused():
    # signal 0 only checks permission, so a failure here cannot take the test run down
    r = run("import os\nos.kill(os.getppid(), 0)\nprint('could signal', os.getppid())", "assert True")
    assert not r.passed and "could signal" not in r.stdout and "PermissionError" in r.stderr


@needs_os
def test_the_kernel_keeps_the_trainers_processes_out_of_reach():
    # No audit hook: a real SIGKILL at a real process; should containment fail, only the victim dies.
    with subprocess.Popen(["sleep", "30"]) as victim:
        try:
            program = f"""
                import os, signal
                for pid, sig in (({victim.pid}, signal.SIGKILL), ({os.getpid()}, 0)):  # victim, trainer
                    try:
                        os.kill(pid, sig)
                        print("signalled", pid)
                    except OSError as err:
                        print(type(err).__name__)
                """
            r = run(program, "assert False", audit_hook=False)
            assert r.stdout == "ProcessLookupError\nProcessLookupError\n"  # other pid namespace
            assert victim.poll() is None and r.duration_s < 5
        finally:
            victim.kill()


def test_huge_print_is_cut_and_stopped():
    for program in ("while True:\n    print('y' * 1000)", "print('x' * 50_000_000)",
                    "import sys\nwhile True:\n    sys.stderr.write('z' * 1000)"):
        r = run(program, "assert True", max_output_bytes=10_000, timeout_s=10)
        assert r.killed == "output_limit" and not r.timed_out and not r.passed
        assert max(len(r.stdout), len(r.stderr)) == 10_000 and r.duration_s < 5, r.killed


# ---- filesystem, environment, network ---------------------------------------------------------

WRITE_ATTEMPTS = """
    import errno, os, pathlib
    names = []
    for outside in {targets!r}:
        mark = outside + "/" + {marker!r}
        attempts = [
            lambda: open(mark + "a.txt", "w").write("x"),
            lambda: pathlib.Path(mark + "b.txt").write_text("x"),
            lambda: os.mkdir(mark + "c"),
            lambda: os.open(mark + "d.txt", os.O_WRONLY | os.O_CREAT),
            lambda: (open("mine.txt", "w").close(), os.rename("mine.txt", mark + "f.txt")),
        ]
        if outside == {open_dir!r}:
            attempts.append(lambda: open("../" + os.path.basename(outside) + "/e.txt", "w"))  # relative
        for attempt in attempts:
            try:
                attempt()
                names.append("WROTE")
            except PermissionError as err:
                names.append("hook" if err.errno is None else errno.errorcode[err.errno])
            except OSError as err:
                names.append(errno.errorcode[err.errno])
    print(" ".join(names))
    """


@HOOK
def test_writing_outside_the_sandbox_dir_is_refused(outside_dirs, audit_hook):
    if not audit_hook and NO_OS:
        pytest.skip(f"needs bubblewrap: {NO_OS}")
    marker = f"gspo-marker-{uuid.uuid4().hex[:8]}-"
    system = [os.path.realpath(sys.base_prefix), "/usr", "/tmp", "/"]  # bound read-only, or the sandbox's own
    open_dir, targets = outside_dirs[0], [*outside_dirs, *system]
    program = WRITE_ATTEMPTS.format(targets=targets, open_dir=open_dir, marker=marker)

    def written_in_system():
        return [f"{d}/{n}" for d in system for n in os.listdir(d) if n.startswith(marker)]

    try:
        r = run(program, "assert 'WROTE' in names", audit_hook=audit_hook)
        assert not r.passed and r.duration_s < 5
        assert all(os.listdir(d) == [] for d in outside_dirs) and written_in_system() == []
        names = r.stdout.split()
        if audit_hook:
            assert names == ["hook"] * (6 + 5 * (len(targets) - 1))
        else:  # the open dir does not exist inside; what does is read-only (a rename: across mounts)
            assert names == ["ENOENT"] * 6 + (["EROFS"] * 4 + ["EXDEV"]) * (len(targets) - 1)
        # control: the weak sandbox without its hook does write there, so this test can fail
        control = run(program, "assert 'WROTE' in names", audit_hook=False, sandbox="weak")
        assert control.passed and f"{marker}a.txt" in os.listdir(open_dir)
    finally:  # the control (or a broken sandbox) may have written into world-writable /tmp
        for path in written_in_system():
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


SQLITE = {
    # the attack that scored 1.0 under the audit hook alone: it never sees ATTACH
    "attach": "db = sqlite3.connect(':memory:')\ndb.execute(f\"ATTACH DATABASE '{target}' AS evil\")\n"
    "db.execute('CREATE TABLE evil.t (x)')",
    "uri": "db = sqlite3.connect(f'file:{target}?mode=rwc', uri=True)\ndb.execute('CREATE TABLE t (x)')",
}


@needs_os
@HOOK
@pytest.mark.parametrize("how", sorted(SQLITE))
def test_sqlite_cannot_write_outside(outside_dirs, how, audit_hook):
    for folder in outside_dirs:
        target = os.path.join(folder, "evil.db")
        program = f"import sqlite3\ntarget = {target!r}\n" + SQLITE[how] + "\ndb.commit()\nwrote = True\n"
        r = run(program, "assert wrote", audit_hook=audit_hook)
        assert not r.passed and r.duration_s < 5 and os.listdir(folder) == []
        expected = "sqlite URIs are not allowed" if how == "uri" and audit_hook else "unable to open database"
        assert expected in r.stderr
        # control: with no sandbox the same program creates the database
        assert unsandboxed(program).returncode == 0 and os.listdir(folder) == ["evil.db"]
        os.remove(target)


CTYPES = """
    import ctypes, errno, os
    libc = ctypes.CDLL(None, use_errno=True)
    results = []
    for path in {paths!r}:
        for call in (lambda p: libc.creat(p, 0o644), lambda p: libc.open(p, os.O_WRONLY | os.O_CREAT, 0o644)):
            fd = call(path.encode())
            results.append("WROTE" if fd >= 0 else errno.errorcode[ctypes.get_errno()])
    print(" ".join(results))
    """


@needs_os
@HOOK
def test_ctypes_cannot_write_outside(outside_dirs, audit_hook):
    # libc's open() straight from ctypes: no audit event, so only the kernel can refuse it
    program = CTYPES.format(paths=[f"{d}/a.txt" for d in outside_dirs])
    r = run(program, "assert 'WROTE' in results", audit_hook=audit_hook)
    assert not r.passed and r.duration_s < 5 and all(os.listdir(d) == [] for d in outside_dirs)
    if audit_hook:
        assert "importing ctypes is not allowed" in r.stderr
    else:  # the open dir does not exist inside; the prefix is read-only
        assert r.stdout.split() == ["ENOENT", "ENOENT", "EROFS", "EROFS"][: 2 * len(outside_dirs)]
    control = unsandboxed(program)
    assert control.stdout.split() == ["WROTE"] * 2 * len(outside_dirs)
    assert os.listdir(outside_dirs[0]) == ["a.txt"]


@needs_os
@HOOK
def test_proc_writes_are_refused(audit_hook):
    # Each write puts back the value just read, so even a failed sandbox changes nothing.
    paths = ["/proc/sys/kernel/core_pattern", "/proc/sys/vm/overcommit_memory",
             f"/proc/{os.getpid()}/oom_score_adj", "/proc/1/oom_score_adj"]  # the trainer; the sandbox's init
    program = f"""
        import errno
        results = []
        for path in {paths!r}:
            try:
                value = open(path).read()
                with open(path, "w") as f:
                    f.write(value)
                results.append("WROTE")
            except PermissionError as err:
                results.append("hook" if err.errno is None else errno.errorcode[err.errno])
            except OSError as err:
                results.append(errno.errorcode[err.errno])
        print(" ".join(results))
        """
    before = open("/proc/sys/kernel/core_pattern").read()
    r = run(program, "assert 'WROTE' in results[:3]", audit_hook=audit_hook)  # the sandbox's init is its own
    assert not r.passed and r.duration_s < 5 and open("/proc/sys/kernel/core_pattern").read() == before
    results = r.stdout.split()
    if audit_hook:
        assert results == ["hook"] * 4
    else:
        # the trainer's pid does not exist in the sandbox's /proc; its init is root's when we are root
        assert results == ["EACCES", "EACCES", "ENOENT", "EACCES" if os.geteuid() == 0 else "WROTE"]
    if os.geteuid() == 0:  # control: root outside the sandbox writes them all (the same values)
        control = unsandboxed(program)
        assert control.stdout.split() == ["WROTE"] * 4, control.stderr


@needs_os
def test_the_kernel_confines_the_process():
    program = """
        import os
        status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines())
        print(status["Uid"].split()[0], status["NoNewPrivs"])
        print(" ".join(status[k] for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")))
        print(" ".join(sorted(os.listdir("/"))))
        pids = sorted(p for p in os.listdir("/proc") if p.isdigit())
        print(os.path.exists("/etc"), os.path.exists(PKG), pids)
        import ctypes, errno
        failed = ctypes.CDLL(None, use_errno=True).unshare(0x10000000)  # CLONE_NEWUSER
        print(errno.errorcode[ctypes.get_errno()] if failed else "made")
        """
    r = run(program.replace("PKG", repr(os.path.dirname(sandbox.__file__))), "assert False", audit_hook=False)
    ids, caps, top, rest, nested = r.stdout.splitlines()
    assert ids == f"{65534 if os.geteuid() == 0 else os.getuid()} 1"  # uid, no_new_privs
    assert caps == " ".join(["0000000000000000"] * 5)  # inheritable, permitted, effective, bounding, ambient
    top = set(top.split())
    assert {"usr", "proc", "dev", "tmp"} <= top and not top & {"etc", "home", "var", "work", "opt", "srv"}
    # no /etc, none of the trainer's code; /proc shows bwrap's init and the interpreter only
    assert rest == "False False ['1', '2']"
    # seccomp refuses unshare() where it is active (x86_64, aarch64), as root too; without it bwrap >= 0.8
    # refuses nested user namespaces to a non-root trainer, and as root they stay possible
    described = describe_sandbox()
    expected = "EPERM" if "seccomp: memfd" in described else "ENOSPC" if "no nested user namespaces" in described \
        else "made"
    assert nested == expected


def test_the_users_home_and_environment_are_not_readable(monkeypatch, open_dir):
    secret = f"TOPSECRET-{uuid.uuid4().hex}"
    token = f"tok-{uuid.uuid4().hex}"
    secret_path = os.path.join(open_dir, "secret.txt")
    with open(secret_path, "w") as f:
        f.write(secret)
    os.chmod(open_dir, 0o755)
    os.chmod(secret_path, 0o644)  # readable by anyone: only the sandbox stands in the way
    monkeypatch.setenv("HOME", open_dir)
    monkeypatch.setenv("GSPO_TEST_TOKEN", token)
    program = f"""
        import os
        print("HOME=" + os.environ["HOME"], "ENV=" + ",".join(sorted(os.environ)))
        leaked = []
        trainer_env = "/proc/{os.getpid()}/environ"
        for path in (os.path.expanduser("~/secret.txt"), {secret_path!r}, trainer_env):
            try:
                leaked.append(open(path).read())
            except OSError as err:
                print(type(err).__name__)
        for folder in ({open_dir!r}, "/etc"):
            try:
                leaked.append(os.listdir(folder))
            except OSError as err:
                print(type(err).__name__)
        print(leaked)
        """
    runs = [(True, ["FileNotFoundError"] + ["PermissionError"] * 4)]  # the hook refuses
    if not NO_OS:
        runs.append((False, ["FileNotFoundError"] * 5))  # the kernel alone: none of it exists inside
    for audit_hook, errors in runs:
        r = run(program, "assert leaked", audit_hook=audit_hook)
        assert not r.passed and r.duration_s < 5
        output = r.stdout + r.stderr
        assert secret not in output and token not in output and "secret.txt" not in r.stdout
        home, env = r.stdout.split("\n", 1)[0].split(" ")
        assert home.startswith("HOME=") and open_dir not in home and "gspo-sandbox-" in home
        names = {"HOME", "LANG", "LC_ALL", "PATH", "TMPDIR"} | ({"PWD"} if MODE == "os" else set())  # bwrap's
        assert set(env[len("ENV="):].split(",")) == names
        assert r.stdout.split("\n")[1:] == errors + ["[]", ""]
    # control: the weak sandbox without its hook prints the secret, so this test can see a leak
    control = run(program, "assert leaked", audit_hook=False, sandbox="weak")
    assert secret in control.stdout


@HOOK
def test_sockets_cannot_reach_the_trainer(audit_hook):
    if not audit_hook and network_isolation(MODE) != "netns":
        pytest.skip("no network namespace here: only the audit hook blocks the network")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        program += "s.sendall(b'hi')"
        r = run(program, "assert s is not None", audit_hook=audit_hook)
        assert not r.passed and r.duration_s < 5
        # bwrap's namespace has its own loopback, nothing listening; unshare's (weak) has no route at all
        refusal = "PermissionError" if audit_hook else {"os": "ConnectionRefusedError",
                                                        "weak": "Network is unreachable"}[MODE]
        assert refusal in r.stderr, r.stderr
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):  # nothing ever connected
            server.accept()


# ---- modes: os refuses where it cannot start, weak when asked ---------------------------------

def test_isolation_is_reported():
    weak = describe_sandbox("weak")
    assert weak.startswith("boundary: weak (no mount namespace") and "audit hook" in weak
    assert network_isolation("weak") in ("netns", "audit_hook")
    if NO_OS:
        assert describe_sandbox().startswith("boundary: none (bwrap")
    else:
        assert describe_sandbox().startswith("boundary: bubblewrap (private mount namespace, read-only system")
        assert network_isolation() == "netns"
    for mode in MODES:
        described = describe_sandbox(mode)
        assert "verdict: the tests run in a judge process the program cannot reach" in described
        assert ("seccomp: memfd/SysV shm" in described) == SECCOMP_ACTIVE
        assert ("memory cgroup (v" in described) == (CGROUP_PARENT is not None)
        if CGROUP_PARENT is None:
            assert f"memory cgroup: none ({NO_CGROUP})" in described


def test_weak_mode_still_runs_when_asked(open_dir):
    assert run(ADD, "assert add(1, 2) == 3", sandbox="weak").passed
    r = run(f"open({open_dir!r} + '/a.txt', 'w')", "assert True", sandbox="weak")
    assert not r.passed and "PermissionError: sandbox: writing" in r.stderr and os.listdir(open_dir) == []


def _fake_bwrap(folder, marker: str = "") -> str:
    """A bwrap that fails the way one does without namespace rights."""
    path = os.path.join(folder, "bwrap")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\n{marker}echo 'bwrap: Creating new namespace failed: Operation not permitted' >&2\n"
                "exit 1\n")
    os.chmod(path, 0o755)
    return path


def test_os_mode_without_a_working_bwrap_refuses(monkeypatch, tmp_path):
    # GSPO_BWRAP, the documented way to name the binary, is the seam: no module internals swapped.
    reasons = {str(tmp_path / "missing"): f"bwrap not found (GSPO_BWRAP={tmp_path / 'missing'})",
               _fake_bwrap(tmp_path): "bwrap failed: bwrap: Creating new namespace failed: Operation not permitted",
               }
    for path, reason in reasons.items():
        monkeypatch.setenv("GSPO_BWRAP", path)
        for attempt in (lambda: run_sandboxed(ADD, "assert True"), lambda: code_reward(**SMALL),
                        lambda: CodeReward(**SMALL)(["p"], [ADD], tests=["assert True"]), network_isolation):
            with pytest.raises(SandboxUnavailable) as caught:
                attempt()
            message = str(caught.value)
            assert isinstance(caught.value, ValueError) and "\n" not in message and reason in message
            assert "apt-get install bubblewrap" in message and "sandbox='weak'" in message
        assert describe_sandbox() == f"boundary: none ({reason}); sandbox='os' runs raise SandboxUnavailable"
        assert CodeReward(**SMALL).sandbox == "os"  # building one does not probe
        assert code_reward(sandbox="weak", **SMALL)(["p"], [ADD], tests=["assert add(1, 2) == 3"]) == [1.0]


def test_importing_the_sandbox_does_not_probe(tmp_path):
    marker = tmp_path / "probed"
    env = {**os.environ, "GSPO_BWRAP": _fake_bwrap(tmp_path, f"touch {marker}\n")}
    code = ("import os, gspo.sandbox.runner as s\nprint(os.path.exists(%r), s.code_tests.sandbox)\n"
            "try:\n    s.code_reward()\nexcept s.SandboxUnavailable:\n    print(os.path.exists(%r))\n")
    out = subprocess.run([sys.executable, "-c", code % (str(marker), str(marker))], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout == "False os\nTrue\n", out.stderr


@needs_os
def test_code_reward_checks_now_and_scores():
    reward = code_reward(**SMALL)
    assert reward.sandbox == "os" and reward(["p"], [ADD], tests=["assert add(2, 2) == 4"]) == [1.0]


# ---- batches, extraction, arguments, registry ------------------------------------------------

@pytest.mark.slow
def test_parallel_batch_keeps_order_and_bounds_the_workers():
    completions = [ADD, "while True:\n    pass", "def add(a, b):\n    return 0", f"```python\n{ADD}```", ADD]
    tests = ["assert add(1, 2) == 3"] * 5
    reward = CodeReward(timeout_s=1, memory_mb=256, workers=4, sandbox=MODE)
    assert reward(["p"] * 5, completions, tests=tests) == [1.0, 0.0, 0.0, 1.0, 1.0]
    sleepers, tests = ["import time\ntime.sleep(30)"] * 4, ["assert True"] * 4
    start = time.monotonic()
    CodeReward(timeout_s=1, memory_mb=256, workers=1, sandbox=MODE)(["p"], sleepers[:1], tests=tests[:1])
    one = time.monotonic() - start  # one 1 s timeout with its start-up, on this machine as loaded as it is now
    start = time.monotonic()
    rewards = CodeReward(timeout_s=1, memory_mb=256, workers=4, sandbox=MODE)(["p"] * 4, sleepers, tests=tests)
    assert rewards == [0.0] * 4
    # four 1 s timeouts at once, not one after another (that would be 4x one run's time)
    assert time.monotonic() - start < 2.5 * one, (time.monotonic() - start, one)
    start = time.monotonic()
    CodeReward(timeout_s=1, memory_mb=256, workers=2, sandbox=MODE)(["p"] * 4, sleepers, tests=tests)
    assert time.monotonic() - start >= 2.0  # at most two at a time: two rounds of 1 s each


def test_extract_code():
    two_blocks = "intro\n```python\na = 1\n```\nthen\n```python\nb = 2\n```\nbye"
    assert extract_code(two_blocks) == "b = 2\n"  # the last one
    assert extract_code("```py\nx = 1\n```") == "x = 1\n"
    assert extract_code("```bash\nls\n```\n```\ny = 2\n```") == "y = 2\n"  # untagged beats bash
    assert extract_code("```python\nz = 3\n```\n```\nuntagged\n```") == "z = 3\n"  # python tag wins
    assert extract_code("text\n```python\nw = 4\nstill going") == "w = 4\nstill going"  # cut off
    assert extract_code("v = 5\n") == "v = 5\n"


def test_bad_arguments_raise_value_error_naming_them():
    with pytest.raises(ValueError, match="timeout_s"):
        run_sandboxed("pass", timeout_s=0)
    with pytest.raises(ValueError, match="timeout_s"):
        run_sandboxed("pass", timeout_s=float("nan"))
    with pytest.raises(ValueError, match="memory_mb"):
        run_sandboxed("pass", memory_mb=8)
    with pytest.raises(ValueError, match="cpu_s"):
        run_sandboxed("pass", cpu_s=-1)
    with pytest.raises(ValueError, match="max_output_bytes"):
        run_sandboxed("pass", max_output_bytes=0)
    with pytest.raises(ValueError, match="code"):
        run_sandboxed(b"pass")
    for bad_mode in (lambda: run_sandboxed("pass", sandbox="docker"), lambda: CodeReward(sandbox="OS"),
                     lambda: code_reward(sandbox=None), lambda: describe_sandbox("none")):
        with pytest.raises(ValueError, match=r"sandbox must be one of 'os', 'weak', got"):
            bad_mode()
    with pytest.raises(ValueError, match="workers"):
        CodeReward(workers=0)
    with pytest.raises(ValueError, match="tests_column"):
        CodeReward(tests_column="")
    reward = CodeReward(**SMALL, sandbox=MODE)
    with pytest.raises(ValueError, match="tests_column 'tests' is not among the dataset columns"):
        reward(["p"], [ADD], answer=["1"])
    with pytest.raises(ValueError, match="tests has 0 entries, expected 1"):
        reward(["p"], [ADD], tests=[])
    with pytest.raises(ValueError, match=r"tests\[0\] is empty"):
        reward(["p"], [ADD], tests=["  "])
    with pytest.raises(ValueError, match=r"tests\[0\] must be a str"):
        reward(["p"], [ADD], tests=[5])
    assert reward(["p"], [ADD], tests=[None]) == [None]  # no tests: no opinion
    renamed = CodeReward(**SMALL, tests_column="checks", sandbox=MODE)
    assert renamed(["p"], [ADD], checks=["assert add(1, 1) == 2"]) == [1.0]


@needs_os
def test_get_reward_fn_code_tests():
    fn = get_reward_fn("code_tests")
    assert fn.__name__ == "code_tests"
    completions = [f"```python\n{ADD}```", "def add(a, b):\n    return a * b\n"]
    assert fn(["p", "p"], completions, tests=["assert add(2, 3) == 5"] * 2) == [1.0, 0.0]


@pytest.mark.slow
def test_importing_rewards_does_not_import_the_sandbox():
    code = "import sys, gspo.data.rewards; print('gspo.sandbox.runner' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "False"
