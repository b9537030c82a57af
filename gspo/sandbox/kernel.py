"""The kernel's bounds on a sandboxed program beyond its rlimits: a seccomp filter and a memory cgroup.

RLIMIT_AS bounds the program's address space, not memory the kernel holds for it outside that space:
pages of a memfd (61 memfds x 16 MB held ~976 MB under memory_mb=64), SysV shared memory and message
queues, a tmpfs mounted in a nested user namespace. Two layers close that:

- **seccomp** (x86_64 and aarch64): a filter installed by the program's process on itself before the
  program runs, for good, refusing with EPERM the system calls that hold memory outside RLIMIT_AS
  (memfd_create, memfd_secret, shmget/shmat, msgget/msgsnd, mq_open, io_uring, userfaultfd, keyrings,
  bpf) and those that reach other processes or build namespaces (ptrace, process_vm_readv/writev,
  pidfd_getfd, unshare, setns, clone with a namespace flag, mount and the new mount API, swap, reboot,
  kexec, kernel modules, open_by_handle_at); clone3 answers ENOSYS, so libc falls back to clone.
- **a memory cgroup** where the trainer may make one (cgroup v1's memory hierarchy, or v2 with the
  memory controller delegated to the trainer's cgroup): each run's process tree is charged to its own
  child cgroup capped at memory_mb + the working dir's tmpfs + 32 MB, which counts everything the
  kernel charges (heap, tmpfs and memfd pages, page tables, pipe buffers); going over kills the run
  (reported as killed="memory_limit").

`describe()` says which are active here. Nothing here runs at import.
"""

from __future__ import annotations

import functools
import os
import platform
import secrets
import shutil
import struct
import time

_EPERM, _ENOSYS = 1, 38

# names refused with EPERM, and their numbers on each architecture (x86_64's table; aarch64 uses the
# generic one); (AUDIT_ARCH, {name: number}, clone's number, clone3's number, the x32 bit or 0)
_DENIED = (
    "memfd_create", "memfd_secret", "shmget", "shmat", "msgget", "msgsnd", "mq_open", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "userfaultfd", "add_key", "request_key", "keyctl", "bpf",
    "perf_event_open", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "unshare", "setns",
    "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
    "mount_setattr", "swapon", "swapoff", "reboot", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "name_to_handle_at", "open_by_handle_at",
)
_X86_64 = dict(zip(_DENIED, (
    319, 447, 29, 30, 68, 69, 240, 425, 426, 427, 323, 248, 249, 250, 321, 298, 101, 310, 311, 438, 272, 308,
    165, 166, 155, 428, 429, 430, 431, 432, 433, 442, 167, 168, 169, 246, 320, 175, 313, 176, 303, 304)))
_GENERIC = dict(zip(_DENIED, (
    279, 447, 194, 196, 186, 189, 180, 425, 426, 427, 282, 217, 218, 219, 280, 241, 117, 270, 271, 438, 97, 268,
    40, 39, 41, 428, 429, 430, 431, 432, 433, 442, 224, 225, 142, 104, 294, 105, 273, 106, 264, 265)))
_ARCHES = {"x86_64": (0xC000003E, _X86_64, 56, 435, 0x40000000),
           "aarch64": (0xC00000B7, _GENERIC, 220, 435, 0)}
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
_CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """The filter as raw BPF (struct sock_filter[]) for `machine` (default: this one); None where the
    architecture has no table here."""
    arch = _ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    audit_arch, numbers, clone, clone3, x32 = arch
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    allow, kill = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS

    def errno(n: int) -> int:
        return 0x00050000 | n  # SECCOMP_RET_ERRNO

    prog = [_insn(ld, 4), _insn(jeq, audit_arch, jt=1), _insn(ret, kill), _insn(ld, 0)]  # arch; syscall nr
    if x32:  # the x32 ABI shares x86_64's arch value: its numbers carry this bit
        prog += [_insn(jge, x32, jf=1), _insn(ret, errno(_ENOSYS))]
    prog += [_insn(jeq, clone3, jf=1), _insn(ret, errno(_ENOSYS))]
    for name in _DENIED:
        prog += [_insn(jeq, numbers[name], jf=1), _insn(ret, errno(_EPERM))]
    # clone with a namespace flag in its first argument (the low 32 bits of args[0], at offset 16)
    prog += [_insn(jeq, clone, jf=3), _insn(ld, 16), _insn(jset, _CLONE_NAMESPACES, jf=1), _insn(ret, errno(_EPERM)),
             _insn(ret, allow)]
    return b"".join(prog)


