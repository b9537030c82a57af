"""Held-out evaluation: scored with the run's own reward functions, in bounded batches, and optional."""

import json

import pytest

from conftest import SMALL, tiny_cfg
from gspo.config import (
    DataSettings,
    EpisodeSettings,
    EvalSettings,
    RewardSettings,
    SamplingSettings,
    SFTConfig,
    TaskSettings,
    TrainConfig,
    make_config,
    section,
)
from gspo.data.evaluation import Evaluation, evaluate, success_threshold
from gspo.data.mixture import TaskMixture
from gspo.data.rows import SplitLoader, holdout_count
from gspo.data.source import prompt_source
from gspo.models import load_model
from gspo.tasks import get_task

T = 8  # completion tokens: enough for a random model's completions to differ in length


def even_answer(prompts, completions, answer, **_):
    """1 where the row's `answer` is even: a 0/1 reward with spread over rows (a random model's greedy
    completions are all alike), read from the column each completion's row holds."""
    return [float(int(a) % 2 == 0) for a in answer]


def always_one(prompts, completions, **_):
    return [1.0] * len(completions)


def char_hash(prompts, completions, **_):
    """97 levels in [0, 1]: any change in a completion almost surely changes the mean."""
    return [sum(map(ord, c)) % 97 / 96 for c in completions]


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny-dense", seed=0, overrides=SMALL)
    rows = list(get_task("add3").dataset("test", 6, seed=0))  # rows with an `answer` column
    return model.eval(), tokenizer, rows


def eval_cfg(**kw) -> TrainConfig:
    return make_config(TrainConfig, {"model": "tiny-dense", "device": "cpu", "max_completion_length": T, "eval_k": 3,
                                     "seeded_sampling": True, **kw})


def plan(**settings) -> Evaluation:
    """The Evaluation of `eval_cfg(**settings)`, built from its sections as a run builds it."""
    cfg = eval_cfg(**settings)
    return Evaluation.of(section(cfg, EvalSettings), section(cfg, RewardSettings), section(cfg, SamplingSettings),
                         seed=cfg.seed, template_kwargs=cfg.chat_template_kwargs,
                         episodes=section(cfg, EpisodeSettings))


def source_of(cfg: TrainConfig, tokenizer, num_train: int):
    """`prompt_source` as a run builds it: the sections it reads and the run's seed."""
    return prompt_source(tokenizer, num_train, data=section(cfg, DataSettings), rewards=section(cfg, RewardSettings),
                         evals=section(cfg, EvalSettings), sampling=section(cfg, SamplingSettings),
                         tasks=section(cfg, TaskSettings), episodes=section(cfg, EpisodeSettings), seed=cfg.seed)


def test_success_threshold_is_full_marks_unless_given():
    assert success_threshold(None, 1) == 1.0  # one 0/1 reward: a correct answer
    assert success_threshold(None, 2) == 2.0  # two rewards, weight 1 each: both at 1
    assert success_threshold([1.0, 0.5, -0.2], 3) == 1.5  # a penalty (negative weight) is best at 0
    assert success_threshold([1.0, 0.5], 2, threshold=0.25) == 0.25


def test_rows_with_an_answer_are_scored_by_the_configured_reward(tiny):
    # An `answer` column used to mean the built-in `####` answer_match whatever reward_funcs said: a custom
    # reward read eval/accuracy 0. Now the run's own reward decides.
    model, tokenizer, rows = tiny
    out = evaluate(model, tokenizer, rows, plan(reward_funcs=[even_answer]))
    assert [r["answer"] for r in rows] == ["821", "930", "1566", "1436", "1042", "665"]  # 4 of 6 even
    for key in ("eval/accuracy", "eval/reward", "eval/mean_at_k", "eval/pass_at_k", "eval/sampled_reward"):
        assert out[key] == pytest.approx(4 / 6, abs=1e-6), key  # every completion of a row scores alike


