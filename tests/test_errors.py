"""What a user gets wrong, answered with one line: the regression suite of issue 14.

Every case runs the real command line (`gspo.apps.cli.main`, in process) and asserts the message, the
exit status, that no traceback was printed, and that nothing already written was lost (metrics
lines, checkpoints). Cases that need a process of their own (a full disk, signals) run `gspo` in a
subprocess. The fuzz tests feed random config files and dataset lines to the readers: every input
gives a valid config / rows or a one-line ValueError, never another exception.
"""

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY_RUN, gspo_argv, gspo_env, logged_steps, read_metrics
from gspo.apps.cli import main
from gspo.config import TrainConfig, load_config, make_config, to_dict
from gspo.data.rows import check_prompt_lengths, load_rows, render_prompts
from gspo.runtime import LOCK_FILE, run_lock
from gspo.tasks import build_char_tokenizer
from gspo.tracking import read_jsonl

TINY = {**TINY_RUN, "task": "add3", "max_steps": 2, "log_samples_steps": 1}

REWARDS = '''
import os, sys, time

CALLS = {"n": 0}


def boom(prompts, completions, **_):
    raise KeyError("no such column")


def boom_on_second_call(prompts, completions, **_):
    CALLS["n"] += 1
    if CALLS["n"] >= 2:
        raise ZeroDivisionError("step 2 went wrong")
    return [float(c[:1].isdigit()) for c in completions]


def exit0(prompts, completions, **_):
    sys.exit(0)


def exit7(prompts, completions, **_):
    sys.exit(7)


def interrupt(prompts, completions, **_):
    raise KeyboardInterrupt


def hang(prompts, completions, **_):
    time.sleep(3600)


def hang_on_marked(prompts, completions, **_):
    if any("HANG" in p for p in prompts):
        time.sleep(3600)
    return [float(c[:1].isdigit()) for c in completions]


def hang_from_step_3(prompts, completions, **_):
    CALLS["n"] += 1
    if CALLS["n"] >= 3 and os.environ.get("GSPO_TEST_HANG"):
        time.sleep(3600)
    return [float(c[:1].isdigit()) for c in completions]


def backtrack(prompts, completions, **_):
    import re
    re.match(r"(a+)+$", "a" * 40 + "b")  # exponential, inside C code that never lets go of the GIL
    return [0.0] * len(completions)


def slow(prompts, completions, **_):
    time.sleep(1.0)  # keeps a run alive long enough for a second one to meet it
    return [float(c[:1].isdigit()) for c in completions]


def vandal(prompts, completions, answer, **_):
    out = [float(c[:1].isdigit()) for c in completions]
    completions[:] = ["VANDALISED"] * len(completions)  # in-place edits of its inputs...
    prompts.clear()
    answer[:] = [None] * len(answer)
    return out


def huge(prompts, completions, **_):
    return [1e39] * len(completions)  # finite as a Python float, inf as float32


def minus_huge(prompts, completions, **_):
    return [-1e308] * len(completions)


def huge_int(prompts, completions, **_):
    return [10**400] * len(completions)  # does not fit a float at all


def huge_on_marked(prompts, completions, **_):
    return [(10**400 if i % 2 else -1e39) if "BIG" in p else float(c[:1].isdigit())
            for i, (p, c) in enumerate(zip(prompts, completions))]


def ten_billion(prompts, completions, **_):
    return [1e10] * len(completions)


def needs_target(prompts, completions, target, **_):
    return [float(str(t) in c) for c, t in zip(completions, target)]


def positional_target(p, c, target, **_):  # called positionally: p and c are the prompts and completions
    return [float(str(t) in x) for x, t in zip(c, target)]
'''

BROKEN_REWARDS = '''
import os

LIMIT = 1 / 0


def fn(prompts, completions, **_):
    return [0.0] * len(completions)
'''


@pytest.fixture(scope="module")
def reward_module(tmp_path_factory):
    """`errors_rewards.<fn>` importable from reward specs (in process and in subprocesses)."""
    folder = tmp_path_factory.mktemp("rewards")
    (folder / "errors_rewards.py").write_text(REWARDS)
    (folder / "errors_broken_rewards.py").write_text(BROKEN_REWARDS)
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop("errors_rewards", None)


def run_cli(capsys, tmp_path, *overrides, config: dict | None = None, args: tuple = ()) -> tuple[int, str]:
    """`gspo train` on the tiny config (+ overrides); (exit status, stderr)."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**TINY, "output_dir": str(tmp_path / "run"), **(config or {})}))
    capsys.readouterr()
    status = main(["train", "--config", str(path), *args, *overrides])
    return status, capsys.readouterr().err


def gspo_command(tmp_path, rewards: Path | None = None, **config) -> tuple[list[str], dict]:
    """(argv, env) of `gspo train` in a process of its own, on the tiny config (+ config)."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**TINY, "output_dir": str(tmp_path / "run"), **config}))
    return gspo_argv("train", "--config", path), gspo_env(*([rewards] if rewards else []))


def one_line_error(err: str, pattern: str, label: str = "error") -> str:
    """The error is the last stderr line, `gspo train: <label>: ...`, matching `pattern`; no traceback."""
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"gspo train: {label}: "), err
    assert re.search(pattern, last), (pattern, last)
    return last


def write(tmp_path, name: str, data: bytes | str) -> str:
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(path)


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


GOOD_ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(1, 12)]

