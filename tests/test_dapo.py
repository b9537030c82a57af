"""DAPO's pieces beyond token-mean and clip-higher (arXiv 2503.14476): the soft overlong penalty (sec. 3.4),
overlong filtering (sec. 3.4) and dynamic sampling (sec. 3.2)."""

import json
import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

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


# ------------------------------------------------------------------------------- dynamic sampling
def test_a_group_informs_when_two_of_its_counted_rewards_differ():
    from gspo.algo.advantages import informative_groups

    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 0.0])  # groups of 3: (1 1 1) (0 .5 .5) (2 2 0)
    assert informative_groups(r, 3).tolist() == [False, True, True]
    valid = torch.tensor([True, True, True, True, True, True, True, True, False])  # the 0 of group 2 dropped
    assert informative_groups(r, 3, valid).tolist() == [False, True, False]
    alone = torch.tensor([True, False, False, True, True, True, True, True, True])  # group 0: one valid reward
    assert informative_groups(torch.tensor([5.0, 0.0, 9.0, 0.0, 0.5, 0.5, 2.0, 2.0, 0.0]), 3, alone).tolist() == [
        False, True, True]
    with pytest.raises(ValueError, match="not a positive multiple of group_size 4"):
        informative_groups(r, 4)


@pytest.mark.parametrize("flags, wanted, expected", [
    ([False, True, False, True, True], 2, [1, 3]),  # the first two informative ones
    ([False, True, False, True, True], 4, [0, 1, 3, 4]),  # all three, topped up with the first other
    ([False, False, False], 2, [0, 1]),  # none informs: the first drawn
    ([True, True], 2, [0, 1]),  # the first round was enough: the batch as drawn
])
def test_the_step_keeps_the_first_informative_groups_in_the_order_drawn(flags, wanted, expected):
    from gspo.algo.advantages import fill_groups

    assert fill_groups(torch.tensor(flags), wanted).tolist() == expected


def test_only_a_group_baseline_zeroes_the_groups_whose_rewards_agree():
    from gspo.algo.advantages import zeroes_agreeing_groups

    assert {e: zeroes_agreeing_groups(e) for e in ("group", "batch", "none", "rloo", "reinforce_pp", "gae")} == {
        "group": True, "batch": True, "none": True, "rloo": True, "reinforce_pp": False, "gae": False}


