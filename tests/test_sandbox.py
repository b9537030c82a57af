"""Sandboxed code reward: hostile programs are contained within their limits, correct ones score 1.

Each hostile case asserts three things: the run failed (reward 0), the harm did not happen
(no file written, no secret printed, no connection made) and it ended within its time limit.
Where cheap, a control run with the audit hook off shows the test could see the harm.
"""

import os
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

from gspo import sandbox
from gspo.rewards import get_reward_fn
from gspo.sandbox import CodeReward, describe_sandbox, extract_code, network_isolation, run_sandboxed

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="uses Linux rlimits and namespaces")

SMALL = dict(timeout_s=5.0, memory_mb=256)
ADD = "def add(a, b):\n    return a + b\n"


def run(code: str, tests: str = "", **limits):
    return run_sandboxed(textwrap.dedent(code), textwrap.dedent(tests), **{**SMALL, **limits})


def kernel_refuses_forks() -> bool:
    # RLIMIT_NPROC binds any user but root; as root the sandbox switches to uid 65534 via setpriv.
    return os.geteuid() != 0 or sandbox._launcher()[2].startswith("uid")


@pytest.fixture
def open_dir():
    """A world-writable, world-readable dir outside the sandbox: only the sandbox stands in the way."""
    path = tempfile.mkdtemp(prefix="gspo-outside-")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ---- scoring ---------------------------------------------------------------------------------

