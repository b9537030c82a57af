"""The judge: runs the tests in a process the program cannot reach, and its exit status is the verdict.

Run as `python -I -S -B -c <wire.py + this file>` by gspo.sandbox.runner, in a sandbox of its
own (another bwrap, so another pid and mount namespace; made non-dumpable, so no ptrace or /proc/PID/mem
either). argv: memory bytes, cpu s, file bytes, max open files, failure status, setup-failure status,
request fd (written), reply fd (read), frame cap. The tests arrive on stdin and never reach the program.

The program runs first, in its own process (child.py), which then sends its global names. The
tests run here in a namespace holding those names: data (None, bools, numbers, str, bytes and
containers of them; see wire) arrives as the plain built-in type, so `==` on it is Python's
own; anything else (functions, classes, instances) is a Remote handle, and every operation on it is
asked of the program and answered with more data or handles. A Remote compares (==, <, ...) only with
another Remote: against data it is unequal, so an object whose __eq__ says True to everything passes
no test that compares it with an expected value. The program's names that shadow builtins (`len`,
`abs`, `isinstance`, ...) do not replace the tests' builtins; the tests reach every program name as
`solution.NAME` too.

Exit status 0 iff the tests ran to their end (or ended with SystemExit(0), as `unittest.main()` does
on success) and the program's process stayed up and spoke the wire format throughout; otherwise the
failure status, with the reason on stderr.
"""
import builtins
import os
import sys
import traceback

if __name__ != "__main__":  # imported (tests, tools); run by `python -c`, wire.py's text comes first
    from gspo.sandbox.wire import WireError, decode, encode, receive, send, set_limits


class ProgramGone(BaseException):
    """The program's process ended, exited or broke the wire format while the tests ran. A
    BaseException, so `except Exception` in the tests does not swallow it; the run fails even if a bare
    `except:` does."""


_UNSET = object()
_BUILTIN_NAMES = frozenset(vars(builtins))
_LINK = None  # the one _Link of this process, set by _main


def _other(value):
    """The wire form of what is not data: the program's own objects go back as their handles."""
    if type(value) is Remote:
        return ["h", object.__getattribute__(value, "_gspo_id"), ""]
    number = getattr(value, "_gspo_id", None) if isinstance(value, type) else None
    if type(number) is int and _LINK.classes.get(number) is value:
        return ["X", number, value.__name__, ""]
    raise TypeError(
        f"sandbox: a {type(value).__name__} cannot be passed to the program: only data (None, bools, numbers, "
        "str, bytes and containers of them) and the program's own objects cross to its process"
    )


def _enc(value):
    return encode(value, _other)