# ------------------------------------------------------------------------------- config
CONFIG_CASES = [
    ("yaml_syntax", b"max_steps: [1, 2\nlearning_rate: 1e-3\n", (),
     r"run2.yaml line 2 column \d+: invalid YAML \(expected ',' or ']'"),
    ("not_utf8", b"max_steps: 2\nseed: \xff\n", (), r"run2.yaml line 2: not UTF-8 text \(byte 0xff at column 7\)"),
    ("not_a_mapping", b"- a\n- b\n", (), r"must hold a mapping of field: value, got list"),
    ("unknown_key", b"max_step: 3\n", (), r"unknown key 'max_step'; did you mean 'max_steps'\?"),
    ("clip_low_2", b"clip_low: 2.0\n", (), r"clip_low=2.0 puts the lower clip 1 - clip_low at or below 0"),
    ("nan_lr", b"learning_rate: .nan\n", (), r"learning_rate=nan must be a finite number"),
    ("bad_override", b"seed: 1\n", ("max_steps=[",), r"override 'max_steps=\[' line 1 column 2: invalid YAML"),
    ("bad_device", b"device: 'cuda:x'\n", (), r"device='cuda:x' is not one of"),
    ("bad_weights", b"reward_weights: [a]\n", (), r"reward_weights\[0\]='a' must be a finite number"),
    ("bad_truncate", b"truncate_prompts: right\n", (), r"truncate_prompts='right' is not one of error, left"),
    ("bad_sandbox", b"sandbox: none\n", (), r"sandbox='none' is not one of os, weak"),
    ("negative_timeout", b"reward_timeout_s: -1\n", (), r"reward_timeout_s=-1.0 must be >= 0"),
    ("duplicate_key", b"max_steps: 2\nseed: 1\nmax_steps: 0\n", (),
     r"run2.yaml line 3 column 1: invalid YAML \(duplicate key 'max_steps', first given on line 1\)"),
    ("duplicate_nested_key", b"tasks:\n  - task: add2\n    weight: 1\n    weight: -2\n", (),
     r"run2.yaml line 4 column 5: invalid YAML \(duplicate key 'weight', first given on line 3\)"),
    ("duplicate_key_in_override", b"seed: 1\n", ("max_steps={a: 1, a: 2}",),
     r"override 'max_steps=\{a: 1, a: 2\}' line 1 column 8: invalid YAML \(duplicate key 'a'"),
]


