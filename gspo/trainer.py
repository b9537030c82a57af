"""The GRPO / GSPO training loop. Read this file first.

One RL step (DESIGN.md, "data flow"):
  B prompts -> G completions each (N = B*G) -> rewards (N,) -> group advantages
  -> pi_old log-probs, once per rollout -> M minibatches, one optimizer step each
  (minibatches 2..M are off-policy: that is where the importance ratio matters)
  -> metrics -> (periodic) evaluation and saving.
What we simplified: one process, HF `generate` as the sampler, the whole rollout in memory.

MoE models (docs/moe.md): `routing_replay` fixes the experts of the training forwards to those
recorded at pi_old (old_policy) or at generation (rollout); `moe/expert_change_frac` measures how
many expert choices each optimizer step changes under free routing.
"""

from __future__ import annotations

import copy
import math
import random
import shutil
import signal
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from gspo import dist
from gspo.advantages import group_advantages, group_stats
from gspo.checkpoint import clean_stale, list_checkpoints, load_checkpoint, resolve_resume, save_checkpoint
from gspo.config import TrainConfig, to_dict
from gspo.data import PromptSampler, columns_of, load_splits
from gspo.evaluation import evaluate
from gspo.logprobs import completion_logprobs, position_ids_from_mask
from gspo.models import load_model
from gspo.moe import (RoutingRecord, expert_change_frac, find_routers, record_routing, replay_routing,
                      require_replay_support)
from gspo.multitask import (TaskMixture, reference_chunks, require_references, saved_tasks, sft_backward,
                            sft_coef_at)
from gspo.objectives import DEFAULT_AGGREGATION, policy_loss
from gspo.rewards import get_reward_fn, score_completions
from gspo.rollout import Rollout, eos_ids, generate, pad_id, row_seeds
from gspo.tracking import METRICS_FILE, SAMPLES_FILE, MetricsLogger


def train(cfg: TrainConfig) -> dict:
    """Run GRPO/GSPO as configured; returns a summary (evaluations before/after, time).

    Under torchrun every rank calls this; see gspo/dist.py for how the work is split.
    """
    d = dist.setup(dist.device_for(cfg.device) or resolve_device(cfg.device), cfg.distributed, cfg.dist_timeout_s)
    try:
        return _train(cfg, d)
    finally:
        dist.teardown(d)


