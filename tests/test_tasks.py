"""Tests for gspo.tasks: the character tokenizer and the arithmetic tasks."""

import random
import re

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo.tasks import TASKS, ArithmeticTask, build_char_tokenizer, extract_answer, get_task
from gspo.tasks.arithmetic import split_of
from gspo.tasks.tokenizer import CHARACTERS

ALL_TASKS = [get_task(n) for n in TASKS if n != "arithmetic" and get_task(n).times == 1] + [
    get_task("arithmetic", digits=1, op="+"),
    get_task("arithmetic", digits=1, op="-"),
    get_task("arithmetic", digits=5, op="*"),
]


_TOK = build_char_tokenizer()  # shared by the hypothesis test, which cannot take fixtures


@pytest.fixture(scope="module")
def tok():
    return _TOK


# ---------------------------------------------------------------- tokenizer


def test_vocab_layout(tok):
    # 4 specials + 10 digits + 13 punctuation + space + newline + 52 letters = 81
    assert len(tok) == 81
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.convert_tokens_to_ids(["0", "+", " ", "\n", "a", "Z"]) == [4, 14, 27, 28, 29, 80]


def test_encode_adds_no_specials_and_unknown_is_unk(tok):
    assert tok("12")["input_ids"] == [5, 6]
    assert tok.encode("a~b") == [29, 3, 30]  # "~" is not in the vocabulary
    assert tok.encode("é") == [3]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=CHARACTERS, max_size=60))
def test_round_trip_is_exact(text):
    tok = _TOK
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per character
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_decode_keeps_spaces_around_punctuation(tok):
    # HF's clean_up_tokenization_spaces would turn " ." into "."
    text = "a , b . c ! d ? \n  e"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("<bos>1<eos>")) == "<bos>1<eos>"
    assert tok.decode([1, 5, 2], skip_special_tokens=True) == "1"