@pytest.mark.parametrize("name, text, overrides, message", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_config_errors_are_one_line(capsys, tmp_path, name, text, overrides, message):
    path = write(tmp_path, "run2.yaml", text)
    capsys.readouterr()
    status = main(["train", "--config", path, *overrides])
    one_line_error(capsys.readouterr().err, message)
    assert status == 2 and not (tmp_path / "runs").exists()


def test_debug_shows_the_traceback(tmp_path):
    path = write(tmp_path, "run2.yaml", b"clip_low: 2.0\n")
    with pytest.raises(ValueError, match="clip_low=2.0"):
        main(["train", "--config", path, "--debug"])


# ------------------------------------------------------------------------------- data
def data_cases():
    long_prompt = {"prompt": "1" * 40 + "+1=", "answer": "2"}
    return [
        ("empty_jsonl", "d.jsonl", b"", r"d.jsonl is empty \(no rows\)"),
        ("malformed_line", "d.jsonl", jsonl(GOOD_ROWS[:2]) + '{"prompt": "3+3=", "answer": }\n',
         r"d.jsonl line 3: invalid JSON \(Expecting value at column 30\)"),
        ("not_utf8", "d.jsonl", jsonl(GOOD_ROWS[:3]).encode() + b'{"prompt": "\xfe"}\n',
         r"d.jsonl line 4: not UTF-8 text \(byte 0xfe at column 13\)"),
        ("bad_value_line_11", "d.jsonl", jsonl(GOOD_ROWS[:10]) + jsonl([{"prompt": 5, "answer": "1"}]),
         r"d.jsonl line 11: prompt must be a non-empty string or a list of messages, got 5"),
        ("no_prompt_column", "d.jsonl", jsonl([{"question": "1+1="}]), r"has no 'prompt' column \(columns: question\)"),
        ("too_long_prompt_line_7", "d.jsonl", jsonl(GOOD_ROWS[:6] + [long_prompt] + GOOD_ROWS[6:]),
         r"d.jsonl line 7: the prompt has 4\d tokens > max_prompt_length=30; raise max_prompt_length, or set "
         r"truncate_prompts=left"),
        ("csv_not_utf8", "d.csv", b"prompt,answer\n1+1=,2\n\xff,3\n",
         r"d.csv line 3: not UTF-8 text \(byte 0xff at column 1\)"),
        ("bad_chat", "d.jsonl", jsonl([{"prompt": [{"role": "user"}], "answer": "1"}] * 3),
         r"d.jsonl line 1: chat messages must be a non-empty list of \{role, content\} string pairs"),
        ("whitespace_prompt_line_4", "d.jsonl", jsonl(GOOD_ROWS[:3] + [{"prompt": " \t ", "answer": "1"}]
                                                      + GOOD_ROWS[3:]),
         r"d.jsonl line 4: prompt must be a non-empty string or a list of messages, got ' \\t '"),
        ("whitespace_prompt_csv", "d.csv", "prompt,answer\n1+1=,2\n\" \",3\n",
         r"d.csv line 3: prompt must be a non-empty string or a list of messages, got ' '"),
    ]


@pytest.mark.parametrize("name, file, data, message", data_cases(), ids=[c[0] for c in data_cases()])
def test_data_errors_name_the_file_and_line_before_training(capsys, tmp_path, name, file, data, message):
    path = write(tmp_path, file, data)
    status, err = run_cli(capsys, tmp_path, config={"task": None, "dataset": path, "eval_dataset": path,
                                                    "max_prompt_length": 30})
    one_line_error(err, message)
    assert status == 2 and logged_steps(tmp_path / "run") == []  # found before any step and any evaluation


def test_every_task_of_a_mixture_is_checked_before_training(capsys, tmp_path):
    rows = GOOD_ROWS[:4] + [{"prompt": "7" * 40 + "+1=", "answer": "8"}]
    held_out = write(tmp_path, "held.jsonl", jsonl(rows))
    train_file = write(tmp_path, "train.jsonl", jsonl(GOOD_ROWS))
    tasks = [{"task": "add2"}, {"dataset": train_file, "eval_dataset": held_out}]
    status, err = run_cli(capsys, tmp_path, config={"tasks": tasks, "max_prompt_length": 30, "eval_num_prompts": 10})
    one_line_error(err, r"held.jsonl line 5: the prompt has 4\d tokens > max_prompt_length=30")  # a held-out prompt
    assert status == 2 and logged_steps(tmp_path / "run") == []


TARGET_ROWS = [{"prompt": f"{i}+{i}=", "target": str(2 * i)} for i in range(1, 12)]
NO_MODEL = {"model": "runs/no/such/model", "model_overrides": None}  # reached only if the checks did not stop it
PREFLIGHT_CASES = [  # (files in the working directory, config, the message); each run stops before the model loads
    ("missing_column", {"d.jsonl": GOOD_ROWS}, {"reward_funcs": ["errors_rewards:needs_target"]},
     r"error: dataset: d.jsonl: reward 'needs_target' needs column 'target'; columns: prompt, answer$"),
    ("called_positionally", {"d.jsonl": GOOD_ROWS}, {"reward_funcs": ["errors_rewards:positional_target"]},
     r"dataset: d.jsonl: reward 'positional_target' needs column 'target'; columns: prompt, answer$"),
    ("the_default_reward", {"d.jsonl": TARGET_ROWS}, {},
     r"dataset: d.jsonl: reward 'answer_match' needs column 'answer'; columns: prompt, target$"),
    ("held_out_file", {"d.jsonl": TARGET_ROWS, "held.jsonl": GOOD_ROWS},
     {"eval_dataset": "held.jsonl", "reward_funcs": ["errors_rewards:needs_target"]},
     r"dataset: held.jsonl: reward 'needs_target' needs column 'target'"),
    ("no_such_file", {}, {"reward_funcs": ["errors_rewards:needs_target"]}, r"dataset: d.jsonl does not exist"),
    ("no_prompt_column", {"d.jsonl": [{"question": "1+1=", "target": "2"}]},
     {"reward_funcs": ["errors_rewards:needs_target"]},
     r"d.jsonl has no 'prompt' column \(columns: question, target\)"),
    ("clash", {"d.jsonl": [{**r, "completions": "x"} for r in TARGET_ROWS]},
     {"reward_funcs": ["errors_rewards:needs_target"]},
     r"d.jsonl: column\(s\) \['completions'\] clash with the reward call's own arguments; rename them"),
    ("a_task_of_a_mixture", {"d.jsonl": GOOD_ROWS},
     {"tasks": [{"task": "add2"}, {"dataset": "d.jsonl"}], "dataset": None,
      "reward_funcs": ["errors_rewards:needs_target"]},
     r"error: task add2: reward 'needs_target' needs column 'target'; columns: prompt, answer, solution$"),
]


@pytest.mark.parametrize("name, files, config, message", PREFLIGHT_CASES, ids=[c[0] for c in PREFLIGHT_CASES])
def test_data_and_rewards_are_checked_before_the_model_loads(capsys, tmp_path, monkeypatch, reward_module, name,
                                                              files, config, message):
    monkeypatch.chdir(tmp_path)
    for file, rows in files.items():
        write(tmp_path, file, jsonl(rows))
    status, err = run_cli(capsys, tmp_path, config={"task": None, "dataset": "d.jsonl", **NO_MODEL, **config})
    one_line_error(err, message)  # not the model's "no such directory": the checks ran first
    assert status == 2 and [p.name for p in (tmp_path / "run").iterdir()] == [LOCK_FILE]  # nor anything written


def test_in_memory_data_and_a_reward_object_are_checked_before_the_model_loads(tmp_path):
    from gspo.apps.api import Trainer

    def needs_target(prompts, completions, target, **_):
        return [0.0] * len(completions)

    trainer = Trainer("runs/no/such/model", needs_target, train_dataset=GOOD_ROWS, output_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=r"^dataset: object:train_dataset: reward 'needs_target' needs column "
                                         r"'target'; columns: prompt, answer$"):
        trainer.train()


def test_a_dataset_scored_by_the_default_reward_is_said_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "d.jsonl", jsonl(GOOD_ROWS))
    note = ("rewards: d.jsonl is scored by answer_match, the default reward_funcs (1 where the text after the last "
            "'####' equals the answer column); set reward_funcs to score it otherwise")
    for config, said in (({"task": None, "dataset": "d.jsonl"}, True),
                         ({"task": None, "dataset": "d.jsonl", "reward_funcs": ["format"]}, False),
                         ({}, False)):  # a built-in task's answers are written for answer_match
        status, err = run_cli(capsys, tmp_path, config={**NO_MODEL, **config})
        assert status == 2 and "no such directory" in err.splitlines()[-1], err  # the checks passed: the model next
        assert (note in err.splitlines()) is said, err


