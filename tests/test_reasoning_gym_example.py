"""examples/reasoning_gym: the committed data is what the generator writes, and the reward is the generator's own
scorer on the completion's last integer (configs/letters_smollm2.yaml runs them; test_cli runs one step of it)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "reasoning_gym"))

import make_data  # noqa: E402
from rewards import scored_by_generator  # noqa: E402


def test_the_committed_rows_are_the_generators_and_no_test_question_is_trained_on():
    drawn = make_data.splits()
    for split, rows in drawn.items():
        committed = [json.loads(line) for line in (ROOT / "examples" / "reasoning_gym" /
                                                   f"letters_{split}.jsonl").read_text().splitlines()]
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
