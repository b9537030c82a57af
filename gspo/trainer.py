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
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from gspo.advantages import group_advantages, group_stats
from gspo.config import TrainConfig, to_dict
from gspo.data import PromptSampler, columns_of, load_splits
from gspo.evaluation import evaluate
from gspo.logprobs import completion_logprobs, position_ids_from_mask
from gspo.models import load_model
from gspo.moe import (RoutingRecord, expert_change_frac, find_routers, record_routing, replay_routing,
                      require_replay_support)
from gspo.objectives import policy_loss
from gspo.rewards import get_reward_fn, score_completions
from gspo.rollout import Rollout, eos_ids, generate
from gspo.tracking import MetricsLogger


def train(cfg: TrainConfig) -> dict:
    """Run GRPO/GSPO as configured; returns a summary (evaluations before/after, time)."""
    started = time.perf_counter()
    device, model, tokenizer = seeded_model(cfg)
    replay = cfg.routing_replay != "none"
    if replay:
        require_replay_support(model)  # dense or unsupported MoE: a clear ValueError before any rollout
    drift = cfg.log_routing_drift and bool(find_routers(model))  # MoE models only
    ref_model = frozen_copy(model) if cfg.kl_coef > 0 else None
    B, G, M = cfg.per_device_batch_size, cfg.num_generations, cfg.num_minibatches
    train_rows, eval_rows = load_splits(cfg, tokenizer, num_train=max(1000, cfg.max_steps * B))
    reward_fns = [get_reward_fn(spec) for spec in cfg.reward_funcs]
    sampler = PromptSampler(train_rows, cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    total_updates = cfg.max_steps * M * cfg.num_epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg.lr_scheduler, cfg.warmup_steps, total_updates))
    out_dir = Path(cfg.output_dir)
    logger = MetricsLogger(out_dir, tensorboard=cfg.tensorboard, wandb=cfg.wandb, wandb_project=cfg.wandb_project,
                           config=to_dict(cfg))
    shuffle = torch.Generator().manual_seed(cfg.seed)
    loss_kwargs = dict(objective=cfg.objective, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                       aggregation=cfg.aggregation, norm_length=cfg.max_completion_length,
                       kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator)
    logp_kwargs = dict(temperature=cfg.temperature, chunk_size=cfg.logprob_chunk_size)

    evals = {0: evaluate(model, tokenizer, eval_rows, cfg)}
    logger.log(0, evals[0])
    progress = Progress(cfg.max_steps, enabled=cfg.progress)
    model.train()
    for step in range(1, cfg.max_steps + 1):
        t0 = time.perf_counter()
        rows = sampler.next(B)
        # 1. Rollout: G completions per prompt, sampled from the current policy (= pi_old).
        #    Routing replay "rollout" (R3) keeps the experts the sampler used: rollout.routing.
        rollout = generate(model, tokenizer, [r["prompt"] for r in rows], G,
                           max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                           top_p=cfg.top_p, top_k=cfg.top_k, max_prompt_length=cfg.max_prompt_length,
                           with_logprobs=cfg.use_sampler_logprobs,
                           routing_recorder=record_routing(model) if cfg.routing_replay == "rollout" else None)
        # 2. Rewards, then advantages normalised within each group of G.
        rewards, per_fn = score_completions(reward_fns, cfg.reward_weights, rollout.prompts, rollout.completions,
                                            columns_of(rows, G))
        rollout.rewards = rewards.to(device)  # (N,)
        rollout.advantages = group_advantages(rewards, G, scale=cfg.advantage_scale).to(device)  # (N,)
        # 3. pi_old log-probs, once per rollout, on the same minibatches (same shapes) the first
        #    epoch trains on, so the first minibatch is exactly on-policy (ratio 1). Routing replay
        #    "old_policy" (GSPO sec. 5.3) records the experts of this forward for every training forward.
        minibatches = torch.randperm(rollout.num_sequences, generator=shuffle).chunk(M)
        with torch.no_grad():
            if cfg.use_sampler_logprobs:  # GSPO sec. 5.4: the sampler's likelihoods serve as pi_old
                rollout.old_logprobs = rollout.sampler_logprobs
            else:
                rollout.old_logprobs, recorded = minibatch_logprobs_and_routing(
                    model, rollout, minibatches, logp_kwargs, replay=cfg.routing_replay == "rollout",
                    record=cfg.routing_replay == "old_policy")
                if cfg.routing_replay == "old_policy":
                    rollout.routing = recorded
            if ref_model is not None:
                rollout.ref_logprobs = minibatch_logprobs(ref_model, rollout, minibatches, logp_kwargs)
        t_rollout = time.perf_counter() - t0

        # 4. One optimizer step per minibatch.
        step_stats: list[dict] = []
        for epoch in range(cfg.num_epochs):
            if epoch > 0:
                minibatches = torch.randperm(rollout.num_sequences, generator=shuffle).chunk(M)
            for idx in minibatches:
                mb = rollout.select(idx)
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
                    loss.backward()
                stats["grad/norm"] = grad_norm(model, cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
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
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item(),
            **{f"reward/{name}": float(np.nanmean(v.numpy())) if not torch.isnan(v).all() else float("nan")
               for name, v in per_fn.items()},
            **group_stats(rewards, G),
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
            evals[step] = evaluate(model, tokenizer, eval_rows, cfg)
            metrics.update(evals[step])
        if step == cfg.max_steps:
            evals[step] = evaluate(model, tokenizer, eval_rows, cfg)
            metrics.update(evals[step])
        logger.log(step, metrics)
        if cfg.log_samples_steps and (step % cfg.log_samples_steps == 0 or step == 1):
            logger.log_samples(step, sample_records(rollout, cfg.log_samples_count))
        if cfg.save_steps and step % cfg.save_steps == 0 and step != cfg.max_steps:
            save_model(model, tokenizer, out_dir / f"checkpoint-{step}")
        progress.update(step, metrics)

    progress.close()
    save_model(model, tokenizer, out_dir / "model")
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
    """Average minibatch stats over the step; extremes of the ratio keep their extremes."""
    out = {}
    for key in step_stats[0]:
        values = torch.stack([torch.as_tensor(s[key]).float() for s in step_stats])
        if key == "ratio/min":
            out[key] = values.min().item()
        elif key == "ratio/max":
            out[key] = values.max().item()
        else:
            out[key] = values.mean().item()
    return out


def grad_norm(model, max_norm: float) -> torch.Tensor:
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))


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


def save_model(model, tokenizer, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


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