BAD_TYPE, TOO_LONG = {"prompt": 5, "answer": "1"}, {"prompt": "1" * 40 + "+1=", "answer": "2"}
FIRST_BAD_CASES = [  # (bad rows by line number, the message naming the first): one file, split by the seed
    ("two_bad_types", {3: BAD_TYPE, 9: BAD_TYPE}, r"d.jsonl line 3: prompt must be a non-empty string"),
    ("two_too_long", {2: TOO_LONG, 8: TOO_LONG}, r"d.jsonl line 2: the prompt has 4\d tokens"),
    ("too_long_then_bad_type", {2: TOO_LONG, 6: BAD_TYPE}, r"d.jsonl line 2: the prompt has 4\d tokens"),
    ("bad_type_then_too_long", {2: BAD_TYPE, 6: TOO_LONG}, r"d.jsonl line 2: prompt must be a non-empty string"),
]


@pytest.mark.parametrize("name, bad, message", FIRST_BAD_CASES, ids=[c[0] for c in FIRST_BAD_CASES])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_several_bad_rows_the_first_is_named(capsys, tmp_path, name, bad, message, seed):
    rows = list(GOOD_ROWS)
    for line in sorted(bad):
        rows.insert(line - 1, bad[line])
    path = write(tmp_path, "d.jsonl", jsonl(rows))
    status, err = run_cli(capsys, tmp_path, f"seed={seed}", config={"task": None, "dataset": path,
                                                                     "max_prompt_length": 30})
    one_line_error(err, message)
    assert status == 2 and logged_steps(tmp_path / "run") == []


CODE_ROWS = [{"prompt": f"Write f() returning {i}.", "tests": f"assert f() == {i}"} for i in range(6)]
CODE_CASES = [
    ("number", 7, r"d.jsonl line 5: tests must be a non-empty string or a list of strings, got int 7"),
    ("list_of_numbers", [1, 2], r"d.jsonl line 5: tests must be a non-empty string or a list of strings, got "
                                r"list \[1, 2\]"),
    ("blank", " \n ", r"d.jsonl line 5: tests is empty: with no tests any program that runs would score 1"),
    ("empty_list", [], r"d.jsonl line 5: tests is empty: with no tests any program that runs would score 1"),
]


@pytest.mark.parametrize("name, tests, message", CODE_CASES, ids=[c[0] for c in CODE_CASES])
def test_code_tests_cells_are_checked_before_training(capsys, tmp_path, name, tests, message):
    rows = CODE_ROWS[:4] + [{"prompt": "Write g().", "tests": tests}] + CODE_ROWS[4:]
    path = write(tmp_path, "d.jsonl", jsonl(rows))
    status, err = run_cli(capsys, tmp_path, config={"task": None, "dataset": path, "eval_dataset": path,
                                                    "reward_funcs": ["code_tests"], "sandbox": "weak"})
    one_line_error(err, message)
    assert status == 2 and logged_steps(tmp_path / "run") == []


def test_the_code_tests_check_accepts_what_the_reward_reads():
    from gspo.sandbox.runner import CodeReward

    fine = [{"prompt": "p", "tests": "assert f() == 1"}, {"prompt": "p", "tests": ["assert f()", "assert g()"]},
            {"prompt": "p", "tests": None}, {"prompt": "p"}]  # None or no cell: no opinion
    CodeReward().check_rows(fine)
    with pytest.raises(ValueError, match=r"^dataset: row 4: tests must be a non-empty string or a list of strings, "
                                         r"got dict \{'a': 1\}$"):
        CodeReward().check_rows(fine + [{"prompt": "p", "tests": {"a": 1}}])


def test_long_prompts_can_be_cut_from_the_left(capsys, tmp_path):
    path = write(tmp_path, "d.jsonl", jsonl([{"prompt": "9" * 40 + "+1=", "answer": "2"}] + GOOD_ROWS))
    status, err = run_cli(capsys, tmp_path, "truncate_prompts=left",
                          config={"task": None, "dataset": path, "eval_dataset": path, "max_prompt_length": 30})
    assert status == 0, err
    assert logged_steps(tmp_path / "run") == [0, 1, 2]


# ------------------------------------------------------------------------------- rewards
REWARD_CASES = [
    ("raises", ["errors_rewards:boom"], {}, r"reward function 'boom' raised KeyError: 'no such column' on sample 0 "
     r"\(prompt='\d+\+\d+=', completion=.*\); fix the function, or set drop_bad_rewards=true"),
    ("raises_on_every_sample_with_drop", ["errors_rewards:boom"], {"drop_bad_rewards": True},
     r"'boom' raised KeyError: 'no such column' on the batch of 4 samples, and on every one of the 4 samples alone"),
    ("sys_exit_0", ["errors_rewards:exit0"], {}, r"'exit0' raised SystemExit: 0 on the batch of 4 samples: a reward "
     r"function must return its values, not exit or interrupt the run"),
    ("sys_exit_7", ["errors_rewards:exit7"], {"drop_bad_rewards": True}, r"'exit7' raised SystemExit: 7 on the batch"),
    ("keyboard_interrupt", ["errors_rewards:interrupt"], {}, r"'interrupt' raised KeyboardInterrupt on the batch"),
    ("hangs", ["errors_rewards:hang"], {"reward_timeout_s": 0.3},
     r"'hang' did not return within reward_timeout_s=0.3 s on sample 0 \(prompt="),
    ("beyond_float32", ["errors_rewards:huge"], {}, r"reward function 'huge' returned 1e\+39 at sample 0 \(prompt="
     r"'\d+\+\d+=', completion=.*\), beyond float32's range \(\|r\| <= 3.4e\+38\); return None for 'no opinion', "
     r"or set drop_bad_rewards"),
    ("minus_1e308", ["errors_rewards:minus_huge"], {}, r"'minus_huge' returned -1e\+308 at sample 0 .*, beyond "
     r"float32's range"),
    ("int_beyond_float", ["errors_rewards:huge_int"], {}, r"'huge_int' returned an int of 401 digits at sample 0 "
     r".*, beyond float32's range"),
    ("weighted_beyond_float32", ["errors_rewards:ten_billion"], {"reward_weights": [1e30]},
     r"sample 0 \(prompt=.*\) has the weighted reward 1e\+40 \(reward_weights \[1e\+30\]\), beyond float32's range"),
]


