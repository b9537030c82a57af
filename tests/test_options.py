"""Options users asked for (issue 32, point 7): chat_template_kwargs, min_p and repetition_penalty in a
run, the reward model's device and dtype, and a model card in every saved model folder."""

import json

import pytest

from conftest import tiny_cfg
from gspo.config import DataSettings, TrainConfig, make_config, section
from gspo.data.rows import SplitLoader, check_rows
from gspo.tasks import build_char_tokenizer

FLAG_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if flag %} (flagged){% endif %}="


def chat_rows(n=3):
    return [{"prompt": [{"role": "user", "content": f"{i}+{i}"}], "answer": str(2 * i)} for i in range(n)]


def test_chat_template_kwargs_reach_the_template(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = FLAG_TEMPLATE
    assert [r["prompt"] for r in check_rows(chat_rows(), tok)] == ["0+0=", "1+1=", "2+2="]
    flagged = check_rows(chat_rows(), tok, template_kwargs={"flag": True})
    assert [r["prompt"] for r in flagged] == ["0+0 (flagged)=", "1+1 (flagged)=", "2+2 (flagged)="]
    # from a config, through the data loading a run uses
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(20)))
    cfg = make_config(TrainConfig, {"task": None, "dataset": str(data), "chat_template_kwargs": {"flag": True}})
    train, held_out = SplitLoader(tok, 0, cfg.eval_num_prompts, cfg.seed)(section(cfg, DataSettings))
    assert all(r["prompt"].endswith(" (flagged)=") for r in train + held_out) and len(train) + len(held_out) == 20


def test_chat_template_kwargs_must_be_a_mapping():
    with pytest.raises(ValueError, match=r"chat_template_kwargs=\['flag'\] has the wrong type"):
        make_config(TrainConfig, {"chat_template_kwargs": ["flag"]})
    with pytest.raises(ValueError, match=r"chat_template_kwargs=\{1: True\} must be a mapping of names to values"):
        make_config(TrainConfig, {"chat_template_kwargs": {1: True}})


def test_a_run_samples_with_min_p_and_repetition_penalty_the_same_on_both_samplers(tmp_path):
    from conftest import comparable
    from gspo.trainer import train

    runs = {}
    for backend in ("gspo", "hf"):
        cfg = tiny_cfg(tmp_path / backend, min_p=0.05, repetition_penalty=1.3, temperature=0.8, max_steps=2,
                       generation_backend=backend)
        train(cfg)
        runs[backend] = comparable(tmp_path / backend / "run")
    assert runs["gspo"] == runs["hf"]  # the same tokens, so the same metrics
    plain = tiny_cfg(tmp_path / "plain", temperature=0.8, max_steps=2, generation_backend="gspo")
    train(plain)
    assert comparable(tmp_path / "plain" / "run") != runs["gspo"]  # the knobs took effect
