"""Procedurally generated multi-digit arithmetic with a worked, column-by-column solution.

A problem is a prompt such as "347+585=". Its target completion works the columns from the
right, then states the answer after a "####" marker (the GSM8K convention):

    +   347+585=   ->  "7+5=12;4+8+1=13;3+5+1=9;#### 932"      (a "+1" is the carry in)
    -   532-285=   ->  "12-5=7;13-8-1=4;5-2-1=2;#### 247"      (a "1" before the top digit
                                                                 is a borrow, "-1" repays it)
    *   347*5=     ->  "7*5=35;4*5+3=23;3*5+2=17;#### 1735"    (multiplier is one digit)

With `times` = t > 1 (addition only) the prompt is "a+t*b=" and the answer adds b t times, one
line per addition, each restating its sum so every line's digits are near it:

    +   347+2*585= ->  "347+585:7+5=12;4+8+1=13;3+5+1=9;=932\n932+585:2+5=7;3+8=11;9+5+1=15;=1517\n#### 1517"

(add3x6: 195-289 tokens, the regimes lab's long answers; one wrong line makes every later sum wrong.)

Completions are tens of tokens for 3 digits, so the answer is only right when every step is.
Train and test problems are disjoint by construction: a problem is a test problem iff the
CRC-32 of its prompt is 0 mod 10.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

ANSWER_MARKER = "####"
OPS = {"+": "add", "-": "sub", "*": "mul"}
SPLITS = ("train", "test")
MAX_DIGITS = 30


def extract_answer(text: str) -> str | None:
    """The text after the last "####", stripped and cut at the first newline or "<eos>".

    None if there is no marker. `extract_answer("4+8=12;#### 12<eos>")` is "12".
    """
    _, marker, rest = text.rpartition(ANSWER_MARKER)
    if not marker:
        return None
    rest = rest.strip()
    rest = rest.split("\n", 1)[0].split("<eos>", 1)[0]
    return rest.strip()


def split_of(prompt: str) -> str:
    """"test" for about one problem in ten (fixed by the prompt's CRC-32), else "train"."""
    return "test" if zlib.crc32(prompt.encode("utf-8")) % 10 == 0 else "train"


def _digits_of(n: int) -> list[int]:
    """Decimal digits of n >= 0, least significant first."""
    return [int(c) for c in reversed(str(n))]


def _solve_add(a: int, b: int) -> str:
    da, db = _digits_of(a), _digits_of(b)
    steps, carry = [], 0
    for i in range(max(len(da), len(db))):
        terms = [str(da[i]) if i < len(da) else "0", str(db[i]) if i < len(db) else "0"]
        if carry:
            terms.append(str(carry))
        total = sum(int(t) for t in terms)
        steps.append(f"{'+'.join(terms)}={total};")
        carry = total // 10
    return "".join(steps) + f"{ANSWER_MARKER} {a + b}"


def _solve_repeated_add(a: int, b: int, times: int) -> str:
    """a + times*b worked as `times` additions, one line each: "<sum>+<b>:<columns>=<new sum>"."""
    lines, total = [], a
    for _ in range(times):
        columns = _solve_add(total, b).rpartition(ANSWER_MARKER)[0]
        lines.append(f"{total}+{b}:{columns}={total + b}\n")
        total += b
    return "".join(lines) + f"{ANSWER_MARKER} {total}"


def _solve_sub(a: int, b: int) -> str:
    """Column subtraction for a >= b; a borrowed column writes its top digit as 1x."""
    da, db = _digits_of(a), _digits_of(b)
    steps, borrow = [], 0
    for i in range(len(da)):
        top, bottom = da[i], db[i] if i < len(db) else 0
        need = top - bottom - borrow < 0
        lhs = f"{10 + top if need else top}-{bottom}" + ("-1" if borrow else "")
        diff = (10 if need else 0) + top - bottom - borrow
        steps.append(f"{lhs}={diff};")
        borrow = int(need)
    return "".join(steps) + f"{ANSWER_MARKER} {a - b}"


def _solve_mul(a: int, m: int) -> str:
    """Multiply a by the single digit m, column by column with the carry added."""
    steps, carry = [], 0
    for d in _digits_of(a):
        total = d * m + carry
        steps.append(f"{d}*{m}" + (f"+{carry}" if carry else "") + f"={total};")
        carry = total // 10
    return "".join(steps) + f"{ANSWER_MARKER} {a * m}"


@dataclass(frozen=True)
class ArithmeticTask:
    """Arithmetic on `digits`-digit operands (no leading zero).

    op "+": a+b. op "-": a-b with a >= b (the operands are swapped if needed). op "*": a times
    a single digit 2..9 (only the first operand has `digits` digits).
    """

    digits: int = 3
    op: str = "+"
    times: int = 1
    """How many times the second operand is added (op "+" only): the prompt is "a+t*b=" for t > 1."""

    def __post_init__(self):
        if isinstance(self.digits, bool) or not isinstance(self.digits, int):
            raise ValueError(f"digits must be an int, got {self.digits!r}")
        if not 1 <= self.digits <= MAX_DIGITS:
            raise ValueError(f"digits must be in [1, {MAX_DIGITS}], got {self.digits}")
        if self.op not in OPS:
            raise ValueError(f"op must be one of {sorted(OPS)}, got {self.op!r}")
        if isinstance(self.times, bool) or not isinstance(self.times, int) or self.times < 1:
            raise ValueError(f"times must be an int >= 1, got {self.times!r}")
        if self.times > 1 and self.op != "+":
            raise ValueError(f"times={self.times} needs op '+' (repeated addition), got op {self.op!r}")

    @property
    def name(self) -> str:
        """Registry name that rebuilds this task, e.g. "add3", "add3x6"."""
        return f"{OPS[self.op]}{self.digits}" + (f"x{self.times}" if self.times > 1 else "")

    def _operand(self, rng: random.Random) -> int:
        return rng.randint(10 ** (self.digits - 1), 10**self.digits - 1)

    def solve(self, a: int, b: int) -> str:
        """Worked solution of `a op b`, e.g. solve(347, 585) for "+" is
        "7+5=12;4+8+1=13;3+5+1=9;#### 932". For "-" needs a >= b >= 0; for "*" b is one digit."""
        if min(a, b) < 0:
            raise ValueError(f"operands must be non-negative, got a={a}, b={b}")
        if self.op == "+":
            return _solve_repeated_add(a, b, self.times) if self.times > 1 else _solve_add(a, b)
        if self.op == "-":
            if a < b:
                raise ValueError(f"subtraction needs a >= b, got a={a}, b={b}")
            return _solve_sub(a, b)
        if b > 9:
            raise ValueError(f"multiplication needs a single-digit b, got b={b}")
        return _solve_mul(a, b)

    def sample(self, rng: random.Random) -> dict:
        """One problem: {"prompt", "answer", "solution"}; the solution has no <eos>."""
        a = self._operand(rng)
        b = rng.randint(2, 9) if self.op == "*" else self._operand(rng)
        if self.op == "-":
            a, b = max(a, b), min(a, b)
        solution = self.solve(a, b)
        prompt = f"{a}+{self.times}*{b}=" if self.times > 1 else f"{a}{self.op}{b}="
        return {"prompt": prompt, "answer": extract_answer(solution), "solution": solution}

    def dataset(self, split: str, n: int, seed: int) -> list[dict]:
        """`n` problems of `split` ("train" or "test"), the same list for the same seed.

        Problems are drawn independently, so a small task (e.g. add1) may repeat one.
        """
        if split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        rng = random.Random(f"{self.name}:{seed}")
        rows: list[dict] = []
        # A split holds ~10% or ~90% of problems; the cap only stops a runaway loop.
        attempts = 100 * n + 1000
        while len(rows) < n and attempts > 0:
            attempts -= 1
            row = self.sample(rng)
            if split_of(row["prompt"]) == split:
                rows.append(row)
        if len(rows) == n:
            return rows
        raise ValueError(f"could not draw {n} {split!r} problems for task {self.name!r}")