@pytest.mark.parametrize("name, funcs, config, message", REWARD_CASES, ids=[c[0] for c in REWARD_CASES])
def test_reward_failures_are_one_line_and_stop_with_status_2(capsys, tmp_path, reward_module, name, funcs, config,
                                                              message):
    started = time.monotonic()
    # evaluation off: the first call is training's (an evaluation scores with the same functions, and fails alike)
    status, err = run_cli(capsys, tmp_path, config={"reward_funcs": funcs, "eval_num_prompts": 0, **config})
    one_line_error(err, message)
    assert status == 2 and logged_steps(tmp_path / "run") == []
    assert time.monotonic() - started < 60


def test_a_reward_failing_later_keeps_metrics_and_checkpoints(capsys, tmp_path, reward_module):
    sys.modules.pop("errors_rewards", None)  # a fresh call counter
    status, err = run_cli(capsys, tmp_path, config={"reward_funcs": ["errors_rewards:boom_on_second_call"],
                                                    "save_steps": 1, "max_steps": 3, "eval_num_prompts": 0})
    one_line_error(err, r"'boom_on_second_call' raised ZeroDivisionError: step 2 went wrong")
    assert status == 2 and logged_steps(tmp_path / "run") == [1]  # evaluation off: only the steps call it
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-1"]
    status, err = run_cli(capsys, tmp_path, config={"reward_funcs": ["errors_rewards:boom_on_second_call"],
                                                    "save_steps": 1, "max_steps": 3, "eval_num_prompts": 0},
                          args=("--resume", "latest"))
    one_line_error(err, r"step 2 went wrong")  # the counter did not reset: it fails again, but resumed at step 2
    assert logged_steps(tmp_path / "run") == [1]


def test_samples_a_reward_hangs_on_are_dropped_and_counted(capsys, tmp_path, reward_module):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "HANG+1=", "answer": "1"}]
    path = write(tmp_path, "d.jsonl", jsonl(rows))
    status, err = run_cli(capsys, tmp_path, config={"task": None, "dataset": path, "eval_dataset": path,
                                                    "reward_funcs": ["errors_rewards:hang_on_marked"],
                                                    "drop_bad_rewards": True, "reward_timeout_s": 0.3})
    assert status == 0, err
    records = read_metrics(tmp_path / "run")
    assert [r["reward/dropped"] for r in records[1:]] == [2, 2]  # the G=2 completions of the HANG prompt


def test_rewards_beyond_float32_are_dropped_and_counted(capsys, tmp_path, reward_module):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "BIG+1=", "answer": "1"}]
    path = write(tmp_path, "d.jsonl", jsonl(rows))
    status, err = run_cli(capsys, tmp_path, config={"task": None, "dataset": path, "eval_dataset": path,
                                                    "reward_funcs": ["errors_rewards:huge_on_marked"],
                                                    "drop_bad_rewards": True})
    assert status == 0, err
    records = read_metrics(tmp_path / "run")
    assert [r["reward/dropped"] for r in records[1:]] == [2, 2]  # 10**400 and -1e39: the BIG prompt's G=2
    assert all(0 <= r["reward/mean"] <= 1 for r in records[1:])  # the other prompt's rewards, not null


def test_a_reward_module_that_fails_to_import(capsys, tmp_path, reward_module):
    status, err = run_cli(capsys, tmp_path, config={"reward_funcs": ["errors_broken_rewards:fn"]})
    one_line_error(err, r"reward 'errors_broken_rewards:fn': importing module 'errors_broken_rewards' raised "
                        r"ZeroDivisionError: division by zero \(.*errors_broken_rewards.py line 4\)")
    assert status == 2 and logged_steps(tmp_path / "run") == []


def test_a_reward_cannot_edit_the_samples_it_scores(capsys, tmp_path, reward_module):
    status, err = run_cli(capsys, tmp_path, config={"reward_funcs": ["errors_rewards:vandal"],
                                                    "log_samples_count": 4})
    assert status == 0, err
    samples = read_jsonl(tmp_path / "run" / "samples.jsonl", null_as_nan=False)
    assert len(samples) == 8 and all(s["completion"] != "VANDALISED" and s["prompt"] for s in samples)


# ------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 2-step run with a checkpoint after each step, to be copied and damaged."""
    folder = tmp_path_factory.mktemp("finished")
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump({**TINY, "output_dir": str(folder / "run"), "save_steps": 1,
                                    "save_total_limit": 3}))
    assert main(["train", "--config", str(path)]) == 0
    return folder / "run"


def damage(run: Path, name: str, how: str) -> None:
    path = run / "checkpoint-2" / name
    if how == "flip":  # same size, one byte changed in the middle
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.unlink()


