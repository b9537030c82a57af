"""Multi-task RL: several tasks in one run, sampled by weight, and an optional supervised term.

Each rollout batch draws its B prompts from the tasks by weight; a prompt's G completions (its
group) stay in that prompt's task, so a group's advantages never mix tasks. Each task brings its
own data, reward functions and held-out set, and is logged under `task/<name>/...`.

Task weights (`task_weighting`):
- `static`: w_k = pi_k, the entries' `weight` normalised to sum to 1.
- `dynamic`: weight follows each task's learning signal, with a floor and smoothing
  (`dynamic_weights` states the rule). Groups whose rewards all agree have zero advantage and
  teach nothing (DAPO's dynamic sampling drops them: Yu et al. 2025, arXiv 2503.14476), so a
  task's share of groups with non-zero reward spread measures how much it can teach now; for a
  0/1 reward at success rate p that share is 1 - p^G - (1-p)^G, small both when a task is
  solved and when it is hopeless: a group-level form of the learnability p(1-p) of Foster et al.
  2025 (arXiv 2502.12272). An optional progress term rewards a task whose mean reward is
  moving, the signal of teacher-student curricula (Matiisen et al. 2017, arXiv 1707.00183,
  "Online" teacher: EMA of the change in score) and of Graves et al. 2017 (arXiv 1704.03003).

The optional supervised term on reference answers (`sft_coef`, in single- and multi-task runs)
lives in gspo/plugs/supervised.py, next to the `gspo sft` encoding it shares.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import torch

from gspo.algo.advantages import group_stats
from gspo.config import WEIGHTINGS, DataSettings, RewardSettings, TaskSettings, TaskSpec, parse_tasks
from gspo.data.evaluation import Evaluation, evaluate
from gspo.data.reward_scoring import reward_names
from gspo.data.rewards import get_reward_fn, reward_options, reward_spec, score_completions, with_terms
from gspo.data.rows import (
    PromptSampler,
    SplitLoader,
    chat_prompts,
    columns_of,
    episode_columns,
    state_count,
    zero_agent_errors,
)


# ------------------------------------------------------------------------------- config (read: gspo.config.parse_tasks)
def saved_tasks(tasks: list | None) -> list | None:
    """The `tasks` entries as JSON: reward functions given as Python callables become "module:name"."""
    if tasks is None:
        return None
    return [{**t, "reward_funcs": [reward_spec(f) for f in t["reward_funcs"]]}
            if isinstance(t.get("reward_funcs"), list) else t for t in tasks]


# ------------------------------------------------------------------------------- the weight rule (pure)
@dataclass(frozen=True)
class TaskSignal:
    """What the dynamic rule knows of one task, updated each time the task has groups in a batch."""

    learnability: float = 1.0  # EMA of the share of its groups with non-zero reward std; starts optimistic
    progress: float = 0.0  # EMA of the change in its mean reward between observations (signed)
    last_reward: float | None = None  # its mean reward when last observed


def update_signal(signal: TaskSignal, nonzero_frac: float, mean_reward: float | None,
                  smoothing: float) -> TaskSignal:
    """One observation of a task: `nonzero_frac` of its groups had reward spread, mean reward `mean_reward`.

    With b = smoothing:  L <- b L + (1-b) nonzero_frac;  Q <- b Q + (1-b) (mean_reward - last_reward)
    (Q is left alone at the first observation, or when every reward was dropped: mean_reward None).
    """
    b = smoothing
    learnability = b * signal.learnability + (1 - b) * nonzero_frac
    progress, last = signal.progress, signal.last_reward
    if mean_reward is not None:
        if last is not None:
            progress = b * progress + (1 - b) * (mean_reward - last)
        last = mean_reward
    return TaskSignal(learnability, progress, last)


def static_weights(prior: list[float]) -> list[float]:
    """w_k = pi_k / sum(pi): the given weights, normalised."""
    total = sum(prior)
    return [p / total for p in prior]


def dynamic_weights(prior: list[float], signals: list[TaskSignal], *, floor: float,
                    progress_coef: float = 0.0) -> list[float]:
    """The dynamic rule: w_k = floor + (1 - K floor) * pi_k s_k / sum_j pi_j s_j.

    s_k = L_k + progress_coef * |Q_k| (see `update_signal`): the EMA of task k's share of groups
    with non-zero reward std (learnability) plus, optionally, the magnitude of its EMA'd change
    in mean reward (progress). pi is the normalised prior (`weight`s). Smoothing lives in the EMAs,
    so weights move gradually. Every task keeps at least `floor` exactly: the second term is never
    negative. If every s_k is 0 the weights fall back to floor + (1 - K floor) * pi_k.
    Example: pi uniform, K = 3, floor 0.1, L = (0.5, 0.75, 1), Q = 0:
    w = 0.1 + 0.7 * (0.5, 0.75, 1) / 2.25 = (0.2556, 0.3333, 0.4111).
    """
    K = len(prior)
    if not 0 <= floor * K <= 1:
        raise ValueError(f"floor={floor!r} must be in [0, 1/{K}] for {K} tasks")
    pi = static_weights(prior)
    score = [p * (s.learnability + progress_coef * abs(s.progress)) for p, s in zip(pi, signals)]
    total = sum(score)
    share = [x / total for x in score] if total > 0 else pi
    return [floor + (1 - K * floor) * x for x in share]


def allocate(weights: list[float], n: int, u: float) -> list[int]:
    """How many of `n` prompts each task gets: systematic sampling with one uniform `u` in [0, 1).

    The points (u + i) / n, i < n, fall into the tasks' cumulative weight intervals; task k gets
    floor(n w_k) or ceil(n w_k) prompts and n w_k on average (systematic resampling, as compared
    in Douc, Cappe & Moulines 2005), far less noisy than n independent draws.
    Example: weights (0.25, 0.75), n = 4: (1, 3) for every u.
    """
    edges, acc = [], 0.0
    for w in weights:
        acc += w
        edges.append(acc * n)
    edges[-1] = float(n)  # rounding must not leave the last point outside every interval
    counts, k = [0] * len(weights), 0
    for i in range(n):
        while u + i >= edges[k]:
            k += 1
        counts[k] += 1
    return counts


# ------------------------------------------------------------------------------- the mixture
class TaskMixture:
    """Prompts drawn from several tasks by weight; per-task rewards, statistics and evaluation.

    Stands in for `gspo.data.PromptSampler` in the trainer (`next`, `state_dict`,
    `load_state_dict`). `next(B)` returns the batch's rows task by task (task 0's first), so
    task k's prompts, and their groups of G completions, are one contiguous block.
    """

    def __init__(self, specs: list[TaskSpec], train_rows: list[list[dict]], eval_rows: list[list[dict]], *,
                 weighting: str = "static", floor: float = 0.0, smoothing: float = 0.8,
                 progress_coef: float = 0.0, seed: int = 0, reward_kwargs: dict | None = None,
                 fingerprints: dict | None = None, evaluation: Evaluation | None = None):
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting={weighting!r} is not one of {', '.join(WEIGHTINGS)}")
        if not 0 <= smoothing < 1:
            raise ValueError(f"smoothing={smoothing!r} must be in [0, 1)")
        if not len(specs) == len(train_rows) == len(eval_rows):
            raise ValueError(f"{len(specs)} tasks but {len(train_rows)} training and {len(eval_rows)} held-out "
                             "row lists")
        self.specs, self.eval_rows = specs, eval_rows
        self.samplers = [PromptSampler(rows, seed) for rows in train_rows]
        self.reward_fns = [[get_reward_fn(f, **(reward_kwargs or {})) for f in s.reward_funcs] for s in specs]
        self.evaluation = evaluation  # how `evaluate` samples and scores (None: a mixture that is never evaluated)
        self.weighting, self.floor, self.smoothing, self.progress_coef, self.seed = (
            weighting, floor, smoothing, progress_coef, seed)
        self.prior = [s.weight for s in specs]
        self.signals = [TaskSignal() for _ in specs]
        self.draws = 0  # batches drawn so far: with the seed, it fixes the next batch's allocation
        self.counts: list[int] | None = None  # prompts per task in the latest batch
        self.fingerprints = fingerprints or {}  # {data file: data_fingerprint} of every task's, for checkpoints
        self.weights = self._weights()

    @classmethod
    def build(cls, tasks: TaskSettings, data: DataSettings, rewards: RewardSettings, load: SplitLoader, *, seed: int,
              evaluation: Evaluation | None = None, shaping: list = ()) -> TaskMixture:
        """The mixture of `tasks.tasks`: each task's data (its entry's task or dataset in place of `data`'s) loaded
        by `load` as a single-task run's would be; `rewards`: the run's reward functions and options; `shaping`:
        (function, weight) terms added to every task's (gspo.data.rewards.overlong_terms)."""
        specs = [with_terms(s, list(shaping)) for s in parse_tasks(tasks.tasks, rewards.reward_funcs,
                                                                  rewards.reward_weights)]
        splits = [load(dataclasses.replace(data, task=s.task, dataset=s.dataset, eval_dataset=s.eval_dataset))
                  for s in specs]
        return cls(specs, [train for train, _ in splits], [held for _, held in splits], weighting=tasks.task_weighting,
                   floor=tasks.task_weight_floor, smoothing=tasks.task_weight_smoothing,
                   progress_coef=tasks.task_progress_coef, seed=seed, reward_kwargs=reward_options(rewards),
                   fingerprints=load.fingerprints, evaluation=evaluation)

    @property
    def train_rows(self) -> list[list[dict]]:
        return [s.rows for s in self.samplers]

    def _weights(self) -> list[float]:
        if self.weighting == "static":
            return static_weights(self.prior)
        return dynamic_weights(self.prior, self.signals, floor=self.floor, progress_coef=self.progress_coef)

    def next(self, n: int) -> list[dict]:
        """`n` prompt rows, task by task; `self.counts` says how many came from each task."""
        u = random.Random(f"gspo-mixture:{self.seed}:{self.draws}").random()  # own RNG: global streams untouched
        self.draws += 1
        self.counts = allocate(self.weights, n, u)
        return [row for sampler, c in zip(self.samplers, self.counts) for row in sampler.next(c)]

    def _blocks(self, group_size: int, first: int = 0, count: int | None = None):
        """(task, rows slice, samples slice) per task block within rows [first, first + count) of the batch.

        Slices are relative to `first`; count defaults to the rest of the batch.
        """
        if self.counts is None:
            raise ValueError("TaskMixture: no batch drawn yet (call next first)")
        count = sum(self.counts) - first if count is None else count
        start = 0
        for k, c in enumerate(self.counts):
            lo, hi = max(start, first) - first, min(start + c, first + count) - first
            if hi > lo:
                yield k, slice(lo, hi), slice(lo * group_size, hi * group_size)
            start += c

    def score(self, rows: list[dict], prompts: list[str], completions: list[str], group_size: int, *,
              drop_bad: bool = False, offset: int = 0, timeout_s: float | None = None,
              completion_ids: list[list[int]] | None = None,
              episodes: list[dict] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`score_completions` task by task with each task's reward functions: rewards (N,), raw values (N,);
        multi-turn `episodes` add their columns (episode_columns).

        `rows` are rows offset.. of the latest batch (under torchrun a rank scores its share).
        A reward function a task does not use reads NaN on that task's samples.
        """
        N = len(completions)
        if N != len(rows) * group_size or self.counts is None or offset + len(rows) > sum(self.counts):
            raise ValueError(f"score: {len(rows)} rows from row {offset} and {N} completions do not match the "
                             f"latest batch ({self.counts} prompts per task, group size {group_size})")
        rewards = torch.empty(N)  # (N,)
        # every task's functions, always: the same keys on every step (and every rank)
        per_fn = {name: torch.full((N,), math.nan) for fns in self.reward_fns for name in reward_names(fns)}
        extra = episode_columns(episodes)
        for k, row_span, span in self._blocks(group_size, offset, len(rows)):
            spec = self.specs[k]
            columns = {**columns_of(rows[row_span], group_size), **{c: v[span] for c, v in extra.items()}}
            r, raw = score_completions(self.reward_fns[k], spec.reward_weights, prompts[span], completions[span],
                                       columns, drop_bad=drop_bad,
                                       timeout_s=timeout_s, chat=chat_prompts(rows[row_span], group_size),
                                       completion_ids=None if completion_ids is None else completion_ids[span])
            rewards[span] = r
            for name, values in raw.items():
                per_fn[name][span] = values
        return zero_agent_errors(rewards, episodes), per_fn

    def observe(self, rewards: torch.Tensor, valid: torch.Tensor, group_size: int) -> dict[str, float]:
        """Per-task metrics of the latest batch; under `dynamic` weighting, update the weights from them.

        rewards, valid: (N,) as in the trainer (valid False: a dropped sample). `task/<name>/weight`
        is the weight this batch was drawn with; a task without prompts this batch logs only that
        and `groups` (0).
        """
        metrics = {}
        for k, spec in enumerate(self.specs):
            metrics[f"task/{spec.name}/weight"] = self.weights[k]
            metrics[f"task/{spec.name}/groups"] = self.counts[k]
        for k, _, span in self._blocks(group_size):
            r, ok = rewards[span], valid[span]  # (n_k * G,)
            zero_std = group_stats(r, group_size, ok)["groups/zero_std_frac"]
            mean = r[ok].mean().item() if ok.any() else None
            metrics[f"task/{self.specs[k].name}/reward"] = math.nan if mean is None else mean
            metrics[f"task/{self.specs[k].name}/zero_std_frac"] = zero_std
            if self.weighting == "dynamic":
                self.signals[k] = update_signal(self.signals[k], 1.0 - zero_std, mean, self.smoothing)
        if self.weighting == "dynamic":
            for k, spec in enumerate(self.specs):
                metrics[f"task/{spec.name}/learnability"] = self.signals[k].learnability
            self.weights = self._weights()
        return metrics

    def evaluate(self, model, tokenizer) -> dict[str, float]:
        """`gspo.data.evaluation.evaluate` on each task's held-out rows with its reward functions and weights.

        Per task `task/<name>/eval_accuracy` (and eval_mean_at_k, ...); `eval/<metric>` is the
        unweighted mean over the tasks that report it, whatever the sampling weights.
        """
        out, by_metric = {}, {}
        for spec, fns, rows in zip(self.specs, self.reward_fns, self.eval_rows):
            for key, value in evaluate(model, tokenizer, rows, self.evaluation, reward_fns=fns,
                                       reward_weights=spec.reward_weights).items():
                out[f"task/{spec.name}/{key.replace('/', '_')}"] = value  # eval/accuracy -> eval_accuracy
                by_metric.setdefault(key, []).append(value)
        out.update({key: sum(values) / len(values) for key, values in by_metric.items()})
        return out

    def state_dict(self) -> dict:
        return {"draws": self.draws, "samplers": [s.state_dict() for s in self.samplers],
                "signals": [dataclasses.asdict(s) for s in self.signals]}

    def load_state_dict(self, state: dict, past_end: bool = False) -> None:
        if len(state["samplers"]) != len(self.samplers):
            raise ValueError(f"TaskMixture: the state has {len(state['samplers'])} tasks, this mixture "
                             f"{len(self.samplers)}")
        self.draws = state_count(state, "draws", "mixture")
        for sampler, s in zip(self.samplers, state["samplers"]):
            sampler.load_state_dict(s, past_end)
        self.signals = [TaskSignal(**s) for s in state["signals"]]
        self.weights = self._weights()
