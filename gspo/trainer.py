"""The GRPO / GSPO training loop. Read this file first.

One RL step (docs/design.md, "The shape of the trainer"):
  1. sample   B prompts -> G completions each (N = B*G), from the current policy (= pi_old)
  2. score    rewards (N,), each reward function's values, lengths (with dynamic_sampling, groups whose
              rewards all agree give way to more prompts' until B groups do not: gspo/rounds.py)
  3. prepare  the minibatch plan, pi_old (and pi_ref) log-probs, advantages: one Batch
  4. update   M minibatches x num_epochs, one optimizer step each (minibatches 2..M are
              off-policy: that is where the importance ratio matters)
  5. metrics  one line of metrics.jsonl
  6. evaluate / log samples / checkpoint, periodically
Everything optional is a plug (gspo/plugs/protocols.py: the Protocols) built once before the loop
(gspo/run.py: build_run) from its own config section, with a do-nothing twin, so the loop never asks which
case it is in: the Topology (one process, DDP, FSDP2: gspo/plugs/parallel.py), the Sampler (gspo/rollout/),
Routing (MoE replay and drift: gspo/plugs/routing.py), the prompt source (one task or a mixture:
gspo/data/source.py), the auxiliary term (SFT: gspo/plugs/auxiliary.py), the baseline
(gspo/plugs/baselines.py: the group's rewards, or PPO's critic, trained on the same minibatches), the
reference policy of the KL term (gspo/plugs/reference.py: none, a frozen copy, or LoRA's base with the
adapters off: gspo/plugs/lora.py) and the forwards' precision (gspo/plugs/precision.py: bf16 autocast or
none). The sampler is the policy itself (gspo/rollout/decode.py or HF `generate`), a copy of it (low
precision, stale: sampler_dtype, sampler_lag), an inference engine colocated in this process (vllm) or
endpoints sampling up to max_staleness steps ahead (rollout_endpoints, or rollout_workers the run starts:
gspo/rollout/endpoint/rollouts.py, fed by gspo/rollout/feed.py); where its distribution mu is not pi_old,
`mismatch/*` measure by how much and a rollout correction (gspo/algo/correction.py) weighs the updates by pi_old/mu.
The whole rollout stays in memory.
"""

from __future__ import annotations

import signal
import time

from gspo.callbacks import Callbacks
from gspo.checkpoint import capture_rng
from gspo.config import TrainConfig
from gspo.models import resolve_device
from gspo.plugs.parallel import Topology
from gspo.rollout.endpoint.client import EndpointLost
from gspo.run import Run, build_run
from gspo.runtime import (
    Progress,
    StepAbandoned,
    StopSignals,
    Terminated,
    TrainingAborted,
    TrainingInterrupted,
    run_lock,
    sigterm_raises,
)
from gspo.step import episode_stats, mismatch_stats, prepare, sample_records, step_metrics
from gspo.tracking import check_trackers

PROGRESS_LINE = ("reward/mean", "reward/std", "loss/policy", "completion/mean_len", "eval/accuracy", "eval/reward")