CHECKPOINT_CASES = [
    ("flipped_weights", "model.safetensors", "flip", r"checkpoint-2: model.safetensors does not match its sha256"),
    ("flipped_optimizer", "optimizer.pt", "flip", r"checkpoint-2: optimizer.pt does not match its sha256"),
    ("garbage_rng", "rng.json", "flip", r"checkpoint-2: rng.json does not match its sha256"),
    ("truncated_weights", "model.safetensors", "truncate", r"checkpoint-2: .*model.safetensors"),
    ("deleted_manifest", "checkpoint.json", "delete", r"checkpoint-2.*checkpoint.json"),
]


@pytest.mark.parametrize("name, file, how, message", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_a_damaged_newest_checkpoint_is_an_error_not_a_silent_fallback(capsys, tmp_path, finished_run, name, file,
                                                                       how, message):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    damage(run, file, how)
    before = sorted((p.relative_to(run).as_posix(), p.stat().st_size) for p in run.rglob("*") if p.is_file())
    status, err = run_cli(capsys, tmp_path, "max_steps=3", config={"save_steps": 1, "save_total_limit": 3},
                          args=("--resume", "latest"))
    last = one_line_error(err, message)
    assert status == 2 and "latest_valid" in last
    after = sorted((p.relative_to(run).as_posix(), p.stat().st_size) for p in run.rglob("*") if p.is_file())
    assert after == before  # nothing touched: the damaged checkpoint is still there to inspect
    # The explicit fallback: resume from checkpoint-1, the damaged one is set aside, not deleted.
    status, err = run_cli(capsys, tmp_path, "max_steps=3", config={"save_steps": 1, "save_total_limit": 3},
                          args=("--resume", "latest_valid"))
    assert status == 0, err
    assert "checkpoint-2" in err and "set aside" in err
    assert (run / "checkpoint-2.damaged").is_dir() and logged_steps(tmp_path / "run") == [0, 1, 2, 3]


def hand_edit(run: Path, name: str, edit) -> None:
    """Edit checkpoint-2's JSON file `name` as a user would, and its manifest entry to match (so it verifies)."""
    path, manifest_path = run / "checkpoint-2" / name, run / "checkpoint-2" / "checkpoint.json"
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state))
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][name] = {"size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


TRAINER_STATE_CASES = [  # (past the rows is allowed only on changed data, with resume_allow_changed_data)
    ("negative_position", lambda s: s["sampler"].update(pos=-1), r"sampler pos=-1 must be an int >= 0"),
    ("position_past_the_rows", lambda s: s["sampler"].update(pos=10**6), r"sampler pos=1000000 is past the end of "
     r"its \d+ rows"),
    ("position_as_text", lambda s: s["sampler"].update(pos="4"), r"sampler pos='4' must be an int >= 0"),
    ("epoch_as_float", lambda s: s["sampler"].update(epoch=0.5), r"sampler epoch=0.5 must be an int >= 0"),
    ("no_sampler", lambda s: s.pop("sampler"), r"no 'sampler' entry"),
    ("sampler_a_list", lambda s: s.update(sampler=[0, 4]), r"sampler state must be a mapping, got list"),
    ("guard_count_as_text", lambda s: s["guard"].update(skipped="none"), r"guard skipped='none' must be an int >= 0"),
    ("evals_a_list", lambda s: s.update(evals=[1]), r"evals must be a mapping of step: metrics, got list"),
]


@pytest.mark.parametrize("name, edit, message", TRAINER_STATE_CASES, ids=[c[0] for c in TRAINER_STATE_CASES])
def test_a_hand_edited_trainer_state_is_refused_naming_the_file(capsys, tmp_path, finished_run, name, edit,
                                                                message):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    hand_edit(run, "trainer_state.json", edit)
    before = sorted((p.relative_to(run).as_posix(), p.stat().st_size) for p in run.rglob("*") if p.is_file())
    status, err = run_cli(capsys, tmp_path, "max_steps=3", config={"save_steps": 1, "save_total_limit": 3},
                          args=("--resume", "latest"))
    one_line_error(err, r"checkpoint-2/trainer_state.json: not the trainer state gspo writes \(" + message)
    assert status == 2
    after = sorted((p.relative_to(run).as_posix(), p.stat().st_size) for p in run.rglob("*") if p.is_file())
    assert after == before and logged_steps(run) == [0, 1, 2]


# ------------------------------------------------------------------------------- file system
def test_output_dir_that_is_a_file(capsys, tmp_path):
    (tmp_path / "run").write_text("not a folder")
    status, err = run_cli(capsys, tmp_path)
    one_line_error(err, r"output_dir .*run is a file, not a folder")
    assert status == 2 and (tmp_path / "run").read_text() == "not a folder"



def test_an_output_dir_of_a_user_s_files_is_refused_in_one_line_and_left_as_it_was(capsys, tmp_path):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "README.md").write_text("my notes\n")
    (run / "model" / "config.json").write_text('{"mine": 1}')
    (run / "plots").mkdir()
    status, err = run_cli(capsys, tmp_path, "overwrite_output_dir=true")
    one_line_error(err, rf"output_dir {re.escape(str(run))} holds no gspo run, but gspo would write over its model/, "
                        r"plots/; move them, or choose another output_dir$")
    assert status == 2
    assert (run / "model" / "README.md").read_text() == "my notes\n" and (run / "model" / "config.json").read_text() \
        == '{"mine": 1}' and sorted(p.name for p in run.iterdir()) == [LOCK_FILE, "model", "plots"]

