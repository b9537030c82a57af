"""The GRPO / GSPO training loop. Read this file first.

One RL step (DESIGN.md, "data flow"):
  B prompts -> G completions each (N = B*G) -> rewards (N,) -> group advantages
  -> pi_old log-probs, once per rollout -> M minibatches, one optimizer step each
  (minibatches 2..M are off-policy: that is where the importance ratio matters)
  -> metrics -> (periodic) evaluation and saving.
What we simplified: a plain KV-cached sampler in the training process (gspo/decode.py, or HF
`generate`), no separate inference engine; the whole rollout in memory. torchrun: gspo/dist.py.

MoE models (docs/moe.md): `routing_replay` fixes the experts of the training forwards to those
recorded at pi_old (old_policy) or at generation (rollout); `moe/expert_change_frac` measures how
many expert choices each optimizer step changes under free routing.
"""

from __future__ import annotations

import copy
import math
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from gspo import dist
from gspo.advantages import group_advantages, group_stats
from gspo.checkpoint import (OPTIMIZER_FILE, capture_rng, check_finite_state, load_checkpoint, load_model_weights,
                             load_state_file, resolve_resume, save_checkpoint, set_aside_damaged)
from gspo.config import TrainConfig, to_dict
from gspo.data import PromptSampler, check_prompt_lengths, columns_of, load_splits
from gspo.evaluation import evaluate
from gspo.logprobs import completion_logprobs, is_fsdp2, position_ids_from_mask
from gspo.moe import (RoutingRecord, expert_change_frac, find_routers, record_routing, replay_routing,
                      require_replay_support)
from gspo.models import resolve_device, seeded_model
from gspo.multitask import TaskMixture
from gspo.objectives import DEFAULT_AGGREGATION, policy_loss
from gspo.rewards import get_reward_fn, score_completions
from gspo.rollout import Rollout, eos_ids, generate, pad_id, row_seeds
from gspo.run_control import (NonFiniteGuard, Progress, StepAbandoned, StopSignals, TrainingInterrupted,
                              check_resumable, discard_newer_checkpoints, prepare_output_dir, run_lock, save_model,
                              saved_config)
from gspo.schedules import lr_schedule
from gspo.supervised import reference_chunks, require_references, sft_backward, sft_coef_at
from gspo.tracking import MetricsLogger


def train(cfg: TrainConfig) -> dict:
    """Run GRPO/GSPO as configured; returns a summary (evaluations before/after, time).

    Under torchrun every rank calls this; see gspo/dist.py for how the work is split.
    """
    d = dist.setup(resolve_device(cfg.device), cfg.distributed, cfg.dist_timeout_s)
    try:
        with run_lock(cfg.output_dir, enabled=d.is_main):  # one run per output_dir (rank 0 holds it)
            return _train(cfg, d)
    finally:
        dist.teardown(d)