# ---- the memory cgroup ------------------------------------------------------------------------

HEADROOM_MB = 32  # the interpreter's page tables, bwrap's own pages, pipe buffers


@functools.cache
def cgroup_parent() -> tuple[str | None, str, str]:
    """(the folder run cgroups are made in, "v1" or "v2", "") where one can be made here, else
    (None, "", why not). Probed once per process: a test cgroup is made, capped and removed."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
        with open("/proc/self/mounts") as f:
            mounts = [line.split() for line in f]
    except OSError as exc:
        return None, "", f"cannot read /proc/self/cgroup or /proc/self/mounts ({exc})"
    candidates = []
    for _, controllers, path in (parts for parts in lines if len(parts) == 3):
        if "memory" in controllers.split(","):
            for m in mounts:
                if len(m) > 3 and m[2] == "cgroup" and "memory" in m[3].split(","):
                    candidates.append((m[1] + path, "v1", "memory.limit_in_bytes"))
        elif controllers == "":
            for m in mounts:
                if len(m) > 2 and m[2] == "cgroup2":
                    candidates.append((m[1] + path, "v2", "memory.max"))
    if not candidates:
        return None, "", "no memory cgroup hierarchy is mounted for this process"
    reasons = []
    for parent, version, limit_file in candidates:
        probe = os.path.join(parent, f"gspo-probe-{secrets.token_hex(4)}")
        try:
            os.mkdir(probe)
        except OSError as exc:
            reasons.append(f"cannot make a cgroup in {parent} ({exc.strerror})")
            continue
        try:
            with open(os.path.join(probe, limit_file), "w") as f:
                f.write(str(64 * 2**20))
            return parent, version, ""
        except OSError as exc:
            reasons.append(f"{version} at {parent}: no memory controller for its children ({exc.strerror})")
        finally:
            _rmdir(probe)
    return None, "", "; ".join(reasons)


def _rmdir(path: str, wait_s: float = 1.0) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY for a moment after its last process is reaped
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)


class RunCgroup:
    """One run's memory cgroup: `wrap(argv)` starts the command inside it; `close()` removes it."""

    def __init__(self, limit_bytes: int):
        parent, self.version, why = cgroup_parent()
        if parent is None:
            raise OSError(why)
        self.path = os.path.join(parent, f"gspo-sandbox-{secrets.token_hex(6)}")
        os.mkdir(self.path)
        try:
            if self.version == "v1":
                self._write("memory.limit_in_bytes", limit_bytes)
                if os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")):
                    self._write("memory.memsw.limit_in_bytes", limit_bytes)  # no escape into swap
            else:
                self._write("memory.max", limit_bytes)
                self._write("memory.swap.max", 0, missing_ok=True)
        except BaseException:
            _rmdir(self.path)
            raise

    def _write(self, name: str, value: int, missing_ok: bool = False) -> None:
        try:
            with open(os.path.join(self.path, name), "w") as f:
                f.write(str(value))
        except FileNotFoundError:
            if not missing_ok:
                raise

    def wrap(self, argv: list[str]) -> list[str]:
        """argv run by a shell that first moves itself into this cgroup, so all it starts is charged here."""
        sh = shutil.which("sh", path="/usr/bin:/bin") or "/bin/sh"
        return [sh, "-c", 'echo $$ > "$0" && exec "$@"', os.path.join(self.path, "cgroup.procs"), *argv]

    def oom_killed(self) -> bool:
        name = "memory.oom_control" if self.version == "v1" else "memory.events"
        try:
            with open(os.path.join(self.path, name)) as f:
                fields = dict(line.split() for line in f if len(line.split()) == 2)
        except OSError:
            return False
        return fields.get("oom_kill", "0") != "0"

    def close(self) -> None:
        _rmdir(self.path)


def describe() -> str:
    """Which of the two layers a run gets here, in words."""
    filt = seccomp_filter()
    seccomp = ("seccomp: memfd/SysV shm/msg/io_uring/userfaultfd/keyrings/bpf, ptrace/process_vm, "
               "namespaces and mounts refused" if filt else f"seccomp: none (no table for {platform.machine()})")
    parent, version, why = cgroup_parent()
    cgroup = (f"memory cgroup ({version}, in {parent}): memory_mb + tmpfs + {HEADROOM_MB} MB in all"
              if parent else f"memory cgroup: none ({why})")
    return f"{seccomp}; {cgroup}"