def test_output_dir_that_cannot_be_written(capsys, tmp_path):
    if os.geteuid() == 0:
        target = "/sys/gspo-test-run"  # sysfs refuses folders even to root
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        target = str(tmp_path / "ro" / "run")
    status, err = run_cli(capsys, tmp_path, f"output_dir={target}")
    one_line_error(err, rf"output_dir {re.escape(target)} cannot be written")
    assert status == 2


def test_one_run_per_output_dir(capsys, tmp_path):
    with run_lock(tmp_path / "run"):  # as a live run would hold it
        status, err = run_cli(capsys, tmp_path)
    one_line_error(err, rf"output_dir .*run is in use by another run \(pid {os.getpid()} on .* since .*\); wait for")
    assert status == 2 and logged_steps(tmp_path / "run") == []
    # A lock file left by a killed run does not block: the kernel released its lock.
    (tmp_path / "run" / LOCK_FILE).write_text("pid 999999 on elsewhere since long ago\n")
    status, err = run_cli(capsys, tmp_path)
    assert status == 0, err


@pytest.mark.parametrize("tracker, hidden", [("tensorboard", ["tensorboard", "torch.utils.tensorboard"]),
                                             ("wandb", ["wandb"])])
def test_a_missing_tracker_package_is_named_before_anything_is_created(capsys, tmp_path, monkeypatch, tracker,
                                                                       hidden):
    for module in hidden:  # as if not installed (a None entry makes `import` fail)
        monkeypatch.setitem(sys.modules, module, None)
    status, err = run_cli(capsys, tmp_path, f"{tracker}=true")
    one_line_error(err, rf"config: {tracker}=true needs the {tracker} package, which cannot be imported "
                        rf"\(.*\); pip install {tracker}, or set {tracker}=false")
    assert status == 2 and not (tmp_path / "run").exists()  # no empty metrics.jsonl to block the rerun
    status, err = run_cli(capsys, tmp_path, "max_steps=1")
    assert status == 0, err


# ------------------------------------------------------------------------------- memory
def test_a_rollout_that_cannot_fit_in_memory_is_refused_up_front(capsys, tmp_path):
    started = time.monotonic()
    status, err = run_cli(capsys, tmp_path, "num_generations=1000000000")
    one_line_error(err, r"config: per_device_batch_size=2 x num_generations=1000000000 = 2000000000 sequences of "
                        r"up to 6 new tokens need at least [\d.]+ GiB to sample \(KV cache and logits\), more than "
                        r"the [\d.]+ GiB available on cpu; lower num_generations \(or per_device_batch_size, "
                        r"max_completion_length\)")
    assert status == 2 and logged_steps(tmp_path / "run") == [] and time.monotonic() - started < 60


def test_the_estimate_refuses_no_sane_config():
    """The bound is the KV cache and one step's logits: 8 x 16 rows of 1024 tokens of a 1.7B-sized model fit in
    64 GiB; 8 x 64 rows of 4096 tokens of an 8B-sized model do not fit in 80 GiB."""
    from types import SimpleNamespace

    from gspo.rollout.sampling import sampling_bytes

    small = SimpleNamespace(num_hidden_layers=28, num_key_value_heads=8, head_dim=128, vocab_size=151_936)
    need = sampling_bytes(small, 8 * 16, 1024, 2)
    assert need == 128 * 1024 * 28 * 2 * 8 * 128 * 2 + 128 * 151_936 * 4  # 14.1 GiB
    big = SimpleNamespace(num_hidden_layers=36, num_key_value_heads=8, head_dim=128, vocab_size=151_936)
    assert sampling_bytes(big, 8 * 64, 4096, 2) / 2**30 == pytest.approx(288.3, abs=0.1)
    no_kv = SimpleNamespace(vocab_size=100)  # a model whose cache gspo cannot size: the logits only
    assert sampling_bytes(no_kv, 10, 100, 2) == 10 * 100 * 4


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
                                   RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: "
                                                "not enough memory: you tried to allocate 96000000000 bytes.")],
                         ids=["cuda", "cpu"])
def test_running_out_of_memory_while_sampling_names_the_fields_to_lower(capsys, tmp_path, monkeypatch, error):
    from gspo.rollout.sampling import GENERATORS, GeneratorBackend

    native = GENERATORS["gspo"].sample

    def sample(model, *args, group_size, **kwargs):  # the evaluation's k=2 fits, the rollout's G=4 does not
        if group_size > 2:
            raise error
        return native(model, *args, group_size=group_size, **kwargs)

    monkeypatch.setitem(GENERATORS, "oom_test", GeneratorBackend(sample, lambda model: None))
    status, err = run_cli(capsys, tmp_path, "num_generations=4", "generation_backend=oom_test")
    one_line_error(err, r"step 1: sampling 8 sequences \(per_device_batch_size=2 x num_generations=4\) ran out of "
                        r"memory \(.*(out of memory|not enough memory).*\); lower num_generations \(or "
                        r"per_device_batch_size, max_completion_length\)")
    assert status == 2 and logged_steps(tmp_path / "run") == [0]