def _train(cfg: TrainConfig, d: dist.Dist) -> dict:
    started = time.perf_counter()
    resuming = cfg.resume_from_checkpoint is not None
    out_dir = prepare_output_dir(cfg, resuming) if d.is_main else Path(cfg.output_dir)  # an earlier run there: error
    dist.barrier(d)
    checkpoint = resolve_resume(cfg.resume_from_checkpoint, out_dir) if resuming else None
    device, model, tokenizer = seeded_model(cfg)
    replay = cfg.routing_replay != "none"
    if replay:
        require_replay_support(model)  # dense or unsupported MoE: a clear ValueError before any rollout
        if d.enabled:
            raise ValueError("config: routing_replay under torchrun is not supported yet; use routing_replay=none")
    drift = cfg.log_routing_drift and bool(find_routers(model)) and not d.enabled  # MoE models, one process
    ref_model = dist.wrap(frozen_copy(model), d) if cfg.kl_coef > 0 else None
    model = dist.wrap(model, d)
    B, G, M = cfg.per_device_batch_size, cfg.num_generations, cfg.num_minibatches
    W, seeded, fsdp = d.world_size, cfg.seeded_sampling or d.enabled, d.enabled and d.mode == "fsdp"
    if fsdp and (cfg.save_steps or resuming):
        raise ValueError("config: checkpoints under distributed=fsdp are not supported yet (the final model is "
                         "saved); use distributed=ddp to checkpoint and resume, or save_steps=0")
    units = "tokens" if (cfg.aggregation or DEFAULT_AGGREGATION[cfg.objective]) == "token_mean" else "sequences"
    # Several tasks (gspo/multitask.py): the mixture samples, scores and evaluates task by task.
    mixture = TaskMixture.from_config(cfg, tokenizer, max(1000, cfg.max_steps * B * W)) if cfg.tasks else None
    train_rows, eval_rows = (load_splits(cfg, tokenizer, num_train=max(1000, cfg.max_steps * B * W))
                             if mixture is None else ([], []))
    reward_fns = [get_reward_fn(spec) for spec in cfg.reward_funcs]
    sampler = PromptSampler(train_rows, cfg.seed) if mixture is None else mixture
    if cfg.sft_coef > 0:
        require_references([train_rows] if mixture is None else mixture.train_rows, cfg.sft_column)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    total_updates = cfg.max_steps * M * cfg.num_epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg.lr_scheduler, cfg.warmup_steps, total_updates))
    guard = NonFiniteGuard(cfg.max_consecutive_skips)
    shuffle = torch.Generator().manual_seed(cfg.seed)
    loss_kwargs = dict(objective=cfg.objective, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                       aggregation=cfg.aggregation, norm_length=cfg.max_completion_length,
                       kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator)
    logp_kwargs = dict(temperature=cfg.temperature, chunk_size=cfg.logprob_chunk_size)

    def save_checkpoint_now(step: int) -> Path | None:
        # Every rank holds the same state (replicas, same RNG draws): rank 0 writes it.
        path = out_dir / f"checkpoint-{step}"
        if fsdp:  # sharded optimizer state: not checkpointed yet (validated: no save_steps, no resume)
            return None
        if d.is_main:
            path = save_checkpoint(out_dir, step, model=model, tokenizer=tokenizer, optimizer=optimizer,
                                   scheduler=scheduler, config=saved_config(cfg, W), rng_generators={"shuffle": shuffle},
                                   keep=cfg.save_total_limit, trainer_state={
                                       "sampler": sampler.state_dict(), "guard": guard.state_dict(),
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
        state = load_checkpoint(checkpoint, model=model, optimizer=optimizer, scheduler=scheduler,
                                rng_generators={"shuffle": shuffle})  # restores the RNGs last: draw nothing before
        check_resumable(state["config"], cfg, state["step"], W)
        if d.is_main:
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
    for step in range(first, cfg.max_steps + 1):
        t0 = time.perf_counter()
        rows = sampler.next(B * W)[d.rank * B : (d.rank + 1) * B]  # every rank draws the global batch, keeps its share
        # 1. Rollout: G completions per prompt, sampled from the current policy (= pi_old).
        #    Routing replay "rollout" (R3) keeps the experts the sampler used: rollout.routing.
        rollout = generate(model, tokenizer, [r["prompt"] for r in rows], G,
                           max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                           top_p=cfg.top_p, top_k=cfg.top_k, max_prompt_length=cfg.max_prompt_length,
                           with_logprobs=cfg.use_sampler_logprobs,
                           routing_recorder=record_routing(model) if cfg.routing_replay == "rollout" else None,
                           row_seeds=row_seeds(cfg.seed, step, d.rank * B * G, B * G) if seeded else None)
        # 2. Rewards, then advantages normalised within each group of G.
        #    A dropped sample (bad reward, drop_bad_rewards) has a NaN reward and advantage 0.
        if mixture is None:
            rewards, per_fn = score_completions(reward_fns, cfg.reward_weights, rollout.prompts, rollout.completions,
                                                columns_of(rows, G), drop_bad=cfg.drop_bad_rewards)
        else:  # each task's own reward functions; this rank's rows start at row d.rank * B of the batch
            rewards, per_fn = mixture.score(rows, rollout.prompts, rollout.completions, G,
                                            drop_bad=cfg.drop_bad_rewards, offset=d.rank * B)
        if d.enabled:  # every rank gets the whole rollout (N = B * G * world) and every reward
            rollout, rewards = dist.gather_rollout(rollout, rewards, pad_id(tokenizer, model), d)
            per_fn = {k: torch.cat([part[k] for part in dist.gather_objects(per_fn, d)]) for k in per_fn}
        valid = torch.isfinite(rewards)  # (N,)
        task_metrics = mixture.observe(rewards, valid, G) if mixture is not None else {}  # and dynamic weights
        rollout.rewards = rewards.to(device)  # (N,)
        rollout.advantages = group_advantages(rewards, G, scale=cfg.advantage_scale, valid=valid).to(device)  # (N,)
        # 3. pi_old log-probs, once per rollout, on the same minibatches (same shapes) the first
        #    epoch trains on, so the first minibatch is exactly on-policy (ratio 1). Routing replay
        #    "old_policy" (GSPO sec. 5.3) records the experts of this forward for every training forward.
        #    Under torchrun each rank computes its part of every minibatch; the rows are summed across ranks.
        minibatches = torch.randperm(rollout.num_sequences, generator=shuffle).chunk(M)
        mine = [idx.chunk(W)[d.rank] for idx in minibatches]
        with torch.no_grad():
            if cfg.use_sampler_logprobs:  # GSPO sec. 5.4: the sampler's likelihoods serve as pi_old
                rollout.old_logprobs = rollout.sampler_logprobs
            else:
                rollout.old_logprobs, recorded = minibatch_logprobs_and_routing(
                    model, rollout, mine, logp_kwargs, replay=cfg.routing_replay == "rollout",
                    record=cfg.routing_replay == "old_policy")
                rollout.old_logprobs = dist.all_sum(rollout.old_logprobs, d)  # (N, T)
                if cfg.routing_replay == "old_policy":
                    rollout.routing = recorded
            if ref_model is not None:
                rollout.ref_logprobs = dist.all_sum(minibatch_logprobs(ref_model, rollout, mine, logp_kwargs), d)
        t_rollout = time.perf_counter() - t0

        # 4. One optimizer step per minibatch (with sft_coef, minibatch i also fits references part i).
        step_stats: list[dict] = []
        sft_coef = sft_coef_at(step, cfg.max_steps, cfg.sft_coef, cfg.sft_schedule)
        refs = reference_chunks(rows, tokenizer, M, cfg.sft_column, max_prompt_length=cfg.max_prompt_length,
                                device=device) if sft_coef > 0 else None
        for epoch in range(cfg.num_epochs):
            if epoch > 0:
                minibatches = torch.randperm(rollout.num_sequences, generator=shuffle).chunk(M)
            for i, idx in enumerate(minibatches):
                mb = rollout.select(idx.chunk(W)[d.rank])  # the whole minibatch in one process
                # Drift is measured with free routing: under replay that needs its own forward.
                before = free_routing(model, mb) if drift and replay else None
                # Replay spans forward and backward (a checkpointed recompute must see the same experts);
                # the free-routing recorder only the forward.
                with replay_routing(model, mb.routing) if replay else nullcontext() as replayer:
                    with record_routing(model) if drift and not replay else nullcontext() as recorder:
                        logp, entropy = completion_logprobs(model, mb.input_ids, mb.attention_mask,
                                                            mb.completion_len, with_entropy=True,
                                                            **logp_kwargs)  # (n, t), (n, t)
                    loss, stats = policy_loss(logp, mb.old_logprobs, mb.advantages, mb.completion_mask,
                                              ref_logprobs=mb.ref_logprobs, **loss_kwargs)
                    optimizer.zero_grad(set_to_none=True)
                    if d.enabled:  # this rank's share of the global minibatch's loss
                        loss = loss * dist.grad_scale(d, *share(rollout, idx, mb, units))
                    loss.backward()
                if refs is not None:  # supervised term: its own forward and backward, outside routing replay
                    term, stats["loss/sft"] = sft_backward(model, refs[i], sft_coef, **logp_kwargs)
                    loss, stats["sft/coef"] = loss.detach() + term, sft_coef
                if d.enabled:
                    dist.average_gradients(model, d)
                    stats, entropy, mb = global_stats(rollout, idx, mb, logp, entropy, loss_kwargs, d)
                    loss = torch.tensor(math.nan if dist.flag_any(not torch.isfinite(loss), d) else 0.0)
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
                    stats.update(routing_stats("moe/expert_change_frac", before, free_routing(model, mb),
                                               completion_positions(mb)))
                if replay:  # how often the replayed experts overrule the routers' own choice
                    stats["moe/replay_mismatch_frac"] = expert_change_frac(mb.routing, replayer.free_record(),
                                                                          completion_positions(mb))[0]
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
    full = layers = None
    for idx in minibatches:
        mb = rollout.select(idx)
        with replay_routing(model, mb.routing) if replay else nullcontext():
            with record_routing(model) if record else nullcontext() as recorder:
                logp, _ = completion_logprobs(model, mb.input_ids, mb.attention_mask, mb.completion_len,
                                              **logp_kwargs)
        out[idx, : mb.completion_len] = logp
        if record:
            part = recorder.record()  # (R, n, l, k)
            if full is None:
                R, _, _, k = part.indices.shape
                full = part.indices.new_full((R, *rollout.input_ids.shape, k), -1)  # (R, N, P+T, k)
                layers = part.layers
            left, cut, _ = rollout.trim(idx)
            full[:, idx.to(full.device), left:cut] = part.indices
    return out, RoutingRecord(full, layers) if record else None


@torch.no_grad()
def free_routing(model, mb: Rollout) -> RoutingRecord:
    """(R, n, l, k) experts the routers pick on their own for `mb`: one no-grad backbone forward.

    Same inputs as `completion_logprobs`, so at equal weights it matches the training forward's
    free routing exactly; the output head is skipped (the logits do not matter here).
    """
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model
    with record_routing(model) as recorder:
        backbone(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                 position_ids=position_ids_from_mask(mb.attention_mask), use_cache=False)
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


def global_stats(rollout: Rollout, idx, mb: Rollout, logp, entropy, loss_kwargs, d) -> tuple[dict, torch.Tensor, Rollout]:
    """Statistics of the global minibatch from every rank's rows: the single-process values."""
    N, T = rollout.completion_mask.shape
    mine = idx.chunk(d.world_size)[d.rank]
    logp_all = dist.fill_rows(logp.detach(), mine, (N, T), d)  # (N, T)
    ent_all = dist.fill_rows(entropy.detach(), mine, (N, T), d)  # (N, T)
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


def lr_schedule(kind: str, warmup: int, total: int):
    def factor(i: int) -> float:
        if warmup and i < warmup:
            return (i + 1) / warmup
        frac = (i - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - frac)
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))
        return 1.0

    return factor


