"""Multi-task training: the weight rule, the sampler, per-task scoring, config, the loop (the SFT term's
pure parts: tests/test_supervised.py)."""

import json
import math

import pytest
import torch

from conftest import changed, comparable, final_weights, initial_weights, read_metrics, starts_with_digit, tiny_cfg
from gspo.config import TrainConfig, load_config
from gspo.data.mixture import (
    TaskMixture,
    TaskSignal,
    TaskSpec,
    allocate,
    dynamic_weights,
    static_weights,
    update_signal,
)
from gspo.trainer import train


# ------------------------------------------------------------------------------- the weight rule
def test_dynamic_weights_follow_the_rule_by_hand():
    # K = 3, floor 0.1, smoothing 0.5, uniform prior; learnability starts at 1.
    # Observed shares of groups with reward spread: 0, 0.5, 1.
    # L = 0.5 * 1 + 0.5 * (0, 0.5, 1) = (0.5, 0.75, 1.0), sum 2.25
    # w = 0.1 + (1 - 3 * 0.1) * L / 2.25 = (0.25556, 0.33333, 0.41111)
    signals = [update_signal(TaskSignal(), a, None, 0.5) for a in (0.0, 0.5, 1.0)]
    assert [s.learnability for s in signals] == [0.5, 0.75, 1.0]
    w = dynamic_weights([1, 1, 1], signals, floor=0.1)
    assert w == pytest.approx([0.1 + 0.7 * 0.5 / 2.25, 0.1 + 0.7 * 0.75 / 2.25, 0.1 + 0.7 / 2.25], abs=1e-12)
    assert w == pytest.approx([0.255556, 0.333333, 0.411111], abs=1e-6)
    # The same shares again: L = (0.25, 0.625, 1.0), sum 1.875 -> w = 0.1 + 0.7 * L / 1.875
    signals = [update_signal(s, a, None, 0.5) for s, a in zip(signals, (0.0, 0.5, 1.0))]
    assert dynamic_weights([1, 1, 1], signals, floor=0.1) == pytest.approx([0.193333, 0.333333, 0.473333], abs=1e-6)
    # A prior multiplies the signal: pi = (0.25, 0.75), L = (1, 1), floor 0 -> (0.25, 0.75)
    assert dynamic_weights([1, 3], [TaskSignal(), TaskSignal()], floor=0.0) == [0.25, 0.75]
    assert static_weights([1, 3]) == [0.25, 0.75]
    # No signal anywhere: floor + (1 - K floor) * pi
    dead = [TaskSignal(learnability=0.0)] * 2
    assert dynamic_weights([1, 3], dead, floor=0.1) == pytest.approx([0.1 + 0.8 * 0.25, 0.1 + 0.8 * 0.75])
    with pytest.raises(ValueError, match="floor=0.6 must be in"):
        dynamic_weights([1, 1], dead, floor=0.6)


def test_progress_term_by_hand():
    # smoothing 0.5, progress_coef 10, floor 0. Step 1: mean rewards 0.2 and 0.5 (first sight: Q stays 0).
    # Step 2: 0.4 and 0.5 -> Q = 0.5 * 0 + 0.5 * (0.4 - 0.2) = 0.1 and 0. Every group had spread, so L = 1.
    # s = (1 + 10 * 0.1, 1 + 0) = (2, 1) -> w = (2/3, 1/3)
    s = [update_signal(TaskSignal(), 1.0, r, 0.5) for r in (0.2, 0.5)]
    assert [x.progress for x in s] == [0.0, 0.0] and [x.last_reward for x in s] == [0.2, 0.5]
    s = [update_signal(x, 1.0, r, 0.5) for x, r in zip(s, (0.4, 0.5))]
    assert s[0].progress == pytest.approx(0.1) and s[1].progress == 0.0
    assert dynamic_weights([1, 1], s, floor=0.0, progress_coef=10.0) == pytest.approx([2 / 3, 1 / 3])
    # A falling reward counts as much as a rising one (|Q|), and every reward dropped leaves Q alone.
    down = update_signal(TaskSignal(progress=0.0, last_reward=0.6), 1.0, 0.4, 0.5)
    assert down.progress == pytest.approx(-0.1)
    assert update_signal(down, 1.0, None, 0.5).progress == down.progress


