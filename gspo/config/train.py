"""The sections only a GRPO/GSPO training run has, their checks, and TrainConfig itself.

TrainConfig is the sections put together: its fields keep their flat names (YAML keys, `key=value`
overrides, TRL's names, saved configs), while each plug is built from its own section (`section(cfg,
SamplingSettings)`), not the whole config. Checks that read fields of two sections are in `check_train`.
The sampling and episode sections live in gspo/config/sampling.py, the multi-task one in gspo/config/tasks.py
(their names import from here too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gspo.algo.schedules import SCHEDULES
from gspo.config.machinery import (
    check_choice,
    check_positive,
    checks,
    coerce_fields,
    own_names,
    prefixed,
    section,
    takes_other_names,
)
from gspo.config.sampling import (  # noqa: F401  (the secret and address helpers: importable from here too)
    MIN_SECRET_CHARS,
    SECRET_ENV,
    EpisodeSettings,
    SamplerShape,
    SamplingSettings,
    reshaping,
    rollout_secret,
)
from gspo.config.shared import (
    DataSettings,
    EvalSettings,
    ModelSettings,
    OutputSettings,
    ProgressSettings,
    RewardSettings,
)
from gspo.config.tasks import TaskSettings, parse_tasks


@dataclass
class BatchSettings:
    """The shape of a step: steps, prompts, completions per prompt, minibatches, epochs."""

    max_steps: int = 200
    """RL steps; each samples a rollout batch and takes num_minibatches * num_epochs optimizer steps."""
    per_device_batch_size: int = 8
    """Prompts per rollout batch (B)."""
    num_generations: int = 8
    """Completions sampled per prompt (G); advantages are normalised within each group."""
    num_minibatches: int = 4
    """Optimizer steps per rollout batch (GSPO paper: 4); minibatches after the first are off-policy."""
    num_epochs: int = 1
    """Passes over each rollout batch (TRL's num_iterations, PPO epochs)."""
    mask_truncated_completions: bool = False
    """Leave completions the length limit cut (no end-of-sequence token) out of the loss: DAPO's overlong filtering
    (TRL's name). Their minibatches train on the rest; one left empty takes no optimizer step."""
    truncated_in_groups: bool = True
    """With mask_truncated_completions: a truncated completion's reward still counts in its group's mean and std
    (true, TRL's: the other answers' advantages are the same as without the mask), or is left out of them as a
    dropped sample's (false)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards all agree (no advantage under a group baseline) are dropped
    and more prompts sampled until the step holds per_device_batch_size groups that do not, or max_sampling_rounds
    ran (then it is topped up with agreeing groups, and groups/filled_frac says how full it was)."""
    max_sampling_rounds: int = 4
    """dynamic_sampling: the most sampling rounds one step takes, the first included."""
    oversample_factor: float = 2.0
    """dynamic_sampling: an extra round samples this many times the groups still missing (rounded up)."""


@checks(BatchSettings)
def _check_batch(s: BatchSettings) -> None:
    check_positive(s, "max_steps", "per_device_batch_size", "num_generations", "num_minibatches", "num_epochs",
                   "max_sampling_rounds")
    if s.oversample_factor < 1:
        raise ValueError(f"config: oversample_factor={s.oversample_factor!r} must be >= 1 (an extra round samples "
                         "that many times the groups still missing)")
    if s.num_generations < 2:
        raise ValueError("config: num_generations must be >= 2: group advantages need at least two completions")
    n, m = s.per_device_batch_size * s.num_generations, s.num_minibatches
    if n % m:  # each minibatch takes whole completions: change num_minibatches, or the batch to fit it
        fits = max(d for d in range(1, m) if n % d == 0)
        raise ValueError(f"config: per_device_batch_size * num_generations = {n} is not divisible by "
                         f"num_minibatches={m}: set num_minibatches={fits} (or another divisor of {n}), or "
                         f"per_device_batch_size to a multiple of {m // math.gcd(m, s.num_generations)}")


@dataclass
class SFTTermSettings:
    """A supervised term added to the policy loss (gspo/plugs/auxiliary.py)."""

    sft_coef: float = 0.0
    """Weight of an NLL term on the sft_column text added to the policy loss (loss/sft); 0: off."""
    sft_schedule: str = "constant"
    """Schedule of sft_coef over the run: constant, linear (to 0) or cosine (to 0)."""
    sft_column: str = "solution"
    """Column holding the supervised term's reference completion (built-in tasks: the worked solution)."""


@checks(SFTTermSettings)
def _check_sft_term(s: SFTTermSettings) -> None:
    check_choice(s, "sft_schedule", SCHEDULES)
    check_positive(s, "sft_coef", allow_zero=True)


@dataclass
class ObjectiveSettings:
    """The policy loss: objective, clipping, aggregation, KL, which pi_old."""

    objective: str = "gspo"
    """Policy objective: gspo (sequence ratio), grpo (token ratio), gspo_token, cispo, sapo, pg (no clip), gmpo,
    kl_cov, luspo (GSPO's term times the length), vespo (a kernel on the sequence weight) or a registered one."""
    clip_low: float | None = None
    """Lower clip range: ratio >= 1 - clip_low; default per objective (gspo 3e-4, grpo 0.2)."""
    clip_high: float | None = None
    """Upper clip range: ratio <= 1 + clip_high; default per objective (gspo 4e-4, grpo 0.2)."""
    aggregation: str | None = None
    """Loss aggregation: seq_mean_token_mean, token_mean, seq_mean_token_sum_norm or seq_mean_token_sum; default per
    objective."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (initial) model; 0 loads no reference model."""
    kl_estimator: str = "k3"
    """KL estimator: k1, k2 or k3 (DeepSeekMath)."""
    use_sampler_logprobs: bool = False
    """Use the sampler's own log-probs as pi_old instead of recomputing them (GSPO sec. 5.4)."""
    objective_options: dict = field(default_factory=dict)
    """The objective's own options by name, e.g. {sapo_tau_pos: 1.2} (sapo: sapo_tau_pos, sapo_tau_neg; kl_cov:
    kl_cov_ratio, kl_cov_coef; vespo: vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg); unset ones keep
    the objective's defaults. An option of another objective is an error."""


@checks(ObjectiveSettings)
def _check_objective(s: ObjectiveSettings) -> None:
    from gspo.algo.objectives import (
        AGGREGATIONS,
        KL_ESTIMATORS,
        OBJECTIVES,
        check_aggregation,
        check_clip,
        objective_options,
    )

    check_choice(s, "objective", OBJECTIVES)
    check_choice(s, "kl_estimator", KL_ESTIMATORS)
    if s.aggregation is not None:
        check_choice(s, "aggregation", AGGREGATIONS)
        prefixed(check_aggregation, s.objective, s.aggregation)  # GSPO: no weighting by length
    prefixed(check_clip, s.objective, s.clip_low, s.clip_high)
    check_positive(s, "kl_coef", allow_zero=True)
    prefixed(objective_options, s.objective, s.objective_options, "objective_options")  # names, types, values


@dataclass
class AdvantageSettings:
    """Advantages: a group estimator, or PPO's learned critic with GAE."""

    advantage_estimator: str = "group"
    """Advantages: group, batch, none, rloo, reinforce_pp, gae (PPO's critic) or a registered one."""
    critic_model: str | None = None
    """gae: the critic's decoder, with a value head; null: a copy of the policy's, else a path or hub name."""
    critic_learning_rate: float | None = None
    """gae: learning rate of the critic's own AdamW; null: learning_rate."""
    vf_coef: float = 1.0
    """gae: weight of the value loss (acts through max_grad_norm: the critic has its own AdamW)."""
    value_clip: float | None = 0.2
    """gae: PPO's value clip around the rollout-time estimate; null: unclipped."""
    gae_gamma: float = 1.0
    """gae: discount per completion token (1: the terminal reward counts in full at every token)."""
    gae_lambda: float = 0.95
    """gae: GAE's lambda in [0, 1]: 1 the whole return (high variance), 0 the next value (high bias)."""
    kl_in_reward: bool = False
    """gae: fold the KL penalty into the per-token rewards instead of the loss; needs kl_coef > 0."""
    whiten_advantages: bool = True
    """gae: normalise the token advantages to mean 0, std 1 before the policy loss."""


@checks(AdvantageSettings)
def _check_advantages(s: AdvantageSettings) -> None:
    from gspo.algo.advantages import estimator_choices

    check_choice(s, "advantage_estimator", estimator_choices())
    check_positive(s, "critic_learning_rate", "vf_coef", "value_clip")
    for name in ("gae_gamma", "gae_lambda"):
        if not 0 <= getattr(s, name) <= 1:
            raise ValueError(f"config: {name}={getattr(s, name)!r} must be in [0, 1]")
    gae = s.advantage_estimator == "gae"
    if s.kl_in_reward and not gae:
        raise ValueError("config: kl_in_reward folds the KL into GAE's per-token rewards: it needs "
                         "advantage_estimator=gae (with another estimator the KL stays in the loss: kl_coef)")
    if not gae and (s.critic_model is not None or s.critic_learning_rate is not None):
        raise ValueError(f"config: critic_model / critic_learning_rate set, but advantage_estimator="
                         f"{s.advantage_estimator!r} trains no critic; set advantage_estimator=gae")


@dataclass
class OptimizerSettings:
    """AdamW, its schedule, gradient clipping and the non-finite guard."""

    learning_rate: float = 1e-6
    """AdamW peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.99
    """AdamW beta2."""
    adam_state_dtype: str = "float32"
    """AdamW's two moments: float32 (torch's fused AdamW) or bfloat16 (gspo.algo.adamw: half the optimizer's
    memory, float32 arithmetic; its effect on learning is measured in docs/benchmarks.md, section 13)."""
    warmup_steps: int = 0
    """Linear warmup, in optimizer steps."""
    lr_scheduler: str = "constant"
    """Schedule after warmup: constant, linear (to 0) or cosine (to 0)."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables it."""
    max_consecutive_skips: int = 5
    """Non-finite guard: a NaN/inf step is skipped; this many in a row abort the run."""


