"""examples/reasoning_gym: the committed data is what the generator writes, and the reward is the generator's own
scorer on the completion's last integer (configs/letters_smollm2.yaml runs them; test_cli runs one step of it)."""

import importlib.util
import json
from pathlib import Path

from gspo.data.rewards import get_reward_fn

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "reasoning_gym"
_spec = importlib.util.spec_from_file_location("reasoning_gym_make_data", EXAMPLE / "make_data.py")
make_data = importlib.util.module_from_spec(_spec)  # by path, under a name of its own: no clash on sys.path
_spec.loader.exec_module(make_data)
scored_by_generator = get_reward_fn(f"{EXAMPLE / 'rewards.py'}:scored_by_generator")  # as the config names it


def test_the_committed_rows_are_the_generators_and_no_test_question_is_trained_on():
    drawn = make_data.splits()
    for split, rows in drawn.items():
        committed = [json.loads(line) for line in (EXAMPLE / f"letters_{split}.jsonl").read_text().splitlines()]
        assert committed == rows, split
    assert (len(drawn["train"]), len(drawn["test"])) == (1000, 198)  # 2 of the 200 drawn after train repeat one
    train = {row["prompt"][0]["content"] for row in drawn["train"]}
    assert not any(row["prompt"][0]["content"] in train for row in drawn["test"])
    first = drawn["test"][0]
    assert first["prompt"][0]["content"].endswith("\nAnswer with just the number.") and first["task"] == \
        "letter_counting"
    question = first["prompt"][0]["content"].split('"')  # How many times does the letter "d" appear in ... "<text>"?
    assert first["answer"] == str(question[3].count(question[1]))  # the answer counts the letter in the text


def test_the_reward_scores_the_last_integer_with_the_generators_rule():
    said = ["The letter \"h\" appears 3 times.", "3 or 13", "There is no h", "It appears 2 times, not 3 or 4",
            [{"role": "assistant", "content": "3"}]]
    # exact: 1; "13" holds the answer "3": the generator's partial credit len("3") / len("13") = 0.5; no integer: 0
    assert scored_by_generator(said, answer=["3"] * 5, task=["letter_counting"] * 5) == [1.0, 0.5, 0.0, 0.0, 1.0]