class _Link:
    """The judge's end of the channel: asks, checks the answer's shape, and remembers a broken program."""

    def __init__(self, wfd, rfd, cap, namespace, module):
        self.wfd, self.rfd, self.cap = wfd, rfd, cap
        self.namespace, self.module = namespace, module
        self.broken = None  # why the program can no longer answer; set once, for good
        self.proxies, self.classes, self.installed = {}, {}, {}

    def fail(self, why):
        if self.broken is None:
            self.broken = why
        raise ProgramGone(self.broken)

    def receive(self):
        try:
            return receive(self.rfd, self.cap)
        except EOFError:
            self.fail("the program's process ended before the tests finished")
        except (OSError, WireError, MemoryError) as exc:  # MemoryError: an answer too large for this process
            self.fail(f"the program's process broke the channel: {type(exc).__name__}: {exc}")

    def handle(self, tag, args):
        if len(args) < 2 or type(args[0]) is not int or not 0 <= args[0] < 2**31 or type(args[1]) is not str:
            raise WireError(f"a malformed {tag!r} handle")
        number = args[0]
        if tag == "h":
            proxy = self.proxies.get(number)
            if proxy is None:
                proxy = self.proxies[number] = Remote.__new__(Remote)
                object.__setattr__(proxy, "_gspo_id", number)
            return proxy
        cls = self.classes.get(number)
        if cls is None:
            if len(args) != 3 or type(args[2]) is not str:
                raise WireError("a malformed exception class")
            name, base = args[1][:100], getattr(builtins, args[2], None)
            if not (isinstance(base, type) and issubclass(base, Exception)):
                base = Exception
            if name == base.__name__:  # one of Python's own: ValueError is ValueError
                cls = base
            else:
                cls = type(name if name.isidentifier() else "ProgramError", (base,),
                           {"__module__": "solution", "_gspo_id": number})
            self.classes[number] = cls
        return cls

    def decode(self, tree):
        return decode(tree, self.handle)

    def rebind(self, changed):
        """Bind the program's (re-)bound global names here: in `solution`, and in the tests' namespace
        unless they shadow a builtin or the tests bound that name themselves."""
        if type(changed) is not list:
            raise WireError("the program's names must be a list")
        for item in changed:
            if type(item) is not list or len(item) != 2 or type(item[0]) is not str:
                raise WireError("a name must be a [name, value] pair")
            name, value = item[0], self.decode(item[1])
            if not name.isidentifier() or name.startswith("__"):
                continue
            setattr(self.module, name, value)
            if name in _BUILTIN_NAMES:
                continue
            if name not in self.namespace or self.namespace[name] is self.installed.get(name, _UNSET):
                self.namespace[name] = self.installed[name] = value

    def ask(self, request, originals=()):
        """Send one request; the answer's value, or the program's exception raised here."""
        if self.broken is not None:
            raise ProgramGone(self.broken)
        try:
            send(self.wfd, request)
        except OSError as exc:
            self.fail(f"the program's process stopped listening ({exc})")
        reply = self.receive()
        try:  # decode the answer; the program's own exception is raised after, never caught here
            kind, error = reply[0] if type(reply) is list and reply else None, None
            if kind == "ok" and len(reply) == 4 and type(reply[2]) is list:
                value = self.decode(reply[1])
                for original, after in zip(originals, reply[2]):
                    if after is not None and isinstance(original, (list, dict, set, bytearray)):
                        _copy_back(original, self.decode(after))
                self.rebind(reply[3])
                return value
            if kind == "stop" and len(reply) == 1:
                error = StopIteration()
            elif kind == "exit" and len(reply) == 2 and type(reply[1]) is str:
                self.fail(reply[1][:300])
            elif kind == "raise" and len(reply) == 4 and type(reply[2]) is str and type(reply[3]) is str:
                cls = self.decode(reply[1])
                if isinstance(cls, type) and issubclass(cls, Exception):
                    error = _make_exception(cls, reply[2])
                    error.add_note("raised in the program's process:\n" + reply[3].rstrip())
            if error is None:
                raise WireError("an answer of the wrong shape")
        except (WireError, MemoryError, RecursionError) as exc:  # MemoryError: an answer too large to hold here
            self.fail(f"the program's process broke the channel: {type(exc).__name__}: {exc}")
        raise error


def _copy_back(original, new):
    """An argument the program changed in place: the tests' object gets its new contents."""
    if isinstance(original, list) and type(new) is list or isinstance(original, bytearray) and type(new) is bytearray:
        original[:] = new
    elif isinstance(original, dict) and isinstance(new, dict) or isinstance(original, set) and type(new) is set:
        original.clear()
        original.update(new)


def _make_exception(cls, message):
    for c in cls.__mro__:  # UnicodeDecodeError and friends take more than a message: their base does not
        try:
            return c(message)
        except Exception:
            continue
    return Exception(message)


def _op(name, *operands):
    return _LINK.ask(["op", name, *map(_enc, operands)])


def _typed(value, kind, what):
    if type(value) is not kind:
        raise TypeError(f"the program's {what} returned {type(value).__name__}, not {kind.__name__}")
    return value