def train(cfg: TrainConfig, *, model=None, tokenizer=None, data: dict | None = None, callbacks=()) -> dict:
    """Run GRPO/GSPO as configured; returns a summary (evaluations before/after, time).

    From Python (gspo.Trainer, gspo/apps/api.py) objects may stand in for what the config names: `model` (and its
    `tokenizer`, None: loaded from the model's path) for the `model` setting, `data` ({name: rows}) for the
    datasets the config names "object:<name>" (gspo/given.py); `callbacks` are called after every step
    (gspo/callbacks.py: one may end the run). Under torchrun every rank calls this; see gspo/plugs/parallel.py for
    how the work is split.
    """
    callbacks = Callbacks(callbacks)  # checked before anything starts
    if cfg.launcher != "process":
        raise ValueError(f"launcher={cfg.launcher}: `gspo train --config ...` places the run's processes "
                         "(gspo.apps.ray_launch.launch(cfg) from Python); train() runs one process of a run")
    topology = Topology.setup(resolve_device(cfg.device), cfg.distributed, cfg.dist_timeout_s)
    try:
        # under torchrun a SIGTERM before the steps (or after) first asks whether a rank was lost (train_loop's
        # StopSignals handle it during the steps)
        with sigterm_raises(topology.heartbeat is not None):
            if topology.is_main:  # rank 0 logs: its tracker packages are checked before output_dir is created
                check_trackers(cfg.tensorboard, cfg.wandb)
            with run_lock(cfg.output_dir, enabled=topology.is_main):  # one run per output_dir (rank 0 holds it)
                started = time.perf_counter()
                run = build_run(cfg, topology, model, tokenizer, data)
                metrics = train_loop(run, callbacks)
                run.checkpoints.save_model(metrics)
                return {"evals": run.evals, "seconds": time.perf_counter() - started,
                        "output_dir": str(run.out_dir)}
    except TrainingAborted:
        raise
    except (RuntimeError, Terminated) as err:  # a failed collective (gloo names a dead peer by address), a bug, or
        topology.raise_if_rank_lost(err)  # torchrun's SIGTERM: another rank ended? one line naming it instead
        if isinstance(err, Terminated):  # no rank lost: end as SIGTERM's default action would
            signal.signal(err.signum, signal.SIG_DFL)
            signal.raise_signal(err.signum)
        raise
    finally:
        topology.teardown()


def train_loop(run: Run, callbacks: Callbacks) -> dict:
    """The RL steps, run.first to max_steps, each the six stages; returns the last step's metrics."""
    cfg, topology, G = run.cfg, run.topology, run.cfg.num_generations
    if not run.held_out:
        run.say(f"evaluation off ({'eval_num_prompts=0' if cfg.eval_num_prompts == 0 else 'no held-out rows'})")
    elif not run.resumed:
        run.logger.log(0, run.evaluate(0))
    progress = Progress(cfg.max_steps, enabled=cfg.progress and topology.is_main, every=cfg.logging_steps,
                        line=PROGRESS_LINE)  # without a terminal: the line printed every logging_steps
    progress.update(run.first - 1, {})
    run.model.train()
    stop = StopSignals()
    metrics: dict = {}  # the last step's, for the model card
    try:
        for step in range(run.first, cfg.max_steps + 1):
            t0 = time.perf_counter()
            # Until the step's first update a signal drops it whole (StopSignals); a checkpoint of
            # step - 1 then needs the RNG states as this step found them (the feed keeps the rest).
            resume_rng = capture_rng({"shuffle": run.shuffle})
            stop.abandonable = topology.can_abandon_step
            # 1-2. Sample and score: every rank draws the global batch and keeps its B prompts (whole groups;
            #    rollout workers were asked for it max_staleness steps ago), scores them, and then holds every
            #    sequence's scalars (a dropped sample, drop_bad_rewards: a NaN reward and advantage 0). With
            #    dynamic_sampling, groups whose rewards agree give way to those of extra rounds (gspo/rounds.py).
            with run.autocast():
                drawn = run.rounds.draw(step)
            examples, rollout, scores, per_fn = drawn.examples, drawn.rollout, drawn.scores, drawn.per_fn
            # 3. Prepare: the minibatch plan, pi_old and pi_ref log-probs, advantages (a critic's values), once.
            with run.autocast():
                batch = prepare(rollout, scores, plan=run.plan, objective=run.objective, logp_kwargs=run.logp_kwargs,
                                topology=topology, routing=run.routing, model=run.model, reference=run.reference,
                                baseline=run.baseline, shuffle=run.shuffle)
            t_rollout = time.perf_counter() - t0
            stop.abandonable = False  # from here on the step changes the weights: it is finished first
            # 4. Update: one optimizer step per minibatch (with sft_coef, minibatch i also fits references part i;
            #    a critic takes its own step on the same minibatch).
            run.aux.begin_step(step, examples)
            step_stats = [run.learner.update(batch, i, part, on_policy=on_policy, step=step)
                          for i, part, on_policy in batch.minibatches()]
            sampler_stats = {**run.sampler.sync(run.model),  # time/sync_s
                             **mismatch_stats(batch.rollout, topology), **episode_stats(batch.rollout, topology)}
            t_train = time.perf_counter() - t0 - t_rollout
            # 5. Metrics.
            metrics = step_metrics(scores, step_stats, {**drawn.stats, **batch.stats, **sampler_stats}, group_size=G,
                                   drop_bad=cfg.drop_bad_rewards, skipped=run.learner.guard.skipped,
                                   lr=run.learner.scheduler.get_last_lr()[0], t_generate=drawn.generate_s,
                                   t_rollout=t_rollout, t_train=t_train)
            # 6. Evaluate, call back, log, checkpoint.
            if end_of_step(run, callbacks, progress, stop, step, metrics, rollout, per_fn):
                break
    except StepAbandoned as stopped:  # a signal before the step's first optimizer step: drop it whole
        saved = run.checkpoints.save(step - 1, resume_rng)
        raise TrainingInterrupted(stopped.signum, step - 1, saved) from None
    except EndpointLost as lost:  # raised as step `step` waits for its rollout: nothing of it applied
        raise worker_lost(run, lost, step, resume_rng) from None
    except RuntimeError as err:  # a failed collective: another rank ended? Found while our SIGTERM handler is in
        stop.abandonable = False  # place (torchrun's SIGTERM follows a rank's death: never the default action)
        topology.raise_if_rank_lost(err)
        raise
    finally:
        stop.restore()
        run.sampler.close()
        progress.close()
        run.logger.close()
    return metrics