def _train(cfg: TrainConfig, d: dist.Dist) -> dict:
    started = time.perf_counter()
    resuming = cfg.resume_from_checkpoint is not None
    out_dir = prepare_output_dir(cfg, resuming) if d.is_main else Path(cfg.output_dir)  # an earlier run there: error
    dist.barrier(d)
    checkpoint = resolve_resume(cfg.resume_from_checkpoint, out_dir) if resuming else None  # hashed in full
    device, model, tokenizer = seeded_model(cfg)
    replay = cfg.routing_replay != "none"
    if replay:
        require_replay_support(model)  # dense or unsupported MoE: a clear ValueError before any rollout
    drift = cfg.log_routing_drift and bool(find_routers(model))  # MoE models
    ref_model = dist.wrap(frozen_copy(model), d) if cfg.kl_coef > 0 else None
    B, G, M = cfg.per_device_batch_size, cfg.num_generations, cfg.num_minibatches
    W, seeded, fsdp = d.world_size, cfg.seeded_sampling or d.enabled, d.enabled and d.mode == "fsdp"
    if fsdp and checkpoint is not None:  # fsdp shards what it wraps: the checkpoint's weights go in first
        load_model_weights(model, checkpoint)  # checked finite before they are copied in
    model = dist.wrap(model, d)
    units = "tokens" if (cfg.aggregation or DEFAULT_AGGREGATION[cfg.objective]) == "token_mean" else "sequences"
    # Several tasks (gspo/multitask.py): the mixture samples, scores and evaluates task by task.
    mixture = TaskMixture.from_config(cfg, tokenizer, max(1000, cfg.max_steps * B * W)) if cfg.tasks else None
    train_rows, eval_rows = (load_splits(cfg, tokenizer, num_train=max(1000, cfg.max_steps * B * W))
                             if mixture is None else ([], []))
    # Every prompt of every task, train and held-out, is length-checked now, not when first drawn.
    for rows in ([train_rows, eval_rows] if mixture is None else [*mixture.train_rows, *mixture.eval_rows]):
        check_prompt_lengths(rows, tokenizer, cfg.max_prompt_length, cfg.truncate_prompts)
    reward_fns = [get_reward_fn(spec, sandbox=cfg.sandbox) for spec in cfg.reward_funcs]
    sampler = PromptSampler(train_rows, cfg.seed) if mixture is None else mixture
    if cfg.sft_coef > 0:
        require_references([train_rows] if mixture is None else mixture.train_rows, cfg.sft_column)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay, **fused_adamw(model))
    total_updates = cfg.max_steps * M * cfg.num_epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg.lr_scheduler, cfg.warmup_steps, total_updates))
    guard = NonFiniteGuard(cfg.max_consecutive_skips)
    shuffle = torch.Generator().manual_seed(cfg.seed)
    loss_kwargs = dict(objective=cfg.objective, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                       aggregation=cfg.aggregation, norm_length=cfg.max_completion_length,
                       kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator)
    logp_kwargs = dict(temperature=cfg.temperature, chunk_size=cfg.logprob_chunk_size)

    def save_checkpoint_now(step: int, resume_point: dict | None = None) -> Path | None:
        # Every rank holds the same state (replicas, same RNG draws): rank 0 writes it. Under fsdp
        # every rank first helps gather the full weights and optimizer state (single-process layout).
        # `resume_point`: the RNG and data-sampler states taken when step `step` + 1 began (a step
        # dropped unfinished leaves weights, optimizer and schedule as step `step` left them).
        resume_point = resume_point or {"rng": None, "sampler": sampler.state_dict()}
        path = out_dir / f"checkpoint-{step}"
        weights = dist.full_state_dict(model, d) if fsdp else None
        optimizer_state = dist.full_optimizer_state(model, optimizer, d) if fsdp else None
        if d.is_main:
            path = save_checkpoint(out_dir, step, model=model, tokenizer=tokenizer, model_state_dict=weights,
                                   optimizer=None if fsdp else optimizer, optimizer_state_dict=optimizer_state,
                                   scheduler=scheduler, config=saved_config(cfg, W), rng_generators={"shuffle": shuffle},
                                   rng_state=resume_point["rng"], keep=cfg.save_total_limit, trainer_state={
                                       "sampler": resume_point["sampler"], "guard": guard.state_dict(),
                                       "evals": {str(k): v for k, v in evals.items()}, "world_size": W})
        dist.barrier(d)
        return path

    def evaluate_now() -> dict:  # several tasks: per-task metrics and their means
        return evaluate(model, tokenizer, eval_rows, cfg) if mixture is None else mixture.evaluate(model, tokenizer, cfg)

    if checkpoint is None:
        logger = MetricsLogger(out_dir, tensorboard=cfg.tensorboard, wandb=cfg.wandb,
                               wandb_project=cfg.wandb_project, config=to_dict(cfg), enabled=d.is_main)
        evals = {0: evaluate_now()}
        logger.log(0, evals[0])
        first = 1
    else:  # exact resume: weights, optimizer, schedule, data position and RNG states as they were
        if fsdp:  # weights went in before sharding; the optimizer state is sharded now (checked finite first)
            optimizer_state = load_state_file(checkpoint / OPTIMIZER_FILE)
            check_finite_state(optimizer_state, str(checkpoint / OPTIMIZER_FILE))
            dist.load_optimizer_state(model, optimizer, optimizer_state)
        state = load_checkpoint(checkpoint, model=None if fsdp else model, optimizer=None if fsdp else optimizer,
                                scheduler=scheduler, rng_generators={"shuffle": shuffle},  # RNGs last: draw nothing before
                                hashes=False)  # resolve_resume hashed it
        check_resumable(state["config"], cfg, state["step"], W)
        if d.is_main:  # newer checkpoints: damaged ones kept out of the way, valid ones only deleted if allowed
            for moved in set_aside_damaged(out_dir, state["step"]):
                print(f"resume: {moved.name.split('.damaged')[0]} failed verification; set aside as {moved} "
                      "(nothing deleted)", file=sys.stderr, flush=True)
            discard_newer_checkpoints(out_dir, state["step"], cfg.overwrite_output_dir)
        sampler.load_state_dict(state["trainer_state"]["sampler"])
        guard.load_state_dict(state["trainer_state"]["guard"])
        evals = {int(k): v for k, v in state["trainer_state"]["evals"].items()}
        logger = MetricsLogger(out_dir, tensorboard=cfg.tensorboard, wandb=cfg.wandb, wandb_project=cfg.wandb_project,
                               config=to_dict(cfg), truncate_after_step=state["step"],  # drop lines past it
                               enabled=d.is_main)
        first = state["step"] + 1
    progress = Progress(cfg.max_steps, enabled=cfg.progress and d.is_main)
    progress.update(first - 1, {})
    model.train()
    stop = StopSignals()
    try:
        for step in range(first, cfg.max_steps + 1):
            t0 = time.perf_counter()
            # Until the first optimizer step a signal drops the step whole (StopSignals); a checkpoint
            # of step - 1 then needs the RNG and sampler states as this step found them. One process
            # only: under torchrun the ranks agree to stop at the end of the step.
            resume_point = {"rng": capture_rng({"shuffle": shuffle}), "sampler": copy.deepcopy(sampler.state_dict())}
            stop.abandonable = not d.enabled
            batch = sampler.next(B * W)  # every rank draws the global batch and keeps its share
            rows = batch[d.rank * B : (d.rank + 1) * B]
            # 1. Rollout: G completions per prompt, sampled from the current policy (= pi_old).
            #    Routing replay "rollout" (R3) keeps the experts the sampler used: rollout.routing.
            rollout = generate(model, tokenizer, [r["prompt"] for r in rows], G,
                               max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                               top_p=cfg.top_p, top_k=cfg.top_k, max_prompt_length=cfg.max_prompt_length,
                               truncate_prompts=cfg.truncate_prompts, with_logprobs=cfg.use_sampler_logprobs,
                               routing_recorder=record_routing(model) if cfg.routing_replay == "rollout" else None,
                               row_seeds=row_seeds(cfg.seed, step, d.rank * B * G, B * G) if seeded else None,
                               backend=cfg.generation_backend)
            # 2. Rewards, then advantages normalised within each group of G.
            #    A dropped sample (bad reward, drop_bad_rewards) has a NaN reward and advantage 0.
            if mixture is None:
                rewards, per_fn = score_completions(reward_fns, cfg.reward_weights, rollout.prompts, rollout.completions,
                                                    columns_of(rows, G), drop_bad=cfg.drop_bad_rewards,
                                                    timeout_s=cfg.reward_timeout_s)
            else:  # each task's own reward functions; this rank's rows start at row d.rank * B of the batch
                rewards, per_fn = mixture.score(rows, rollout.prompts, rollout.completions, G,
                                                drop_bad=cfg.drop_bad_rewards, offset=d.rank * B,
                                                timeout_s=cfg.reward_timeout_s)
            if d.enabled:  # every rank gets the whole rollout (N = B * G * world) and every reward
                rollout, rewards = dist.gather_rollout(rollout, rewards, pad_id(tokenizer, model), d)
                per_fn = {k: torch.cat([part[k] for part in dist.gather_objects(per_fn, d)]) for k in per_fn}
            valid = torch.isfinite(rewards)  # (N,)
            task_metrics = mixture.observe(rewards, valid, G) if mixture is not None else {}  # and dynamic weights
            rollout.rewards = rewards.to(device)  # (N,)
            rollout.advantages = group_advantages(rewards, G, scale=cfg.advantage_scale, valid=valid).to(device)  # (N,)
            # 3. pi_old log-probs, once per rollout, on the same minibatches (same shapes) the first
            #    epoch trains on. The first minibatch is on-policy (same weights, same shapes): its pi_old
            #    is the first training forward's own log-probs, detached (ratio exactly 1), so it is not
            #    computed here, unless routing replay "old_policy" (GSPO sec. 5.3) needs the experts this
            #    forward records for every training forward. Under torchrun each rank computes its part
            #    of every minibatch; the rows are summed across ranks.
            minibatches = torch.randperm(rollout.num_sequences, generator=shuffle).chunk(M)
            mine = [idx.chunk(W)[d.rank] for idx in minibatches]
            reuse_first = not cfg.use_sampler_logprobs and cfg.routing_replay != "old_policy"
            with torch.no_grad():
                if cfg.use_sampler_logprobs:  # GSPO sec. 5.4: the sampler's likelihoods serve as pi_old
                    rollout.old_logprobs = rollout.sampler_logprobs
                else:
                    rollout.old_logprobs, recorded = minibatch_logprobs_and_routing(
                        model, rollout, mine[1:] if reuse_first else mine, logp_kwargs,
                        replay=cfg.routing_replay == "rollout", record=cfg.routing_replay == "old_policy")
                    rollout.old_logprobs = dist.all_sum(rollout.old_logprobs, d)  # (N, T)
                    if cfg.routing_replay == "old_policy":  # each rank recorded its rows: every rank gets them all
                        rollout.routing = dist.merge_records(recorded, d)
                if ref_model is not None:
                    rollout.ref_logprobs = dist.all_sum(minibatch_logprobs(ref_model, rollout, mine, logp_kwargs), d)
            t_rollout = time.perf_counter() - t0
            stop.abandonable = False  # from here on the step changes the weights: it is finished first

            # 4. One optimizer step per minibatch (with sft_coef, minibatch i also fits references part i).
            step_stats: list[dict] = []
            sft_coef = sft_coef_at(step, cfg.max_steps, cfg.sft_coef, cfg.sft_schedule)
            # Under torchrun every rank fits the whole (small) reference part i and takes 1/W of its gradient.
            refs = reference_chunks(batch, tokenizer, M, cfg.sft_column, max_prompt_length=cfg.max_prompt_length,
                                    device=device, truncate_prompts=cfg.truncate_prompts) if sft_coef > 0 else None
            for epoch in range(cfg.num_epochs):
                if epoch > 0:
                    minibatches = torch.randperm(rollout.num_sequences, generator=shuffle).chunk(M)
                for i, idx in enumerate(minibatches):
                    rows = idx.chunk(W)[d.rank]  # this rank's part of the minibatch (all of it in one process)
                    mb = local = rollout.select(rows)
                    # Drift is measured with free routing: under replay that needs its own forward.
                    before = free_routing(model, mb) if drift and replay else None
                    # Replay spans forward and backward (a checkpointed recompute must see the same experts);
                    # the free-routing recorder only the forward.
                    with replay_routing(model, mb.routing) if replay else nullcontext() as replayer:
                        with record_routing(model) if drift and not replay else nullcontext() as recorder:
                            logp, entropy = completion_logprobs(model, mb.input_ids, mb.attention_mask,
                                                                mb.completion_len, with_entropy=True,
                                                                **logp_kwargs)  # (n, t), (n, t)
                        on_policy = reuse_first and epoch == 0 and i == 0
                        if on_policy:  # step 3 left this minibatch's pi_old to this forward
                            mb.old_logprobs = logp.detach()  # (n, t)
                            rollout.old_logprobs[rows, : mb.completion_len] = mb.old_logprobs
                        loss, stats = policy_loss(logp, mb.old_logprobs, mb.advantages, mb.completion_mask,
                                                  ref_logprobs=mb.ref_logprobs, **loss_kwargs)
                        optimizer.zero_grad(set_to_none=True)
                        if d.enabled:  # this rank's share of the global minibatch's loss
                            loss = loss * dist.grad_scale(d, *share(rollout, idx, mb, units))
                        loss.backward()
                    sft_stats = {}
                    if refs is not None:  # supervised term: its own forward and backward, outside routing replay
                        term, sft_stats["loss/sft"] = sft_backward(model, refs[i], sft_coef * dist.grad_scale(d, 1, W),
                                                                   **logp_kwargs)
                        loss, sft_stats["sft/coef"] = loss.detach() + term, sft_coef
                    if d.enabled:
                        dist.average_gradients(model, d)
                        stats, entropy, mb = global_stats(rollout, idx, mb, logp, entropy, loss_kwargs, d, on_policy)
                        loss = torch.tensor(math.nan if dist.flag_any(not torch.isfinite(loss), d) else 0.0)
                    stats.update(sft_stats)
                    stats["grad/norm"] = grad_norm(model, cfg.max_grad_norm)
                    if torch.isfinite(loss) and torch.isfinite(stats["grad/norm"]):
                        optimizer.step()
                        scheduler.step()
                        guard.ok()
                    else:  # non-finite guard: weights are never updated with NaN/inf (nor the schedule advanced)
                        optimizer.zero_grad(set_to_none=True)
                        guard.skip(step, loss, stats["grad/norm"])
                    stats["entropy"] = (entropy.detach() * mb.completion_mask).sum() / mb.completion_mask.sum()
                    if drift:  # after the step, free routing again: which expert choices did it change?
                        before = before if before is not None else recorder.record()
                        records = minibatch_records(rollout, idx, d, before, free_routing(model, local))
                        stats.update(routing_stats("moe/expert_change_frac", *records, completion_positions(mb)))
                    if replay:  # how often the replayed experts overrule the routers' own choice
                        records = minibatch_records(rollout, idx, d, local.routing, replayer.free_record())
                        stats["moe/replay_mismatch_frac"] = expert_change_frac(*records, completion_positions(mb))[0]
                    step_stats.append(stats)
            t_train = time.perf_counter() - t0 - t_rollout

            # 5. Metrics.
            lengths = rollout.completion_mask.sum(-1).float()  # (N,)
            metrics = {
                "reward/mean": rewards[valid].mean().item(),
                "reward/std": rewards[valid].std().item(),
                **{f"reward/{name}": float(np.nanmean(v.numpy())) if not torch.isnan(v).all() else float("nan")
                   for name, v in per_fn.items()},
                **group_stats(rewards, G, valid),
                **task_metrics,
                **({"reward/dropped": int((~valid).sum())} if cfg.drop_bad_rewards else {}),
                "guard/skipped_steps": guard.skipped,
                **reduce_stats(step_stats),
                "completion/mean_len": lengths.mean().item(),
                "completion/max_len": lengths.max().item(),
                "completion/truncated_frac": (~ended_with_eos(rollout, eos_ids(tokenizer, model))).float().mean().item(),
                "lr": scheduler.get_last_lr()[0],
                "time/rollout_s": t_rollout,
                "time/train_s": t_train,
                "throughput/tokens_per_s": lengths.sum().item() / (t_rollout + t_train),
            }
            if cfg.eval_steps and step % cfg.eval_steps == 0 and step != cfg.max_steps:
                evals[step] = evaluate_now()
                metrics.update(evals[step])
            if step == cfg.max_steps:
                evals[step] = evaluate_now()
                metrics.update(evals[step])
            logger.log(step, metrics)
            if cfg.log_samples_steps and (step % cfg.log_samples_steps == 0 or step == 1):
                logger.log_samples(step, sample_records(rollout, cfg.log_samples_count))
            progress.update(step, metrics)
            if d.enabled and dist.flag_any(bool(stop.requested), d):  # one rank's signal stops them all
                stop.requested = stop.requested or signal.SIGTERM
            if (cfg.save_steps and step % cfg.save_steps == 0) or step == cfg.max_steps or stop.requested:
                saved = save_checkpoint_now(step)
                if stop.requested and step < cfg.max_steps:  # SIGINT / SIGTERM: stop cleanly, resumable
                    progress.close()
                    logger.close()
                    stop.restore()
                    raise TrainingInterrupted(stop.requested, step, saved)
    except StepAbandoned as stopped:  # a signal before the step's first optimizer step: drop it whole
        saved = save_checkpoint_now(step - 1, resume_point)
        progress.close()
        logger.close()
        stop.restore()
        raise TrainingInterrupted(stopped.signum, step - 1, saved) from None

    stop.restore()
    progress.close()
    full = dist.full_state_dict(model, d) if fsdp else None  # every rank takes part in gathering the shards
    if d.is_main:
        save_model(model, tokenizer, out_dir / "model", state_dict=full)
    dist.barrier(d)
    logger.close()
    return {"evals": evals, "seconds": time.perf_counter() - started, "output_dir": str(out_dir)}