def test_allocate_is_systematic():
    # Weights (0.25, 0.75) and 4 prompts: always (1, 3).
    assert all(allocate([0.25, 0.75], 4, u) == [1, 3] for u in (0.0, 0.3, 0.999))
    # Otherwise each task gets floor or ceil of n * w, and n * w on average over u.
    w, n = [0.1, 0.45, 0.45], 16
    draws = [allocate(w, n, (j + 0.5) / 1000) for j in range(1000)]
    for counts in draws:
        assert sum(counts) == n and all(math.floor(n * x) <= c <= math.ceil(n * x) for c, x in zip(counts, w))
    means = [sum(d[k] for d in draws) / len(draws) for k in range(3)]
    assert means == pytest.approx([1.6, 7.2, 7.2], abs=1e-2)
    assert allocate([0.0, 1.0], 3, 0.0) == [0, 3]  # a zero-weight task gets nothing


# ------------------------------------------------------------------------------- the mixture
def rows_of(kind: str, n: int) -> list[dict]:
    return [{"prompt": f"{kind}{i}=", "kind": kind, "answer": str(i)} for i in range(n)]


def mixture(weighting="dynamic", floor=0.1, smoothing=0.8, prior=(1, 1, 1), **kw) -> TaskMixture:
    specs = [TaskSpec(f"t{k}", None, f"t{k}.jsonl", None, [starts_with_digit], None, float(p))
             for k, p in enumerate(prior)]
    return TaskMixture(specs, [rows_of(f"t{k}", 20) for k in range(len(prior))], [[] for _ in prior],
                       weighting=weighting, floor=floor, smoothing=smoothing, **kw)


def synthetic_rewards(counts: list[int], G: int, solved: int) -> torch.Tensor:
    """Task `solved`: every reward 1 (no spread); the others: 1, 0, 0, ... in every group."""
    blocks = []
    for k, c in enumerate(counts):
        group = torch.ones(G) if k == solved else torch.tensor([1.0] + [0.0] * (G - 1))
        blocks.append(group.repeat(c))
    return torch.cat(blocks)  # (N,)


def test_a_task_without_reward_spread_falls_to_the_floor_and_no_lower():
    mix, B, G = mixture(floor=0.1, smoothing=0.8), 16, 4
    history = []
    for _ in range(250):
        rows = mix.next(B)
        assert [r["kind"] for r in rows] == [f"t{k}" for k, c in enumerate(mix.counts) for _ in range(c)]
        rewards = synthetic_rewards(mix.counts, G, solved=0)
        metrics = mix.observe(rewards, torch.ones_like(rewards, dtype=torch.bool), G)
        history.append(mix.weights[0])
        if mix.counts[0]:
            assert metrics["task/t0/zero_std_frac"] == 1.0 and metrics["task/t0/reward"] == 1.0
        assert metrics["task/t1/zero_std_frac"] == 0.0 and metrics["task/t1/reward"] == 0.25
    assert all(b <= a for a, b in zip(history, history[1:])), "the solved task's weight only falls"
    assert min(history) >= 0.1  # exactly: floor + a non-negative share
    assert history[-1] == 0.1  # L_0 = 0.8^n underflows the share: the weight is the floor itself
    assert mix.weights[1:] == pytest.approx([0.45, 0.45])  # the rest is shared by the tasks with spread
    counts = []
    for _ in range(50):
        mix.next(B)
        counts.append(mix.counts[0])
    assert set(counts) <= {1, 2} and sum(counts) / 50 == pytest.approx(1.6, abs=0.05)  # B * floor = 1.6


def test_static_weights_do_not_move():
    mix = mixture(weighting="static", prior=(1, 1, 2))
    for _ in range(5):
        mix.next(8)
        assert mix.counts == [2, 2, 4]
        r = synthetic_rewards(mix.counts, 4, solved=0)
        metrics = mix.observe(r, torch.ones_like(r, dtype=torch.bool), 4)
        assert mix.weights == [0.25, 0.25, 0.5] and metrics["task/t2/weight"] == 0.5
        assert "task/t0/learnability" not in metrics