def test_accuracy_is_the_share_of_prompts_at_the_threshold(tiny):
    model, tokenizer, rows = tiny
    # the total, as before eval_accuracy_reward: always_one + answer_match (0 for a random model) is 1 of full marks 2
    total = dict(reward_funcs=[always_one, "answer_match"], eval_k=2, eval_accuracy_reward="total")
    out = evaluate(model, tokenizer, rows, plan(**total))
    assert out == {"eval/accuracy": 0.0, "eval/reward": 1.0, "eval/mean_at_k": 0.0, "eval/pass_at_k": 0.0,
                   "eval/sampled_reward": 1.0}
    out = evaluate(model, tokenizer, rows, plan(**total, eval_success_threshold=1.0))
    assert (out["eval/accuracy"], out["eval/mean_at_k"], out["eval/pass_at_k"]) == (1.0, 1.0, 1.0)
    # by default the first reward decides, at 1: always_one succeeds, answer_match never does
    out = evaluate(model, tokenizer, rows, plan(reward_funcs=[always_one, "answer_match"], eval_k=2))
    assert (out["eval/accuracy"], out["eval/mean_at_k"], out["eval/pass_at_k"], out["eval/reward"]) == (1, 1, 1, 1)
    out = evaluate(model, tokenizer, rows, plan(reward_funcs=[always_one, "answer_match"], eval_k=2,
                                                eval_accuracy_reward="answer_match"))
    assert (out["eval/accuracy"], out["eval/mean_at_k"], out["eval/pass_at_k"]) == (0, 0, 0)
    out = evaluate(model, tokenizer, rows, plan(reward_funcs=[always_one], reward_weights=[0.25], eval_k=2))
    assert out["eval/reward"] == 0.25 and out["eval/accuracy"] == 1.0  # the reward's own value, 1, not 0.25 x 1


def short_bonus(prompts, completions, **_):
    """At most 0.5, as open-r1's length reward: a mix with it never reaches the full marks of its total."""
    return [0.5 / (1 + len(c)) for c in completions]


def test_accuracy_of_a_mix_with_a_length_reward_is_its_first_rewards(tiny):
    # open-r1's mix: accuracy, format, length. Full marks of the total (3) are out of reach, so accuracy by the
    # total read 0 whatever was right; by its first reward it is the share of right answers (4 of 6 rows even).
    model, tokenizer, rows = tiny
    mix = dict(reward_funcs=[even_answer, always_one, short_bonus], eval_k=2)
    old = evaluate(model, tokenizer, rows, plan(**mix, eval_accuracy_reward="total"))
    assert (old["eval/accuracy"], old["eval/mean_at_k"], old["eval/pass_at_k"]) == (0.0, 0.0, 0.0)
    new = evaluate(model, tokenizer, rows, plan(**mix))
    for key in ("eval/accuracy", "eval/mean_at_k", "eval/pass_at_k"):
        assert new[key] == pytest.approx(4 / 6, abs=1e-6), key
    assert new["eval/reward"] == old["eval/reward"]  # the mean total either way
    assert evaluate(model, tokenizer, rows, plan(**mix, eval_accuracy_reward="always_one"))["eval/accuracy"] == 1.0
    with pytest.raises(ValueError, match=r"eval_accuracy_reward='accuracy' names none of the reward functions "
                                         r"evaluated \(even_answer, always_one, short_bonus\)"):
        evaluate(model, tokenizer, rows, plan(**mix, eval_accuracy_reward="accuracy"))


def test_chunked_evaluation_equals_one_call(tiny):
    # Seeded rows draw the same tokens whatever else shares the generate call: chunks change nothing but the
    # largest batch (prompts x eval_k sequences) held in memory at once.
    model, tokenizer, rows = tiny
    sizes = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append((kwargs.get("input_ids") if "input_ids" in kwargs else args[0]
                                                   ).shape[0]), with_kwargs=True)
    try:
        whole = evaluate(model, tokenizer, rows, plan(reward_funcs=[char_hash], eval_batch_size=100))
        largest_whole, sizes[:] = max(sizes), []
        chunked = evaluate(model, tokenizer, rows, plan(reward_funcs=[char_hash], eval_batch_size=4))
    finally:
        hook.remove()
    assert largest_whole == 6 * 3 and max(sizes) == 4 * 3  # sampled: prompts x eval_k rows per call
    assert sorted(set(sizes)) == [2, 4, 6, 12]  # greedy 4 + 2 prompts, sampled (4 + 2) x 3
    assert chunked == whole
    assert 0 < whole["eval/sampled_reward"] < 1 and whole["eval/sampled_reward"] != whole["eval/reward"]