def save_model(model, tokenizer, path: Path, state_dict: dict | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, **({"state_dict": state_dict} if state_dict is not None else {}))
    tokenizer.save_pretrained(path)


def prepare_output_dir(cfg, resuming: bool = False) -> Path:
    """The run's folder; an earlier run's files there are an error unless overwriting or resuming."""
    out = Path(cfg.output_dir)
    clean_stale(out) if out.is_dir() else None  # half-written checkpoints of a killed run
    old = [out / METRICS_FILE, out / SAMPLES_FILE, *sorted(out.glob("checkpoint-*"))]
    old = [p for p in old if p.exists()]
    if old and not resuming:
        if not cfg.overwrite_output_dir:
            raise ValueError(f"output_dir {out} already holds a run ({old[0].name}); continue it with --resume latest, "
                             "choose another output_dir, or set overwrite_output_dir=true to delete it")
        for path in old:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return out


# Settings that may change when resuming: where and how much is logged, not what is computed.
RESUME_MAY_CHANGE = ("max_steps", "output_dir", "overwrite_output_dir", "resume_from_checkpoint", "progress",
                     "save_steps", "save_total_limit", "eval_steps", "log_samples_steps", "log_samples_count",
                     "tensorboard", "wandb", "wandb_project", "max_consecutive_skips", "dist_timeout_s")