def test_each_task_is_scored_with_its_own_rewards_and_columns():
    def kind_reward(prompts, completions, kind, **_):  # sees only its own task's column values
        assert set(kind) == {"t1"}
        return [0.5] * len(completions)

    def tagged(prompts, completions, answer, **_):
        return [float(c == a) for c, a in zip(completions, answer)]

    specs = [TaskSpec("t0", None, "a", None, [tagged], None, 1.0),
             TaskSpec("t1", None, "b", None, [kind_reward, tagged], [2.0, 1.0], 1.0)]
    mix = TaskMixture(specs, [rows_of("t0", 5), rows_of("t1", 5)], [[], []], weighting="static")
    G = 2
    rows = mix.next(4)
    assert mix.counts == [2, 2]
    completions = [r["answer"] if j == 0 else "x" for r in rows for j in range(G)]
    prompts = [r["prompt"] for r in rows for _ in range(G)]
    rewards, per_fn = mix.score(rows, prompts, completions, G)
    # t0: tagged only (1 for the right answer); t1: 2 * 0.5 + tagged
    assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0, 2.0, 1.0, 2.0, 1.0]
    assert list(per_fn) == ["tagged", "kind_reward"]
    assert torch.isnan(per_fn["kind_reward"][:4]).all() and per_fn["kind_reward"][4:].tolist() == [0.5] * 4
    # A rank's share (rows 1..2 of the batch: one of each task) scores like that slice of the whole.
    part, part_fn = mix.score(rows[1:3], prompts[2:6], completions[2:6], G, offset=1)
    assert torch.equal(part, rewards[2:6]) and set(part_fn) == {"tagged", "kind_reward"}
    with pytest.raises(ValueError, match="do not match the latest batch"):
        mix.score(rows, prompts[:4], completions[:4], G)


def test_state_dict_continues_exactly():
    def run(mix, steps):
        out = []
        for _ in range(steps):
            rows = mix.next(6)
            r = synthetic_rewards(mix.counts, 2, solved=1)
            mix.observe(r, torch.ones_like(r, dtype=torch.bool), 2)
            out.append(([x["prompt"] for x in rows], list(mix.weights)))
        return out

    a = mixture(floor=0.05, smoothing=0.5, progress_coef=1.0)
    run(a, 5)
    state = json.loads(json.dumps(a.state_dict()))  # checkpoints store it as JSON
    b = mixture(floor=0.05, smoothing=0.5, progress_coef=1.0)
    b.load_state_dict(state)
    assert b.weights == a.weights
    assert run(b, 4) == run(a, 4)


