"""The prompt-source plug: where a step's prompts come from, how they are scored and evaluated.

`SingleTask` (one task or dataset, its reward functions) and `gspo.data.mixture.TaskMixture`
(several tasks drawn by weight) answer the same calls: `next(n)` rows, `score(...)` rewards,
`observe(...)` per-task metrics (and dynamic weights), `evaluate(...)`, and a `state_dict` that
is part of a checkpoint, as are its `fingerprints` ({data file: rows and hash}, checked at resume).
`preflight` checks a run's data and rewards before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from gspo.config import (
    DataSettings,
    EpisodeSettings,
    EvalSettings,
    RewardSettings,
    SamplingSettings,
    TaskSettings,
    TaskSpec,
    parse_tasks,
)
from gspo.data.evaluation import Evaluation, evaluate
from gspo.data.mixture import TaskMixture
from gspo.data.rewards import get_reward_fn, overlong_terms, reward_options, score_completions, with_terms
from gspo.data.rows import (
    EPISODE_COLUMNS,
    MESSAGES,
    PromptSampler,
    SplitLoader,
    chat_prompts,
    columns_of,
    episode_columns,
    load_rows,
    stderr_line,
    zero_agent_errors,
)
from gspo.given import is_marker
from gspo.tasks import get_task

CALL_ARGUMENTS = ("prompts", "completions", "completion_ids")
"""What every reward call gives besides the data's columns (completion_ids: to a function that takes it)."""


def preflight(data: DataSettings, rewards: RewardSettings, tasks: TaskSettings, episodes: EpisodeSettings, *,
              evaluating: bool = True, given: dict | None = None, note=stderr_line) -> None:
    """Check a run's data and rewards before any model is loaded or any sampling happens: every data file exists
    and has its prompt column (`load_rows`), no column clashes with the reward call's own arguments, and every
    named argument a reward function requires (one without a default) is a column of the data it scores (of the
    held-out file too, when `evaluating`). Reads the data and the reward functions' signatures only: no tokenizer,
    no reward model (rm:<path>). `given`: in-memory data (gspo.Trainer, see `load_rows`); an object a saved config
    names but cannot rebuild (gspo/given.py) is refused where it is built, not here. `note`: where it says, in one
    line, that a dataset is scored by answer_match because that is the default reward_funcs."""
    if tasks.tasks:
        specs = parse_tasks(tasks.tasks, rewards.reward_funcs, rewards.reward_weights)
    else:
        specs = [TaskSpec("", data.task, data.dataset, data.eval_dataset, rewards.reward_funcs, None, 1.0)]
    extra = set(EPISODE_COLUMNS) if episodes.environment is not None else set()  # an episode's own
    for spec in specs:
        fns = [get_reward_fn(f, **reward_options(rewards)) for f in spec.reward_funcs  # a reward model: text only
               if not (isinstance(f, str) and (f.startswith("rm:") or is_marker(f)))]
        if spec.dataset is None:
            rows = get_task(spec.task).dataset("train", 1, 0)
            check_reward_columns(fns, rows, f"task {spec.task}", extra)
            continue
        if list(spec.reward_funcs) == ["answer_match"]:
            note(f"rewards: {spec.dataset} is scored by answer_match, the default reward_funcs (1 where the text "
                 "after the last '####' equals the answer column); set reward_funcs to score it otherwise")
        files = [spec.dataset, *([spec.eval_dataset] if spec.eval_dataset is not None else [])]
        for i, path in enumerate(files):
            if is_marker(path) and path not in (given or {}):
                continue
            rows = load_rows(path, data.prompt_column, given, config=data.dataset_config,
                             split=data.dataset_test_split if i else data.dataset_train_split)
            if i == 0 or evaluating:
                check_reward_columns(fns, rows, f"dataset: {path}", extra)