def end_of_step(run: Run, callbacks: Callbacks, progress: Progress, stop: StopSignals, step: int, metrics: dict,
                rollout, per_fn: dict) -> bool:
    """Stage 6: evaluate, call back (a callback's "stop" ends the run here, as max_steps would), log, checkpoint
    (and stop on a signal, resumable); True after the last step."""
    cfg, topology = run.cfg, run.topology
    last = step == cfg.max_steps
    if (cfg.eval_steps and step % cfg.eval_steps == 0) or last:
        metrics.update(run.evaluate(step))
    last = topology.any(callbacks.on_step_end(step, metrics)) or last  # one rank's stop stops them all
    if last and step not in run.evals:  # stopped early: the final evaluation
        metrics.update(run.evaluate(step))
    run.logger.log(step, metrics)
    if cfg.log_samples_steps and (step % cfg.log_samples_steps == 0 or step == 1):
        run.logger.log_samples(step, sample_records(rollout, cfg.log_samples_count, per_fn))  # rank 0's rows
    progress.update(step, metrics)
    if topology.any(bool(stop.requested)):  # one rank's signal stops them all
        stop.requested = stop.requested or signal.SIGTERM
    if (cfg.save_steps and step % cfg.save_steps == 0) or last or stop.requested:
        saved = run.checkpoints.save(step)
        if stop.requested and not last:  # SIGINT / SIGTERM: stop cleanly, resumable
            raise TrainingInterrupted(stop.requested, step, saved)
    return last


def worker_lost(run: Run, lost: EndpointLost, step: int, resume_rng: dict) -> TrainingAborted:
    """The error ending a run whose rollout worker was lost as step `step` waited for it (nothing of the step was
    applied): alone, the run first saves step - 1; under torchrun the other ranks stop as this one ends."""
    if run.topology.enabled:
        return TrainingAborted(f"rank {run.topology.rank}: {lost}\nstopped in step {step}; continue from the latest "
                               "checkpoint with --resume latest")
    saved = run.checkpoints.save(step - 1, resume_rng, wait=False)
    return TrainingAborted(f"{lost}\nstopped after step {step - 1}; checkpoint saved to {saved}; continue with "
                           "--resume latest (rollouts the worker had not returned are sampled again)")
