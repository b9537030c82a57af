"""A run's setup, apart from its loop: `build_run(cfg, topology)` builds every plug once, in order, and returns
them named in a `Run`; `Checkpointer` is how the loop saves (and how a resumed run restores) its state.

The order of building is part of the behaviour: the data and the reward functions are checked first, reading no
model (`preflight`: files, columns, what each reward needs); then the policy is seeded and loaded, a critic copies
the full policy before LoRA's adapters go on, fsdp's weights are loaded before sharding, and the sampler starts from
the weights training starts from (after a resume restored them). gspo/trainer.py runs the loop over a Run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path

import torch

from gspo.algo.adamw import LowPrecisionAdamW
from gspo.algo.schedules import lr_schedule
from gspo.checkpoint import (
    OPTIMIZER_FILE,
    TRAINER_STATE_FILE,
    check_data,
    check_finite_state,
    check_resumable,
    discard_newer_checkpoints,
    load_checkpoint,
    load_model_weights,
    load_state_file,
    load_trainer_state,
    resolve_resume,
    save_checkpoint,
    saved_config,
    set_aside_damaged,
)
from gspo.config import (
    AdvantageSettings,
    BatchSettings,
    CorrectionSettings,
    DataSettings,
    EpisodeSettings,
    EvalSettings,
    LoraSettings,
    ModelSettings,
    ObjectiveSettings,
    OptimizerSettings,
    OutputSettings,
    PrecisionSettings,
    RewardSettings,
    SamplingSettings,
    SFTTermSettings,
    TaskSettings,
    TrainConfig,
    section,
    to_dict,
)
from gspo.data.source import preflight, prompt_source
from gspo.model_card import write_model_card
from gspo.models import seeded_model
from gspo.plugs.auxiliary import auxiliary_term
from gspo.plugs.baselines import build_baseline
from gspo.plugs.lora import attach_adapters, is_peft, merged_model
from gspo.plugs.parallel import Topology
from gspo.plugs.precision import enable_gradient_checkpointing, forward_precision, loss_scaler
from gspo.plugs.reference import reference_policy
from gspo.plugs.routing import build_routing
from gspo.rollout import eos_ids, pad_id
from gspo.rollout.feed import PENDING_FILE, RolloutFeed, all_ranks_pending, rank_pending
from gspo.rollout.sampling import build_sampler, sampler_sections
from gspo.rounds import DynamicSampling, OneRound
from gspo.runtime import CRITIC_DIR, MERGED_DIR, NonFiniteGuard, prepare_output_dir, save_model, stderr_printer
from gspo.step import Learner, group_members, logprob_options, loss_options
from gspo.tracking import MetricsLogger


@dataclass
class Run:
    """Everything the loop uses, built once. `evals` ({step: eval/* metrics}) grows as the loop evaluates."""

    cfg: TrainConfig
    topology: Topology
    out_dir: Path
    model: torch.nn.Module  # wrapped for the topology (DDP / FSDP2), LoRA's adapters on
    tokenizer: object
    autocast: object  # () -> context manager of every policy forward (bf16, or nothing)
    routing: object  # plugs.protocols.Routing
    reference: object  # plugs.protocols.Reference
    baseline: object  # plugs.protocols.Baseline
    source: object  # plugs.protocols.PromptSource
    aux: object  # plugs.protocols.AuxiliaryTerm
    learner: Learner  # the policy's optimizer, its schedule and the non-finite guard with it
    shuffle: torch.Generator  # the minibatch plans
    logp_kwargs: dict  # every policy forward's options
    stop_ids: list[int]
    sampler: object  # plugs.protocols.Sampler
    feed: RolloutFeed
    rounds: object  # stages 1-2, sample and score: gspo.rounds.OneRound, or DynamicSampling over it
    logger: MetricsLogger
    say: object  # a line as each long phase begins (rank 0, with progress on)
    plan: BatchSettings  # the minibatch plan's settings
    objective: ObjectiveSettings  # the policy loss's settings
    first: int  # the first step to run (1, or the resumed checkpoint's step + 1)
    resumed: bool  # from a checkpoint (perhaps checkpoint-0: first is 1 then too)
    evals: dict = field(default_factory=dict)

    @cached_property
    def checkpoints(self) -> Checkpointer:
        """How the loop saves this run."""
        return Checkpointer(self)

    @property
    def held_out(self) -> int:
        """Held-out prompts evaluated (0: evaluation off: eval_num_prompts=0, or nothing held out)."""
        return sum(map(len, self.source.eval_rows))

    def evaluate(self, step: int) -> dict:
        """eval/* metrics on the held-out rows, kept in `evals` for the summary; {} when evaluation is off."""
        if not self.held_out:
            return {}
        self.say(f"evaluating {self.held_out} prompts x (greedy + {self.cfg.eval_k} samples) ...")
        with self.autocast():
            self.evals[step] = self.source.evaluate(self.model, self.tokenizer)
        return self.evals[step]


def adamw(module, lr: float, settings: OptimizerSettings, total_updates: int):
    """The policy's and a critic's optimizer: AdamW on the run's learning-rate schedule; (optimizer, scheduler)."""
    trained = [p for p in module.parameters() if p.requires_grad]  # LoRA: the adapters only
    betas = (settings.adam_beta1, settings.adam_beta2)
    if settings.adam_state_dtype == "float32":
        optimizer = torch.optim.AdamW(trained, lr=lr, betas=betas, weight_decay=settings.weight_decay,
                                      **fused_adamw(trained))
    else:  # the moments in a lower precision (bfloat16): half the optimizer's memory
        optimizer = LowPrecisionAdamW(trained, lr=lr, betas=betas, weight_decay=settings.weight_decay,
                                      state_dtype=getattr(torch, settings.adam_state_dtype))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_schedule(settings.lr_scheduler, settings.warmup_steps, total_updates))


def fused_adamw(params: list) -> dict:
    """{"fused": True} where torch has a fused AdamW kernel for every parameter (CPU and CUDA, float
    dtypes; FSDP2's DTensors too): one kernel per step instead of a loop over parameters (docs/benchmarks.md,
    item 5)."""
    ok = params and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return {"fused": True} if ok else {}


def build_run(cfg: TrainConfig, topology: Topology, model=None, tokenizer=None, data: dict | None = None) -> Run:
    """Build a run's plugs from its config (`model`, `tokenizer`, `data`: objects standing in for what the config
    names, gspo/apps/api.py); a resumed run's state is restored before the sampler copies the weights."""
    preflight(section(cfg, DataSettings), section(cfg, RewardSettings), section(cfg, TaskSettings),
              section(cfg, EpisodeSettings), evaluating=cfg.eval_num_prompts > 0, given=data,
              note=stderr_printer(topology.is_main))  # data and rewards checked before any model loads
    resuming = cfg.resume_from_checkpoint is not None
    out = section(cfg, OutputSettings)
    out_dir = prepare_output_dir(out, resuming) if topology.is_main else Path(out.output_dir)  # earlier run: error
    topology.barrier()
    checkpoint = resolve_resume(cfg.resume_from_checkpoint, out_dir) if resuming else None  # hashed in full
    say = stderr_printer(cfg.progress and topology.is_main, "gspo: ")
    say(f"loading model {cfg.model} ...")
    device, model, tokenizer = seeded_model(section(cfg, ModelSettings), model, tokenizer)  # None: as configured
    enable_gradient_checkpointing(model, cfg.gradient_checkpointing)
    autocast = forward_precision(cfg.bf16, device, cfg.fp16)  # every policy forward under autocast, weights fp32
    routing = build_routing(model, cfg.routing_replay, cfg.log_routing_drift, cfg.padding_free,
                            cfg.router_aux_loss_coef)
    make_optimizer = partial(adamw, settings=section(cfg, OptimizerSettings),
                             total_updates=cfg.max_steps * cfg.num_minibatches * cfg.num_epochs)
    baseline = build_baseline(  # a critic copies the policy first
        section(cfg, AdvantageSettings), model, topology, make_optimizer, checkpoint, group_size=cfg.num_generations,
        learning_rate=cfg.learning_rate, max_grad_norm=cfg.max_grad_norm, kl_coef=cfg.kl_coef, packed=cfg.padding_free,
        max_consecutive_skips=cfg.max_consecutive_skips, trust_remote_code=cfg.trust_remote_code)
    model = attach_adapters(model, section(cfg, LoraSettings))  # LoRA: adapters on the frozen base
    reference = reference_policy(cfg.kl_coef, model, topology)  # pi_ref: none, a copy, the adapters off
    if topology.sharded and checkpoint is not None:  # fsdp shards what it wraps: the checkpoint's weights go in first
        load_model_weights(model, checkpoint)  # checked finite before they are copied in
    model = topology.wrap(model)
    B, W = cfg.per_device_batch_size, topology.world_size
    source = prompt_source(tokenizer, max(1000, cfg.max_steps * B * W), data=section(cfg, DataSettings),
                           rewards=section(cfg, RewardSettings), evals=section(cfg, EvalSettings),
                           sampling=section(cfg, SamplingSettings), tasks=section(cfg, TaskSettings),
                           episodes=section(cfg, EpisodeSettings), seed=cfg.seed, given=data,
                           note=stderr_printer(topology.is_main))  # the held-out split, said once
    logp_kwargs = logprob_options(cfg.temperature, section(cfg, PrecisionSettings))
    aux = auxiliary_term(section(cfg, SFTTermSettings), tokenizer, device, source.train_rows, logp_kwargs=logp_kwargs,
                         max_steps=cfg.max_steps, num_minibatches=cfg.num_minibatches,
                         max_prompt_length=cfg.max_prompt_length, truncate_prompts=cfg.truncate_prompts)
    optimizer, scheduler = make_optimizer(model, cfg.learning_rate)
    guard = NonFiniteGuard(cfg.max_consecutive_skips, scaler=loss_scaler(cfg.fp16, device))
    learner = Learner(model, optimizer, scheduler, guard, logp_kwargs=logp_kwargs, max_grad_norm=cfg.max_grad_norm,
                      loss_kwargs=loss_options(section(cfg, ObjectiveSettings), norm_length=cfg.max_completion_length,
                                               kl_in_reward=cfg.kl_in_reward),
                      correction=section(cfg, CorrectionSettings), topology=topology, routing=routing, aux=aux,
                      baseline=baseline, autocast=autocast)
    shuffle = torch.Generator().manual_seed(cfg.seed)
    stop_ids = eos_ids(tokenizer, model)
    first, evals, pending = 1, {}, None
    if checkpoint is not None:  # exact resume: weights, optimizer, schedule, data position and RNG states as they were
        first, evals = restore(checkpoint, cfg, topology, out_dir, learner, shuffle, source)
        pending = rank_pending(load_state_file(checkpoint / PENDING_FILE) if (checkpoint / PENDING_FILE).exists()
                               else None, topology.rank, W)
    # the sampler starts from the weights training starts from (a copy, an engine, a worker: loaded now)
    sampler = build_sampler(model, tokenizer, *sampler_sections(cfg), seeded=cfg.seeded_sampling or topology.enabled,
                            load=(section(cfg, ModelSettings), section(cfg, LoraSettings)), rank=topology.rank,
                            recorder=routing.sampling_recorder, records=routing.records_sampling, version=first - 1,
                            rng=(pending or {}).get("worker_rng"), topology=topology)
    # each step's prompts and rollout: sampled as the step begins, or asked for max_staleness steps ahead
    feed = RolloutFeed(source, sampler, batch=B * W, share=topology.batch_share(B),
                       first_row=topology.rank * B * cfg.num_generations, ahead=cfg.max_staleness, after=first - 1,
                       last=cfg.max_steps, pending=pending)
    say(getattr(sampler, "reason", f"sampler: {sampler.name}"))  # which sampler, and why
    rounds = OneRound(feed, source, topology, batch=B, group_size=cfg.num_generations, drop_bad=cfg.drop_bad_rewards,
                      timeout_s=cfg.reward_timeout_s, stop_ids=stop_ids)
    if cfg.dynamic_sampling:  # more rounds until the step holds B groups whose rewards do not all agree
        rounds = DynamicSampling(rounds, rounds=cfg.max_sampling_rounds, factor=cfg.oversample_factor,
                                 grouped=partial(group_members, plan=section(cfg, BatchSettings)),
                                 pad=pad_id(tokenizer, model))
    logger = MetricsLogger(out_dir, tensorboard=cfg.tensorboard, wandb=cfg.wandb, wandb_project=cfg.wandb_project,
                           config=to_dict(cfg), truncate_after_step=None if checkpoint is None else first - 1,
                           enabled=topology.is_main)
    return Run(cfg, topology, out_dir, model, tokenizer, autocast, routing, reference, baseline, source, aux,
               learner, shuffle, logp_kwargs, stop_ids, sampler, feed, rounds, logger, say,
               section(cfg, BatchSettings), section(cfg, ObjectiveSettings), first, checkpoint is not None, evals)


def restore(checkpoint: Path, cfg, topology: Topology, out_dir: Path, learner: Learner, shuffle, source
            ) -> tuple[int, dict]:
    """Resume from `checkpoint` (weights, optimizer, schedule, data position, RNGs): (first step, evaluations).

    Under fsdp the weights went in before sharding; the optimizer state is sharded here.
    """
    model, optimizer = learner.model, learner.optimizer
    if topology.sharded:
        optimizer_state = load_state_file(checkpoint / OPTIMIZER_FILE)
        check_finite_state(optimizer_state, str(checkpoint / OPTIMIZER_FILE))
        topology.load_optimizer_state(model, optimizer, optimizer_state)
    state = load_checkpoint(checkpoint, model=None if topology.sharded else model,
                            optimizer=None if topology.sharded else optimizer, scheduler=learner.scheduler,
                            rng_generators={"shuffle": shuffle},  # RNGs last: nothing draws before
                            hashes=False)  # resolve_resume hashed it
    check_resumable(state["config"], cfg, state["step"], topology.world_size)
    saved_data = state["trainer_state"].get("data") if isinstance(state["trainer_state"], dict) else None
    changed_data = check_data(saved_data, source.fingerprints, checkpoint.name,
                              cfg.resume_allow_changed_data)  # the same rows as then, unless allowed
    evals = load_trainer_state(checkpoint / TRAINER_STATE_FILE, state["trainer_state"], source, learner.guard,
                               past_end=bool(changed_data))  # changed (allowed) or unknown: fewer rows may be
    for warning in changed_data if topology.is_main else ():
        print(warning, file=sys.stderr, flush=True)
    if topology.is_main:  # newer checkpoints: damaged ones kept out of the way, valid ones only deleted if allowed
        for moved in set_aside_damaged(out_dir, state["step"]):
            print(f"resume: {moved.name.split('.damaged')[0]} failed verification; set aside as {moved} "
                  "(nothing deleted)", file=sys.stderr, flush=True)
        discard_newer_checkpoints(out_dir, state["step"], cfg.overwrite_output_dir)
        print(f"resume: continuing from {checkpoint} (after step {state['step']})", file=sys.stderr, flush=True)
    if cfg.sampler_lag and topology.is_main:
        print(f"resume: sampler_lag={cfg.sampler_lag}: the sampler starts again from the resumed weights (the older "
              "weights it lagged behind are not checkpointed)", file=sys.stderr, flush=True)
    return state["step"] + 1, evals


class Checkpointer:
    """Saves a run: a checkpoint for exact resume (`save`), and the trained model at the end (`save_model`).

    Every rank holds the same state (replicas, same RNG draws): rank 0 writes it, in the single-process layout
    (under fsdp every rank first helps gather it).
    """

    def __init__(self, run: Run):
        self.run = run

    def save(self, step: int, rng: dict | None = None, wait: bool = True) -> Path | None:
        """Checkpoint step `step`. `rng`: the RNG states taken when step `step` + 1 began (a step dropped unfinished
        leaves weights, optimizer and schedule as step `step` left them). The feed gives the prompt source's state
        and the rollouts asked for beyond `step` (max_staleness; `wait`: False when their worker is lost)."""
        run, topology = self.run, self.run.topology
        source_state, pending = run.feed.resume_state(step, wait=wait)
        pending = topology.gather_object(pending)  # torchrun: each rank's workers sample its own share ahead
        path, state = run.out_dir / f"checkpoint-{step}", topology.full_state(run.model, run.learner.optimizer)
        extra_states = run.baseline.checkpoint_states()  # a critic's state; below, the rollouts asked for ahead
        if topology.is_main:
            extra_states[PENDING_FILE] = all_ranks_pending(pending)
            path = save_checkpoint(run.out_dir, step, model=run.model, tokenizer=run.tokenizer,
                                   scheduler=run.learner.scheduler, config=saved_config(run.cfg, topology.world_size),
                                   rng_generators={"shuffle": run.shuffle}, rng_state=rng,
                                   keep=run.cfg.save_total_limit, trainer_state={
                                       "sampler": source_state, "guard": run.learner.guard.state_dict(),
                                       "evals": {str(k): v for k, v in run.evals.items()},
                                       "world_size": topology.world_size,
                                       "data": run.source.fingerprints},  # checked at resume (check_data)
                                   extra_states=extra_states, **state)
        topology.barrier()
        return path

    def save_model(self, metrics: dict) -> None:
        """The trained policy in output_dir/model (LoRA: the adapter), its model card, the merged weights
        (lora_save_merged) and PPO's critic; `metrics`: the last step's, for the card."""
        run, topology = self.run, self.run.topology
        cfg, out_dir = run.cfg, run.out_dir
        full = topology.full_weights(run.model)  # fsdp: every rank takes part in gathering the shards
        if topology.is_main:
            save_model(run.model, run.tokenizer, out_dir / "model", state_dict=full)  # LoRA: PEFT's layout
            card = dict(kind="rl", evals=run.evals, metrics=metrics, data={  # the card: README.md beside the weights
                "train_rows": sum(map(len, run.source.train_rows)), "held_out_rows": run.held_out,
                "files": run.source.fingerprints})
            config = saved_config(cfg, topology.world_size)
            write_model_card(out_dir / "model", config, adapter=is_peft(run.model), **card)
            if cfg.lora_save_merged:
                save_model(merged_model(run.model), run.tokenizer, out_dir / MERGED_DIR)  # the policy spent
                write_model_card(out_dir / MERGED_DIR, config, **card)
        run.baseline.save(out_dir / CRITIC_DIR)  # PPO: the trained critic (critic_model can start from it)
        topology.barrier()


__all__ = ["Checkpointer", "Run", "adamw", "build_run", "fused_adamw", "restore"]