@pytest.mark.parametrize("kw, message", [
    ({"advantage_estimator": "reinforce_pp"}, "advantage_estimator=reinforce_pp gives them one (use group, batch, "
                                              "none, rloo)"),
    ({"advantage_estimator": "gae", "objective": "grpo"}, "advantage_estimator=gae gives them one"),
    ({"max_sampling_rounds": 0}, "max_sampling_rounds"),
    ({"oversample_factor": 0.5}, "oversample_factor=0.5 must be >= 1"),
])
def test_dynamic_sampling_refuses_what_it_cannot_do_by_name(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_config(TrainConfig, {"dynamic_sampling": True, "task": "add3", **kw})


def half_informative(prompts, completions, **_):
    """A reward that agrees within every group of about half the prompts (0 for a prompt of odd checksum) and
    spreads in most groups of the others (its completion's checksum's parity)."""
    return [float(zlib.crc32(c.encode()) % 2) if zlib.crc32(p.encode()) % 2 == 0 else 0.0
            for p, c in zip(prompts, completions)]


def _groups(samples: list[dict], G: int) -> list[list[dict]]:
    return [samples[i:i + G] for i in range(0, len(samples), G)]


def test_a_step_trains_on_informative_groups_only_and_counts_what_it_sampled(tmp_path):
    B, G = 4, 4
    cfg = tiny_cfg(tmp_path, max_steps=3, per_device_batch_size=B, num_generations=G, reward_funcs=[half_informative],
                   dynamic_sampling=True, max_sampling_rounds=6, oversample_factor=1.5, eval_num_prompts=0,
                   log_samples_count=B * G, seeded_sampling=True)
    train(cfg)
    lines = [r for r in read_metrics(tmp_path / "run") if r["step"] >= 1]
    samples = [json.loads(s) for s in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert any(r["groups/sampling_rounds"] > 1 for r in lines)  # the case under test: extra rounds were needed
    for r in lines:
        assert r["groups/filled_frac"] == 1.0 and r["groups/kept"] == B and r["groups/zero_std_frac"] == 0.0
        # every round after the first samples ceil(1.5 x the groups still missing): 2 to 6 groups a round
        extra = r["groups/sampling_rounds"] - 1
        assert B + 2 * extra <= r["groups/sampled"] <= B + 6 * extra
        assert 0 < r["groups/sampled_zero_std_frac"] < 1 and r["time/extra_sampling_s"] >= 0
    for step in {s["step"] for s in samples}:  # each logged step: B groups, each of one prompt with spread
        groups = _groups([s for s in samples if s["step"] == step], G)
        assert len(groups) == B
        for g in groups:
            assert len({s["prompt"] for s in g}) == 1 and len({s["reward"] for s in g}) > 1
            assert all(s["reward"] == half_informative([s["prompt"]], [s["completion"]])[0] for s in g)


def test_when_the_rounds_run_out_the_step_is_topped_up_and_says_how_full_it_is(tmp_path):
    B, G = 2, 4
    cfg = tiny_cfg(tmp_path, max_steps=2, per_device_batch_size=B, num_generations=G, dynamic_sampling=True,
                   max_sampling_rounds=3, oversample_factor=2.0, eval_num_prompts=0)  # answer_match: 0 everywhere
    train(cfg)
    for r in [r for r in read_metrics(tmp_path / "run") if r["step"] >= 1]:
        # no group informs: rounds of ceil(2 x 2) = 4 prompts until the third, then the first round's groups
        assert (r["groups/sampling_rounds"], r["groups/sampled"], r["groups/kept"]) == (3.0, 2 + 4 + 4, 0.0)
        assert r["groups/filled_frac"] == 0.0 and r["groups/sampled_zero_std_frac"] == 1.0
        assert r["groups/zero_std_frac"] == 1.0


def test_off_the_metrics_are_those_of_a_run_without_it_and_one_round_is_the_plain_run(tmp_path):
    common = dict(max_steps=2, eval_num_prompts=0, reward_funcs=[half_informative], seeded_sampling=True)
    train(tiny_cfg(tmp_path / "plain", **common))
    train(tiny_cfg(tmp_path / "one", dynamic_sampling=True, max_sampling_rounds=1, **common))
    plain, one = read_metrics(tmp_path / "plain" / "run"), read_metrics(tmp_path / "one" / "run")
    assert not any(k.startswith("groups/sampl") for r in plain for k in r)
    timing = ("time/", "throughput/")
    for a, b in zip(plain, one, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(timing)} == {
            k: v for k, v in b.items() if not k.startswith(timing) and k not in DYNAMIC_KEYS}
    assert all(torch.equal(a, b) for a, b in zip(final_weights(tmp_path / "plain" / "run").values(),
                                                   final_weights(tmp_path / "one" / "run").values()))


DYNAMIC_KEYS = ("groups/sampled", "groups/kept", "groups/filled_frac", "groups/sampled_zero_std_frac",
                "groups/sampling_rounds", "reward/sampled_mean")


@pytest.mark.parametrize("seeded, workers", [(True, 0), (False, 0),
                                             pytest.param(False, 1, marks=pytest.mark.slow)])
def test_a_run_with_extra_rounds_resumes_bit_for_bit(tmp_path, seeded, workers):
    # the extra rounds draw prompts from the source and random numbers from the trainer's streams (or a worker's,
    # which samples them after the step asked ahead): a checkpoint after step 2 holds each where the uninterrupted
    # run had it
    def cfg(name, **kw):
        return tiny_cfg(tmp_path / name, max_steps=4, per_device_batch_size=4, reward_funcs=[half_informative],
                        dynamic_sampling=True, eval_num_prompts=0, seeded_sampling=seeded, learning_rate=1e-2,
                        rollout_workers=workers, max_staleness=workers, **kw)

    train(cfg("whole"))
    train(cfg("parts"), callbacks=[lambda step, metrics: "stop" if step == 2 else None])
    train(cfg("parts", resume_from_checkpoint="latest"))
    timing = ("time/", "throughput/")
    whole, parts = read_metrics(tmp_path / "whole" / "run"), read_metrics(tmp_path / "parts" / "run")
    assert any(r.get("groups/sampling_rounds", 1) > 1 for r in whole[2:])  # extra rounds after the resume too
    timing = (*timing, "async/trainer_busy", "async/worker_busy")
    assert [{k: v for k, v in r.items() if not k.startswith(timing)} for r in whole] == [
        {k: v for k, v in r.items() if not k.startswith(timing)} for r in parts]
    if workers:  # an extra round samples after the step asked ahead, with the weights of its time: fresher
        assert any(0 < r["async/staleness_mean"] < 1 for r in whole), [r["async/staleness_mean"] for r in whole]
    w, p = final_weights(tmp_path / "whole" / "run"), final_weights(tmp_path / "parts" / "run")
    assert all(torch.equal(w[k], p[k]) for k in w)


def test_the_sft_term_and_the_samples_see_the_kept_groups_rows(tmp_path):
    # the step's data rows (the SFT term's references) are those of the groups kept, in the rollout's order
    from gspo.callbacks import Callbacks
    from gspo.plugs.parallel import Topology
    from gspo.run import build_run
    from gspo.trainer import train_loop

    class Recording:  # an AuxiliaryTerm that adds nothing and notes each step's rows
        def __init__(self):
            self.rows = {}

        def begin_step(self, step, rows):
            self.rows[step] = [r["prompt"] for r in rows]

        def backward(self, i, model, scale):
            return 0.0, {}

    B, G = 4, 4
    cfg = tiny_cfg(tmp_path, max_steps=3, per_device_batch_size=B, num_generations=G, reward_funcs=[half_informative],
                   dynamic_sampling=True, max_sampling_rounds=6, eval_num_prompts=0, log_samples_count=B * G)
    run = build_run(cfg, Topology())
    run.aux = aux = Recording()
    train_loop(run, Callbacks(()))
    samples = [json.loads(s) for s in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    lines = read_metrics(tmp_path / "run")
    assert any(r["groups/sampling_rounds"] > 1 for r in lines)
    for step, prompts in aux.rows.items():
        assert prompts == [g[0]["prompt"] for g in _groups([s for s in samples if s["step"] == step], G)]


def test_the_sums_example_is_the_real_model_demo_s_data():
    # configs/sums_smollm2.yaml trains on examples/sums: the rows gspo/apps/demo_real.py writes, held-out split too
    from gspo.apps.demo_real import sum_rows

    root = Path(__file__).resolve().parents[1] / "examples" / "sums"
    for split in ("train", "test"):
        rows = [json.loads(line) for line in (root / f"{split}.jsonl").read_text().splitlines()]
        assert rows == sum_rows(split)
    assert (len(sum_rows("train")), len(sum_rows("test"))) == (269, 131)