def test_correct_code_scores_one_and_wrong_code_zero():
    reward = CodeReward(**SMALL, workers=2)
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
        print(os.getcwd())
        """,
        "assert open('d/f.txt').read() == 'fine'\nos.chmod('d', 0)  # cleanup must still work",
    )
    assert r.passed, r.stderr
    workdir = r.stdout.strip()
    assert os.path.basename(workdir).startswith("gspo-sandbox-") and not os.path.exists(workdir)


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
    "fake_exit_event": "import sys\nsys.audit('gspo.sandbox.exit', 0)",
    "exit_event_from_the_sandbox_frame": "import sys\n"
    "sys._getframe(1).f_locals['_audit']('gspo.sandbox.exit', 0)",
    "replaced_stdout": "import sys\nE = SystemExit\nclass Out:\n    def write(self, s):\n        pass\n"
    "    def flush(self):\n        raise E(0)\nsys.stdout = Out()\n",
}


@pytest.mark.parametrize("name", sorted(TAMPERING))
def test_tampering_with_the_sandbox_exit_does_not_pass(name):
    r = run(TAMPERING[name], "assert f() == 1" if name == "builtins" else "assert False")
    assert not r.passed and r.returncode == sandbox._FAIL_RC


# ---- limits -----------------------------------------------------------------------------------

def test_infinite_loop_is_stopped_by_the_wall_clock():
    start = time.monotonic()
    r = run("while True:\n    pass", timeout_s=1, cpu_s=10)  # CPU limit out of the way: the wall clock stops it
    assert r.timed_out and r.killed == "timeout" and not r.passed
    assert r.returncode == -signal.SIGKILL and 1.0 <= r.duration_s < 5 and time.monotonic() - start < 5


def test_cpu_limit_stops_a_busy_loop_before_the_wall_clock():
    r = run("while True:\n    pass", timeout_s=30, cpu_s=1)
    assert r.killed == "cpu_limit" and r.returncode == -signal.SIGXCPU and not r.timed_out
    assert r.duration_s < 15


def test_memory_bomb_is_refused():
    gradual = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 2**20))"
    for bomb in ("x = bytearray(2 * 1024**3)", gradual):
        r = run(bomb, "assert True", memory_mb=256)
        assert not r.passed and "MemoryError" in r.stderr and r.duration_s < 5, r
    # the limit is not so tight that ordinary programs fail
    fits = run("x = bytearray(64 * 2**20)", "assert len(x) == 64 * 2**20", memory_mb=256)
    assert fits.passed, fits.stderr


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


@pytest.mark.parametrize("audit_hook", [True, False], ids=["hook", "kernel_only"])
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


def test_huge_print_is_cut_and_stopped():
    for program in ("while True:\n    print('y' * 1000)", "print('x' * 50_000_000)",
                    "import sys\nwhile True:\n    sys.stderr.write('z' * 1000)"):
        r = run(program, "assert True", max_output_bytes=10_000, timeout_s=10)
        assert r.killed == "output_limit" and not r.timed_out and not r.passed
        assert max(len(r.stdout), len(r.stderr)) == 10_000 and r.duration_s < 5, r.killed


# ---- filesystem, environment, network ---------------------------------------------------------

def test_writing_outside_the_sandbox_dir_is_refused(open_dir):
    program = f"""
        import os, pathlib
        outside = {open_dir!r}
        attempts = [
            lambda: open(outside + "/a.txt", "w").write("x"),
            lambda: pathlib.Path(outside, "b.txt").write_text("x"),
            lambda: os.mkdir(outside + "/c"),
            lambda: os.open(outside + "/d.txt", os.O_WRONLY | os.O_CREAT),
            lambda: open("../" + os.path.basename(outside) + "/e.txt", "w"),  # relative escape
            lambda: (open("mine.txt", "w").close(), os.rename("mine.txt", outside + "/f.txt")),
        ]
        wrote = 0
        for attempt in attempts:
            try:
                attempt()
                wrote += 1
            except OSError as err:
                print(type(err).__name__)
        """
    r = run(program, "assert wrote > 0")
    assert not r.passed and os.listdir(open_dir) == [] and r.duration_s < 5
    assert r.stdout.split() == ["PermissionError"] * 6
    # control: without the audit hook the same program does write there, so this test can fail
    control = run(program, "assert wrote > 0", audit_hook=False)
    assert control.passed and "a.txt" in os.listdir(open_dir)


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
        trainer_env = f"/proc/{{os.getppid()}}/environ"
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
    r = run(program, "assert leaked")
    assert not r.passed and r.duration_s < 5
    output = r.stdout + r.stderr
    assert secret not in output and token not in output and "secret.txt" not in r.stdout
    home, env = r.stdout.split("\n", 1)[0].split(" ")
    assert home.startswith("HOME=") and open_dir not in home and "gspo-sandbox-" in home
    assert set(env[len("ENV="):].split(",")) == {"HOME", "LANG", "LC_ALL", "PATH", "TMPDIR"}
    assert r.stdout.split("\n")[1:] == ["FileNotFoundError"] + ["PermissionError"] * 4 + ["[]", ""]
    # control: without the audit hook the secret is printed, so this test can see a leak
    control = run(program, "assert leaked", audit_hook=False)
    assert secret in control.stdout


@pytest.mark.parametrize("audit_hook", [True, False], ids=["hook", "netns_only"])
def test_sockets_cannot_reach_the_trainer(audit_hook):
    if not audit_hook and network_isolation() != "netns":
        pytest.skip("no network namespace here: only the audit hook blocks the network")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        program += "s.sendall(b'hi')"
        r = run(program, "assert s is not None", audit_hook=audit_hook)
        assert not r.passed and r.duration_s < 5
        assert ("PermissionError" if audit_hook else "OSError") in r.stderr
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):  # nothing ever connected
            server.accept()


def test_isolation_is_reported():
    assert network_isolation() in ("netns", "audit_hook")
    assert describe_sandbox().startswith("network: ")


# ---- batches, extraction, arguments, registry ------------------------------------------------

def test_parallel_batch_keeps_order_and_bounds_the_workers():
    completions = [ADD, "while True:\n    pass", "def add(a, b):\n    return 0", f"```python\n{ADD}```", ADD]
    tests = ["assert add(1, 2) == 3"] * 5
    assert CodeReward(timeout_s=1, memory_mb=256, workers=4)(["p"] * 5, completions, tests=tests) == [
        1.0, 0.0, 0.0, 1.0, 1.0,
    ]
    sleepers, tests = ["import time\ntime.sleep(30)"] * 4, ["assert True"] * 4
    start = time.monotonic()
    rewards = CodeReward(timeout_s=1, memory_mb=256, workers=4)(["p"] * 4, sleepers, tests=tests)
    assert rewards == [0.0] * 4
    assert time.monotonic() - start < 3.5  # four 1 s timeouts at once, not one after another
    start = time.monotonic()
    CodeReward(timeout_s=1, memory_mb=256, workers=2)(["p"] * 4, sleepers, tests=tests)
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
    with pytest.raises(ValueError, match="workers"):
        CodeReward(workers=0)
    with pytest.raises(ValueError, match="tests_column"):
        CodeReward(tests_column="")
    reward = CodeReward(**SMALL)
    with pytest.raises(ValueError, match="tests_column 'tests' is not among the dataset columns"):
        reward(["p"], [ADD], answer=["1"])
    with pytest.raises(ValueError, match="tests has 0 entries, expected 1"):
        reward(["p"], [ADD], tests=[])
    with pytest.raises(ValueError, match=r"tests\[0\] is empty"):
        reward(["p"], [ADD], tests=["  "])
    with pytest.raises(ValueError, match=r"tests\[0\] must be a str"):
        reward(["p"], [ADD], tests=[5])
    assert reward(["p"], [ADD], tests=[None]) == [None]  # no tests: no opinion
    renamed = CodeReward(**SMALL, tests_column="checks")
    assert renamed(["p"], [ADD], checks=["assert add(1, 1) == 2"]) == [1.0]


def test_get_reward_fn_code_tests():
    fn = get_reward_fn("code_tests")
    assert fn.__name__ == "code_tests"
    completions = [f"```python\n{ADD}```", "def add(a, b):\n    return a * b\n"]
    assert fn(["p", "p"], completions, tests=["assert add(2, 3) == 5"] * 2) == [1.0, 0.0]


def test_importing_rewards_does_not_import_the_sandbox():
    code = "import sys, gspo.rewards; print('gspo.sandbox' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "False"