@checks(OptimizerSettings)
def _check_optimizer(s: OptimizerSettings) -> None:
    check_choice(s, "lr_scheduler", SCHEDULES)
    check_choice(s, "adam_state_dtype", ("float32", "bfloat16"))
    check_positive(s, "learning_rate", "max_consecutive_skips")
    check_positive(s, "weight_decay", "warmup_steps", "max_grad_norm", allow_zero=True)


@dataclass
class LoraSettings:
    """LoRA adapters (PEFT) instead of full fine-tuning."""

    lora_r: int = 0
    """LoRA rank (PEFT): > 0 trains adapters on the frozen base; 0: full fine-tuning."""
    lora_alpha: float = 32.0
    """LoRA scale numerator: the adapter's update is scaled by lora_alpha / lora_r."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input while training; above 0 the ratios carry dropout noise."""
    lora_target_modules: str | list = "all-linear"
    """Layers that get adapters: all-linear (all but the output head) or a list of module names."""
    peft: dict | None = None
    """A full peft.LoraConfig as a mapping, instead of the lora_* fields (not both)."""
    lora_save_merged: bool = False
    """With LoRA, also write the base with the adapters merged into it to output_dir/merged."""


@checks(LoraSettings)
def _check_lora(s: LoraSettings) -> None:
    from gspo.plugs.lora import check_lora

    check_positive(s, "lora_r", allow_zero=True)
    check_positive(s, "lora_alpha")
    if not 0 <= s.lora_dropout < 1:
        raise ValueError(f"config: lora_dropout={s.lora_dropout!r} must be in [0, 1)")
    check_lora(s)


