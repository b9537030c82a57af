"""The sandbox's child: run as `python -I -S -B -c <this file's text>` by gspo.data.sandbox.

argv: sandbox dir, memory bytes, cpu s, file bytes, max open files, policy flag (1: the full
audit policy), failure status, setup-failure status. The dir holds solution.py and tests.py,
deleted here before any model code runs.

The audit hook is also the only holder of the real os._exit: the run ends with status 0 only
when _main itself reports the tests passed; any other ending (an exception or SystemExit that
escapes, a signal handler, the end of the script) reaches interpreter shutdown, where the hook
exits with the failure status. The hook binds everything it uses as default arguments, so
replacing builtins or module attributes from the program does not change its decisions. The
hook is defence in depth; the boundary is the operating system's (see gspo.data.sandbox).
"""
import builtins
import linecache
import os
import pathlib
import posix
import resource
import sys
import traceback


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

        if event == "gspo.data.sandbox.exit":
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
            if _type(args[0]) in (_str, _bytes) and args[0][:5] in ("file:", b"file:"):
                raise _PE("sandbox: sqlite URIs are not allowed")  # check() would read one as a relative path
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
        _audit("gspo.data.sandbox.exit", code)

if __name__ == "__main__":  # run by `python -c`; importing this module does nothing
    _main()