# ------------------------------------------------------------------------------- helpers
def minibatch_logprobs(model, rollout: Rollout, minibatches, logp_kwargs, *, replay: bool = False) -> torch.Tensor:
    """(N, T) log-probs computed minibatch by minibatch, on the trimmed shapes training uses.

    `replay`: route every forward by `rollout.routing` (gspo.moe.replay_routing).
    """
    return minibatch_logprobs_and_routing(model, rollout, minibatches, logp_kwargs, replay=replay)[0]


def minibatch_logprobs_and_routing(model, rollout: Rollout, minibatches, logp_kwargs, *, replay: bool = False,
                                   record: bool = False) -> tuple[torch.Tensor, RoutingRecord | None]:
    """`minibatch_logprobs`, and with `record` the experts those forwards used.

    The record is full width, (R, N, P+T, k) like `rollout.input_ids`: each minibatch's trimmed
    columns are written back in place and the trimmed-away (all-padding) ones are -1, so a
    later epoch's reshuffled minibatches can `select` and replay it.
    """
    out = torch.zeros(rollout.completion_mask.shape, dtype=torch.float32, device=rollout.input_ids.device)
    full = None
    for idx in minibatches:
        mb = rollout.select(idx)
        with replay_routing(model, mb.routing) if replay else nullcontext():
            with record_routing(model) if record else nullcontext() as recorder:
                logp, _ = completion_logprobs(model, mb.input_ids, mb.attention_mask, mb.completion_len,
                                              **logp_kwargs)
        out[idx, : mb.completion_len] = logp
        if record:
            full = widen_record(rollout, idx, recorder.record(), into=full)  # (R, N, P+T, k)
    return out, full


