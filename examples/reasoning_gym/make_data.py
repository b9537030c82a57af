"""Writes the data of configs/letters_smollm2.yaml: reasoning-gym's `letter_counting` ("How many times does the
letter "h" appear in the text: ...?"), a generator nobody here wrote (pip install reasoning-gym; 0.1.25 made the
committed files), 3 to 5 words a question. The generator draws question i from seed + i, so one draw of 1,200 is
split in order: the first 1,000 train, the rest test, less any test question that also occurs in train (the
held-out rows are never trained on).

    python examples/reasoning_gym/make_data.py          # rewrites letters_train.jsonl and letters_test.jsonl

Each row: `prompt` (one chat message: the generator's question and "Answer with just the number."), `answer` (the
generator's) and `task` (the generator's name: `rewards.py` scores each answer with that generator's own scorer).
"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASK = "letter_counting"
SETTINGS = {"min_words": 3, "max_words": 5}
INSTRUCTION = "Answer with just the number."
SEED, TRAIN, TOTAL = 1, 1000, 1200  # the generator's seed; questions for train; questions drawn


def rows(seed: int, size: int) -> list[dict]:
    """The generator's questions as gspo rows (chat prompt, answer, task), in the generator's order."""
    import reasoning_gym  # the generator: imported here, so the module imports without it

    data = reasoning_gym.create_dataset(TASK, seed=seed, size=size, **SETTINGS)
    return [{"prompt": [{"role": "user", "content": f"{entry['question'].strip()}\n{INSTRUCTION}"}],
             "answer": entry["answer"], "task": TASK} for entry in data]


def splits() -> dict[str, list[dict]]:
    """{"train": rows, "test": rows}, the test rows without any question of the train rows."""
    drawn = rows(SEED, TOTAL)
    train = drawn[:TRAIN]
    seen = {row["prompt"][0]["content"] for row in train}
    return {"train": train, "test": [row for row in drawn[TRAIN:] if row["prompt"][0]["content"] not in seen]}


def main() -> None:
    for split, data in splits().items():
        path = HERE / f"letters_{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in data))
        print(f"{path}: {len(data)} rows")


if __name__ == "__main__":
    main()
