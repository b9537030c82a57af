"""How a sandboxed run's interpreter is started here: bubblewrap's OS boundary, or the weak launcher.

Used by gspo.sandbox.runner (whose docstring says what each guarantees); each is probed once per
process and cached. Nothing here runs at import.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import warnings

NOBODY = 65534
TMPFS_MIN_MB = 16  # the interpreter and a small program need a few MB; 16 leaves room
TMPFS_FILES = 4  # the working dir holds four files of the largest size RLIMIT_FSIZE allows


def tmpfs_bytes(max_file_mb: float) -> int:
    """Size of a run's working dir: max(16 MB, 4 x max_file_mb)."""
    return int(max(TMPFS_MIN_MB, TMPFS_FILES * max_file_mb) * 2**20)


def python_path() -> str:
    if not sys.executable:
        raise RuntimeError("the sandbox needs sys.executable to start a fresh Python interpreter")
    # The real interpreter, not a venv shim, so the sandbox only needs to see its prefix.
    return os.path.realpath(sys.executable)


def child_env(tmp: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": tmp, "TMPDIR": tmp}


# ---- the operating-system boundary (bubblewrap) -----------------------------------------------

@dataclasses.dataclass(frozen=True)
class Bwrap:
    """A bubblewrap that works here, and how to call it."""

    path: str
    flags: tuple[str, ...]  # namespaces and capabilities that depend on who the trainer is
    drop: tuple[str, ...]  # root: the setpriv command that runs the child as uid 65534; else ()


def _ancestors(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _mounts(tmp: str) -> list[str]:
    """bwrap arguments for the read-only view of the system and the interpreter, and tmp's parents."""
    binds, covered = ["--ro-bind", "/usr", "/usr"], ["/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):  # merged /usr: the same symlink, so paths resolve as on the host
            binds += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            binds += ["--ro-bind", path, path]
            covered.append(path)
    roots: list[str] = []
    for path in sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix),
                        os.path.dirname(python_path())}):
        if not any(path == c or path.startswith(c + "/") for c in covered + roots):
            roots.append(path)
            binds += ["--ro-bind", path, path]
    # bwrap would create missing parents with a mode uid 65534 cannot traverse
    parents = sorted({p for path in [*roots, tmp] for p in _ancestors(path)})
    return [arg for p in parents for arg in ("--perms", "0755", "--dir", p)] + binds


def bwrap_argv(box: Bwrap, tmp: str, size: int, files: list[tuple[int, str]]) -> list[str]:
    """The bwrap command line up to the interpreter; `files` are (descriptor, name in tmp)."""
    argv = [box.path, *box.flags, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", *_mounts(tmp),
            "--proc", "/proc", "--dev", "/dev",
            # as root the tmpfs belongs to root, and the program runs as uid 65534
            "--size", str(size), "--perms", "0777" if box.drop else "0700", "--tmpfs", tmp]
    for fd, name in files:
        argv += ["--perms", "0644", "--file", str(fd), f"{tmp}/{name}"]
    return argv + ["--chdir", tmp, "--remount-ro", "/dev", "--remount-ro", "/", "--", *box.drop]


def bwrap_commands(box: Bwrap, source: bytes, max_file_mb: float,
                   fds: list[int]) -> tuple[list[str], list[str], str, str, int]:
    """sandbox="os": (the program's bwrap command, the judge's, their working dirs, the memfd holding the program's
    source, added to `fds`, which the caller closes)."""
    size, tag = tmpfs_bytes(max_file_mb), secrets.token_hex(6)
    ptmp, jtmp = f"/tmp/gspo-sandbox-{tag}", f"/tmp/gspo-judge-{tag}"  # each only in its own namespace
    fds.append(source_fd := memfd("source", source))
    return (bwrap_argv(box, ptmp, size, [(source_fd, "solution.py")]), bwrap_argv(box, jtmp, size, []), ptmp, jtmp,
            source_fd)


def weak_commands(prefix, who: str, source: bytes, folders: list[str]) -> tuple[list[str], list[str], str, str]:
    """sandbox="weak": (the program's launcher command, the judge's, their working dirs), the dirs made in the
    host's temp dir (added to `folders`, which the caller deletes) with the program's source as solution.py."""
    ptmp = os.path.realpath(tempfile.mkdtemp(prefix="gspo-sandbox-"))
    jtmp = os.path.realpath(tempfile.mkdtemp(prefix="gspo-judge-"))
    folders += [ptmp, jtmp]
    with open(os.path.join(ptmp, "solution.py"), "wb") as f:
        f.write(source)
    if who.startswith(f"uid {NOBODY}"):
        for folder in folders:
            os.chown(folder, NOBODY, NOBODY)
    return list(prefix), list(prefix), ptmp, jtmp