def widen_record(rollout: Rollout, rows: torch.Tensor, part: RoutingRecord, into: RoutingRecord | None = None
                 ) -> RoutingRecord:
    """A minibatch's record (R, n, l, k) written into the rollout's (R, N, P+T, k) layout (-1 elsewhere)."""
    if into is None:
        R, _, _, k = part.indices.shape
        into = RoutingRecord(part.indices.new_full((R, *rollout.input_ids.shape, k), -1), part.layers)
    left, cut, _ = rollout.trim(rows)
    into.indices[:, rows.to(into.indices.device), left:cut] = part.indices
    return into


def minibatch_records(rollout: Rollout, idx: torch.Tensor, d, *records: RoutingRecord) -> list[RoutingRecord]:
    """Records of this rank's part of minibatch `idx`, as records of the whole minibatch (every rank's rows)."""
    if not d.enabled:
        return list(records)
    mine = idx.chunk(d.world_size)[d.rank]
    left, cut, _ = rollout.trim(idx)
    return [dist.merge_records(widen_record(rollout, mine, r), d).select(idx, slice(left, cut)) for r in records]


@torch.no_grad()
def free_routing(model, mb: Rollout) -> RoutingRecord:
    """(R, n, l, k) experts the routers pick on their own for `mb`: one no-grad backbone forward.

    Same inputs as `completion_logprobs`, so at equal weights it matches the training forward's
    free routing exactly; the output head is skipped (the logits do not matter here).
    """
    sharded = is_fsdp2(model)  # fsdp: the root's forward must run (it gathers the embedding), with one logit row
    backbone = model.get_decoder() if hasattr(model, "get_decoder") and not sharded else model
    with record_routing(model) as recorder:
        backbone(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                 position_ids=position_ids_from_mask(mb.attention_mask), use_cache=False,
                 **({"logits_to_keep": 1} if sharded else {}))
    return recorder.record()