def test_each_task_of_a_mixture_is_evaluated_with_its_own_rewards(tmp_path):
    cfg = tiny_cfg(tmp_path, task=None, reward_funcs=["answer_match"], eval_num_prompts=3,
                   tasks=[{"task": "add2"}, {"name": "paid", "task": "add3", "reward_funcs": [always_one]}])
    model, tokenizer = load_model("tiny-dense", seed=0, overrides=SMALL)
    source = source_of(cfg, tokenizer, num_train=10)
    assert isinstance(source, TaskMixture)
    out = source.evaluate(model, tokenizer)
    assert out["task/paid/eval_accuracy"] == 1.0 and out["task/paid/eval_reward"] == 1.0
    assert out["task/add2/eval_accuracy"] == 0.0  # answer_match: a random model is never right
    assert out["eval/accuracy"] == 0.5  # the unweighted mean over the tasks


def write_rows(path, n: int):
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(n)))
    return str(path)


def test_holdout_count():
    assert holdout_count(30, 0.1) == 3 and holdout_count(10, 0.1) == 1 and holdout_count(9, 0.1) == 1
    assert holdout_count(30, 0) == 0 and holdout_count(30, 5) == 5 and holdout_count(1, 0.1) == 0
    assert holdout_count(70, 0.1) == 7 and holdout_count(3, 0.9) == 2  # never every row
    with pytest.raises(ValueError, match="eval_holdout=30 holds out every row"):
        holdout_count(30, 30, "data.jsonl")


def splits(tokenizer, eval_num_prompts: int = 200, **data):
    """(train rows, held-out rows) of DataSettings(task=None, **data), loaded as a run loads them (seed 0)."""
    return SplitLoader(tokenizer, 0, eval_num_prompts, seed=0, max_prompt_length=512)(DataSettings(task=None, **data))


def test_the_held_out_split_is_said_and_can_be_none(tmp_path, capsys):
    data = write_rows(tmp_path / "data.jsonl", 30)
    _, tokenizer = load_model("tiny-dense", seed=0, overrides=SMALL)
    train_rows, held_out = splits(tokenizer, dataset=data)
    assert (len(train_rows), len(held_out)) == (27, 3)
    assert f"eval: holding out 3 of 30 rows of {data} (eval_holdout=0.1)" in capsys.readouterr().err
    train_rows, held_out = splits(tokenizer, dataset=data, eval_holdout=0)
    assert (len(train_rows), len(held_out)) == (30, 0)
    assert f"eval: holding out 0 of 30 rows of {data} (eval_holdout=0): no evaluation" in capsys.readouterr().err
    train_rows, held_out = splits(tokenizer, dataset=data, eval_holdout=12, eval_num_prompts=5)
    assert (len(train_rows), len(held_out)) == (18, 5)
    assert "holding out 12 of 30 rows" in capsys.readouterr().err
    train_rows, held_out = splits(tokenizer, dataset=data, eval_num_prompts=0)
    assert (len(train_rows), len(held_out)) == (30, 0)  # evaluation off: nothing held out


@pytest.mark.parametrize("values, message", [
    ({"eval_holdout": -0.1}, "eval_holdout=-0.1 must be >= 0"),
    ({"eval_holdout": 2.5}, "eval_holdout=2.5 must be a fraction below 1 or a whole number of rows"),
    ({"eval_batch_size": 0}, "eval_batch_size=0 must be > 0"),
])
def test_eval_field_errors(values, message):
    with pytest.raises(ValueError, match=message):
        make_config(TrainConfig, values)


def test_sft_target_accuracy_needs_evaluation():
    with pytest.raises(ValueError, match="target_accuracy needs an evaluation"):
        make_config(SFTConfig, {"target_accuracy": 0.4, "eval_num_prompts": 0})