@dataclass
class PrecisionSettings:
    """The training forwards: mixed precision, activation checkpointing, padding-free rows, head chunks."""

    bf16: bool = False
    """bf16 autocast for every policy forward; weights and optimizer state stay float32 (dtype=float32)."""
    fp16: bool = False
    """fp16 autocast for every policy forward, the backward on a dynamically scaled loss; weights and optimizer
    state stay float32 (dtype=float32). Not with a critic (gae), an SFT term or fsdp yet."""
    gradient_checkpointing: bool = False
    """Recompute layer activations in the backward pass: less training memory, ~one more forward."""
    padding_free: bool = True
    """Training forwards pack each minibatch's sequences into rows without padding (same log-probs)."""
    logprob_chunk_size: int | None = None
    """Rows of the output head computed at once for log-probs; null: chunks of 2**26 fp32 logits."""


@checks(PrecisionSettings)
def _check_precision(s: PrecisionSettings) -> None:
    check_positive(s, "logprob_chunk_size")


@dataclass
class CorrectionSettings:
    """A sampler that is not pi_old (mu != pi_old): the mismatch metrics and the rollout correction."""

    rollout_correction: str = "none"
    """Correction by pi_old/mu: none, token_tis, seq_tis (truncate), token_mis, seq_mis, geo_mis (mask)."""
    rollout_correction_low: float | None = None
    """Lower threshold of the *_mis corrections (default 0.5; geo_mis 0.99); unused by *_tis."""
    rollout_correction_high: float | None = None
    """Truncation of *_tis and upper threshold of *_mis (default 2.0; geo_mis 1.01)."""
    log_mismatch: bool = False
    """Log mismatch/* (sampler log-probs mu vs pi_old) even when the sampler is the policy itself."""