@pytest.mark.slow
def test_two_runs_into_one_folder_at_once(tmp_path, reward_module):
    """Two real processes: one finishes its run, the other is refused; metrics are not interleaved."""
    argv, env = gspo_command(tmp_path, reward_module, max_steps=4, reward_funcs=["errors_rewards:slow"])
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert sorted(code for code, _ in results) == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "is in use by another run (pid" in refused and "Traceback" not in refused
    assert logged_steps(tmp_path / "run") == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_disk_full_during_a_checkpoint(tmp_path):
    """RLIMIT_FSIZE makes big writes fail (EFBIG) as a full disk would: one line, earlier files kept."""
    argv, env = gspo_command(tmp_path, save_steps=1)

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
        resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))

    done = subprocess.run(argv, preexec_fn=limit, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("gspo train: error: checkpoint-1 could not be written (File too large)"), last
    assert "the previous checkpoints are intact" in last
    assert logged_steps(tmp_path / "run") == [0, 1] and not list((tmp_path / "run").glob("*checkpoint-1*"))


# ------------------------------------------------------------------------------- signals
@pytest.mark.slow
@pytest.mark.parametrize("timeout", [300, 0], ids=["reward_in_a_thread", "reward_in_the_main_thread"])
def test_a_signal_while_a_reward_hangs_stops_promptly_at_the_last_completed_step(tmp_path, reward_module, timeout):
    # evaluation off: its calls would count as the reward's (the third call is then step 3's)
    argv, env = gspo_command(tmp_path, reward_module, max_steps=5, reward_funcs=["errors_rewards:hang_from_step_3"],
                             reward_timeout_s=timeout, eval_num_prompts=0)
    proc = subprocess.Popen(argv, env={**env, "GSPO_TEST_HANG": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 200
    while logged_steps(tmp_path / "run") != [1, 2]:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(1.0)  # step 3 is now stuck in its reward
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and time.monotonic() - sent < 10, err
    assert "dropping this unfinished step" in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("gspo train: stopped: SIGTERM after step 2; checkpoint saved")
    assert (tmp_path / "run" / "checkpoint-2").is_dir() and logged_steps(tmp_path / "run") == [1, 2]
    resumed = subprocess.run([*argv, "--resume", "latest"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert logged_steps(tmp_path / "run") == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_a_reward_stuck_holding_the_gil_ends_the_run_instead_of_hanging_it(tmp_path, reward_module):
    """No Python thread runs again (signal handlers included): faulthandler's C watchdog ends it."""
    argv, env = gspo_command(tmp_path, reward_module, reward_timeout_s=1, reward_funcs=["errors_rewards:backtrack"],
                             eval_num_prompts=0)  # stuck in step 1's call (an evaluation would call it first)
    started = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "Timeout (0:00:07)!" in done.stderr and 'errors_rewards.py", line' in done.stderr  # where it was stuck
    assert time.monotonic() - started < 60 and logged_steps(tmp_path / "run") == []


# ------------------------------------------------------------------------------- fuzz
FIELDS = sorted(TrainConfig.__dataclass_fields__)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=20))
def nested(children):
    return st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)


values = st.recursive(scalars, nested, max_leaves=8)
keys = st.one_of(st.sampled_from(FIELDS), st.text(max_size=12))


def assert_one_line(err: ValueError) -> None:
    text = str(err)
    assert text and "\n" not in text, repr(text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.dictionaries(keys, values, max_size=5).map(lambda d: yaml.safe_dump(d).encode()),
                 st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
def test_fuzz_config_files_give_a_config_or_one_line(tmp_path, data):
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(data)
    try:
        cfg = load_config(TrainConfig, path)
    except ValueError as err:
        assert_one_line(err)
    else:  # a config that loads is a valid one: its fields pass validation again, unchanged
        assert make_config(TrainConfig, to_dict(cfg)) == cfg


row_values = st.one_of(scalars, st.lists(st.dictionaries(st.sampled_from(["role", "content", "x"]), scalars,
                                                         max_size=3), max_size=3))
lines = st.one_of(st.dictionaries(st.sampled_from(["prompt", "answer", "x"]), row_values, max_size=3)
                  .map(lambda r: json.dumps(r).encode()), st.binary(max_size=40), st.text(max_size=40).map(str.encode))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(lines, max_size=6), st.sampled_from([".jsonl", ".json", ".csv"]))
def test_fuzz_dataset_lines_give_rows_or_one_line(tmp_path, content, suffix):
    path = tmp_path / f"fuzz{suffix}"
    path.write_bytes(b"\n".join(content))
    tokenizer = build_char_tokenizer()
    try:
        rows = render_prompts(load_rows(str(path)), tokenizer)
        check_prompt_lengths(rows, tokenizer, 64, "error")
    except ValueError as err:
        assert_one_line(err)
    else:
        assert rows and all(isinstance(r["prompt"], str) and r["prompt"] for r in rows)


# ------------------------------------------------------------------------------- reward values
def test_a_reward_value_that_cannot_be_read_as_a_float_is_named():
    from gspo.data.rewards import score_completions

    class Unreadable(float):  # a float whose own conversion fails (a lazy value, a proxy)
        def __float__(self):
            raise RuntimeError("cannot evaluate")

    def lazy_score(prompts, completions, **_):
        return [1.0, Unreadable(2.0)]

    with pytest.raises(ValueError) as refused:
        score_completions([lazy_score], None, ["1+1=", "2+2="], ["2", "4"], {})
    assert str(refused.value) == ("reward function 'lazy_score' returned Unreadable at sample 1 (prompt='2+2=', "
                                  "completion='4'), which cannot be read as a float (RuntimeError: cannot evaluate); "
                                  "return None for 'no opinion', or set drop_bad_rewards to drop such samples")
    total, raw = score_completions([lazy_score], None, ["1+1=", "2+2="], ["2", "4"], {}, drop_bad=True)
    assert total[0].item() == 1.0 and torch.isnan(total[1]) and torch.isnan(raw["lazy_score"][1])
