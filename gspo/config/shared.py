"""The settings every command that loads a model shares (gspo train, sft, eval), in sections.

A section is a plain dataclass of fields; each field's one-line doc is the string under it (`gspo train
--help` prints them; docs/configuration.md explains them at length). The checks of a section sit beside it
(`@checks`): they see that section's fields only. TrainConfig and SFTConfig are built from sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gspo.config.machinery import check_choice, check_positive, checks

MODEL_DTYPES = ("float32", "bfloat16", "float16", "auto")
"""The dtypes a model may be loaded in (`dtype`, `reward_model_dtype`); gspo.models.DTYPES maps each to torch's
("auto": the checkpoint's own)."""


@dataclass
class ModelSettings:
    """The model: what is loaded, in which dtype, on which device."""

    model: str = "tiny-dense"
    """Preset (tiny-dense, tiny-moe: random init), packaged model (smollm2: make demo-real), or a local path / hub
    name of a causal LM."""
    model_overrides: dict | None = None
    """Config fields patched into a preset before it is built, e.g. {num_hidden_layers: 2}."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16, float16 or auto."""
    device: str = "auto"
    """Device: auto (cuda if available, else cpu), cpu, cuda or cuda:<i>."""
    trust_remote_code: bool = False
    """Run model code shipped with a checkpoint; only for a source you trust."""
    attn_implementation: str | None = None
    """Attention kernel: null (transformers' default), eager, sdpa, flash_attention_2 (CUDA) or another it knows."""
    seed: int = 0
    """Seed for model init (presets), data order and sampling."""


@checks(ModelSettings)
def _check_model(s: ModelSettings) -> None:
    check_choice(s, "dtype", MODEL_DTYPES)
    check_device(s, "device")


def check_device(s, name: str) -> None:
    """ValueError unless `s.<name>` is auto, cpu, cuda, cuda:<i> or mps."""
    device = getattr(s, name)
    if not (device in ("auto", "cpu", "cuda", "mps") or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ValueError(f"config: {name}={device!r} is not one of auto, cpu, cuda, cuda:<i>, mps")


@dataclass
class OutputSettings:
    """Where the run writes."""

    output_dir: str = "runs/gspo"
    """Where metrics, samples, plots and the final model are written."""
    overwrite_output_dir: bool = False
    """Start afresh in an output_dir that holds a run (deleting its metrics, checkpoints); false: error. A folder
    of other files (no gspo run) takes a run beside them only with it set, never where gspo would write over one."""


@dataclass
class DataSettings:
    """The prompts: a built-in task or local data, and the held-out split."""

    task: str | None = "add3"
    """Built-in task (gspo.tasks.TASKS) giving train and held-out prompts; null: use `dataset`."""
    dataset: str | None = None
    """Local data: a .jsonl/.json/.csv/.parquet file, a save_to_disk folder, or the name of a dataset that the
    `datasets` library holds in its local cache (e.g. openai/gsm8k; never downloaded); a `prompt` column."""
    eval_dataset: str | None = None
    """Held-out data, same format; default: the task's test split, or eval_holdout of `dataset`."""
    dataset_config: str | None = None
    """Configuration of a cached `datasets` dataset (e.g. main for openai/gsm8k); null: the only one cached."""
    dataset_train_split: str = "train"
    """Split of a cached `datasets` dataset that `dataset` names."""
    dataset_test_split: str = "test"
    """Split of a cached `datasets` dataset that `eval_dataset` names."""
    eval_holdout: float = 0.1
    """Rows of `dataset` held out if no eval_dataset: a fraction < 1 or a row count; 0: none, no eval."""
    prompt_column: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages (chat template)."""
    chat_template_kwargs: dict | None = None
    """Extra chat-template arguments for chat prompts, e.g. {enable_thinking: false} (TRL's name)."""


@checks(DataSettings)
def _check_data(s: DataSettings) -> None:
    check_positive(s, "eval_holdout", allow_zero=True)  # 0: nothing held out
    if s.eval_holdout >= 1 and s.eval_holdout != int(s.eval_holdout):
        raise ValueError(f"config: eval_holdout={s.eval_holdout!r} must be a fraction below 1 or a whole number "
                         "of rows")
    kwargs = s.chat_template_kwargs
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise ValueError(f"config: chat_template_kwargs={kwargs!r} must be a mapping of names to values, "
                         "e.g. {enable_thinking: false}")


@dataclass
class EvalSettings:
    """Evaluation on held-out prompts: greedy accuracy and sampled mean@k / pass@k."""

    eval_num_prompts: int = 200
    """Held-out prompts per evaluation; 0 turns evaluation off."""
    eval_k: int = 4
    """Samples per held-out prompt for the sampled metrics mean@k and pass@k."""
    eval_temperature: float = 1.0
    """Temperature of the sampled evaluation."""
    eval_accuracy_reward: str | None = None
    """Reward deciding held-out success (its name, as in reward/<name>); null: the first; total: the weighted sum."""
    eval_success_threshold: float | None = None
    """Value at which a held-out completion succeeds; null: 1 (total: full marks, the sum of positive weights)."""
    eval_batch_size: int = 16
    """Held-out prompts per generate call of an evaluation (bounds its memory)."""
    eval_steps: int = 0
    """Evaluate every this many steps, and before and after training; 0: only before and after."""


@checks(EvalSettings)
def _check_eval(s: EvalSettings) -> None:
    check_positive(s, "eval_k", "eval_temperature", "eval_batch_size")
    check_positive(s, "eval_num_prompts", "eval_steps", allow_zero=True)  # 0: evaluation off
    if s.eval_accuracy_reward is not None and not (isinstance(s.eval_accuracy_reward, str)
                                                   and s.eval_accuracy_reward.strip()):
        raise ValueError(f"config: eval_accuracy_reward={s.eval_accuracy_reward!r} must be a reward function's name "
                         "(as in reward/<name>), total, or null (the first reward function)")


@dataclass
class RewardSettings:
    """Reward functions and where they run."""

    reward_funcs: list = field(default_factory=lambda: ["answer_match"])
    """Reward functions: answer_match, math, format, code_tests, rm:<path> or module:function."""
    reward_weights: list | None = None
    """One weight per reward function; null: all 1."""
    drop_bad_rewards: bool = False
    """Drop a sample whose reward raises or is NaN/inf (advantage 0) instead of stopping the run."""
    reward_timeout_s: float = 300.0
    """Longest a reward function may take on one batch before it is an error; 0: no limit."""
    sandbox: str = "os"
    """Isolation of code_tests: os (a bubblewrap boundary, required) or weak (rlimits and an audit hook)."""
    reward_model_device: str = "cpu"
    """Where an rm:<path> reward model scores: cpu, auto, cuda, cuda:<i> or mps."""
    reward_model_dtype: str = "float32"
    """Dtype of an rm:<path> reward model: float32, bfloat16, float16 or auto (the checkpoint's)."""
    overlong_penalty: dict | None = None
    """{buffer: L, factor: f}: DAPO's soft overlong penalty added to every reward (weight 1): 0 up to
    max_completion_length - L tokens, falling linearly to -f at the limit; logged as reward/overlong. null: none."""


@checks(RewardSettings)
def _check_rewards(s: RewardSettings) -> None:
    import math

    from gspo.sandbox.runner import SANDBOX_MODES  # light: the probe runs only when code_tests is built

    check_positive(s, "reward_timeout_s", allow_zero=True)
    check_choice(s, "sandbox", SANDBOX_MODES)
    check_choice(s, "reward_model_dtype", MODEL_DTYPES)
    check_device(s, "reward_model_device")
    if not s.reward_funcs:
        raise ValueError("config: reward_funcs is empty; give at least one reward function")
    for i, spec in enumerate(s.reward_funcs):  # names or import paths (callables, from Python)
        if not callable(spec) and not (isinstance(spec, str) and spec.strip()):
            raise ValueError(f"config: reward_funcs[{i}]={spec!r} must be a reward name or 'module:function'")
    if s.reward_weights is not None and len(s.reward_weights) != len(s.reward_funcs):
        raise ValueError(f"config: reward_weights has {len(s.reward_weights)} entries but reward_funcs has "
                         f"{len(s.reward_funcs)}")
    for i, w in enumerate(s.reward_weights or []):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"config: reward_weights[{i}]={w!r} must be a finite number")
    if s.overlong_penalty is not None:
        penalty = s.overlong_penalty
        if not isinstance(penalty, dict) or set(penalty) != {"buffer", "factor"}:
            raise ValueError(f"config: overlong_penalty={penalty!r} must be a mapping of buffer (tokens) and factor, "
                             "e.g. {buffer: 64, factor: 1.0}")
        buffer, factor = penalty["buffer"], penalty["factor"]
        if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
            raise ValueError(f"config: overlong_penalty.buffer={buffer!r} must be a whole number of tokens >= 1")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 0:
            raise ValueError(f"config: overlong_penalty.factor={factor!r} must be a finite number >= 0")


@dataclass
class ProgressSettings:
    """What is shown while the run goes."""

    progress: bool = True
    """Show progress: a bar on a terminal, else a metrics line on stderr; plus phase lines. false: none."""
    logging_steps: int = 1
    """Without a terminal, print the metrics line every this many steps (TRL's name)."""


@checks(ProgressSettings)
def _check_progress(s: ProgressSettings) -> None:
    check_positive(s, "logging_steps")