@checks(CorrectionSettings)
def _check_correction(s: CorrectionSettings) -> None:
    from gspo.algo.correction import CORRECTIONS, thresholds

    check_choice(s, "rollout_correction", CORRECTIONS)
    prefixed(thresholds, s.rollout_correction, s.rollout_correction_low, s.rollout_correction_high)


@dataclass
class RoutingSettings:
    """Mixture-of-Experts: routing replay and the drift meter (docs/moe.md)."""

    routing_replay: str = "none"
    """MoE routing replay: none, old_policy (record at pi_old) or rollout (record at generation)."""
    log_routing_drift: bool = True
    """MoE only: log moe/expert_change_frac (one extra no-grad forward per optimizer step) and moe/aux_loss, the
    routers' load-balancing loss (measured, added to the loss only with router_aux_loss_coef)."""
    router_aux_loss_coef: float = 0.0
    """MoE only: weight of the routers' load-balancing loss added to every minibatch's loss (Hugging Face's, which
    the model's own router_aux_loss_coef scales in pre-training: Qwen3-MoE 0.001); 0: none."""


@checks(RoutingSettings)
def _check_routing(s: RoutingSettings) -> None:
    from gspo.plugs.moe import REPLAY_MODES

    check_choice(s, "routing_replay", REPLAY_MODES)
    check_positive(s, "router_aux_loss_coef", allow_zero=True)


@dataclass
class CheckpointSettings:
    """Checkpoints and exact resume."""

    save_steps: int = 0
    """Write a checkpoint (model, optimizer, RNG, data position) every this many steps; 0: only at the end."""
    save_total_limit: int = 2
    """Keep the newest this many checkpoints (older ones are deleted)."""
    resume_from_checkpoint: str | None = None
    """Resume exactly from a checkpoint folder, latest or latest_valid (gspo train --resume)."""
    resume_allow_changed_data: bool = False
    """Resume even when a data file's rows changed since the checkpoint (a warning, not an error)."""


@checks(CheckpointSettings)
def _check_checkpoint(s: CheckpointSettings) -> None:
    check_positive(s, "save_total_limit")
    check_positive(s, "save_steps", allow_zero=True)


@dataclass
class LoggingSettings:
    """What is written besides metrics.jsonl: samples and trackers."""

    log_samples_steps: int = 10
    """Write sample completions with rewards to samples.jsonl every this many steps."""
    log_samples_count: int = 4
    """How many sample completions each time."""
    tensorboard: bool = False
    """Also log to TensorBoard (needs `pip install tensorboard`)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb`)."""
    wandb_project: str | None = None
    """Weights & Biases project name."""