def memfd(name: str, data: bytes) -> int:
    """A descriptor of an in-memory file holding `data`, read from its start (bwrap's --file)."""
    fd = os.memfd_create(f"gspo-{name}", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _find_bwrap() -> tuple[str | None, str]:
    """(the bwrap binary or None, where it was looked for)."""
    named = os.environ.get("GSPO_BWRAP")
    if named:
        found = os.path.isfile(named) and os.access(named, os.X_OK)
        return (named if found else None), f"GSPO_BWRAP={named}"
    return shutil.which("bwrap"), "on PATH"


@functools.cache
def _probe_bwrap(path: str, root: bool) -> tuple[Bwrap | None, str]:
    """(the boundary, "") if `path` starts the interpreter inside it and that reads its own stdlib."""
    if root:
        # Never a user namespace as root: the sandbox's uid would be root outside it.
        setpriv = shutil.which("setpriv", path="/usr/bin:/usr/sbin")
        if setpriv is None:
            return None, "setpriv (util-linux) not found in /usr/bin: it drops root to uid 65534 inside bwrap"
        # bwrap as root keeps every capability unless told: keep only what setpriv needs
        caps = ("--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                "--cap-add", "CAP_SETPCAP")
        drop = (os.path.realpath(setpriv), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all")
        box = Bwrap(path, caps, drop)
    else:
        try:
            usage = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            usage = ""
        nested = ("--disable-userns",) if "--disable-userns" in usage else ()  # bwrap >= 0.8
        box = Bwrap(path, ("--unshare-user", *nested, "--cap-drop", "ALL"), ())
    tmp, fd = "/tmp/gspo-sandbox-probe", memfd("probe", b"ok")
    code = "import os; open('w', 'w').close(); print(open('probe.txt').read(), os.path.realpath(os.__file__))"
    try:
        done = subprocess.run(
            [*bwrap_argv(box, tmp, tmpfs_bytes(0), [(fd, "probe.txt")]), python_path(), "-I", "-S", "-B",
             "-c", code],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, cwd="/", env=child_env(tmp),
            pass_fds=(fd,), timeout=20,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"bwrap failed: {exc}"
    finally:
        os.close(fd)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}, no message"]
        return None, f"bwrap failed: {lines[0][:300]}"
    # An interpreter that cannot read its own prefix falls back to another stdlib (e.g. /usr/lib).
    if done.stdout.strip() != f"ok {os.path.realpath(os.__file__)}":
        return None, f"bwrap failed: the interpreter inside read another stdlib ({done.stdout[:200]!r})"
    return box, ""


def boundary() -> tuple[Bwrap | None, str]:
    """(the OS boundary, "") where it works here, else (None, why not): probed once per binary."""
    path, where = _find_bwrap()
    if path is None:
        return None, f"bwrap not found ({where})"
    return _probe_bwrap(path, os.geteuid() == 0)


# ---- the weak launcher ------------------------------------------------------------------------

def _probe(prefix: list[str]) -> bool:
    """True if `prefix python` starts here and imports the trainer's own standard library."""
    try:
        done = subprocess.run(
            [*prefix, python_path(), "-I", "-S", "-B", "-c", "import os; print(os.path.realpath(os.__file__))"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, cwd=tempfile.gettempdir(),
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and done.stdout.strip() == os.path.realpath(os.__file__)


@functools.cache
def weak_launcher() -> tuple[tuple[str, ...], bool, str]:
    """(command prefix, has a network namespace, user description): the strongest that works here."""
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    root = os.geteuid() == 0
    netns = []
    if unshare:
        netns = [unshare, "--net"] if root else [unshare, "--user", "--map-root-user", "--net"]
    drops: list[tuple[list[str], str]] = []
    if root and setpriv:
        drop = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--no-new-privs"]
        caps = ["--inh-caps=-all,+dac_read_search", "--ambient-caps=-all,+dac_read_search"]
        drops = [(drop, f"uid {NOBODY}"), (drop + caps, f"uid {NOBODY} + CAP_DAC_READ_SEARCH")]
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
                    f"gspo.sandbox.runner: {' and '.join(weak)} are guarded only by an in-process audit hook, "
                    "which is not a security boundary (unshare or setpriv is missing or failed)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return tuple(prefix), has_netns, who
    raise RuntimeError(f"the sandbox cannot start {python_path()} even without isolation")

