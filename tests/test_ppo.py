"""PPO in the trainer: advantage_estimator=gae, the critic plug (gspo/plugs/baselines.py), its config,
checkpoints and exact resume. The pure parts (gae, value_loss) are tested in test_advantages.py
and test_values.py; the value model in test_critic.py."""

import math
import statistics

import pytest
import torch
from safetensors.torch import load_file

from conftest import SMALL, changed, final_weights, initial_weights, read_metrics, starts_with_digit, tiny_cfg
from gspo.config import AdvantageSettings, TrainConfig, make_config, section
from gspo.models import load_model
from gspo.plugs.baselines import CriticBaseline, GroupBaseline, build_baseline
from gspo.plugs.critic import HEAD_FILE, load_value_model
from gspo.plugs.parallel import Part, Topology
from gspo.rollout import Rollout
from gspo.runtime import NonFiniteGuard
from gspo.trainer import train

PPO = dict(objective="grpo", advantage_estimator="gae")


class FixedValues(torch.nn.Module):
    """A stand-in critic: the value of every position is read from a table (N, L)."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.tensor(table)
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask, packed=False):  # ValueModel.forward's signature
        return self.table[:, : input_ids.shape[1]] + 0 * self.unused


def hand_rollout(rewards, old=None, ref=None) -> Rollout:
    """2 rows, 1 prompt token, 3 completion tokens; row 1 ends after 2 (its third is padding)."""
    mask = torch.tensor([[True, True, True], [True, True, False]])
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 0]])
    return Rollout(input_ids=ids, attention_mask=torch.cat([torch.ones(2, 1, dtype=torch.long), mask.long()], 1),
                   completion_mask=mask, prompts=["p", "p"], completions=["a", "b"], rewards=torch.tensor(rewards),
                   old_logprobs=old, ref_logprobs=ref)


def critic_baseline(table, **kw) -> CriticBaseline:
    cfg = tiny_cfg_values(**kw)
    critic = FixedValues(table)
    optimizer = torch.optim.SGD(critic.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return CriticBaseline(section(cfg, AdvantageSettings), critic, optimizer, scheduler, NonFiniteGuard(5), Topology(),
                          kl_coef=cfg.kl_coef, max_grad_norm=cfg.max_grad_norm, packed=cfg.padding_free)


def tiny_cfg_values(**kw) -> TrainConfig:
    return make_config(TrainConfig, {**PPO, **kw})


ALL = [Part(torch.arange(2), 2.0, 2.0, 5.0, 5.0)]  # one minibatch holding both rows


def test_gae_plug_hand_values_and_whitening():
    # values at completion tokens are read from positions 0..2: row 0 (0.5, 0.4, 0.6), row 1 (0.2, 0.1)
    table = [[0.5, 0.4, 0.6, 9.0], [0.2, 0.1, 9.0, 9.0]]
    # rewards 1 (row 0, on token 2) and -1 (row 1, on token 1); gamma 0.9, lambda 0.8 (gamma*lambda = 0.72):
    # row 0: d2 = 1 - 0.6 = 0.4, A2 = 0.4; d1 = 0.9*0.6 - 0.4 = 0.14, A1 = 0.14 + 0.72*0.4 = 0.428;
    #        d0 = 0.9*0.4 - 0.5 = -0.14, A0 = -0.14 + 0.72*0.428 = 0.16816
    # row 1: d1 = -1 - 0.1 = -1.1, A1 = -1.1; d0 = 0.9*0.1 - 0.2 = -0.11, A0 = -0.11 + 0.72*(-1.1) = -0.902
    A = [0.16816, 0.428, 0.4, -0.902, -1.1]
    R = [0.66816, 0.828, 1.0, -0.702, -1.0]  # A + V
    for whiten in (False, True):
        baseline = critic_baseline(table, gae_gamma=0.9, gae_lambda=0.8, whiten_advantages=whiten)
        rollout = hand_rollout([1.0, -1.0])
        stats = baseline.estimate(rollout, None, ALL, Topology())
        mask = rollout.completion_mask
        torch.testing.assert_close(rollout.returns[mask], torch.tensor(R), atol=1e-6, rtol=0)
        mean, std = statistics.fmean(A), statistics.pstdev(A)
        want = [(a - mean) / (std + 1e-8) for a in A] if whiten else A
        torch.testing.assert_close(rollout.advantages[mask], torch.tensor(want), atol=1e-6, rtol=0)
        assert rollout.advantages[1, 2] == 0.0 and rollout.returns[1, 2] == 0.0  # padding
        assert stats["advantages/mean"] == pytest.approx(mean, abs=1e-6)  # before whitening (float32 advantages)
        assert stats["advantages/std"] == pytest.approx(std, abs=1e-6)
        # R - V = A: explained variance 1 - Var(A) / Var(R)
        assert stats["value/explained_var"] == pytest.approx(1 - statistics.pvariance(A) / statistics.pvariance(R),
                                                             abs=1e-6)


def test_terminal_reward_reaches_every_token_and_kl_folds_into_the_reward():
    # gamma = lambda = 1 and a zero critic: every token's return is the sum of the rewards after it
    zero = [[0.0] * 4, [0.0] * 4]
    baseline = critic_baseline(zero, gae_gamma=1.0, gae_lambda=1.0, whiten_advantages=False)
    rollout = hand_rollout([2.0, -1.0])
    baseline.estimate(rollout, None, ALL, Topology())
    assert rollout.returns.tolist() == [[2.0, 2.0, 2.0], [-1.0, -1.0, 0.0]]
    assert torch.equal(rollout.advantages, rollout.returns)  # A = R - V, V = 0
    # kl_in_reward, kl_coef 0.5: r_t -= 0.5 * (log pi_old - log pi_ref); row 0's log-ratios (0.2, 0, -0.2)
    # give rewards (-0.1, 0, 1.1) with the terminal 1; returns (1.0, 1.1, 1.1); row 1's (0.4, 0.2 | pad 7)
    # give (-0.2, -0.1 - 1) -> returns (-1.3, -1.1)
    old = torch.tensor([[0.2, 0.0, -0.2], [0.4, 0.2, 7.0]])
    baseline = critic_baseline(zero, gae_gamma=1.0, gae_lambda=1.0, whiten_advantages=False, kl_coef=0.5,
                               kl_in_reward=True)
    assert baseline.needs_pi_old  # prepare then computes pi_old for the first minibatch too
    rollout = hand_rollout([1.0, -1.0], old=old, ref=torch.zeros(2, 3))
    baseline.estimate(rollout, None, ALL, Topology())
    torch.testing.assert_close(rollout.returns, torch.tensor([[1.0, 1.1, 1.1], [-1.3, -1.1, 0.0]]), atol=1e-6,
                               rtol=0)


def test_a_dropped_sample_gets_no_advantage_and_stays_out_of_the_statistics():
    table = [[0.5, 0.4, 0.6, 9.0], [0.2, 0.1, 9.0, 9.0]]
    baseline = critic_baseline(table, gae_gamma=0.9, gae_lambda=0.8)
    rollout = hand_rollout([1.0, float("nan")])
    stats = baseline.estimate(rollout, None, ALL, Topology())
    A = [0.16816, 0.428, 0.4]  # row 0 as in the hand example; row 1 dropped
    assert rollout.advantages[1].tolist() == [0.0, 0.0, 0.0]
    assert stats["advantages/mean"] == pytest.approx(statistics.fmean(A), abs=1e-6)
    assert torch.isfinite(rollout.advantages).all() and torch.isfinite(rollout.returns).all()


def test_group_baseline_is_the_registered_estimator():
    from gspo.algo.advantages import group_advantages
    from gspo.step import Scores

    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 0.0, 4.0])
    scores = Scores(rewards, torch.ones(8, dtype=torch.bool), {}, torch.ones(8), torch.ones(8, dtype=torch.bool),
                    torch.ones(8))
    for name in ("group", "rloo", "reinforce_pp"):
        rollout = Rollout(torch.zeros(8, 2, dtype=torch.long), torch.ones(8, 2), torch.ones(8, 1, dtype=torch.bool),
                          [""] * 8, [""] * 8)
        stats = GroupBaseline(name, 4).estimate(rollout, scores, [], Topology())
        want = group_advantages(rewards, 4, estimator=name)
        assert torch.equal(rollout.advantages, want)
        assert stats["advantages/mean"] == pytest.approx(want.double().mean().item(), abs=1e-12)


def test_ppo_trains_policy_and_critic_and_the_reward_rises(tmp_path):
    # the learnable reward of test_trainer.py (a completion starting with a digit, ~12% at random init)
    cfg = tiny_cfg(tmp_path, **PPO, reward_funcs=[starts_with_digit], max_steps=30, per_device_batch_size=4,
                   num_generations=8, max_completion_length=4, learning_rate=3e-3, critic_learning_rate=3e-3,
                   eval_num_prompts=1, log_samples_steps=0)
    train(cfg)
    records = read_metrics(tmp_path / "run")[1:]
    rewards = [r["reward/mean"] for r in records]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.35 and last > first + 0.4, (first, last)
    for key in ("loss/value", "value/mean", "value/explained_var", "value/clip_frac", "advantages/mean",
                "advantages/std", "value/grad_norm"):
        assert all(math.isfinite(r[key]) for r in records), key
    # the head starts at zero (minibatch 1 of step 1 sees values 0, explaining nothing); later the values
    # track the rising reward (measured: value/mean 0.04 -> 1.0 as reward/mean rises 0.1 -> 0.95)
    assert abs(records[0]["value/mean"]) < 0.1 and abs(records[0]["value/explained_var"]) < 0.05
    assert abs(records[-1]["value/mean"] - last) < 0.25, (records[-1]["value/mean"], last)
    trained = final_weights(tmp_path / "run")
    assert len(changed(initial_weights(cfg), trained)) > len(trained) // 2
    critic = load_value_model(str(tmp_path / "run" / "critic"), dtype=torch.float32, device="cpu")
    head = load_file(str(tmp_path / "run" / "critic" / HEAD_FILE))
    assert torch.equal(critic.head.weight, head["weight"]) and head["weight"].abs().sum() > 0  # trained, reloaded
    policy = initial_weights(cfg)
    moved = [k for k, v in critic.decoder.state_dict().items() if not torch.equal(v, policy[f"model.{k}"])]
    assert len(moved) > len(policy) // 4  # the critic's decoder was trained too (its own copy)


def test_ppo_resume_is_exact_including_the_critic(tmp_path):
    kw = dict(**PPO, reward_funcs=[starts_with_digit], per_device_batch_size=2, num_generations=4,
              max_completion_length=6, eval_num_prompts=2, log_samples_steps=0, kl_coef=0.05, kl_in_reward=True,
              eval_steps=2, save_steps=2)  # the same evaluations as the run that stops at step 2
    full = tiny_cfg(tmp_path / "full", **kw, max_steps=4)
    train(full)
    part = tiny_cfg(tmp_path / "part", **kw, max_steps=2)
    train(part)
    train(tiny_cfg(tmp_path / "part", **kw, max_steps=4, resume_from_checkpoint="latest"))

    def strip(records):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in records]

    assert strip(read_metrics(tmp_path / "part" / "run")) == strip(read_metrics(tmp_path / "full" / "run"))
    assert changed(final_weights(tmp_path / "full" / "run"), final_weights(tmp_path / "part" / "run")) == []
    a, b = (load_file(str(tmp_path / d / "run" / "critic" / "model.safetensors")) for d in ("full", "part"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    ha, hb = (load_file(str(tmp_path / d / "run" / "critic" / HEAD_FILE)) for d in ("full", "part"))
    assert torch.equal(ha["weight"], hb["weight"]) and ha["weight"].abs().sum() > 0


def test_critic_model_from_a_saved_critic_or_a_causal_lm(tmp_path):
    policy, tokenizer = load_model("tiny-dense", overrides=SMALL, seed=3)
    policy.save_pretrained(tmp_path / "lm")
    critic = load_value_model(str(tmp_path / "lm"), dtype=torch.float32, device="cpu")
    assert all(torch.equal(v, policy.state_dict()[f"model.{k}"]) for k, v in critic.decoder.state_dict().items())
    assert not critic.head.weight.any()  # a causal LM brings no value head: zero
    from gspo.plugs.critic import save_value_model

    torch.nn.init.normal_(critic.head.weight)
    save_value_model(critic, tmp_path / "critic")
    again = load_value_model(str(tmp_path / "critic"), dtype=torch.float32, device="cpu")
    assert torch.equal(again.head.weight, critic.head.weight)
    # the trainer builds it from critic_model (not from the policy it trains)
    cfg = tiny_cfg(tmp_path, **PPO, critic_model=str(tmp_path / "critic"))
    other, _ = load_model("tiny-dense", overrides=SMALL, seed=0)
    baseline = baseline_of(cfg, other)
    assert torch.equal(baseline.critic.head.weight, critic.head.weight)
    with pytest.raises(ValueError, match="critic_model '.*nowhere': could not load a decoder"):
        load_value_model(str(tmp_path / "nowhere"), dtype=torch.float32, device="cpu")


def _adamw(module, lr):
    optimizer = torch.optim.AdamW(module.parameters(), lr=lr)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def baseline_of(cfg: TrainConfig, policy, make_optimizer=_adamw):
    """`build_baseline` as a run builds it: its own section and the values it shares with the run."""
    return build_baseline(section(cfg, AdvantageSettings), policy, Topology(), make_optimizer,
                          group_size=cfg.num_generations, learning_rate=cfg.learning_rate,
                          max_grad_norm=cfg.max_grad_norm, max_consecutive_skips=cfg.max_consecutive_skips,
                          kl_coef=cfg.kl_coef, packed=cfg.padding_free, trust_remote_code=cfg.trust_remote_code)


def test_the_baseline_is_built_from_its_section_and_the_values_named_to_it():
    policy, _ = load_model("tiny-dense", overrides=SMALL, seed=0)
    shared = dict(group_size=3, learning_rate=1e-3, max_grad_norm=0.5, max_consecutive_skips=7, kl_coef=0.25,
                  packed=False)
    group = build_baseline(AdvantageSettings(advantage_estimator="rloo"), policy, Topology(), _adamw, **shared)
    assert isinstance(group, GroupBaseline) and (group.estimator, group.group_size) == ("rloo", 3)
    rates = []

    def recording(module, lr):
        rates.append(lr)
        return _adamw(module, lr)

    folded = build_baseline(AdvantageSettings(advantage_estimator="gae", kl_in_reward=True, gae_gamma=0.9), policy,
                            Topology(), recording, **shared)
    own_lr = build_baseline(AdvantageSettings(advantage_estimator="gae", critic_learning_rate=1e-4), policy,
                            Topology(), recording, **shared)
    assert rates == [1e-3, 1e-4]  # critic_learning_rate, else the run's learning_rate
    assert (folded.gamma, folded.kl_reward_coef, folded.needs_pi_old) == (0.9, 0.25, True)
    assert (own_lr.kl_reward_coef, own_lr.needs_pi_old) == (0.0, False)  # the KL stays in the loss
    assert (folded.max_grad_norm, folded.packed, folded.guard.limit) == (0.5, False, 7)


def test_a_checkpoint_saved_before_the_rename_and_the_ppo_fields_resumes():
    from gspo.checkpoint import check_resumable, saved_config

    cfg = make_config(TrainConfig, {"advantage_estimator": "rloo", "max_steps": 3})
    old = saved_config(cfg)
    old["advantage_scale"] = old.pop("advantage_estimator")  # an older gspo's name
    for name in ("critic_model", "vf_coef", "value_clip", "gae_gamma", "gae_lambda", "kl_in_reward",
                 "whiten_advantages", "critic_learning_rate"):
        del old[name]  # not there yet: they acted as their defaults
    check_resumable(old, cfg, 1)
    with pytest.raises(ValueError, match=r"advantage_estimator='rloo' \(now 'group'\)"):
        check_resumable(old, make_config(TrainConfig, {"max_steps": 3}), 1)


@pytest.mark.parametrize("settings, message", [
    ({"advantage_estimator": "gae", "objective": "gspo"},
     "advantage_estimator=gae gives one advantage per token, but objective 'gspo' takes one per sequence"),
    ({"kl_in_reward": True, "kl_coef": 0.1}, "kl_in_reward folds the KL into GAE's per-token rewards"),
    ({**PPO, "kl_in_reward": True}, "kl_in_reward needs kl_coef > 0"),
    ({"critic_learning_rate": 1e-4}, "critic_model / critic_learning_rate set, but advantage_estimator='group'"),
    ({**PPO, "gae_lambda": 1.5}, r"gae_lambda=1.5 must be in \[0, 1\]"),
    ({**PPO, "value_clip": 0.0}, "value_clip=0.0 must be > 0"),
    ({**PPO, "vf_coef": -1.0}, "vf_coef=-1.0 must be > 0"),
    ({"advantage_estimator": "ppo"}, "advantage_estimator='ppo' is not one of group, batch, none, rloo, reinforce_pp, "
                                     "gae"),
])
def test_bad_ppo_settings_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        make_config(TrainConfig, settings)


def unrelated_reward(prompts, completions, **_):
    """A reward that ignores correctness (a hash of the text): a control for the demo test below."""
    return [sum(map(ord, c)) % 7 / 6 for c in completions]


@pytest.mark.slow
def test_ppo_raises_held_out_accuracy_from_the_demo_cold_start(tmp_path):
    """The demo's cold start (SFT to 40% greedy on its own check), then 30 PPO steps at the demo's RL
    settings: held-out greedy accuracy must rise by 0.15. The same run with a reward unrelated to
    correctness (the update is then noise as far as addition goes) must not. (30 steps, not 20: on an
    AMD EPYC AVX-512 machine 20 gave +0.12, at bbf266e too; 30 gave +0.19, the control -0.47.)"""
    from gspo.apps.demo import DEMO_RL, DEMO_SFT
    from gspo.config import SFTConfig
    from gspo.sft import sft

    cold = sft(make_config(SFTConfig, {**DEMO_SFT, "output_dir": str(tmp_path / "sft"), "progress": False}))
    gains = {}
    for name, rewards in (("answer_match", ["answer_match"]), ("unrelated", [unrelated_reward])):
        cfg = make_config(TrainConfig, {**DEMO_RL, **PPO, "clip_low": 0.2, "clip_high": 0.2, "model": cold["model_dir"],
                                        "max_steps": 30, "eval_steps": 0, "eval_num_prompts": 100, "eval_k": 1,
                                        "reward_funcs": rewards, "log_samples_steps": 0, "progress": False,
                                        "output_dir": str(tmp_path / name)})
        evals = train(cfg)["evals"]
        gains[name] = evals[30]["eval/accuracy"] - evals[0]["eval/accuracy"]
    assert gains["answer_match"] > 0.15 > gains["unrelated"], gains


@pytest.mark.slow
def test_the_rlhf_path_a_trained_reward_model_scores_the_last_token_and_ppo_trains_on_it(tmp_path):
    """A tiny reward model trained in the test (tests/conftest.py: Bradley-Terry on right vs wrong add3
    answers), used as `rm:<path>`: its score sits on each completion's last token, so with gamma =
    lambda = 1 and a critic at zero every token's return is that score; then PPO trains on it."""
    from conftest import answer_pairs, train_tiny_reward_model
    from gspo.data.rewards import get_reward_fn
    from gspo.rollout import generate

    numbers = train_tiny_reward_model(tmp_path / "rm", steps=100)
    assert numbers["accuracy"] > 0.6  # a weak but real preference after 100 steps (the full 300: 0.97)
    rm = get_reward_fn(f"rm:{tmp_path / 'rm'}")
    pairs = answer_pairs("test", 4, seed=3)
    prompts = [p["prompt"] for p in pairs]
    policy, tokenizer = load_model("tiny-dense", overrides=SMALL, seed=0)
    torch.manual_seed(0)
    rollout = generate(policy, tokenizer, prompts, 2, max_new_tokens=10)
    scores = torch.tensor(rm(rollout.prompts, rollout.completions))  # (N,)
    rollout.rewards = scores
    cfg = tiny_cfg(tmp_path, **PPO, reward_funcs=[f"rm:{tmp_path / 'rm'}"], gae_gamma=1.0, gae_lambda=1.0,
                   whiten_advantages=False)
    baseline = baseline_of(cfg, policy)
    N = rollout.num_sequences
    lengths = rollout.completion_mask.sum(-1).float()
    baseline.estimate(rollout, None, [Topology().part(torch.arange(N), N, lengths, False)], Topology())
    mask = rollout.completion_mask
    assert torch.equal(rollout.returns, torch.where(mask, scores[:, None].expand_as(mask), 0.0))
    assert len(set(scores.tolist())) > 1  # the score depends on the completion
    # the whole path: PPO with the reward model as its reward
    cfg = tiny_cfg(tmp_path, **PPO, reward_funcs=[f"rm:{tmp_path / 'rm'}"], max_steps=3, per_device_batch_size=4)
    train(cfg)
    records = read_metrics(tmp_path / "run")[1:]
    assert all(math.isfinite(r["reward/reward_model"]) and r["loss/value"] > 0 for r in records)
    assert len(changed(initial_weights(cfg), final_weights(tmp_path / "run"))) > 0


def test_a_non_finite_value_loss_skips_the_critic_step_and_aborts_naming_the_critic():
    from gspo.runtime import TrainingAborted

    cfg = tiny_cfg_values()
    critic = FixedValues([[0.0] * 4, [0.0] * 4])
    optimizer = torch.optim.SGD(critic.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    baseline = CriticBaseline(section(cfg, AdvantageSettings), critic, optimizer, scheduler,
                              NonFiniteGuard(2, "critic steps", "critic_learning_rate"), Topology(),
                              kl_coef=cfg.kl_coef, max_grad_norm=cfg.max_grad_norm, packed=cfg.padding_free)
    mb = hand_rollout([1.0, 0.0])
    mb.old_values, mb.returns = torch.zeros(2, 3), torch.full((2, 3), float("nan"))  # a NaN target
    stats = baseline.update(mb, ALL[0], step=1)
    assert math.isnan(stats["loss/value"]) and stats["value/skipped_steps"] == 1
    assert critic.unused.grad is None and critic.unused.item() == 0.0  # no step taken
    with pytest.raises(TrainingAborted, match="2 critic steps in a row had a non-finite loss .* Lower "
                                              "critic_learning_rate"):
        baseline.update(mb, ALL[0], step=2)