@checks(LoggingSettings)
def _check_logging(s: LoggingSettings) -> None:
    check_positive(s, "log_samples_count")
    check_positive(s, "log_samples_steps", allow_zero=True)


LAUNCHERS = ("process", "ray")
RAY_ENGINES = ("gspo", "vllm")  # gspo/apps/ray_launch.py's ENGINES


@dataclass
class DistributedSettings:
    """Under torchrun (docs/distributed.md)."""

    distributed: str = "ddp"
    """Under torchrun: ddp (a replica per rank) or fsdp (FSDP2: parameters and optimizer state sharded)."""
    dist_timeout_s: float = 600.0
    """Under torchrun: seconds a rank waits in a collective before giving up."""
    launcher: str = "process"
    """process: this process is the run (alone, or one rank torchrun started); ray: gspo places the trainer ranks and
    the rollout engines on a Ray cluster (`pip install gspo[ray]`; docs/distributed.md)."""
    ray_address: str | None = None
    """launcher=ray: the cluster's address (auto: the one `ray start` runs here; host:port); null: Ray's default (a
    running local cluster, else a new one for this run)."""
    ray_trainers: int = 1
    """launcher=ray: trainer ranks (actors, each running `gspo train` as torchrun would start it: ddp or fsdp)."""
    ray_placement: str = "PACK"
    """launcher=ray: how the placement group spreads its bundles (a rank or an engine each): PACK or SPREAD."""
    ray_engine: str = "gspo"
    """launcher=ray: what each rollout engine actor serves: gspo (gspo serve, any generation_backend) or vllm (vLLM's
    OpenAI server with gspo's weight-transfer backend; vllm installed where the actors run)."""
    max_engine_restarts: int = 3
    """launcher=ray: times Ray restarts a lost rollout engine actor (rollout_workers of them) before the run stops."""
    ray_start_timeout_s: float = 600.0
    """launcher=ray: longest wait for the bundles to be placed and for the engines and ranks to start."""