def test_save_and_autotokenizer_reload(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    again = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Q: 347+585=?\nA: 7+5=12;#### 932"
    assert again.encode(text) == tok.encode(text)
    assert again.decode(tok.encode(text)) == text
    assert again.pad_token_id == 0 and again.eos_token_id == 2
    assert again.chat_template == tok.chat_template


def test_chat_template_renders_contents(tok):
    one = [{"role": "user", "content": "347+585="}]
    # A single user message renders exactly as the plain prompt.
    assert tok.apply_chat_template(one, tokenize=False, add_generation_prompt=True) == "347+585="
    two = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="}]
    assert tok.apply_chat_template(two, tokenize=False, add_generation_prompt=True) == "Add.\n1+2="


# ---------------------------------------------------------------- solutions


def test_solve_hand_written():
    assert ArithmeticTask(3, "+").solve(347, 585) == "7+5=12;4+8+1=13;3+5+1=9;#### 932"
    assert ArithmeticTask(3, "+").solve(999, 999) == "9+9=18;9+9+1=19;9+9+1=19;#### 1998"
    assert ArithmeticTask(2, "+").solve(12, 34) == "2+4=6;1+3=4;#### 46"
    # 532-285: 2<5 borrow -> 12-5=7; 3-8-1<0 borrow -> 13-8-1=4; 5-2-1=2
    assert ArithmeticTask(3, "-").solve(532, 285) == "12-5=7;13-8-1=4;5-2-1=2;#### 247"
    assert ArithmeticTask(3, "-").solve(532, 529) == "12-9=3;3-2-1=0;5-5=0;#### 3"
    assert ArithmeticTask(3, "*").solve(347, 5) == "7*5=35;4*5+3=23;3*5+2=17;#### 1735"


_STEP = re.compile(r"^(\d+)([-+*])(\d+)(?:([-+])(\d+))?=(\d+)$")


def _check_solution(prompt: str, solution: str, answer: str):
    """Recompute everything in a solution from scratch and check it is consistent."""
    a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", prompt).groups()
    a, b = int(a), int(b)
    expected = {"+": a + b, "-": a - b, "*": a * b}[op]
    assert answer == str(expected)
    body, marker, tail = solution.rpartition("#### ")
    assert marker and tail == answer
    steps = body.split(";")
    assert steps[-1] == ""  # every step ends with ";"
    units = []
    for step in steps[:-1]:
        x, sop, y, eop, z, rhs = _STEP.fullmatch(step).groups()
        value = {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[sop]
        if eop:
            value = value + int(z) if eop == "+" else value - int(z)
        assert value == int(rhs), step
        units.append(int(rhs) % 10)
        last_rhs = int(rhs)
    # The answer is the column digits read right to left, plus the final carry.
    carry = last_rhs // 10 if op != "-" else 0
    digits = "".join(str(d) for d in reversed(units))
    assert str(int((str(carry) if carry else "") + digits)) == answer
    assert len(steps) - 1 == len(str(a))  # one step per column of the first operand


@pytest.mark.parametrize("task", ALL_TASKS, ids=lambda t: t.name)
def test_samples_are_correct(task):
    rng = random.Random(123)
    for _ in range(300):
        row = task.sample(rng)
        assert set(row) == {"prompt", "answer", "solution"}
        assert "<eos>" not in row["solution"]
        assert extract_answer(row["solution"]) == row["answer"]
        _check_solution(row["prompt"], row["solution"], row["answer"])


@pytest.mark.parametrize("task", ALL_TASKS, ids=lambda t: t.name)
def test_operand_digit_counts(task):
    rng = random.Random(7)
    for _ in range(200):
        a, b = re.fullmatch(r"(\d+)[-+*](\d+)=", task.sample(rng)["prompt"]).groups()
        assert len(a) == task.digits and a[0] != "0"
        if task.op == "*":
            assert 2 <= int(b) <= 9
        else:
            assert len(b) == task.digits and b[0] != "0"
            if task.op == "-":
                assert int(a) >= int(b)


def test_add3_solution_length_range():
    # Shortest: 3 columns "a+b=s;" (6 chars) + "#### " + 3 digits = 26.
    # Longest: "a+b=ss;" (7) + 2x "a+b+1=ss;" (9) + "#### " + 4 digits = 34.
    rng = random.Random(0)
    lengths = [len(get_task("add3").sample(rng)["solution"]) for _ in range(3000)]
    assert min(lengths) == 26 and max(lengths) == 34


def test_repeated_addition_hand_written():
    # 347+2*585: 347+585 = 932, then 932+585 = 1517 (the last column's carry is the sum's leading 1, as in add3).
    assert ArithmeticTask(3, "+", times=2).solve(347, 585) == (
        "347+585:7+5=12;4+8+1=13;3+5+1=9;=932\n932+585:2+5=7;3+8=11;9+5+1=15;=1517\n#### 1517")
    # A 4-digit running sum gets a column for its extra digit: 1517+585 = 2102.
    assert ArithmeticTask(3, "+", times=3).solve(347, 585).split("\n")[2] == (
        "1517+585:7+5=12;1+8+1=10;5+5+1=11;1+0+1=2;=2102")
    task = get_task("add3x6")
    assert (task.name, task.times) == ("add3x6", 6)
    row = task.sample(random.Random(3))
    a, b = map(int, re.fullmatch(r"(\d+)\+6\*(\d+)=", row["prompt"]).groups())
    assert row["answer"] == str(a + 6 * b) and extract_answer(row["solution"]) == row["answer"]
    lines = row["solution"].split("\n")
    assert len(lines) == 7  # six additions, then the answer
    for i, line in enumerate(lines[:6]):  # every line restates its sum and checks out on its own
        head, _, tail = line.partition(":")
        assert head == f"{a + i * b}+{b}" and tail.endswith(f"={a + (i + 1) * b}")
        assert ArithmeticTask(3, "+").solve(a + i * b, b).rpartition("####")[0] == tail.rpartition("=")[0]


def test_add3x6_answers_are_long(tok):
    # The regimes lab's long answers. By construction, 6 lines "<sum>+<b>:<columns>=<new sum>" + newline, then
    # "#### " and the answer. Shortest: 100+6*100, 3-digit sums, no carries, ~31 characters a line (195 tokens
    # in all); longest: 999+6*999, 4-digit sums with carries, ~48 a line. Sampled: 2000 problems, one token per
    # character + EOS: all but the rare carry-free problem have >= 200 tokens.
    rng = random.Random(0)
    rows = [get_task("add3x6").sample(rng) for _ in range(2000)]
    lengths = [len(tok(r["solution"], add_special_tokens=False)["input_ids"]) + 1 for r in rows]  # + EOS
    assert 190 <= min(lengths) and max(lengths) <= 295
    assert sum(n >= 200 for n in lengths) / len(lengths) > 0.99 and 240 < sorted(lengths)[1000] < 270


def test_add3x3_answers_span_100_to_150_tokens(tok):
    # Lab part 4's length level: three lines "<sum>+<b>:<columns>=<new sum>", ~31-48 characters each, then the
    # answer; one token per character + EOS. 2000 problems: 102 to 145 tokens, median 130.
    rng = random.Random(0)
    rows = [get_task("add3x3").sample(rng) for _ in range(2000)]
    lengths = sorted(len(tok(r["solution"], add_special_tokens=False)["input_ids"]) + 1 for r in rows)
    assert (lengths[0], lengths[1000], lengths[-1]) == (102, 130, 145)
    assert get_task("add3x3").name == "add3x3" and all(r["solution"].count("\n") == 3 for r in rows)


def test_repeated_addition_errors():
    with pytest.raises(ValueError, match="times must be an int >= 1"):
        ArithmeticTask(times=0)
    with pytest.raises(ValueError, match=r"needs op '\+'"):
        ArithmeticTask(op="*", times=2)
    assert get_task("arithmetic", digits=2, op="+", times=3).name == "add2x3"


@pytest.mark.parametrize("task", ALL_TASKS, ids=lambda t: t.name)
def test_all_text_is_in_vocab(task, tok):
    rng = random.Random(1)
    for _ in range(100):
        row = task.sample(rng)
        ids = tok.encode(row["prompt"] + row["solution"])
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == row["prompt"] + row["solution"]


# ---------------------------------------------------------------- datasets


def test_splits_disjoint_and_labelled():
    task = get_task("add3")
    train = task.dataset("train", 2000, seed=0)
    test = task.dataset("test", 300, seed=0)
    assert len(train) == 2000 and len(test) == 300
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in test})
    assert all(split_of(r["prompt"]) == "train" for r in train)
    assert all(split_of(r["prompt"]) == "test" for r in test)