def saved_config(cfg, world_size: int = 1) -> dict:
    """The config as JSON: reward functions passed as Python callables become "module:name".

    Two settings are stored as they act: the global batch (per-device batch x world size), and
    seeded_sampling (always on under torchrun), so a run can resume on another number of ranks.
    """
    out = to_dict(cfg)
    out["per_device_batch_size"] *= world_size
    out["seeded_sampling"] = cfg.seeded_sampling or world_size > 1
    out["reward_funcs"] = [f if isinstance(f, str) else f"{f.__module__}:{getattr(f, '__qualname__', type(f).__name__)}"
                           for f in out["reward_funcs"]]
    out["tasks"] = saved_tasks(out["tasks"])  # the same for each task's reward functions
    return out


def check_resumable(saved: dict, cfg, step: int, world: int = 1) -> None:
    """A resumed run must compute what the checkpointed one did: same settings, and steps left to run."""
    now = saved_config(cfg, world)
    changed = sorted(k for k in set(saved) | set(now) if k not in RESUME_MAY_CHANGE and saved.get(k) != now.get(k))
    if changed:
        raise ValueError("resume: the checkpoint was made with other settings: " +
                         ", ".join(f"{k}={saved.get(k)!r} (now {now.get(k)!r})" for k in changed))
    if step >= cfg.max_steps:
        raise ValueError(f"resume: the checkpoint is at step {step} and max_steps={cfg.max_steps}: nothing left to "
                         "run (raise max_steps to train further)")


