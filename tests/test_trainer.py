"""End-to-end training on tiny models built from config (nothing downloaded)."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import (
    SMALL,
    SMALL_MOE,
    changed,
    final_weights,
    initial_weights,
    read_metrics,
    starts_with_digit,
    tiny_cfg,
)
from gspo.algo.logprobs import completion_logprobs, minibatch_logprobs
from gspo.algo.objectives import registered_objective
from gspo.config import BatchSettings, ObjectiveSettings, PrecisionSettings, section
from gspo.models import load_model
from gspo.plugs.reference import NoReference
from gspo.rollout import generate
from gspo.tasks import get_task
from gspo.tracking import read_jsonl
from gspo.trainer import train

DOCUMENTED = ["reward/mean", "reward/std", "reward/answer_match", "groups/zero_std_frac", "loss/policy", "loss/kl",
              "ratio/mean", "ratio/std", "ratio/min", "ratio/max", "clip/low_frac", "clip/high_frac", "kl/approx",
              "entropy", "completion/mean_len", "prompt/mean_len", "grad/norm", "time/generate_s", "time/rollout_s",
              "time/train_s", "throughput/tokens_per_s", "lr"]


@pytest.mark.parametrize("preset, overrides", [("tiny-dense", SMALL), ("tiny-moe", SMALL_MOE)])
@pytest.mark.parametrize("objective", ["gspo", "grpo"])
def test_few_steps_change_parameters_and_log_documented_metrics(tmp_path, preset, overrides, objective):
    # answer_match is 0 for a random model (zero advantages, no update), so add a reward with spread
    cfg = tiny_cfg(tmp_path, model=preset, model_overrides=overrides, objective=objective,
                   reward_funcs=["answer_match", starts_with_digit], per_device_batch_size=4)
    summary = train(cfg)
    trained = final_weights(tmp_path / "run")
    assert len(changed(initial_weights(cfg), trained)) > len(trained) // 2, "most parameters should move"
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert set(records[0]) == {"step", "eval/accuracy", "eval/reward", "eval/mean_at_k", "eval/pass_at_k",
                               "eval/sampled_reward"}
    for r in records[1:]:
        for key in DOCUMENTED:
            assert math.isfinite(r[key]), (key, r[key])
        assert 0 <= r["clip/low_frac"] <= 1 and 0 <= r["completion/mean_len"] <= 12
        assert r["prompt/mean_len"] == 8  # add3's prompts: "abc+def=", 3-digit operands, 8 characters
        assert 0 < r["time/generate_s"] < r["time/rollout_s"]  # sampling is the first part of the rollout
    assert "eval/accuracy" in records[-1] and summary["evals"][3]["eval/accuracy"] == records[-1]["eval/accuracy"]
    samples = read_jsonl(tmp_path / "run" / "samples.jsonl", null_as_nan=False)
    assert len(samples) == 3 * 4 and records[1]["reward/std"] > 0
    assert all(isinstance(s["completion"], str) for s in samples)
    assert samples[0]["prompt"].endswith("=")  # an add3 prompt such as "347+585="


@pytest.mark.parametrize("objective", ["gspo", "grpo", "pg", "gmpo", "kl_cov", "luspo", "vespo"])
def test_learnable_reward_rises(tmp_path, objective):
    # A random-init model starts a completion with one of the 10 digits ~12% of the time
    # (10 of 81 tokens); the reward pays exactly that, so RL must push the rate up.
    cfg = tiny_cfg(tmp_path, objective=objective, reward_funcs=[starts_with_digit], max_steps=30,
                   per_device_batch_size=4, num_generations=8, max_completion_length=4, learning_rate=3e-3,
                   eval_num_prompts=1, log_samples_steps=0)
    train(cfg)
    rewards = [r["reward/mean"] for r in read_metrics(tmp_path / "run")[1:]]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.35, first
    assert last > first + 0.4, (first, last)


def test_pi_old_equals_first_minibatch_logprobs():
    model, tok = load_model("tiny-dense", overrides=SMALL)
    prompts = [r["prompt"] for r in get_task("add3").dataset("train", 3, 0)]
    torch.manual_seed(0)  # the rollout samples from the global RNG
    rollout = generate(model, tok, prompts, 4, max_new_tokens=10)
    minibatches = torch.randperm(12, generator=torch.Generator().manual_seed(0)).chunk(3)
    with torch.no_grad():
        old = minibatch_logprobs(model, rollout, minibatches, {"temperature": 1.0, "chunk_size": 1024})
    mb = rollout.select(minibatches[0])
    logp, _ = completion_logprobs(model, mb.input_ids, mb.attention_mask, mb.completion_len, with_entropy=True)
    assert logp.requires_grad
    mask = mb.completion_mask
    assert torch.equal(logp[mask], old[minibatches[0], : mb.completion_len][mask])  # ratio exactly 1


def test_single_minibatch_is_exactly_on_policy(tmp_path):
    cfg = tiny_cfg(tmp_path, num_minibatches=1, max_steps=2)
    train(cfg)
    rows = read_metrics(tmp_path / "run")[1:]
    assert [r["step"] for r in rows] == [1, 2]  # the loop below checks every step, and there are steps
    for r in rows:
        assert r["ratio/min"] == 1.0 and r["ratio/max"] == 1.0 and r["kl/approx"] == 0.0
        assert r["clip/low_frac"] == 0.0 and r["clip/high_frac"] == 0.0


def test_later_minibatches_are_off_policy(tmp_path):
    cfg = tiny_cfg(tmp_path, num_minibatches=4, per_device_batch_size=2, num_generations=4, max_steps=2,
                   learning_rate=1e-2, reward_funcs=[starts_with_digit])
    train(cfg)
    rows = read_metrics(tmp_path / "run")[1:]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # A step's ratio/min and ratio/max are the extremes over its minibatches. The first is on-policy
        # (every ratio exactly 1), so they bracket 1; the later ones follow an update, so they spread.
        assert r["ratio/min"] <= 1.0 <= r["ratio/max"], r
        assert r["ratio/max"] > r["ratio/min"] and r["kl/approx"] > 0, r


def test_kl_to_reference_and_sampler_logprobs(tmp_path):
    cfg = tiny_cfg(tmp_path, kl_coef=0.1, use_sampler_logprobs=True, max_steps=2, reward_funcs=[starts_with_digit],
                   num_minibatches=1)
    train(cfg)
    r = read_metrics(tmp_path / "run")
    # The reference is the initial model: KL is 0 at step 1 (one minibatch, before any update)
    # and positive once the policy moved.
    assert r[1]["loss/kl"] == 0.0 and r[2]["loss/kl"] > 1e-6
    # With the sampler's log-probs as pi_old the first minibatch is no longer bit-exact on-policy,
    # but the two computations agree closely.
    assert abs(r[1]["ratio/mean"] - 1) < 1e-3


def test_trained_model_reloads_and_generates(tmp_path):
    cfg = tiny_cfg(tmp_path, max_steps=1, reward_funcs=[starts_with_digit])  # a reward with spread: an update
    train(cfg)
    path = tmp_path / "run" / "model"
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    state = model.state_dict()
    assert len(changed(initial_weights(cfg), state)) > len(state) // 2  # the trained weights, not the initial
    ids = tok(["12+34="], return_tensors="pt")
    # min_new_tokens holds off EOS (the saved generation config's) for all 5 tokens: exactly 5 come out,
    # each the argmax of the reloaded model's logits over the others.
    out = model.generate(**ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    expected = ids["input_ids"]  # (1, P)
    with torch.no_grad():
        for _ in range(5):
            logits = model(expected).logits[0, -1]  # (V,)
            logits[tok.eos_token_id] = -math.inf
            expected = torch.cat([expected, logits.argmax().view(1, 1)], dim=1)
    assert torch.equal(out, expected)
    assert tok.decode(out[0]).startswith("12+34=")


def test_user_dataset_with_chat_prompts_and_extra_columns(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "answer": str(2 * a), "bonus": a % 2}
            for a in range(10, 40)]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    seen = {}

    def bonus_reward(prompts, completions, bonus, answer, completion_ids, **_):  # TRL's signature
        seen.update(bonus=list(bonus), prompts=list(prompts), completions=list(completions), ids=list(completion_ids))
        return [float(b) for b in bonus]

    cfg = tiny_cfg(tmp_path, task=None, dataset=str(path), reward_funcs=[bonus_reward, "answer_match"],
                   reward_weights=[0.5, 1.0], max_steps=1, eval_num_prompts=0)  # `seen`: the training step's call
    train(cfg)
    assert len(seen["bonus"]) == 8 and set(seen["bonus"]) <= {0, 1}
    # TRL's conversational format: each prompt as its messages (G copies), each completion one assistant message
    first = seen["prompts"][0]
    assert first == seen["prompts"][3] and first in [r["prompt"] for r in rows]
    assert all(len(c) == 1 and c[0]["role"] == "assistant" for c in seen["completions"])
    # completion_ids: the tokens the text was decoded from (the stop token kept, padding not)
    tok = AutoTokenizer.from_pretrained(tmp_path / "run" / "model")
    assert [tok.decode(ids, skip_special_tokens=True) for ids in seen["ids"]] == \
        [c[0]["content"] for c in seen["completions"]]
    assert all(0 < len(ids) <= cfg.max_completion_length for ids in seen["ids"])
    r = read_metrics(tmp_path / "run")[0]  # step 1
    # answer_match (a built-in, reads_text) scored the same completions' text
    assert r["reward/mean"] == pytest.approx(0.5 * r["reward/bonus_reward"] + r["reward/answer_match"], abs=1e-6)


def test_missing_prompt_column_is_a_clear_error(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"question": "1+1="}))
    with pytest.raises(ValueError, match="no 'prompt' column"):
        train(tiny_cfg(tmp_path, task=None, dataset=str(path)))


def test_pi_old_forward_skips_the_first_minibatch(tmp_path):
    """Minibatch 1 is on-policy: its pi_old is its training forward (bitwise equal, test above), so
    `prepare` runs M - 1 pi_old forwards and leaves minibatch 1's rows at 0. The Routing plug is the seam."""
    from gspo.plugs.baselines import GroupBaseline
    from gspo.plugs.parallel import Topology
    from gspo.plugs.routing import NoRouting
    from gspo.step import gather_scores, logprob_options, prepare

    class Counting:
        def __init__(self, records: bool):
            self.records_pi_old, self.calls = records, []

        def logprobs(self, model, rollout, minibatches, logp_kwargs, writes=None):
            self.calls.append([len(idx) for idx in minibatches])
            return NoRouting().logprobs(model, rollout, minibatches, logp_kwargs, writes)

    model, tok = load_model("tiny-dense", overrides=SMALL)
    cfg = tiny_cfg(tmp_path, num_minibatches=4, num_epochs=2, per_device_batch_size=2)
    prompts = [r["prompt"] for r in get_task("add3").dataset("train", 2, 0)]
    for records, expected in ((False, [[2, 2, 2]]), (True, [[2, 2, 2, 2]])):
        rollout = generate(model, tok, prompts, 4, max_new_tokens=6)
        scores = gather_scores(Topology(), rollout, torch.arange(8, dtype=torch.float32), {}, [tok.eos_token_id])
        routing = Counting(records)
        batch = prepare(rollout, scores, plan=section(cfg, BatchSettings), objective=section(cfg, ObjectiveSettings),
                        logp_kwargs=logprob_options(cfg.temperature, section(cfg, PrecisionSettings)),
                        topology=Topology(), routing=routing, model=model, reference=NoReference(),
                        baseline=GroupBaseline("group", 4), shuffle=torch.Generator().manual_seed(0))
        assert routing.calls == expected and batch.first_on_policy is not records
        assert [len(parts) for parts in batch.epochs] == [4, 4]  # both epochs planned up front
        # the loop trains once per planned minibatch (M x epochs forwards with grad); only the first is on-policy
        assert [on_policy for _, _, on_policy in batch.minibatches()] == [not records] + [False] * 7
        first = batch.epochs[0][0].index
        assert bool((batch.rollout.old_logprobs[first] == 0).all()) is not records
        assert sorted(torch.cat([p.index for p in batch.epochs[1]]).tolist()) == list(range(8))


def test_a_registered_objective_is_what_the_trainer_optimises(tmp_path):
    """The seam for swapping the loss: register an objective and name it in the config."""
    seen = []

    def reinforce(x):  # -A log pi, token mean per sequence, mean over sequences
        seen.append(tuple(x.logp.shape))
        return ((-x.adv_t * x.logp * x.maskf).sum(-1) / x.lengths).mean(), {}

    with registered_objective("reinforce_test", reinforce, default_clip=(None, None),
                              default_aggregation="seq_mean_token_mean"):
        train(tiny_cfg(tmp_path, objective="reinforce_test", reward_funcs=["answer_match", starts_with_digit],
                       max_steps=2, per_device_batch_size=2, num_generations=4, num_minibatches=2))
    assert len(seen) == 2 * 2 and all(n == 4 for n, _ in seen)  # every minibatch (B G / M = 4 rows) of both steps
    initial, _ = load_model("tiny-dense", seed=0, overrides=SMALL)
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
    assert any(not torch.equal(p, initial.state_dict()[n]) for n, p in trained.named_parameters())
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(math.isfinite(r["loss/policy"]) and "clip/low_frac" not in r for r in records[1:])