def test_test_split_is_about_a_tenth():
    rng = random.Random(0)
    task = get_task("add3")
    frac = sum(split_of(task.sample(rng)["prompt"]) == "test" for _ in range(5000)) / 5000
    assert 0.08 < frac < 0.12


def test_split_of_uses_crc32():
    import zlib

    prompts = [f"{a}+{a}=" for a in range(100, 200)]
    expected = ["test" if zlib.crc32(p.encode()) % 10 == 0 else "train" for p in prompts]
    assert [split_of(p) for p in prompts] == expected
    assert "test" in expected and "train" in expected


def test_dataset_is_deterministic():
    task = get_task("sub3")
    assert task.dataset("train", 50, seed=3) == task.dataset("train", 50, seed=3)
    assert task.dataset("train", 50, seed=3) != task.dataset("train", 50, seed=4)
    assert get_task("add3").dataset("test", 0, seed=0) == []


def test_dataset_validates_arguments():
    task = get_task("add2")
    with pytest.raises(ValueError, match="split"):
        task.dataset("valid", 5, seed=0)
    with pytest.raises(ValueError, match="n must be"):
        task.dataset("train", -1, seed=0)


# ---------------------------------------------------------------- extract_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("7+5=12;#### 932", "932"),
        ("#### 932<eos>", "932"),
        ("#### 932<eos>junk", "932"),
        ("#### 932\n#", "932"),
        ("#### 12 #### 34", "34"),  # the last marker wins
        ("####   56  \nmore text", "56"),
        ("####\n78", "78"),  # leading whitespace (even a newline) is stripped first
        ("####", ""),
        ("#### <eos>", ""),
        ("no marker 932", None),
        ("### 932", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# ---------------------------------------------------------------- registry


def test_registry():
    assert {"add2", "add3", "add4", "add3x6", "arithmetic"} <= set(TASKS)
    assert (get_task("add3").digits, get_task("add3").op) == (3, "+")
    assert (get_task("add4").digits, get_task("add2").digits) == (4, 2)
    task = get_task("arithmetic", digits=5, op="-")
    assert task.name == "sub5"
    for name in TASKS:
        if name != "arithmetic":
            assert get_task(name).name == name


def test_registry_errors():
    with pytest.raises(ValueError, match="known tasks: .*add3"):
        get_task("add33")
    with pytest.raises(ValueError, match="fixes"):
        get_task("add3", digits=4)
    with pytest.raises(ValueError, match="unknown argument"):
        get_task("arithmetic", digit=4)
    with pytest.raises(ValueError, match="digits"):
        ArithmeticTask(digits=0)
    with pytest.raises(ValueError, match="op must be"):
        ArithmeticTask(op="/")
    with pytest.raises(ValueError, match="a >= b"):
        ArithmeticTask(op="-").solve(1, 2)
