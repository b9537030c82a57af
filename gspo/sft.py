"""Cold-start supervised fine-tuning: teach the answer format on prompt/answer pairs.

The loss is the NLL of the answer tokens (and the closing EOS) only; prompt tokens are
context. The encoding is gspo/plugs/supervised.py's, shared with the RL run's sft_coef term. With
`target_accuracy` the run stops as soon as greedy held-out accuracy reaches it, so the cold
start is partial by design and RL has something left to learn.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from gspo.algo.schedules import lr_schedule
from gspo.config import (
    DataSettings,
    EvalSettings,
    ModelSettings,
    OutputSettings,
    RewardSettings,
    SamplingSettings,
    SFTConfig,
    section,
    to_dict,
)
from gspo.data.evaluation import Evaluation, evaluate
from gspo.data.rewards import reward_spec
from gspo.data.rows import SplitLoader
from gspo.model_card import write_model_card
from gspo.models import seeded_model
from gspo.plugs.supervised import collate, encode_pairs, labelled_nll
from gspo.rollout import pad_id
from gspo.runtime import Progress, prepare_output_dir, run_lock, save_model
from gspo.tracking import MetricsLogger


def sft(cfg: SFTConfig) -> dict:
    """Supervised fine-tuning as configured; saves the model to `output_dir/model`."""
    with run_lock(cfg.output_dir):  # one run per output_dir
        return _sft(cfg)


def _sft(cfg: SFTConfig) -> dict:
    started = time.perf_counter()
    out_dir = prepare_output_dir(section(cfg, OutputSettings), resumable=False)
    device, model, tokenizer = seeded_model(section(cfg, ModelSettings))
    train_rows, eval_rows = SplitLoader(tokenizer, cfg.num_examples, cfg.eval_num_prompts, cfg.seed)(
        section(cfg, DataSettings))  # no prompt length limit here: encode_pairs checks max_length
    plan = Evaluation.of(section(cfg, EvalSettings), section(cfg, RewardSettings),
                         SamplingSettings(max_completion_length=cfg.max_completion_length), seed=cfg.seed,
                         template_kwargs=cfg.chat_template_kwargs)
    if cfg.dataset is not None and cfg.num_examples:
        train_rows = train_rows[: cfg.num_examples]
    pairs = encode_pairs(tokenizer, train_rows, cfg.answer_column, cfg.max_length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule("constant", cfg.warmup_steps, cfg.max_steps))
    logger = MetricsLogger(out_dir, config=to_dict(cfg))
    rng = random.Random(cfg.seed)
    progress = Progress(cfg.max_steps, enabled=cfg.progress, label="sft", show=("loss/sft", "eval/accuracy"),
                        every=cfg.logging_steps)
    accuracy, step = None, 0
    model.train()
    for step in range(1, cfg.max_steps + 1):
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(cfg.batch_size)]
        ids, mask, labels = (t.to(device) for t in collate(batch, pad_id(tokenizer)))
        loss = labelled_nll(model, ids, mask, labels)  # token mean over answer tokens (and the closing EOS)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        metrics = {"loss/sft": loss.item()}
        if step % cfg.eval_steps == 0 or step == cfg.max_steps:
            metrics.update(evaluate(model, tokenizer, eval_rows, plan, sampled=False))
            model.train()
            accuracy = metrics.get("eval/accuracy")
        logger.log(step, metrics)
        progress.update(step, metrics)
        if cfg.target_accuracy is not None and accuracy is not None and accuracy >= cfg.target_accuracy:
            break
    progress.close()
    save_model(model, tokenizer, Path(cfg.output_dir) / "model")
    config, last = {**to_dict(cfg), "reward_funcs": [reward_spec(f) for f in cfg.reward_funcs]}, metrics if step else {}
    evaluated = {k: v for k, v in last.items() if k.startswith("eval/")}  # the last step evaluates (or stopped it)
    write_model_card(Path(cfg.output_dir) / "model", config, kind="sft", metrics=last,
                     evals={step: evaluated} if evaluated else {},
                     data={"train_rows": len(train_rows), "held_out_rows": len(eval_rows)})
    logger.close()
    return {"steps": step, "eval/accuracy": accuracy, "seconds": time.perf_counter() - started,
            "model_dir": str(Path(cfg.output_dir) / "model")}