def completion_positions(mb: Rollout) -> torch.Tensor:
    """(n, l) bool: the positions whose hidden states give the completion log-probs.

    Completion token j (column P+j) is predicted at column P+j-1, so these are the last prompt
    token and every real completion token but the last (whose output predicts nothing we score).
    """
    n, width = mb.input_ids.shape
    T = mb.completion_len
    positions = torch.zeros(n, width, dtype=torch.bool, device=mb.input_ids.device)  # (n, P+T)
    positions[:, width - T - 1 : width - 1] = mb.completion_mask  # (n, T) shifted left by one
    return positions


def routing_stats(name: str, before: RoutingRecord, after: RoutingRecord, positions: torch.Tensor) -> dict:
    """`name` (all routers) and `name/layer_<i>` (decoder layer i): expert_change_frac at `positions`."""
    overall, per_layer = expert_change_frac(before, after, positions)
    return {name: overall, **{f"{name}/layer_{layer}": v for layer, v in zip(before.layers, per_layer)}}


def reduce_stats(step_stats: list[dict]) -> dict[str, float]:
    """Average minibatch stats over the step; extremes of the ratio keep their extremes.

    `grad/norm_std` is the spread of the gradient norm across the step's minibatches (GSPO
    sec. 4: token-level ratios make gradients noisier); 0 with a single minibatch.
    """
    out = {}
    for key in step_stats[0]:
        values = torch.stack([torch.as_tensor(s[key]).float() for s in step_stats])
        if key == "ratio/min":
            out[key] = values.min().item()
        elif key == "ratio/max":
            out[key] = values.max().item()
        else:
            out[key] = values.mean().item()
        if key == "grad/norm":
            out["grad/norm_std"] = values.std().item() if len(values) > 1 else 0.0
    return out