# ------------------------------------------------------------------------------- config
@pytest.mark.parametrize("overrides, message", [
    ({"tasks": []}, r"tasks must be a non-empty list"),
    ({"tasks": [{"task": "add3", "wieght": 2}]}, r"tasks\[0\] has unknown key 'wieght'"),
    ({"tasks": [{"task": "add3", "dataset": "d.jsonl"}]}, r"tasks\[0\] needs exactly one of `task`"),
    ({"tasks": [{"task": "add9"}]}, r"tasks\[0\].task='add9' is not a built-in task"),
    ({"tasks": [{"task": "add3"}, {"task": "add3"}]}, r"tasks\[1\].name='add3' is taken"),
    ({"tasks": [{"task": "add3", "name": "a/b"}]}, r"tasks\[0\].name='a/b' must be"),
    ({"tasks": [{"task": "add3", "weight": 0}]}, r"tasks\[0\].weight=0 must be a finite number > 0"),
    ({"tasks": [{"task": "add3", "reward_weights": [1, 2]}]},
     r"tasks\[0\].reward_weights=\[1, 2\] must be a list of 1"),
    ({"tasks": [{"task": "add3", "eval_dataset": "e.jsonl"}]}, r"tasks\[0\].eval_dataset needs `dataset`"),
    ({"tasks": [{"task": "add3"}], "dataset": "d.jsonl"}, r"dataset is set but `tasks` lists the data"),
    ({"tasks": [{"task": "add2"}, {"task": "add3"}, {"task": "add4"}], "task_weighting": "dynamic",
      "task_weight_floor": 0.5}, r"task_weight_floor=0.5 is more than 1/3"),
    ({"task_weighting": "greedy"}, r"task_weighting='greedy' is not one of static, dynamic"),
    ({"task_weight_smoothing": 1.0}, r"task_weight_smoothing=1.0 must be in \[0, 1\)"),
    ({"task_weight_floor": -0.1}, r"task_weight_floor=-0.1 must be >= 0"),
    ({"sft_coef": -1}, r"sft_coef=-1.0 must be >= 0"),
    ({"sft_schedule": "step"}, r"sft_schedule='step' is not one of constant, linear, cosine"),
])
def test_config_errors_name_the_key(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_cfg(tmp_path, **overrides)


def test_tasks_from_a_command_line_override():
    cfg = load_config(TrainConfig, overrides=["tasks=[{task: add2}, {task: mul3, name: hard, weight: 3}]",
                                              "task_weighting=dynamic", "task=null"])
    assert cfg.tasks == [{"task": "add2"}, {"task": "mul3", "name": "hard", "weight": 3}] and cfg.task is None


# ------------------------------------------------------------------------------- the training loop
def test_multitask_run_logs_per_task_metrics_follows_the_rule_and_resumes_exactly(tmp_path):
    kw = dict(tasks=[{"task": "add2"}, {"task": "add3", "reward_funcs": ["answer_match", starts_with_digit]},
                     {"name": "hard", "task": "mul3", "weight": 2}],
              task_weighting="dynamic", task_weight_floor=0.1, task_weight_smoothing=0.5, sft_coef=0.5,
              per_device_batch_size=4, num_generations=4, num_minibatches=2, max_completion_length=8,
              eval_steps=2, save_steps=2, log_samples_steps=0, eval_num_prompts=3, eval_k=1)
    train(tiny_cfg(tmp_path, output_dir=str(tmp_path / "full"), max_steps=4, **kw))
    lines = read_metrics(tmp_path / "full")
    names = ["add2", "add3", "hard"]
    for r in (lines[0], lines[2], lines[4]):  # evaluations: per task, and their unweighted mean
        assert r["eval/accuracy"] == pytest.approx(sum(r[f"task/{n}/eval_accuracy"] for n in names) / 3)
    signals, prior = [TaskSignal()] * 3, [1, 1, 2]
    for r in lines[1:]:
        assert sum(r[f"task/{n}/groups"] for n in names) == 4
        assert r["loss/sft"] > 0 and r["sft/coef"] == 0.5 and math.isfinite(r["loss/policy"])
        # the weights this batch was drawn with are the rule applied to the statistics logged before it
        assert [r[f"task/{n}/weight"] for n in names] == pytest.approx(dynamic_weights(prior, signals, floor=0.1))
        signals = [update_signal(s, 1 - r[f"task/{n}/zero_std_frac"], r[f"task/{n}/reward"], 0.5)
                   if r[f"task/{n}/groups"] else s for s, n in zip(signals, names)]
        assert [r[f"task/{n}/learnability"] for n in names] == pytest.approx([s.learnability for s in signals])
    assert "reward/starts_with_digit" in lines[1] and "reward/answer_match" in lines[1]

    # Stop at step 2, resume to 4: the same metrics (but timings) and bitwise the same weights.
    train(tiny_cfg(tmp_path, output_dir=str(tmp_path / "part"), max_steps=2, **kw))
    train(tiny_cfg(tmp_path, output_dir=str(tmp_path / "part"), max_steps=4, resume_from_checkpoint="latest", **kw))
    assert comparable(tmp_path / "part") == comparable(tmp_path / "full")
    assert changed(final_weights(tmp_path / "full"), final_weights(tmp_path / "part")) == []


def test_sft_term_is_the_only_update_when_advantages_vanish(tmp_path):
    # A random model never writes a correct "#### answer": answer_match is 0 everywhere, every
    # advantage is 0, and the policy loss has zero gradient. Without the SFT term nothing moves
    # (Adam's step is exactly 0); with it the reference NLL falls.
    common = dict(task="add3", reward_funcs=["answer_match"], per_device_batch_size=4, num_generations=2,
                  num_minibatches=2, max_completion_length=6, eval_num_prompts=1, eval_k=1, log_samples_steps=0,
                  learning_rate=3e-3)
    off = tiny_cfg(tmp_path, output_dir=str(tmp_path / "off"), max_steps=2, **common)
    train(off)
    assert changed(initial_weights(off), final_weights(tmp_path / "off")) == []
    assert "loss/sft" not in read_metrics(tmp_path / "off")[1]

    train(tiny_cfg(tmp_path, output_dir=str(tmp_path / "on"), max_steps=6, sft_coef=1.0, **common))
    lines = read_metrics(tmp_path / "on")[1:]
    assert all(r["reward/mean"] == 0.0 for r in lines)
    nll = [r["loss/sft"] for r in lines]
    assert nll[0] > 3.5, nll  # about ln(81) = 4.39 for a random 81-token model
    assert nll[-1] < nll[0] - 0.5, nll
