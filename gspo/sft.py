"""Cold-start supervised fine-tuning: teach the answer format on prompt/answer pairs.

The loss is the NLL of the answer tokens (and the closing EOS) only; prompt tokens are
context. With `target_accuracy` the run stops as soon as greedy held-out accuracy reaches
it, so the cold start is partial by design and RL has something left to learn.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from gspo.config import SFTConfig, to_dict
from gspo.data import load_splits, where
from gspo.evaluation import evaluate
from gspo.tracking import MetricsLogger
from gspo.run_control import Progress, prepare_output_dir, run_lock, save_model, seeded_model


def encode_pairs(tokenizer, rows: list[dict], answer_column: str, max_length: int) -> list[tuple[list[int], int]]:
    """Token ids of prompt + answer + EOS, and where the answer starts."""
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer: needs an eos token to mark where an answer ends")
    out = []
    for i, r in enumerate(rows):
        if answer_column not in r or not isinstance(r[answer_column], str):
            raise ValueError(f"dataset: {where(r, i)}: no text column {answer_column!r} (the SFT target)")
        prompt = tokenizer(r["prompt"])["input_ids"]
        answer = tokenizer(r[answer_column], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(prompt) + len(answer) > max_length:
            raise ValueError(f"dataset: {where(r, i)}: prompt + answer have {len(prompt) + len(answer)} tokens > "
                             f"max_length={max_length}")
        out.append((prompt + answer, len(prompt)))
    return out


def collate(pairs: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, mask and labels (-100 on prompt and padding). Shapes (b, L)."""
    width = max(len(ids) for ids, _ in pairs)
    ids = torch.full((len(pairs), width), pad_id)  # (b, L)
    labels = torch.full((len(pairs), width), -100)  # (b, L)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)  # (b, L)
    for i, (seq, start) in enumerate(pairs):
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, start : len(seq)] = torch.tensor(seq[start:])
        mask[i, : len(seq)] = 1
    return ids, mask, labels


def sft(cfg: SFTConfig) -> dict:
    """Supervised fine-tuning as configured; saves the model to `output_dir/model`."""
    with run_lock(cfg.output_dir):  # one run per output_dir
        return _sft(cfg)


def _sft(cfg: SFTConfig) -> dict:
    started = time.perf_counter()
    out_dir = prepare_output_dir(cfg)
    device, model, tokenizer = seeded_model(cfg)
    train_rows, eval_rows = load_splits(cfg, tokenizer, num_train=cfg.num_examples)
    if cfg.dataset is not None and cfg.num_examples:
        train_rows = train_rows[: cfg.num_examples]
    pairs = encode_pairs(tokenizer, train_rows, cfg.answer_column, cfg.max_length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / max(1, cfg.warmup_steps)))
    logger = MetricsLogger(out_dir, config=to_dict(cfg))
    rng = random.Random(cfg.seed)
    progress = Progress(cfg.max_steps, enabled=cfg.progress, label="sft", show=("loss/sft", "eval/accuracy"))
    accuracy, step = None, 0
    model.train()
    for step in range(1, cfg.max_steps + 1):
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(cfg.batch_size)]
        ids, mask, labels = (t.to(device) for t in collate(batch, tokenizer.pad_token_id))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss  # token mean over answer tokens
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        metrics = {"loss/sft": loss.item()}
        if step % cfg.eval_steps == 0 or step == cfg.max_steps:
            metrics.update(evaluate(model, tokenizer, eval_rows, cfg, sampled=False))
            model.train()
            accuracy = metrics.get("eval/accuracy")
        logger.log(step, metrics)
        progress.update(step, metrics)
        if cfg.target_accuracy is not None and accuracy is not None and accuracy >= cfg.target_accuracy:
            break
    progress.close()
    save_model(model, tokenizer, Path(cfg.output_dir) / "model")
    logger.close()
    return {"steps": step, "eval/accuracy": accuracy, "seconds": time.perf_counter() - started,
            "model_dir": str(Path(cfg.output_dir) / "model")}