def check_reward_columns(reward_fns: list, rows: list[dict], where: str, extra: set = frozenset()) -> None:
    """ValueError naming `where` (a file, a task) where a column of `rows` clashes with the reward call's own
    arguments, or where a reward function requires a named argument that neither the call, the rows' columns nor
    `extra` (an episode's columns) give. Example: "dataset: d.jsonl: reward 'needs_target' needs column 'target';
    columns: prompt, answer"."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    clash = [c for c in CALL_ARGUMENTS if c in columns]
    if clash:
        raise ValueError(f"{where}: column(s) {clash} clash with the reward call's own arguments; rename them")
    passed = set(columns) - {"prompt", MESSAGES} | set(extra)  # what reaches a reward by name (columns_of)
    for fn in reward_fns:
        for name in required_arguments(fn):
            if name not in passed:
                hint = " (the prompts arrive as `prompts`)" if name in ("prompt", MESSAGES) else ""
                raise ValueError(f"{where}: reward {getattr(fn, '__name__', type(fn).__name__)!r} needs column "
                                 f"{name!r}{hint}; columns: {', '.join(map(str, columns))}")


def required_arguments(fn) -> list[str]:
    """The named arguments reward function `fn` requires (no default) that the call does not give it itself: the
    columns its data must have. A function naming `completions` (or no positional parameter) is called with
    keywords; another gets the prompts and completions as its first two positional parameters (scoring's rule,
    gspo.data.reward_scoring). A callable without a readable signature: none."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_keyword = any(p.name == "completions" and p.kind is not p.POSITIONAL_ONLY for p in params) or not positional
    given = set(CALL_ARGUMENTS) if by_keyword else {p.name for p in positional[:2]} | {"completion_ids"}
    return [p.name for p in params if p.default is p.empty and p.name not in given
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def prompt_source(tokenizer, num_train: int, *, data: DataSettings, rewards: RewardSettings, evals: EvalSettings,
                  sampling: SamplingSettings, tasks: TaskSettings, episodes: EpisodeSettings, seed: int,
                  given: dict | None = None, note=stderr_line):
    """`TaskMixture` for `tasks.tasks`, else `SingleTask`, built from these sections and the run's `seed`. Every row
    is checked now, not when first drawn: its prompt and its length against sampling's max_prompt_length
    (`load_splits`), and the columns a reward function reads, where it has a `check_rows(rows)` (code_tests: its
    tests). `num_train`: the rows a built-in task generates. `given`: in-memory data by the names `data` holds
    (gspo.Trainer; see `load_rows`). `note`: where the held-out split is said (`load_splits`)."""
    evaluation = Evaluation.of(evals, rewards, sampling, seed=seed, template_kwargs=data.chat_template_kwargs,
                               episodes=episodes)
    # the tool environment's tools, shown by a template that shows tools (as evaluation renders them)
    data = dataclasses.replace(data, chat_template_kwargs=evaluation.template_kwargs)
    load = SplitLoader(tokenizer, num_train, evals.eval_num_prompts, seed, sampling.max_prompt_length,
                       sampling.truncate_prompts, given, note)
    shaping = overlong_terms(rewards, sampling.max_completion_length)  # added to every task's reward functions
    if tasks.tasks:
        source = TaskMixture.build(tasks, data, rewards, load, seed=seed, evaluation=evaluation, shaping=shaping)
        fns_per_task = source.reward_fns
    else:
        source = SingleTask.build(data, with_terms(rewards, shaping), load, seed=seed, evaluation=evaluation)
        fns_per_task = [source.reward_fns]
    for fns, train, held_out in zip(fns_per_task, source.train_rows, source.eval_rows, strict=True):
        for check in filter(None, (getattr(fn, "check_rows", None) for fn in fns)):
            check(train)
            check(held_out)
    return source


class SingleTask:
    """One task's shuffled training rows, its reward functions and its held-out rows."""

    def __init__(self, train_rows: list[dict], eval_rows: list[dict], reward_fns: list, reward_weights,
                 seed: int, fingerprints: dict | None = None, evaluation: Evaluation | None = None):
        self.sampler = PromptSampler(train_rows, seed)
        self.evaluation = evaluation  # how `evaluate` samples and scores (None: a source that is never evaluated)
        self.held_out = eval_rows
        self.reward_fns, self.reward_weights = reward_fns, reward_weights
        self.fingerprints = fingerprints or {}  # {data file: data_fingerprint}, recorded in checkpoints

    @classmethod
    def build(cls, data: DataSettings, rewards: RewardSettings, load: SplitLoader, *, seed: int,
              evaluation: Evaluation | None = None) -> SingleTask:
        """The task or dataset of `data`, its rows loaded by `load`, scored by the reward functions of `rewards`."""
        train_rows, eval_rows = load(data)
        reward_fns = [get_reward_fn(spec, **reward_options(rewards)) for spec in rewards.reward_funcs]
        return cls(train_rows, eval_rows, reward_fns, rewards.reward_weights, seed, load.fingerprints, evaluation)

    @property
    def train_rows(self) -> list[list[dict]]:
        return [self.sampler.rows]

    @property
    def eval_rows(self) -> list[list[dict]]:
        return [self.held_out]

    def next(self, n: int) -> list[dict]:
        return self.sampler.next(n)

    def score(self, rows: list[dict], prompts: list[str], completions: list[str], group_size: int, *,
              drop_bad: bool = False, offset: int = 0, timeout_s: float | None = None,
              completion_ids: list[list[int]] | None = None,
              episodes: list[dict] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Rewards (N,) and each function's raw values (N,) of `rows`' completions (G per row, in order);
        multi-turn `episodes` (Rollout.episodes) add their columns (episode_columns)."""
        rewards, per_fn = score_completions(self.reward_fns, self.reward_weights, prompts, completions,
                                            {**columns_of(rows, group_size), **episode_columns(episodes)},
                                            drop_bad=drop_bad, timeout_s=timeout_s, chat=chat_prompts(rows, group_size),
                                            completion_ids=completion_ids)
        return zero_agent_errors(rewards, episodes), per_fn

    def observe(self, rewards: torch.Tensor, valid: torch.Tensor, group_size: int) -> dict[str, float]:
        return {}  # one task: nothing per task to report or reweigh

    def evaluate(self, model, tokenizer) -> dict[str, float]:
        return evaluate(model, tokenizer, self.held_out, self.evaluation, reward_fns=self.reward_fns,
                        reward_weights=self.reward_weights)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict, past_end: bool = False) -> None:
        self.sampler.load_state_dict(state, past_end)
