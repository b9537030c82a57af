"""The program's process: run as `python -I -S -B -c <wire.py + this file>` by gspo.sandbox.runner.

argv: working dir, memory bytes, cpu s, file bytes, max open files, policy flag (1: the full audit
policy), setup-failure status, request fd, reply fd, frame cap, set-up fd, seccomp filter (hex; "-":
none). The working dir holds solution.py, deleted here before the program runs. One byte on the set-up
fd, closed before the program runs, tells the trainer the set-up succeeded: a later exit with the
set-up-failure status is the program's, not the sandbox's.

It runs the program as __main__, then tells the judge its global names (["ready", [[name, value],
...]]) or why it stopped (["failed", why]), then answers the judge's requests (call, getattr, setattr,
delattr, op) until the judge closes the channel. Nothing here decides the verdict: the judge
(judge.py) runs the tests in a process this one cannot reach and reads these answers as
data. Everything in this process, this bootstrap included, is the program's to change; the layers
set up here before it runs (seccomp, rlimits, the audit hook) bound what it can do to the machine.
"""
import operator
import os
import pathlib
import posix
import sys
import traceback

if __name__ != "__main__":  # imported (tests, tools); run by `python -c`, wire.py's text comes first
    from gspo.sandbox.wire import decode, encode, receive, send, set_limits


def _seccomp(program_hex):
    """Install the trainer's seccomp filter (raw BPF) on this process for good; then forget ctypes."""
    if program_hex == "-":
        return
    import ctypes

    prog = bytes.fromhex(program_hex)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: needed for a filter without privileges
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
    for name in [n for n in sys.modules if n.partition(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]  # so that `import ctypes` is an import again, which the audit hook sees


# The audit hook's policy (see _make_hook): events refused outright, modules never imported, path events
_DENIED_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
    "subprocess.Popen", "os.killpg", "os.symlink", "os.link", "os.chown", "os.setxattr",
    "os.removexattr", "resource.setrlimit", "resource.prlimit", "gc.get_objects",
    "gc.get_referrers", "gc.get_referents", "sys._current_frames", "sys.settrace", "sys.setprofile"})
# posix: only a re-import (after deleting it from sys.modules) fires this event
_BLOCKED_IMPORTS = frozenset({"ctypes", "_ctypes", "readline", "_testcapi", "_testinternalcapi", "posix"})
_PATH_EVENTS = frozenset({"os.mkdir", "os.rmdir", "os.remove", "os.chmod", "os.utime"})


