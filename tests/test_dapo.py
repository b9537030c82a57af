"""DAPO's pieces beyond token-mean and clip-higher (arXiv 2503.14476): the soft overlong penalty (sec. 3.4)."""

import json
import math
import re
from dataclasses import dataclass

import pytest
import torch

from conftest import changed, final_weights, initial_weights, read_metrics, tiny_cfg
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


# ------------------------------------------------------------------------------- overlong filtering
def _prepared(tmp_path, stopped: list[bool], **kw):
    """`prepare` of a tiny rollout (2 prompts x 4, 4 minibatches) whose stop flags are `stopped`, rewards 0..7."""
    from dataclasses import replace

    from conftest import SMALL
    from gspo.config import BatchSettings, ObjectiveSettings, PrecisionSettings, section
    from gspo.models import load_model
    from gspo.plugs.baselines import GroupBaseline
    from gspo.plugs.parallel import Topology
    from gspo.plugs.reference import NoReference
    from gspo.plugs.routing import NoRouting
    from gspo.rollout import generate
    from gspo.step import gather_scores, logprob_options, prepare
    from gspo.tasks import get_task

    class Counting:  # NoRouting, noting the rows each pi_old call covers
        records_pi_old = False

        def __init__(self):
            self.calls = []

        def logprobs(self, model, rollout, minibatches, logp_kwargs, writes=None):
            self.calls.append(sorted(int(i) for idx in minibatches for i in idx))
            return NoRouting().logprobs(model, rollout, minibatches, logp_kwargs, writes)

    model, tok = load_model("tiny-dense", overrides=SMALL)
    cfg = tiny_cfg(tmp_path, num_minibatches=4, per_device_batch_size=2, **kw)
    prompts = [r["prompt"] for r in get_task("add3").dataset("train", 2, 0)]
    rollout = generate(model, tok, prompts, 4, max_new_tokens=6)
    scores = gather_scores(Topology(), rollout, torch.arange(8, dtype=torch.float32), {}, [tok.eos_token_id])
    scores = replace(scores, stopped=torch.tensor(stopped))
    routing = Counting()
    batch = prepare(rollout, scores, plan=section(cfg, BatchSettings), objective=section(cfg, ObjectiveSettings),
                    logp_kwargs=logprob_options(cfg.temperature, section(cfg, PrecisionSettings)),
                    topology=Topology(), routing=routing, model=model, reference=NoReference(),
                    baseline=GroupBaseline("group", 4), shuffle=torch.Generator().manual_seed(0))
    return batch, routing.calls


STOPPED = [True, False, True, True, False, False, False, True]  # rows 1, 4, 5, 6 hit the limit


def test_the_updates_train_on_the_finished_completions_only_and_pi_old_covers_every_row(tmp_path):
    batch, calls = _prepared(tmp_path, STOPPED, mask_truncated_completions=True)
    trained = sorted(int(i) for part in batch.epochs[0] for i in part.index)
    assert trained == [0, 2, 3, 7]  # every finished row once, no truncated one
    assert all(len(part.index) for part in batch.epochs[0])  # a minibatch with no finished row is not planned
    assert batch.first_on_policy is False and calls == [list(range(8))]  # pi_old of all 8 rows, before the updates
    assert batch.stats["loss/masked_truncated_frac"] == 0.5
    unmasked, _ = _prepared(tmp_path, STOPPED)
    assert sorted(int(i) for part in unmasked.epochs[0] for i in part.index) == list(range(8))
    assert "loss/masked_truncated_frac" not in unmasked.stats
    # by default (truncated_in_groups) the groups' statistics are the same: so are the advantages
    assert torch.equal(batch.rollout.advantages, unmasked.rollout.advantages)


def test_left_out_of_the_groups_the_truncated_rewards_no_longer_move_the_baseline(tmp_path):
    batch, _ = _prepared(tmp_path, STOPPED, mask_truncated_completions=True, truncated_in_groups=False)
    adv = batch.rollout.advantages
    # group 0 = rows 0-3 (rewards 0-3), finished 0, 2, 3: mean 5/3, std (population) of [0, 2, 3] = sqrt(14/9)
    mean, std = 5 / 3, (14 / 9) ** 0.5
    for i, r in ((0, 0.0), (2, 2.0), (3, 3.0)):
        assert adv[i].item() == pytest.approx((r - mean) / (std + 1e-4), rel=1e-5)
    assert adv[1].item() == 0.0 and adv[4:7].tolist() == [0.0, 0.0, 0.0]  # left out: advantage 0
    assert adv[7].item() == 0.0  # group 1's one finished row: alone in its group, no spread


def test_when_the_limit_cuts_every_answer_the_step_trains_nothing(tmp_path, monkeypatch):
    import gspo.step

    monkeypatch.setattr(gspo.step, "ended_with_eos", lambda rollout, stop_ids: torch.zeros(
        rollout.num_sequences, dtype=torch.bool))  # every completion truncated
    cfg = tiny_cfg(tmp_path, max_steps=2, mask_truncated_completions=True, eval_num_prompts=0)
    train(cfg)
    lines = [r for r in read_metrics(tmp_path / "run") if r["step"] >= 1]
    assert [r["loss/masked_truncated_frac"] for r in lines] == [1.0, 1.0]
    assert all(r["completion/truncated_frac"] == 1.0 and "loss/policy" not in r for r in lines)
    assert changed(initial_weights(cfg), final_weights(tmp_path / "run")) == []  # no optimizer step at all


def test_a_run_masks_exactly_the_truncated_share_and_trains_on_the_rest(tmp_path):
    cfg = tiny_cfg(tmp_path, max_steps=2, max_completion_length=4, mask_truncated_completions=True,
                   eval_num_prompts=0)  # 4 tokens: the untrained model ends some answers, the limit cuts others
    train(cfg)
    lines = [r for r in read_metrics(tmp_path / "run") if r["step"] >= 1]
    fracs = [r["completion/truncated_frac"] for r in lines]
    assert any(0 < f < 1 for f in fracs), fracs  # the case under test: some of each
    for r in lines:
        assert r["loss/masked_truncated_frac"] == r["completion/truncated_frac"]
        # a step with finished answers takes its updates (the untrained model scores 0 everywhere, so the
        # advantages and the weights' change are 0: the loss and gradient norm show the updates ran)
        assert r["completion/truncated_frac"] == 1.0 or (math.isfinite(r["loss/policy"]) and "grad/norm" in r)