class Remote:
    """An object living in the program's process: attribute access, calls and operators are asked of it."""

    __slots__ = ("_gspo_id",)

    def __getattribute__(self, name):
        if name.startswith("_gspo_") or name == "__class__":
            return object.__getattribute__(self, name)
        return _LINK.ask(["getattr", _enc(self), name])

    def __setattr__(self, name, value):
        _LINK.ask(["setattr", _enc(self), name, _enc(value)])

    def __delattr__(self, name):
        _LINK.ask(["delattr", _enc(self), name])

    def __call__(self, *args, **kwargs):
        request = ["call", _enc(self), [_enc(a) for a in args], [[k, _enc(v)] for k, v in kwargs.items()]]
        return _LINK.ask(request, [*args, *kwargs.values()])

    def __hash__(self):
        return _typed(_op("hash", self), int, "__hash__")

    def __bool__(self):
        return _typed(_op("truth", self), bool, "__bool__")

    def __str__(self):
        return _typed(_op("str", self), str, "__str__")

    def __repr__(self):
        try:
            return _typed(_op("repr", self), str, "__repr__")
        except Exception:
            return f"<the program's object #{object.__getattribute__(self, '_gspo_id')}>"

    def __format__(self, spec):
        return _typed(_op("format", self, spec), str, "__format__")

    def __iter__(self):
        return _typed(_op("iter", self), Remote, "__iter__")

    def __mro_entries__(self, bases):
        raise TypeError("sandbox: the tests cannot subclass the program's classes")


def _compare(name):
    # with another of the program's objects only: against data a Remote is unequal (== False, < TypeError)
    return lambda self, other: _op(name, self, other) if type(other) is Remote else NotImplemented


def _forward(name, reflected=False):
    if reflected:
        return lambda self, other: _op(name, other, self)
    return lambda self, *operands: _op(name, self, *operands)


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    setattr(Remote, f"__{_name}__", _compare(_name))
for _name in ("len", "next", "reversed", "contains", "getitem", "setitem", "delitem", "index", "int", "float",
              "complex", "round", "neg", "pos", "abs", "invert", "enter", "dir"):
    setattr(Remote, f"__{_name}__", _forward(_name))
for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift",
              "rshift", "divmod"):
    setattr(Remote, f"__{_name}__", _forward(_name))
    setattr(Remote, f"__r{_name}__", _forward(_name, reflected=True))
for _name in ("iadd", "isub", "imul"):
    setattr(Remote, f"__{_name}__", _forward(_name))
Remote.__exit__ = lambda self, *exc_info: _op("exit", self)
Remote.__instancecheck__ = lambda self, instance: _op("isinstance", instance, self)
Remote.__subclasscheck__ = lambda self, subclass: _op("issubclass", subclass, self)


def _not_dumpable():
    """No ptrace, /proc/PID/mem or /proc/PID/fd of this process for anyone without CAP_SYS_PTRACE."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, 0
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")


def _main():
    global _LINK
    mem, cpu, fsize, nofile, fail, setup_fail, wfd, rfd, cap = map(int, sys.argv[1:10])
    try:
        tests = sys.stdin.buffer.read().decode("utf-8", "replace")
        _not_dumpable()
        set_limits(mem, cpu, fsize, nofile)
    except BaseException:
        traceback.print_exc()
        os._exit(setup_fail)
    main, solution = type(sys)("__main__"), type(sys)("solution")
    sys.modules["__main__"], sys.modules["solution"] = main, solution
    _LINK = link = _Link(wfd, rfd, cap, main.__dict__, solution)
    verdict = fail
    try:
        hello = link.receive()
        if type(hello) is list and len(hello) == 2 and hello[0] == "failed" and type(hello[1]) is str:
            link.fail(hello[1][:300])
        if not (type(hello) is list and len(hello) == 2 and hello[0] == "ready"):
            link.fail("the program's process broke the channel: its first message is not ready/failed")
        try:
            link.rebind(hello[1])
        except WireError as exc:
            link.fail(f"the program's process broke the channel: {exc}")
        exec(compile(tests, "tests.py", "exec"), main.__dict__)
        verdict = 0
    except SystemExit as exc:  # only the tests can raise it here: the program's exits arrive as ProgramGone
        verdict = 0 if exc.code in (None, 0) else fail
        if verdict:
            sys.stderr.write(f"sandbox: the tests exited with status {exc.code!r}\n")
    except ProgramGone:
        pass  # reported below
    except BaseException:
        traceback.print_exc()
    if link.broken is not None:
        sys.stderr.write(f"sandbox: {link.broken}\n")
        verdict = fail
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(verdict)


if __name__ == "__main__":  # run by `python -c`; importing this module does nothing
    _main()
