"""DAPO's pieces beyond token-mean and clip-higher (arXiv 2503.14476): the soft overlong penalty (sec. 3.4)."""

import json
import re
from dataclasses import dataclass

import pytest
import torch

from conftest import read_metrics, tiny_cfg
from gspo.config import TrainConfig, make_config
from gspo.data.rewards import OverlongReward, overlong_penalty, overlong_terms, score_completions, with_terms
from gspo.trainer import train


@pytest.mark.parametrize("length, expected", [
    (0, 0.0), (6, 0.0),  # up to max - buffer = 10 - 4: nothing
    (7, -0.25), (8, -0.5), (9, -0.75),  # then factor / buffer = 1/4 a token
    (10, -1.0),  # -factor at the limit
    (12, -1.0),  # and beyond it (an answer the limit did not cut: a multi-turn episode's)
])
def test_the_penalty_by_hand_at_its_edges(length, expected):
    assert overlong_penalty(length, max_length=10, buffer=4, factor=1.0) == expected


def test_the_factor_scales_it_and_a_buffer_of_the_whole_limit_starts_at_the_first_token():
    assert overlong_penalty(9, max_length=10, buffer=4, factor=0.5) == -0.375  # 3 tokens in: 0.5 * 3/4
    assert [overlong_penalty(n, 4, 4, 2.0) for n in (0, 1, 2, 4)] == [0.0, -0.5, -1.0, -2.0]
    assert overlong_penalty(10, 10, 4, 0.0) == 0.0  # factor 0: no penalty (and 0.0, not -0.0)
    assert str(overlong_penalty(3, 10, 4, 1.0)) == "0.0"


def test_as_a_reward_it_reads_the_token_counts_and_adds_to_the_total_under_its_own_name():
    fns, weights = [lambda completions, answer, **_: [1.0, 1.0, 0.0]], [2.0]
    terms = overlong_terms(make_config(TrainConfig, {"overlong_penalty": {"buffer": 2, "factor": 1.0},
                                                     "max_completion_length": 4}), 4)
    assert len(terms) == 1 and terms[0][1] == 1.0
    total, raw = score_completions([*fns, terms[0][0]], [*weights, 1.0], ["p"] * 3, ["a", "b", "c"],
                                   {"answer": ["1"] * 3}, completion_ids=[[5, 6], [5, 6, 7], [5, 6, 7, 8]])
    assert raw["overlong"].tolist() == [0.0, -0.5, -1.0]  # lengths 2, 3, 4 of a limit of 4 with a buffer of 2
    assert total.tolist() == [2.0, 1.5, -1.0]  # 2 x the first reward + the penalty


def test_the_terms_join_the_functions_and_their_weights():
    @dataclass
    class Settings:  # a stand-in for RewardSettings and TaskSpec: reward functions and weights
        reward_funcs: list
        reward_weights: list | None

    fn = OverlongReward(8, 2, 1.0)
    assert with_terms(Settings(["math"], None), [(fn, 1.0)]) == Settings(["math", fn], [1.0, 1.0])
    assert with_terms(Settings(["a", "b"], [0.5, 2.0]), [(fn, 1.0)]) == Settings(["a", "b", fn], [0.5, 2.0, 1.0])
    assert with_terms(Settings(["a"], None), []) == Settings(["a"], None)
    assert overlong_terms(make_config(TrainConfig, {}), 8) == []  # the default: no term


@pytest.mark.parametrize("value, message", [
    ({"buffer": 4}, "must be a mapping of buffer (tokens) and factor"),
    ({"buffer": 4, "factor": 1.0, "scale": 2}, "must be a mapping of buffer (tokens) and factor"),
    ([4, 1.0], "overlong_penalty=[4, 1.0] has the wrong type: expected dict"),
    ({"buffer": 0, "factor": 1.0}, "overlong_penalty.buffer=0 must be a whole number of tokens >= 1"),
    ({"buffer": 2.5, "factor": 1.0}, "overlong_penalty.buffer=2.5 must be a whole number"),
    ({"buffer": 4, "factor": -1.0}, "overlong_penalty.factor=-1.0 must be a finite number >= 0"),
    ({"buffer": 4, "factor": float("inf")}, "overlong_penalty.factor=inf must be a finite number >= 0"),
    ({"buffer": 40, "factor": 1.0}, "overlong_penalty.buffer=40 is longer than max_completion_length=32"),
])
def test_a_bad_penalty_setting_is_refused_by_name(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_config(TrainConfig, {"overlong_penalty": value, "max_completion_length": 32})


def test_a_run_logs_the_penalty_as_its_own_reward_and_its_total_includes_it(tmp_path):
    # tiny-dense at a limit of 12 with a buffer of the whole limit: every answer pays length/12 of the factor
    cfg = tiny_cfg(tmp_path, max_steps=1, overlong_penalty={"buffer": 12, "factor": 1.0}, eval_num_prompts=0)
    train(cfg)
    line = read_metrics(tmp_path / "run")[-1]
    samples = [json.loads(s) for s in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert "reward/overlong" in line and -1.0 <= line["reward/overlong"] < 0.0
    for s in samples:  # each sample: its penalty from its length, and the total = the task's reward + the penalty
        assert s["rewards"]["overlong"] <= 0.0
        assert s["reward"] == pytest.approx(s["rewards"]["answer_match"] + s["rewards"]["overlong"])
    assert torch.tensor([s["rewards"]["overlong"] for s in samples]).lt(0).any()


def test_in_a_mixture_every_task_pays_it_its_own_functions_or_the_runs(tmp_path):
    kw = dict(tasks=[{"task": "add2"}, {"task": "add3", "reward_funcs": ["answer_match"], "reward_weights": [2.0]}],
              per_device_batch_size=4, num_generations=2, overlong_penalty={"buffer": 12, "factor": 1.0},
              eval_num_prompts=0, log_samples_count=8)
    train(tiny_cfg(tmp_path, max_steps=1, **kw))
    samples = [json.loads(s) for s in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and all("overlong" in s["rewards"] for s in samples)
    assert {len(s["prompt"].split("+")[0]) for s in samples} == {2, 3}  # both tasks drawn
    weight = {"add2": 1.0, "add3": 2.0}  # add3's own weight on its own function; the penalty's weight 1 in both
    for s in samples:
        task = f"add{len(s['prompt'].split('+')[0])}"  # add2: 2-digit terms, add3: 3-digit
        assert s["reward"] == pytest.approx(weight[task] * s["rewards"]["answer_match"] + s["rewards"]["overlong"])