def discard_newer_checkpoints(out_dir: Path, step: int, allowed: bool) -> None:
    """Resuming from an older checkpoint abandons the newer ones: only with overwrite_output_dir."""
    newer = [c for c in list_checkpoints(out_dir) if int(c.name.rsplit("-", 1)[1]) > step]
    if newer and not allowed:
        raise ValueError(f"resume: {newer[-1].name} is newer than checkpoint-{step}; resume from latest, or set "
                         "overwrite_output_dir=true to delete the newer checkpoints")
    for path in newer:
        shutil.rmtree(path)


def frozen_copy(model):
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def seeded_model(cfg) -> tuple[torch.device, torch.nn.Module, object]:
    """Seed every RNG, then load the configured model and tokenizer onto the configured device."""
    seed_everything(cfg.seed)
    device = resolve_device(cfg.device)
    model, tokenizer = load_model(cfg.model, dtype=cfg.dtype, device=device, trust_remote_code=cfg.trust_remote_code,
                                  seed=cfg.seed, overrides=cfg.model_overrides)
    return device, model, tokenizer


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"config: device={device!r} but CUDA is not available here")
    return torch.device(device)


class TrainingAborted(RuntimeError):
    """The run cannot go on (e.g. every recent update was non-finite); the message says why."""


class TrainingInterrupted(TrainingAborted):
    """SIGINT/SIGTERM arrived; the step in flight was finished and checkpointed."""

    def __init__(self, signum: int, step: int, checkpoint: Path):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"{signal.Signals(signum).name} at step {step}; checkpoint saved to {checkpoint}; "
                         "continue with --resume latest")


class StopSignals:
    """Turns SIGINT/SIGTERM into a request to stop after the current step (a second one stops at once).

    Installed only in the main thread (Python delivers signals there); `restore` puts back the
    previous handlers.
    """

    def __init__(self):
        self.requested, self.previous = 0, {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested:  # second signal: do what the previous handler would have done
            self.restore()
            signal.raise_signal(signum)
            return
        self.requested = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}


class NonFiniteGuard:
    """Counts optimizer steps skipped for a non-finite loss or gradient; aborts after `limit` in a row."""

    def __init__(self, limit: int):
        self.limit, self.skipped, self.in_a_row = limit, 0, 0

    def ok(self) -> None:
        self.in_a_row = 0

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict) -> None:
        self.skipped, self.in_a_row = state["skipped"], state["in_a_row"]

    def skip(self, step: int, loss: torch.Tensor, norm: torch.Tensor) -> None:
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise TrainingAborted(
                f"step {step}: {self.in_a_row} optimizer steps in a row had a non-finite loss ({loss.item()}) or "
                f"gradient norm ({float(norm)}); the weights were not updated by them. Lower learning_rate, check "
                "rewards and inputs, or raise max_consecutive_skips")


class Progress:
    """A rich progress bar showing the latest values of a few metrics; a no-op when disabled."""

    def __init__(self, total: int, enabled: bool = True, label: str = "train",
                 show: tuple[str, ...] = ("reward/mean", "eval/accuracy")):
        self.bar, self.show, self.latest = None, show, {}
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[text]}"), TimeElapsedColumn(), TimeRemainingColumn())
            self.task = self.bar.add_task(label, total=total, text="")
            self.bar.start()

    def update(self, step: int, metrics: dict) -> None:
        if self.bar is None:
            return
        self.latest.update({k: metrics[k] for k in self.show if k in metrics})
        text = "  ".join(f"{k} {v:.3f}" for k, v in self.latest.items())
        self.bar.update(self.task, completed=step, text=text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
