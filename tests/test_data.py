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


def add(a: int, b: int) -> int:
    """a + b"""
    return a + b


def test_a_prompt_source_is_built_from_its_sections_and_the_seed(tmp_path):
    # No TrainConfig: each section and the shared seed are handed over by name. The tool environment's tools
    # reach the training rows' template and the evaluation's alike (computed once).
    from gspo.config import DataSettings, EpisodeSettings, EvalSettings, RewardSettings, SamplingSettings, TaskSettings
    from gspo.data.source import SingleTask, prompt_source
    from gspo.env import tool_schema

    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if tools %} t{{ tools | length }}" \
                        "{% endif %}="
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+{i}"}], "answer": str(2 * i)})
                            + "\n" for i in range(10)))
    sections = dict(data=DataSettings(task=None, dataset=str(path), eval_holdout=3), rewards=RewardSettings(),
                    evals=EvalSettings(eval_num_prompts=2), sampling=SamplingSettings(max_prompt_length=8),
                    tasks=TaskSettings(), episodes=EpisodeSettings(environment="tools", tools=["test_data:add"]))
    source = prompt_source(tok, 0, **sections, seed=3, note=lambda line: None)
    assert isinstance(source, SingleTask) and source.sampler.seed == 3 and source.evaluation.seed == 3
    assert (len(source.sampler.rows), len(source.held_out)) == (7, 2)  # 3 held out, 2 of them evaluated
    assert all(r["prompt"].endswith(" t1=") for r in source.sampler.rows + source.held_out)
    assert source.evaluation.template_kwargs == {"tools": [tool_schema(add)]}
    assert source.evaluation.sampling.max_prompt_length == 8
    # the prompt length limit is sampling's: "0+0 t1=" has 7 tokens
    with pytest.raises(ValueError, match="has 7 tokens > max_prompt_length=6"):
        prompt_source(tok, 0, **{**sections, "sampling": SamplingSettings(max_prompt_length=6)}, seed=3,
                      note=lambda line: None)
