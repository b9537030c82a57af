"""The sandbox's wire: frames and values between the judge (the tests' process) and the program's.

Both sandbox bootstraps run as `python -I -S -B -c <this file's text + their own>`, so this file
imports only the standard library and runs nothing at import; it also holds their one other shared
step, `set_limits`. A frame is a 4-byte big-endian length
and that many bytes of JSON. A value is JSON where None, True and False stand for themselves and
everything else is a list [tag, ...]:

    ["i", hex]  int          ["f", hex]  float        ["c", re, im]  complex   ["s", text]  str
    ["y", hex]  bytes        ["Y", hex]  bytearray    ["l", ...]     list      ["t", ...]   tuple
    ["d", [k, v], ...] dict  ["O", ...]  OrderedDict  ["C", ...]     Counter   ["S", ...]   set
    ["F", ...]  frozenset    ["r", a, b, c] range     ["z", a, b, c] slice     ["E"]        Ellipsis
    ["Q", num, den] Fraction ["D", text] Decimal      ["q", [items], maxlen]  deque
    ["h", id, type name]     an object that stays in the program's process (a handle)
    ["X", id, name, base]    an exception class of the program's (base: its nearest built-in one)

Subclasses of these types travel as the type itself (a namedtuple as a tuple, an IntEnum as an
int, a str subclass as its characters): whatever methods the subclass overrides stay behind.
`decode` is the judge's: it builds only these types and the handles it is given a factory for, and
refuses anything else with WireError.
"""

import collections
import json
import os
import resource
import sys

MAX_DEPTH = 200  # nesting of one value; deeper is refused (the judge's decoder is recursive)


class WireError(ValueError):
    """A frame or value that does not follow the wire format."""