def grad_norm(model, max_norm: float) -> torch.Tensor:
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor


def share(rollout: Rollout, idx: torch.Tensor, mb: Rollout, units: str) -> tuple[float, float]:
    """(this rank's, the global minibatch's) count of the units the loss averages over."""
    if units == "tokens":
        return float(mb.completion_mask.sum()), float(rollout.completion_mask[idx].sum())
    return float(mb.num_sequences), float(len(idx))


def global_stats(rollout: Rollout, idx, mb: Rollout, logp, entropy, loss_kwargs, d, on_policy: bool = False
                 ) -> tuple[dict, torch.Tensor, Rollout]:
    """Statistics of the global minibatch from every rank's rows: the single-process values.

    `on_policy`: these log-probs are also the minibatch's pi_old (every rank's rows go into the rollout).
    """
    N, T = rollout.completion_mask.shape
    mine = idx.chunk(d.world_size)[d.rank]
    logp_all = dist.fill_rows(logp.detach(), mine, (N, T), d)  # (N, T)
    ent_all = dist.fill_rows(entropy.detach(), mine, (N, T), d)  # (N, T)
    if on_policy:
        rollout.old_logprobs[idx] = logp_all[idx]
    whole = rollout.select(idx)
    t = whole.completion_len
    with torch.no_grad():
        _, stats = policy_loss(logp_all[idx, :t], whole.old_logprobs, whole.advantages, whole.completion_mask,
                               ref_logprobs=whole.ref_logprobs, **loss_kwargs)
    return stats, ent_all[idx, :t], whole



def ended_with_eos(rollout: Rollout, stop_ids: list[int]) -> torch.Tensor:
    """(N,) True where the completion stopped on a stop token rather than at the length limit."""
    T = rollout.completion_len
    completion = rollout.input_ids[:, -T:]  # (N, T)
    last = rollout.completion_mask.sum(-1) - 1  # (N,) index of the last real token
    final = completion.gather(1, last[:, None]).squeeze(1)  # (N,)
    return torch.isin(final, torch.tensor(stop_ids, device=final.device))


def sample_records(rollout: Rollout, count: int) -> list[dict]:
    return [{"prompt": rollout.prompts[i], "completion": rollout.completions[i],
             "reward": rollout.rewards[i].item(), "advantage": rollout.advantages[i].item()}
            for i in range(min(count, rollout.num_sequences))]


def fused_adamw(model) -> dict:
    """{"fused": True} where torch has a fused AdamW kernel for every parameter (CPU and CUDA, float
    dtypes; FSDP2's DTensors too): one kernel per step instead of a loop over parameters (BENCHMARKS.md, item 5)."""
    params = list(model.parameters())
    ok = params and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return {"fused": True} if ok else {}


def frozen_copy(model):
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
