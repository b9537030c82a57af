"""The Python API: `Trainer(...).train()`, and `GRPOTrainer` / `GSPOTrainer`, the same with the objective set.

    from gspo import GSPOTrainer
    trainer = GSPOTrainer(model="Qwen/Qwen3-0.6B", reward_funcs=[my_reward], train_dataset=dataset,
                          learning_rate=1e-6, max_steps=100, output_dir="runs/notebook")
    summary = trainer.train()

A Trainer is a validated TrainConfig plus the Python objects that stand in for some of its settings
(a model object, in-memory data; reward functions sit in `reward_funcs` itself). `train()` runs
exactly what `gspo train` runs (`train_and_plot`), with the same outputs in output_dir.
The config records each object by a name (gspo/given.py): resuming (`resume_from_checkpoint=...`)
works from Python with the same objects passed again; a config naming objects nobody passed is
refused in one line, naming them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

from gspo.callbacks import Callbacks
from gspo.config import TrainConfig, make_config, to_dict
from gspo.given import marker

if TYPE_CHECKING:  # annotations only: importing gspo stays free of torch and transformers
    from datasets import Dataset
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ModelLike = Union[str, "os.PathLike[str]", "PreTrainedModel"]
"""A preset name, a local path or hub name, or a causal LM object."""
RewardLike = str | Callable[..., Any]
"""A built-in reward name, "module:function", "rm:<path>", or a function / instance with `__call__`."""
DataLike = Union[str, "os.PathLike[str]", "Dataset", Sequence[Mapping[str, Any]]]
"""A datasets.Dataset, a list of rows (dicts with a `prompt`), or a data file."""
Callback = Callable[[int, dict], Any] | object
"""A function of (step, metrics), or an object with `on_step_end(step, metrics)`; returning "stop" ends the run."""

TRAIN_DATA, EVAL_DATA = marker("train_dataset"), marker("eval_dataset")
"""What `dataset` / `eval_dataset` hold when the data was handed over in memory."""


class Trainer:
    """RL training of a causal LM (GSPO by default; `objective` picks another), as `gspo train` runs it.

    model: a preset name, local path or hub name (the `model` setting), or a causal LM object (trained in place,
        cast to `dtype` unless dtype="auto"). Default: the config's.
    reward_funcs: a reward function or a list of them: functions, instances with `__call__` (TRL's signature:
        `f(prompts, completions, **columns)`), built-in names, "module:function". Default: the config's.
    train_dataset, eval_dataset: a datasets.Dataset or a list of dicts with a `prompt` column (every other column
        reaches the rewards by name), or a data file. Default: the config's task or dataset.
    tokenizer: to use with the model; None: the one loaded with it (a model object's: from its name_or_path).
    config: a TrainConfig to start from; `settings` (TrainConfig fields as keywords) win over it.
    callbacks: objects with `on_step_end(step, metrics)`, or functions of (step, metrics), called after every
        step; returning "stop" ends the run there (gspo/callbacks.py).
    """

    def __init__(self, model: ModelLike | None = None, reward_funcs: RewardLike | Sequence[RewardLike] | None = None,
                 *, train_dataset: DataLike | None = None, eval_dataset: DataLike | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None, config: TrainConfig | None = None,
                 callbacks: Iterable[Callback] = (), **settings: Any) -> None:
        if config is not None and not isinstance(config, TrainConfig):
            raise ValueError(f"config must be a TrainConfig, got {type(config).__name__}")
        values = {**(to_dict(config, keep_secrets=True) if config is not None else {}), **settings}
        self.model, self.tokenizer, self.data, self.callbacks = None, tokenizer, {}, list(callbacks)
        Callbacks(self.callbacks)  # each checked now
        if isinstance(model, (str, os.PathLike)):
            values["model"] = str(model)
        elif model is not None:  # named, not rebuilt, by a saved config
            self.model, values["model"] = model, marker(getattr(model, "name_or_path", "") or type(model).__name__)
        if reward_funcs is not None:
            values["reward_funcs"] = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        for key, name, data in (("dataset", TRAIN_DATA, train_dataset), ("eval_dataset", EVAL_DATA, eval_dataset)):
            if isinstance(data, Mapping):
                raise ValueError(f"{name.removeprefix('object:')} is a mapping (a DatasetDict?); pass one split, "
                                 "e.g. dataset['train']")
            if isinstance(data, (str, os.PathLike)):
                values[key] = str(data)
            elif data is not None:
                self.data[name], values[key] = data, name
        if train_dataset is not None:
            values["task"] = None  # the data replaces a built-in task
        self.config = make_config(TrainConfig, values)  # types, choices, ranges: one line naming the setting
        if self.model is not None and self.tokenizer is None:  # loaded now: a model without one fails here
            from gspo.models import tokenizer_of

            self.tokenizer = tokenizer_of(self.model, self.config.trust_remote_code)

    def train(self) -> dict[str, Any]:
        """Train; returns the summary: {"evals": {step: held-out metrics}, "seconds", "output_dir", "model" (the
        saved model's folder), "plots" (the PNGs written)}."""
        return train_and_plot(self.config, model=self.model, tokenizer=self.tokenizer, data=self.data,
                              callbacks=self.callbacks)


def GRPOTrainer(model: ModelLike | None = None, reward_funcs: RewardLike | Sequence[RewardLike] | None = None,
                **kwargs: Any) -> Trainer:
    """`Trainer` with objective="grpo": token-level ratios clipped at 0.2 (DeepSeekMath's GRPO)."""
    return _preset("grpo", model, reward_funcs, kwargs)


def GSPOTrainer(model: ModelLike | None = None, reward_funcs: RewardLike | Sequence[RewardLike] | None = None,
                **kwargs: Any) -> Trainer:
    """`Trainer` with objective="gspo": one length-normalised ratio per sequence (the GSPO paper)."""
    return _preset("gspo", model, reward_funcs, kwargs)


def _preset(objective: str, model: ModelLike | None, reward_funcs: RewardLike | Sequence[RewardLike] | None,
            kwargs: dict[str, Any]) -> Trainer:
    if "objective" in kwargs:
        raise ValueError(f"{objective.upper()}Trainer sets objective={objective!r}; use Trainer(objective=...) "
                         "for another")
    return Trainer(model, reward_funcs, objective=objective, **kwargs)


def train_and_plot(cfg: TrainConfig, **given: Any) -> dict[str, Any]:
    """`gspo.trainer.train(cfg, **given)`, then plots of its metrics: what `gspo train` and `Trainer.train` run.
    Returns train's summary with "model" (the saved model's folder) and "plots" (the PNGs' paths; none, said in one
    line on stderr, without matplotlib: pip install 'gspo[lab]')."""
    from gspo.report import plot_run_or_skip
    from gspo.trainer import train

    summary = train(cfg, **given)
    return {**summary, "model": f"{cfg.output_dir}/model",
            "plots": [str(p) for p in plot_run_or_skip(cfg.output_dir)]}