def send(fd: int, message) -> None:
    data = json.dumps(message, separators=(",", ":")).encode("utf-8")
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(fd: int, cap: int):
    """The next frame's JSON; EOFError at the end, WireError if longer than `cap` bytes or not JSON."""
    size = int.from_bytes(_read_exactly(fd, 4), "big")
    if size > cap:
        raise WireError(f"a frame of {size} bytes (the most is {cap})")
    try:
        return json.loads(_read_exactly(fd, size).decode("utf-8", "surrogatepass"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise WireError(f"a frame that is not JSON: {exc}") from None


class TooLarge(ValueError):
    """A value over its encoding budget."""


def encode(value, other, depth: int = 0, budget: list | None = None):
    """`value` as wire JSON; `other(value)` encodes what is not data (a handle) or raises TypeError.

    `budget`: None, or [n]: about how many bytes the encoding may take (each item costs 1, a str or
    bytes its length); TooLarge once spent, checked before each value is converted.
    """
    if depth > MAX_DEPTH:
        raise ValueError(f"a value nested more than {MAX_DEPTH} deep")
    if value is None or value is True or value is False:
        return value
    d = depth + 1
    if budget is not None:
        size = len(value) if isinstance(value, (str, bytes, bytearray)) else 1
        budget[0] -= 2 * size if isinstance(value, (bytes, bytearray)) else size  # bytes go as hex
        if budget[0] < 0:
            raise TooLarge("a value over its encoding budget")

    def many(items):
        return [encode(v, other, d, budget) for v in items]

    if isinstance(value, int):
        return ["i", hex(int.__int__(value))]
    if isinstance(value, float):
        return ["f", float.hex(float.__float__(value))]
    if isinstance(value, complex):
        return ["c", float.hex(value.real), float.hex(value.imag)]
    if isinstance(value, str):
        return ["s", str.__str__(value)]
    if isinstance(value, bytearray):
        return ["Y", bytes(value).hex()]
    if isinstance(value, bytes):
        return ["y", bytes.hex(value)]
    if isinstance(value, list):
        return ["l", *many(list.__iter__(value))]
    if isinstance(value, tuple):
        return ["t", *many(tuple.__iter__(value))]
    if isinstance(value, dict):
        tag = "O" if isinstance(value, collections.OrderedDict) else "C" if isinstance(value, collections.Counter) \
            else "d"
        return [tag, *([encode(k, other, d, budget), encode(v, other, d, budget)] for k, v in dict.items(value))]
    if isinstance(value, frozenset):
        return ["F", *many(frozenset.__iter__(value))]
    if isinstance(value, set):
        return ["S", *many(set.__iter__(value))]
    if isinstance(value, range):
        return ["r", *many((value.start, value.stop, value.step))]
    if isinstance(value, slice):
        return ["z", *many((value.start, value.stop, value.step))]
    if value is Ellipsis:
        return ["E"]
    # a Fraction or a Decimal exists only where its module was imported: no import here for them
    fractions, decimal = sys.modules.get("fractions"), sys.modules.get("decimal")
    if fractions is not None and isinstance(value, fractions.Fraction):
        return ["Q", hex(value.numerator), hex(value.denominator)]
    if decimal is not None and isinstance(value, decimal.Decimal):
        return ["D", decimal.Decimal.__str__(value)]
    if isinstance(value, collections.deque):
        return ["q", many(value), value.maxlen]
    return other(value)


def _int(text) -> int:
    if type(text) is not str or not 0 < len(text) <= 1 << 24:
        raise WireError(f"an int must be a hex str, got {type(text).__name__}")
    try:
        return int(text, 16)
    except ValueError:
        raise WireError(f"{text[:40]!r} is not a hex int") from None


def _float(text) -> float:
    if type(text) is not str or len(text) > 64:
        raise WireError(f"a float must be a short hex str, got {type(text).__name__}")
    try:
        return float.fromhex(text)
    except ValueError:
        raise WireError(f"{text!r} is not a hex float") from None


def _hex_bytes(text) -> bytes:
    if type(text) is not str:
        raise WireError(f"bytes must be a hex str, got {type(text).__name__}")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise WireError("bytes that are not hex") from None


# Fields each fixed-width tag takes; the others (containers) take any number
_FIELDS = {"i": 1, "f": 1, "c": 2, "s": 1, "D": 1, "y": 1, "Y": 1, "r": 3, "z": 3, "E": 0, "Q": 2, "q": 2}


def decode(tree, handle, depth: int = 0):
    """The value `tree` stands for; `handle(tag, args)` builds "h" and "X" values. WireError if malformed."""
    if tree is None or tree is True or tree is False:
        return tree
    if depth > MAX_DEPTH:
        raise WireError(f"a value nested more than {MAX_DEPTH} deep")
    if type(tree) is not list or not tree or type(tree[0]) is not str:
        raise WireError(f"a value must be null, a bool or a tagged list, got {type(tree).__name__}")
    tag, args = tree[0], tree[1:]
    if tag in _FIELDS and len(args) != _FIELDS[tag]:
        raise WireError(f"tag {tag!r} takes {_FIELDS[tag]} fields, got {len(args)}")

    def many(items):
        return [decode(v, handle, depth + 1) for v in items]

    if tag in ("i", "f", "c", "s", "D", "y", "Y", "E", "Q"):
        return _decode_atom(tag, args)
    if tag in ("l", "t", "d", "O", "C", "S", "F", "r", "z", "q"):
        return _decode_container(tag, args, many)
    if tag == "h" or tag == "X":
        return handle(tag, args)
    raise WireError(f"unknown tag {tag[:20]!r}")


def _decode_atom(tag: str, args: list):
    """A number, a str, bytes, a Decimal, a Fraction or Ellipsis (its fields already counted)."""
    if tag == "i":
        return _int(args[0])
    if tag == "f":
        return _float(args[0])
    if tag == "c":
        return complex(_float(args[0]), _float(args[1]))
    if tag == "s" or tag == "D":
        if type(args[0]) is not str:
            raise WireError(f"tag {tag!r} holds a str")
        if tag == "s":
            return args[0]
        import decimal

        try:
            return decimal.Decimal(args[0])
        except decimal.InvalidOperation:
            raise WireError(f"{args[0][:40]!r} is not a Decimal") from None
    if tag == "y" or tag == "Y":
        data = _hex_bytes(args[0])
        return data if tag == "y" else bytearray(data)
    if tag == "E":
        return Ellipsis
    num, den = _int(args[0]), _int(args[1])  # "Q"
    if den == 0:
        raise WireError("a Fraction with denominator 0")
    import fractions

    return fractions.Fraction(num, den)


def _decode_container(tag: str, args: list, many):
    """A list, tuple, dict (plain, Ordered, Counter), set, frozenset, range, slice or deque; `many(items)` decodes
    the items one level deeper."""
    if tag == "l":
        return many(args)
    if tag == "t":
        return tuple(many(args))
    if tag in ("d", "O", "C"):
        out = {"d": dict, "O": collections.OrderedDict, "C": collections.Counter}[tag]()
        for pair in args:
            if type(pair) is not list or len(pair) != 2:
                raise WireError("a dict item must be a [key, value] pair")
            key, value = many(pair)
            try:
                out[key] = value
            except TypeError as exc:  # an unhashable key: a dict of the program's could not hold it either
                raise WireError(f"a dict key that cannot be hashed: {exc}") from None
        return out
    if tag == "S" or tag == "F":
        try:
            return (set if tag == "S" else frozenset)(many(args))
        except TypeError as exc:
            raise WireError(f"a set member that cannot be hashed: {exc}") from None
    if tag == "r" or tag == "z":
        start, stop, step = many(args)
        if tag == "z":
            return slice(start, stop, step)
        if not all(type(v) is int for v in (start, stop, step)) or step == 0:
            raise WireError("a range takes three ints, the step not 0")
        return range(start, stop, step)
    if type(args[0]) is not list or not (args[1] is None or type(args[1]) is int and args[1] >= 0):  # "q"
        raise WireError("a deque takes [items] and a maxlen (null or an int >= 0)")
    return collections.deque(many(args[0]), args[1])


def set_limits(mem: int, cpu: int, fsize: int, nofile: int) -> None:
    """This process's rlimits: address space, CPU seconds, file size, open files; no core, no new process."""
    R = resource
    for res, soft, hard in ((R.RLIMIT_CORE, 0, 0), (R.RLIMIT_AS, mem, mem), (R.RLIMIT_CPU, cpu, cpu + 1),
                            (R.RLIMIT_FSIZE, fsize, fsize), (R.RLIMIT_NOFILE, nofile, nofile),
                            (R.RLIMIT_NPROC, 0, 0)):
        cap = R.getrlimit(res)[1]
        if cap != R.RLIM_INFINITY:
            hard = min(hard, cap)
            soft = min(soft, hard)
        R.setrlimit(res, (soft, hard))