@checks(DistributedSettings)
def _check_distributed(s: DistributedSettings) -> None:
    from gspo.plugs.parallel import MODES

    check_choice(s, "distributed", MODES)
    check_positive(s, "dist_timeout_s", "ray_trainers", "ray_start_timeout_s")
    check_positive(s, "max_engine_restarts", allow_zero=True)
    check_choice(s, "launcher", LAUNCHERS)
    check_choice(s, "ray_placement", ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
    check_choice(s, "ray_engine", RAY_ENGINES)


# The sections of a training run in the order `gspo train --help` lists them. A dataclass collects its bases'
# fields from the last base to the first, hence TrainConfig's bases are this tuple reversed.
TRAIN_SECTIONS = (ModelSettings, OutputSettings, DataSettings, EvalSettings, RewardSettings, BatchSettings,
                  SamplingSettings, EpisodeSettings, TaskSettings, SFTTermSettings, ObjectiveSettings,
                  AdvantageSettings, OptimizerSettings, LoraSettings, PrecisionSettings, CorrectionSettings,
                  RoutingSettings, CheckpointSettings, LoggingSettings, ProgressSettings, DistributedSettings)


@takes_other_names  # TrainConfig(beta=0.04): TRL's and former names, and a did-you-mean, as make_config
@dataclass
class TrainConfig(DistributedSettings, ProgressSettings, LoggingSettings, CheckpointSettings, RoutingSettings,
                  CorrectionSettings, PrecisionSettings, LoraSettings, OptimizerSettings, AdvantageSettings,
                  ObjectiveSettings, SFTTermSettings, TaskSettings, EpisodeSettings, SamplingSettings, BatchSettings,
                  RewardSettings,
                  EvalSettings, DataSettings, OutputSettings, ModelSettings):
    """GRPO/GSPO training run: the sections above, with flat field names (TRL's where TRL has one)."""

    def __post_init__(self):
        coerce_fields(self)  # TrainConfig(learning_rate="abc") is an error naming the field, from Python too


def renamed(values: dict, cls=None) -> dict:
    """`values` with other names of the settings (gspo.aliases: former names, TRL's) read into their own, as
    `own_names` does; cls: TrainConfig unless given (a saved train_config.json, on resume)."""
    return own_names(values, TrainConfig if cls is None else cls)


@checks(TrainConfig)
def check_train(cfg: TrainConfig) -> None:
    """The checks that read fields of more than one section (each section's own ran before)."""
    from gspo.algo.advantages import estimator_choices, zeroes_agreeing_groups
    from gspo.algo.objectives import OBJECTIVES

    if cfg.task is None and cfg.dataset is None and cfg.tasks is None:
        raise ValueError("config: set `task` (a built-in task) or `dataset` (a local data file or folder, or a "
                         "cached datasets name)")
    gae = cfg.advantage_estimator == "gae"
    if gae and not OBJECTIVES[cfg.objective].token_advantages:
        takes = ", ".join(o for o, spec in OBJECTIVES.items() if spec.token_advantages)
        raise ValueError(f"config: advantage_estimator=gae gives one advantage per token, but objective "
                         f"{cfg.objective!r} takes one per sequence; use objective grpo (PPO's token ratio) or "
                         f"another that takes them: {takes}")
    if cfg.kl_in_reward and cfg.kl_coef <= 0:
        raise ValueError("config: kl_in_reward needs kl_coef > 0 (the weight of the KL in the reward)")
    if cfg.rollout_workers > cfg.per_device_batch_size:
        raise ValueError(f"config: rollout_workers={cfg.rollout_workers} share per_device_batch_size="
                         f"{cfg.per_device_batch_size} prompts per step; more workers than prompts would sit idle")
    if cfg.launcher == "ray" and cfg.rollout_endpoints:
        raise ValueError("config: launcher=ray starts the rollout engines itself (rollout_workers of them) and "
                         "points the ranks at them; rollout_endpoints names endpoints run elsewhere: use one or the "
                         "other")
    agents = cfg.agent is not None or (cfg.environment or "").startswith(("openenv:", "verifiers:"))
    if agents and (cfg.rollout_workers or cfg.rollout_endpoints):
        raise ValueError("config: agent episodes (agent, environment: openenv:/verifiers:) run on the trainer's own "
                         "endpoint, in its process; rollout_workers and rollout_endpoints are not supported with them")
    if cfg.use_sampler_logprobs and cfg.routing_replay == "old_policy":
        raise ValueError("config: routing_replay=old_policy records the experts in the pi_old forward, which "
                         "use_sampler_logprobs skips; use routing_replay=rollout (experts from the sampler)")
    reshaped = reshaping(cfg)
    if cfg.use_sampler_logprobs and reshaped:
        raise ValueError(f"config: use_sampler_logprobs with {', '.join(reshaped)} would train on the log-probs of "
                         "a reshaped distribution, not the policy's; disable one of them")
    if cfg.rollout_correction != "none" and cfg.use_sampler_logprobs:
        raise ValueError("config: rollout_correction weighs by pi_old/mu, but use_sampler_logprobs makes pi_old = mu "
                         "(every weight 1); use one of them")
    if cfg.rollout_correction != "none" and not OBJECTIVES[cfg.objective].corrects:
        raise ValueError(f"config: objective {cfg.objective!r} does not apply a rollout correction "
                         "(registered without corrects=True); use rollout_correction=none")
    if cfg.dynamic_sampling and not zeroes_agreeing_groups(cfg.advantage_estimator):
        raise ValueError(f"config: dynamic_sampling drops groups whose rewards agree because a group baseline gives "
                         f"them no advantage; advantage_estimator={cfg.advantage_estimator} gives them one (use "
                         f"{', '.join(e for e in estimator_choices() if zeroes_agreeing_groups(e))})")
    if cfg.overlong_penalty is not None and cfg.overlong_penalty["buffer"] > cfg.max_completion_length:
        raise ValueError(f"config: overlong_penalty.buffer={cfg.overlong_penalty['buffer']} is longer than "
                         f"max_completion_length={cfg.max_completion_length}: the penalty starts at the limit minus "
                         "the buffer")
    if cfg.bf16 and cfg.fp16:
        raise ValueError("config: bf16 and fp16 are two autocast precisions; choose one")
    for precision in ("bf16", "fp16"):
        if getattr(cfg, precision) and cfg.dtype != "float32":
            raise ValueError(f"config: {precision} mixed precision keeps float32 master weights, but dtype="
                             f"{cfg.dtype!r}; set dtype=float32 (or {precision}=false to train in the dtype itself)")
    if cfg.fp16 and cfg.distributed == "fsdp":
        raise ValueError("config: fp16 with distributed=fsdp is not supported yet (its loss scale is untested on "
                         "sharded gradients); use bf16, or distributed=ddp")
    if cfg.adam_state_dtype != "float32" and cfg.distributed == "fsdp":
        raise ValueError(f"config: adam_state_dtype={cfg.adam_state_dtype!r} with distributed=fsdp is not supported "
                         "yet (untested on sharded parameters); use adam_state_dtype=float32, or distributed=ddp")
    if cfg.fp16 and (gae or cfg.sft_coef > 0):
        raise ValueError("config: fp16 scales the policy loss's backward only; a critic (advantage_estimator=gae) "
                         "or an SFT term (sft_coef) would backpropagate unscaled: not supported yet, use bf16")
    if cfg.distributed == "fsdp" and (cfg.lora_r or cfg.peft is not None):
        raise ValueError("config: LoRA with distributed=fsdp is not supported; use distributed=ddp (adapters "
                         "are small: replicas cost little)")
    if cfg.tasks is not None:  # the entries are checked where they are parsed
        specs = parse_tasks(cfg.tasks, cfg.reward_funcs, cfg.reward_weights)
        for key in ("dataset", "eval_dataset"):
            if getattr(cfg, key) is not None:
                raise ValueError(f"config: {key} is set but `tasks` lists the data; give each task entry its own {key}")
        if cfg.task_weighting == "dynamic" and cfg.task_weight_floor * len(specs) > 1:
            raise ValueError(f"config: task_weight_floor={cfg.task_weight_floor!r} is more than 1/{len(specs)}: "
                             f"{len(specs)} tasks cannot each keep it")


def keeps_sampler_logprobs(sampling, correction, objective) -> bool:
    """Whether a run keeps the sampler's log-probs (mu), from its SamplingSettings, CorrectionSettings and
    ObjectiveSettings: it trains on them (use_sampler_logprobs, a rollout correction), or mu may differ from pi_old
    (a copy, a lag, stale workers, endpoints that serve another engine's numerics), or log_mismatch. (An engine's
    are kept regardless: the Sampler adds that.)"""
    return bool(objective.use_sampler_logprobs or correction.rollout_correction != "none" or sampling.sampler_dtype
                or sampling.sampler_lag or sampling.max_staleness or correction.log_mismatch
                or sampling.rollout_endpoints)


def sampler_sections(cfg) -> tuple:
    """(SamplingSettings, EpisodeSettings, SamplerShape) of a TrainConfig: what `Sampler` and `build_sampler` take."""
    sampling = section(cfg, SamplingSettings)
    keep = keeps_sampler_logprobs(sampling, section(cfg, CorrectionSettings), section(cfg, ObjectiveSettings))
    shape = SamplerShape(num_generations=cfg.num_generations, per_device_batch_size=cfg.per_device_batch_size,
                         seed=cfg.seed, keep_logprobs=keep, chat_template_kwargs=cfg.chat_template_kwargs,
                         sandbox=cfg.sandbox, autocast="bf16" if cfg.bf16 else "fp16" if cfg.fp16 else None)
    return sampling, section(cfg, EpisodeSettings), shape
