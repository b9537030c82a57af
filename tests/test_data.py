import json

import datasets
import pytest

from gspo.data.rows import PromptSampler, columns_of, load_rows, render_prompts
from gspo.tasks import build_char_tokenizer

ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet", "disk"])
def test_local_formats_load_the_same_rows(tmp_path, kind):
    ds = datasets.Dataset.from_list(ROWS)
    if kind == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in ROWS))
    elif kind == "csv":
        path = tmp_path / "d.csv"
        ds.to_csv(str(path))
    elif kind == "parquet":
        path = tmp_path / "d.parquet"
        ds.to_parquet(str(path))
    else:
        path = tmp_path / "d"
        ds.save_to_disk(str(path))
    rows = load_rows(str(path))
    assert [(r["prompt"], str(r["answer"])) for r in rows] == [(r["prompt"], r["answer"]) for r in ROWS]


def test_prompt_column_rename_and_errors(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "5+5=", "answer": "10"}))
    assert load_rows(str(path), prompt_column="question") == [{"prompt": "5+5=", "answer": "10"}]
    with pytest.raises(ValueError, match="no 'prompt' column"):
        load_rows(str(path))
    with pytest.raises(ValueError, match="does not exist"):
        load_rows(str(tmp_path / "missing.jsonl"))
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(ValueError, match="unsupported extension"):
        load_rows(str(tmp_path / "d.txt"))


def test_chat_prompts_render_with_the_template():
    tok = build_char_tokenizer()
    rows = render_prompts([{"prompt": [{"role": "user", "content": "12+30="}]}], tok)
    assert rows[0]["prompt"] == tok.apply_chat_template([{"role": "user", "content": "12+30="}], tokenize=False,
                                                        add_generation_prompt=True)
    assert "12+30=" in rows[0]["prompt"]
    with pytest.raises(ValueError, match="row 0: prompt must be"):
        render_prompts([{"prompt": ""}], tok)


def test_columns_repeat_per_completion():
    assert columns_of(ROWS[:2], repeat=2) == {"answer": ["2", "2", "4", "4"]}


def test_sampler_is_deterministic_covers_epochs_and_resumes():
    rows = [{"prompt": str(i)} for i in range(5)]
    a = PromptSampler(rows, seed=3)
    first = [r["prompt"] for r in a.next(5)]
    assert sorted(first) == ["0", "1", "2", "3", "4"]  # one full pass before repeating
    a.next(2)
    state = a.state_dict()
    expected = [r["prompt"] for r in a.next(6)]
    b = PromptSampler(rows, seed=3)
    b.load_state_dict(state)
    assert [r["prompt"] for r in b.next(6)] == expected
    assert [r["prompt"] for r in PromptSampler(rows, seed=3).next(5)] == first