def _make_hook(reads, writes, me):
    """The audit hook: the policy above plus reads only under `reads`, writes only under `writes`; `me` gets it.

    One function on purpose: everything it reads is bound as a default argument when it is made (the program may
    rebind this module's globals afterwards) and changing the hook itself is refused, so its checks cannot be
    split into other functions the program could reach and change.
    """
    wflags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    pure = pathlib.PurePath

    def hook(event, args, _deny=_DENIED_EVENTS, _blocked=_BLOCKED_IMPORTS, _pathev=_PATH_EVENTS, _wflags=wflags,
             _reads=reads, _writes=writes, _me=me, _cwd=posix.getcwd, _pid=posix.getpid,
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
            if _type(args[0]) in (_str, _bytes) and args[0][:5] in ("file:", b"file:"):
                raise _PE("sandbox: sqlite URIs are not allowed")  # check() would read one as a relative path
            check(args[0], True)

    me.append(hook)
    return hook


# ---- answering the judge ----------------------------------------------------------------------

def _call_exit(obj):
    return type(obj).__exit__(obj, None, None, None)


_OPS = {
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt,
    "ge": operator.ge, "add": operator.add, "sub": operator.sub, "mul": operator.mul,
    "truediv": operator.truediv, "floordiv": operator.floordiv, "mod": operator.mod, "pow": pow,
    "matmul": operator.matmul, "and": operator.and_, "or": operator.or_, "xor": operator.xor,
    "lshift": operator.lshift, "rshift": operator.rshift, "divmod": divmod, "iadd": operator.iadd,
    "isub": operator.isub, "imul": operator.imul, "neg": operator.neg, "pos": operator.pos, "abs": abs,
    "invert": operator.invert, "index": operator.index, "int": int, "float": float, "complex": complex,
    "round": round, "truth": bool, "len": len, "iter": iter, "next": next, "reversed": reversed,
    "contains": operator.contains, "getitem": operator.getitem, "setitem": operator.setitem,
    "delitem": operator.delitem, "hash": hash, "str": str, "repr": repr, "format": format,
    "isinstance": isinstance, "issubclass": issubclass, "dir": dir,
    "enter": lambda obj: type(obj).__enter__(obj), "exit": _call_exit,
}
_MUTABLE = (list, dict, set, bytearray)  # arguments whose new contents go back to the judge
# Encoding budgets (about bytes): a global name's value is sent as data only up to GLOBAL_BUDGET (a
# table the program precomputed goes as a handle), an answer up to RESULT_BUDGET.
GLOBAL_BUDGET, RESULT_BUDGET = 2**20, 2**24


class _Answers:
    """The program's objects the judge holds handles to, and how this process encodes its answers."""

    def __init__(self, namespace, cap):
        self.namespace, self.cap = namespace, cap
        self.objects, self.ids, self.bound = [], {}, {}

    def handle(self, obj):
        key = id(obj)
        number = self.ids.get(key)
        if number is None:
            number = self.ids[key] = len(self.objects)
            self.objects.append(obj)  # kept alive, so its id is never reused
        if isinstance(obj, type) and issubclass(obj, BaseException):
            base = next(c for c in obj.__mro__ if c.__module__ == "builtins")
            return ["X", number, obj.__name__, base.__name__]
        return ["h", number, type(obj).__name__]

    def encode(self, value, budget=RESULT_BUDGET):
        try:
            return encode(value, self.handle, budget=[budget])
        except (ValueError, RecursionError, MemoryError):  # too large or deep, or a cycle: a handle instead
            return self.handle(value)

    def resolve(self, tag, args):
        return self.objects[args[0]]

    def new_globals(self):
        """[[name, value], ...] for the names bound (or re-bound) since the last call."""
        changed = []
        for name, value in list(self.namespace.items()):
            if type(name) is str and not name.startswith("__") and self.bound.get(name, self) is not value:
                self.bound[name] = value
                changed.append([name, self.encode(value, GLOBAL_BUDGET)])
        return changed

    def answer(self, request):
        """The reply to one request (see the module docstring); the program's exceptions propagate."""
        def value(v):
            return decode(v, self.resolve)

        kind, mutable = request[0], []
        if kind == "call":
            args, kwargs = [value(a) for a in request[2]], {k: value(v) for k, v in request[3]}
            mutable = [*args, *kwargs.values()]
            result = value(request[1])(*args, **kwargs)
        elif kind == "getattr":
            result = getattr(value(request[1]), request[2])
        elif kind == "setattr":
            result = setattr(value(request[1]), request[2], value(request[3]))
        elif kind == "delattr":
            result = delattr(value(request[1]), request[2])
        else:  # ["op", name, operand, ...]
            result = _OPS[request[1]](*map(value, request[2:]))
        after = [self.encode(a) if isinstance(a, _MUTABLE) else None for a in mutable]
        return ["ok", self.encode(result), after, self.new_globals()]


def _text(exc, limit=4000):
    try:
        return str(exc)[:limit]
    except BaseException:
        return "(its message could not be printed)"


def _serve(answers, rfd, wfd, _exit, _flush):
    while True:
        try:
            request = receive(rfd, answers.cap)
        except BaseException:  # the judge is done (or gone): so is this process
            _flush()
            _exit(0)
        try:
            reply = answers.answer(request)
        except StopIteration:
            reply = ["stop"]
        except Exception as exc:
            trace = "".join(traceback.format_exception(exc))[-4000:]
            reply = ["raise", answers.handle(type(exc)), _text(exc), trace]
        except BaseException as exc:
            send(wfd, ["exit", f"the program exited before the tests finished ({type(exc).__name__})"])
            _flush()
            _exit(0)
        send(wfd, reply)


def _flush_all():
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:
            pass


def _main():
    tmp, args = sys.argv[1], sys.argv[2:]
    mem, cpu, fsize, nofile, policy, setup_fail, rfd, wfd, cap, setup_fd = map(int, args[:10])
    _exit, _flush = posix._exit, _flush_all  # bound before the program can replace either
    try:
        with open(tmp + "/solution.py", "rb") as f:
            program = f.read().decode("utf-8", "replace")
        os.unlink(tmp + "/solution.py")
        _seccomp(args[10])
        set_limits(mem, cpu, fsize, nofile)
        stdlib = tuple(os.path.realpath(p) for p in sys.path if p)
        devices = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/stdout", "/dev/stderr")
        reads = (tmp,) + stdlib + devices + ("/usr/share/zoneinfo",)
        writes = (tmp, "/dev/null", "/dev/stdout", "/dev/stderr")
        if policy:
            sys.addaudithook(_make_hook(reads, writes, []))
        os.write(setup_fd, b"1")
        os.close(setup_fd)
    except BaseException:
        traceback.print_exc()
        _exit(setup_fail)
    main = type(sys)("__main__")
    sys.modules["__main__"] = main
    answers = _Answers(main.__dict__, cap)
    try:
        exec(compile(program, "solution.py", "exec"), main.__dict__)
        del program
        hello = ["ready", answers.new_globals()]
    except Exception:
        traceback.print_exc()
        hello = ["failed", "the program raised an exception before the tests ran"]
    except BaseException as exc:
        hello = ["failed", f"the program exited before the tests ran ({type(exc).__name__})"]
    _flush()
    send(wfd, hello)
    if hello[0] == "failed":
        _exit(0)
    _serve(answers, rfd, wfd, _exit, _flush)


if __name__ == "__main__":  # run by `python -c`; importing this module does nothing
    _main()
