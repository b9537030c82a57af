"""The GRPO / GSPO training loop. Read this file first.

One RL step (docs/design.md, "The shape of the trainer"):
  1. sample   B prompts -> G completions each (N = B*G), from the current policy (= pi_old)
  2. score    rewards (N,), each reward function's values, lengths
  3. prepare  the minibatch plan, pi_old (and pi_ref) log-probs, advantages: one Batch
  4. update   M minibatches x num_epochs, one optimizer step each (minibatches 2..M are
              off-policy: that is where the importance ratio matters)
  5. metrics  one line of metrics.jsonl
  6. evaluate / log samples / checkpoint, periodically
Everything optional is a plug (gspo/plugs/protocols.py: the Protocols) built once before the loop from its own
config section, with a do-nothing twin, so the loop never asks which case it is in: the Topology
(one process, DDP, FSDP2: gspo/plugs/parallel.py), the Sampler (gspo/rollout/), Routing (MoE replay and
drift: gspo/plugs/routing.py), the prompt source (one task or a mixture: gspo/data/source.py), the
auxiliary term (SFT: gspo/plugs/auxiliary.py), the baseline (gspo/plugs/baselines.py: the group's rewards, or
PPO's critic, trained on the same minibatches), the reference policy of the KL term
(gspo/plugs/reference.py: none, a frozen copy, or LoRA's base with the adapters off: gspo/plugs/lora.py) and the
forwards' precision (gspo/plugs/precision.py: bf16 autocast or none).
The sampler is the policy itself (gspo/rollout/decode.py or HF `generate`), a copy of it (low
precision, stale: sampler_dtype, sampler_lag), an inference engine colocated in this process
(vllm) or a worker process sampling up to max_staleness steps ahead (gspo/rollout/remote/client.py, fed
by gspo/rollout/feed.py); where its distribution mu is not pi_old, `mismatch/*` measure by how
much and a rollout correction (gspo/algo/correction.py) weighs the updates by pi_old/mu. The whole
rollout stays in memory.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import torch

from gspo.algo.schedules import lr_schedule
from gspo.callbacks import Callbacks
from gspo.checkpoint import (
    OPTIMIZER_FILE,
    TRAINER_STATE_FILE,
    capture_rng,
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
    BatchSettings,
    CorrectionSettings,
    LoraSettings,
    ModelSettings,
    ObjectiveSettings,
    OutputSettings,
    PrecisionSettings,
    SFTTermSettings,
    TrainConfig,
    section,
    to_dict,
)
from gspo.data.source import prompt_source
from gspo.model_card import write_model_card
from gspo.models import resolve_device, seeded_model
from gspo.plugs.auxiliary import auxiliary_term
from gspo.plugs.baselines import build_baseline
from gspo.plugs.lora import attach_adapters, is_peft, merged_model
from gspo.plugs.parallel import Topology
from gspo.plugs.precision import enable_gradient_checkpointing, forward_precision, loss_scaler
from gspo.plugs.reference import reference_policy
from gspo.plugs.routing import build_routing
from gspo.rollout import eos_ids
from gspo.rollout.feed import PENDING_FILE, RolloutFeed, all_ranks_pending, rank_pending
from gspo.rollout.remote.client import RolloutWorkerLost, build_sampler
from gspo.runtime import (
    CRITIC_DIR,
    MERGED_DIR,
    NonFiniteGuard,
    Progress,
    StepAbandoned,
    StopSignals,
    TrainingAborted,
    TrainingInterrupted,
    prepare_output_dir,
    run_lock,
    save_model,
    stderr_printer,
)
from gspo.step import (
    Learner,
    episode_stats,
    gather_scores,
    logprob_options,
    loss_options,
    mismatch_stats,
    prepare,
    sample_records,
    step_metrics,
)
from gspo.tracking import MetricsLogger, check_trackers


def train(cfg: TrainConfig, *, model=None, tokenizer=None, data: dict | None = None, callbacks=()) -> dict:
    """Run GRPO/GSPO as configured; returns a summary (evaluations before/after, time).

    From Python (gspo.Trainer, gspo/apps/api.py) objects may stand in for what the config names: `model` (and its
    `tokenizer`, None: loaded from the model's path) for the `model` setting, `data` ({name: rows}) for the
    datasets the config names "object:<name>" (gspo/given.py); `callbacks` are called after every step
    (gspo/callbacks.py: one may end the run). Under torchrun every rank calls this; see gspo/plugs/parallel.py for
    how the work is split.
    """
    callbacks = Callbacks(callbacks)  # checked before anything starts
    topology = Topology.setup(resolve_device(cfg.device), cfg.distributed, cfg.dist_timeout_s)
    try:
        if topology.is_main:  # rank 0 logs: its tracker packages are checked before output_dir is created
            check_trackers(cfg.tensorboard, cfg.wandb)
        with run_lock(cfg.output_dir, enabled=topology.is_main):  # one run per output_dir (rank 0 holds it)
            return _train(cfg, topology, model, tokenizer, data, callbacks)
    except TrainingAborted:
        raise
    except RuntimeError as err:  # a failed collective (gloo names a dead peer by address) or a bug
        topology.raise_if_rank_lost(err)  # another rank ended: one line naming it instead
        raise
    finally:
        topology.teardown()


def _train(cfg: TrainConfig, topology: Topology, model, tokenizer, data: dict | None, callbacks: Callbacks) -> dict:
    started = time.perf_counter()
    resuming = cfg.resume_from_checkpoint is not None
    out = section(cfg, OutputSettings)
    out_dir = prepare_output_dir(out, resuming) if topology.is_main else Path(out.output_dir)  # earlier run: error
    topology.barrier()
    checkpoint = resolve_resume(cfg.resume_from_checkpoint, out_dir) if resuming else None  # hashed in full
    say = stderr_printer(cfg.progress and topology.is_main, "gspo: ")  # a line as each long phase begins
    say(f"loading model {cfg.model} ...")
    device, model, tokenizer = seeded_model(section(cfg, ModelSettings), model, tokenizer)  # None: as configured
    enable_gradient_checkpointing(model, cfg.gradient_checkpointing)
    autocast = forward_precision(cfg.bf16, device, cfg.fp16)  # every policy forward under autocast, weights fp32
    routing = build_routing(model, cfg.routing_replay, cfg.log_routing_drift, cfg.padding_free)

    def make_optimizer(module, lr: float):  # the policy's and a critic's: AdamW on the run's schedule
        trained = [p for p in module.parameters() if p.requires_grad]  # LoRA: the adapters only
        optimizer = torch.optim.AdamW(trained, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                      weight_decay=cfg.weight_decay, **fused_adamw(trained))
        total_updates = cfg.max_steps * cfg.num_minibatches * cfg.num_epochs
        return optimizer, torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_schedule(cfg.lr_scheduler, cfg.warmup_steps, total_updates))

    baseline = build_baseline(cfg, model, topology, make_optimizer, checkpoint)  # a critic copies the policy first
    # LoRA: adapters on the frozen base (the critic copied the full model)
    model = attach_adapters(model, section(cfg, LoraSettings))
    # pi_ref, the starting policy: none, a copy, the adapters off
    reference = reference_policy(cfg.kl_coef, model, topology)
    if topology.sharded and checkpoint is not None:  # fsdp shards what it wraps: the checkpoint's weights go in first
        load_model_weights(model, checkpoint)  # checked finite before they are copied in
    model = topology.wrap(model)
    B, G, W = cfg.per_device_batch_size, cfg.num_generations, topology.world_size
    source = prompt_source(cfg, tokenizer, max(1000, cfg.max_steps * B * W), data,
                           note=stderr_printer(topology.is_main))  # the held-out split, said once
    logp_kwargs = logprob_options(cfg.temperature, section(cfg, PrecisionSettings))  # every forward's options
    aux = auxiliary_term(section(cfg, SFTTermSettings), tokenizer, device, source.train_rows, logp_kwargs=logp_kwargs,
                         max_steps=cfg.max_steps, num_minibatches=cfg.num_minibatches,
                         max_prompt_length=cfg.max_prompt_length, truncate_prompts=cfg.truncate_prompts)
    optimizer, scheduler = make_optimizer(model, cfg.learning_rate)
    guard = NonFiniteGuard(cfg.max_consecutive_skips, scaler=loss_scaler(cfg.fp16, device))
    objective, plan = section(cfg, ObjectiveSettings), section(cfg, BatchSettings)
    learner = Learner(model, optimizer, scheduler, guard, logp_kwargs=logp_kwargs, max_grad_norm=cfg.max_grad_norm,
                      loss_kwargs=loss_options(objective, norm_length=cfg.max_completion_length,
                                               kl_in_reward=cfg.kl_in_reward),
                      correction=section(cfg, CorrectionSettings), topology=topology, routing=routing, aux=aux,
                      baseline=baseline, autocast=autocast)
    shuffle = torch.Generator().manual_seed(cfg.seed)  # the minibatch plans
    stop_ids = eos_ids(tokenizer, model)

    def save_checkpoint_now(step: int, rng: dict | None = None, wait: bool = True) -> Path | None:
        # Every rank holds the same state (replicas, same RNG draws): rank 0 writes it, in the
        # single-process layout (under fsdp every rank first helps gather it). `rng`: the RNG states
        # taken when step `step` + 1 began (a step dropped unfinished leaves weights, optimizer and
        # schedule as step `step` left them). The feed gives the prompt source's state and the rollouts
        # asked for beyond `step` (max_staleness; `wait`: False when the worker that samples them is lost).
        source_state, pending = feed.resume_state(step, wait=wait)
        pending = topology.gather_object(pending)  # torchrun: each rank's workers sample its own share ahead
        path, state = out_dir / f"checkpoint-{step}", topology.full_state(model, optimizer)
        extra_states = baseline.checkpoint_states()  # a critic's state; below, the rollouts asked for ahead
        if topology.is_main:
            extra_states[PENDING_FILE] = all_ranks_pending(pending)
            path = save_checkpoint(out_dir, step, model=model, tokenizer=tokenizer, scheduler=scheduler,
                                   config=saved_config(cfg, W), rng_generators={"shuffle": shuffle},
                                   rng_state=rng, keep=cfg.save_total_limit, trainer_state={
                                       "sampler": source_state, "guard": guard.state_dict(),
                                       "evals": {str(k): v for k, v in evals.items()}, "world_size": W,
                                       "data": source.fingerprints},  # checked at resume (check_data)
                                   extra_states=extra_states, **state)
        topology.barrier()
        return path

    if checkpoint is None:
        first, evals, pending = 1, {}, None
    else:  # exact resume: weights, optimizer, schedule, data position and RNG states as they were
        first, evals = restore(checkpoint, cfg, topology, out_dir, model, optimizer, scheduler, shuffle, source, guard)
        pending = rank_pending(load_state_file(checkpoint / PENDING_FILE) if (checkpoint / PENDING_FILE).exists()
                               else None, topology.rank, W)
    # the sampler starts from the weights training starts from (a copy, an engine, a worker: loaded now)
    sampler = build_sampler(model, tokenizer, cfg, seeded=cfg.seeded_sampling or topology.enabled,
                            rank=topology.rank, recorder=routing.sampling_recorder,
                            records=routing.records_sampling, version=first - 1,
                            rng=(pending or {}).get("worker_rng"))
    # each step's prompts and rollout: sampled as the step begins, or asked for max_staleness steps ahead
    feed = RolloutFeed(source, sampler, batch=B * W, share=topology.batch_share(B), first_row=topology.rank * B * G,
                       ahead=cfg.max_staleness, after=first - 1, last=cfg.max_steps,
                       pending=pending)
    say(getattr(sampler, "reason", f"sampler: {sampler.name}"))  # which sampler, and why
    logger = MetricsLogger(out_dir, tensorboard=cfg.tensorboard, wandb=cfg.wandb, wandb_project=cfg.wandb_project,
                           config=to_dict(cfg), truncate_after_step=None if checkpoint is None else first - 1,
                           enabled=topology.is_main)

    held_out = sum(map(len, source.eval_rows))  # 0: evaluation off (eval_num_prompts=0, or nothing held out)
    if not held_out:
        say(f"evaluation off ({'eval_num_prompts=0' if cfg.eval_num_prompts == 0 else 'no held-out rows'})")

    def evaluate(step: int) -> dict:  # held-out metrics, kept for the summary; none when evaluation is off
        if not held_out:
            return {}
        say(f"evaluating {held_out} prompts x (greedy + {cfg.eval_k} samples) ...")
        with autocast():
            evals[step] = source.evaluate(model, tokenizer)
        return evals[step]

    if checkpoint is None and held_out:
        logger.log(0, evaluate(0))
    progress = Progress(cfg.max_steps, enabled=cfg.progress and topology.is_main, every=cfg.logging_steps,
                        line=("reward/mean", "reward/std", "loss/policy", "completion/mean_len", "eval/accuracy",
                              "eval/reward"))  # without a terminal: the line printed every logging_steps
    progress.update(first - 1, {})
    model.train()
    stop = StopSignals()
    metrics: dict = {}  # the last step's, for the model card
    try:
        for step in range(first, cfg.max_steps + 1):
            t0 = time.perf_counter()
            # Until the step's first update a signal drops it whole (StopSignals); a checkpoint of
            # step - 1 then needs the RNG states as this step found them (the feed keeps the rest).
            resume_rng = capture_rng({"shuffle": shuffle})
            stop.abandonable = topology.can_abandon_step
            # 1. Sample: every rank draws the global batch and keeps its B prompts (whole groups); rollout
            #    workers were asked for it max_staleness steps ago.
            with autocast():
                examples, rollout = feed.next(step)
            mine = examples[topology.batch_share(B)]
            t_generate = time.perf_counter() - t0
            # 2. Score this rank's completions; every rank then holds every sequence's scalars.
            #    A dropped sample (bad reward, drop_bad_rewards) has a NaN reward and advantage 0.
            rewards, per_fn = source.score(mine, rollout.prompts, rollout.completions, G, drop_bad=cfg.drop_bad_rewards,
                                           offset=topology.rank * B, timeout_s=cfg.reward_timeout_s,
                                           completion_ids=rollout.completion_token_ids(), episodes=rollout.episodes)
            scores = gather_scores(topology, rollout, rewards, per_fn, stop_ids)
            task_metrics = source.observe(scores.rewards, scores.valid, G)  # several tasks: reweigh them
            # 3. Prepare: the minibatch plan, pi_old and pi_ref log-probs, advantages (a critic's values), once.
            with autocast():
                batch = prepare(rollout, scores, plan=plan, objective=objective,
                                logp_kwargs=logp_kwargs, topology=topology, routing=routing, model=model,
                                reference=reference, baseline=baseline, shuffle=shuffle)
            t_rollout = time.perf_counter() - t0
            stop.abandonable = False  # from here on the step changes the weights: it is finished first

            # 4. Update: one optimizer step per minibatch (with sft_coef, minibatch i also fits references part i;
            #    a critic takes its own step on the same minibatch).
            aux.begin_step(step, examples)
            step_stats = [learner.update(batch, i, part, on_policy=on_policy, step=step)
                          for i, part, on_policy in batch.minibatches()]
            sampler_stats = {**sampler.sync(model), **feed.staleness(step),  # time/sync_s, async/*
                             **mismatch_stats(batch.rollout, topology), **episode_stats(batch.rollout, topology)}
            t_train = time.perf_counter() - t0 - t_rollout

            # 5. Metrics.
            metrics = step_metrics(scores, step_stats, {**task_metrics, **batch.stats, **sampler_stats}, group_size=G,
                                   drop_bad=cfg.drop_bad_rewards, skipped=guard.skipped, lr=scheduler.get_last_lr()[0],
                                   t_generate=t_generate, t_rollout=t_rollout, t_train=t_train)
            # 6. Evaluate, call back (a callback's "stop" ends the run here, as max_steps would), log, checkpoint.
            last = step == cfg.max_steps
            if (cfg.eval_steps and step % cfg.eval_steps == 0) or last:
                metrics.update(evaluate(step))
            last = topology.any(callbacks.on_step_end(step, metrics)) or last  # one rank's stop stops them all
            if last and step not in evals:  # stopped early: the final evaluation
                metrics.update(evaluate(step))
            logger.log(step, metrics)
            if cfg.log_samples_steps and (step % cfg.log_samples_steps == 0 or step == 1):
                logger.log_samples(step, sample_records(rollout, cfg.log_samples_count))  # rank 0's rows
            progress.update(step, metrics)
            if topology.any(bool(stop.requested)):  # one rank's signal stops them all
                stop.requested = stop.requested or signal.SIGTERM
            if (cfg.save_steps and step % cfg.save_steps == 0) or last or stop.requested:
                saved = save_checkpoint_now(step)
                if stop.requested and not last:  # SIGINT / SIGTERM: stop cleanly, resumable
                    raise TrainingInterrupted(stop.requested, step, saved)
            if last:
                break
    except StepAbandoned as stopped:  # a signal before the step's first optimizer step: drop it whole
        saved = save_checkpoint_now(step - 1, resume_rng)
        raise TrainingInterrupted(stopped.signum, step - 1, saved) from None
    except RolloutWorkerLost as lost:  # raised as step `step` waits for its rollout: nothing of it applied
        if topology.enabled:  # the other ranks are inside the step: they stop as this rank ends, naming it
            raise TrainingAborted(f"rank {topology.rank}: {lost}\nstopped in step {step}; continue from the latest "
                                  "checkpoint with --resume latest") from None
        saved = save_checkpoint_now(step - 1, resume_rng, wait=False)
        raise TrainingAborted(f"{lost}\nstopped after step {step - 1}; checkpoint saved to {saved}; continue with "
                              "--resume latest (rollouts the worker had not returned are sampled again)") from None
    finally:
        stop.restore()
        sampler.close()
        progress.close()
        logger.close()

    full = topology.full_weights(model)  # fsdp: every rank takes part in gathering the shards
    if topology.is_main:
        save_model(model, tokenizer, out_dir / "model", state_dict=full)  # LoRA: the adapter (PEFT's layout)
        card = dict(kind="rl", evals=evals, metrics=metrics, data={  # the model card: README.md beside the weights
            "train_rows": sum(map(len, source.train_rows)), "held_out_rows": held_out, "files": source.fingerprints})
        write_model_card(out_dir / "model", saved_config(cfg, W), adapter=is_peft(model), **card)
        if cfg.lora_save_merged:
            save_model(merged_model(model), tokenizer, out_dir / MERGED_DIR)  # the policy spent: nothing runs after
            write_model_card(out_dir / MERGED_DIR, saved_config(cfg, W), **card)
    baseline.save(out_dir / CRITIC_DIR)  # PPO: the trained critic (critic_model can start from it)
    topology.barrier()
    return {"evals": evals, "seconds": time.perf_counter() - started, "output_dir": str(out_dir)}


def restore(checkpoint: Path, cfg, topology: Topology, out_dir: Path, model, optimizer, scheduler, shuffle,
            source, guard) -> tuple[int, dict]:
    """Resume from `checkpoint` (weights, optimizer, schedule, data position, RNGs): (first step, evaluations).

    Under fsdp the weights went in before sharding; the optimizer state is sharded here.
    """
    if topology.sharded:
        optimizer_state = load_state_file(checkpoint / OPTIMIZER_FILE)
        check_finite_state(optimizer_state, str(checkpoint / OPTIMIZER_FILE))
        topology.load_optimizer_state(model, optimizer, optimizer_state)
    state = load_checkpoint(checkpoint, model=None if topology.sharded else model,
                            optimizer=None if topology.sharded else optimizer, scheduler=scheduler,
                            rng_generators={"shuffle": shuffle},  # RNGs last: nothing draws before
                            hashes=False)  # resolve_resume hashed it
    check_resumable(state["config"], cfg, state["step"], topology.world_size)
    saved_data = state["trainer_state"].get("data") if isinstance(state["trainer_state"], dict) else None
    changed_data = check_data(saved_data, source.fingerprints, checkpoint.name,
                              cfg.resume_allow_changed_data)  # the same rows as then, unless allowed
    evals = load_trainer_state(checkpoint / TRAINER_STATE_FILE, state["trainer_state"], source, guard,
                               past_end=bool(changed_data))  # changed (allowed) or unknown: fewer rows may be
    for warning in changed_data if topology.is_main else ():
        print(warning, file=sys.stderr, flush=True)
    if topology.is_main:  # newer checkpoints: damaged ones kept out of the way, valid ones only deleted if allowed
        for moved in set_aside_damaged(out_dir, state["step"]):
            print(f"resume: {moved.name.split('.damaged')[0]} failed verification; set aside as {moved} "
                  "(nothing deleted)", file=sys.stderr, flush=True)
        discard_newer_checkpoints(out_dir, state["step"], cfg.overwrite_output_dir)
    if cfg.sampler_lag and topology.is_main:
        print(f"resume: sampler_lag={cfg.sampler_lag}: the sampler starts again from the resumed weights (the older "
              "weights it lagged behind are not checkpointed)", file=sys.stderr, flush=True)
    return state["step"] + 1, evals


def fused_adamw(params: list) -> dict:
    """{"fused": True} where torch has a fused AdamW kernel for every parameter (CPU and CUDA, float
    dtypes; FSDP2's DTensors too): one kernel per step instead of a loop over parameters (docs/benchmarks.md,
    item 5)."""
    ok = params and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return {"fused": True} if ok else {}
