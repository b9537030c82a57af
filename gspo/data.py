"""Prompt data: built-in tasks or users' local files, as rows of plain dicts.

A row has a `prompt` (text, rendered from chat messages when needed) and any other columns,
which reach the reward functions as keyword lists.
"""

from __future__ import annotations

import random
from pathlib import Path

_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def load_rows(path: str, prompt_column: str = "prompt") -> list[dict]:
    """Rows from a local .jsonl/.json/.csv/.parquet file or a `save_to_disk` folder."""
    import datasets  # lazy: only user data needs it

    p = Path(path)
    if p.is_dir():
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(f"dataset: {path} holds splits {list(ds)}; save a single split or one named 'train'")
            ds = ds["train"]
    elif p.is_file():
        kind = _FORMATS.get(p.suffix.lower())
        if kind is None:
            raise ValueError(f"dataset: {path} has an unsupported extension; use one of {', '.join(_FORMATS)} or a folder")
        ds = datasets.load_dataset(kind, data_files=str(p), split="train")
    else:
        raise ValueError(f"dataset: {path} does not exist (only local files and folders are read)")
    if prompt_column not in ds.column_names:
        raise ValueError(f"dataset: {path} has no {prompt_column!r} column (columns: {', '.join(ds.column_names)})")
    rows = [dict(r) for r in ds]
    if not rows:
        raise ValueError(f"dataset: {path} is empty")
    if prompt_column != "prompt":
        for r in rows:
            r["prompt"] = r.pop(prompt_column)
    return rows


def render_prompts(rows: list[dict], tokenizer) -> list[dict]:
    """Turn chat-message prompts into text with the tokenizer's chat template (in place)."""
    for i, r in enumerate(rows):
        prompt = r["prompt"]
        if isinstance(prompt, list):
            if getattr(tokenizer, "chat_template", None) is None:
                raise ValueError(f"dataset: row {i} has chat messages but the tokenizer has no chat template")
            r["prompt"] = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        elif not isinstance(prompt, str) or not prompt:
            raise ValueError(f"dataset: row {i} prompt must be a non-empty string or a list of messages, got {prompt!r:.80}")
    return rows


def load_splits(cfg, tokenizer, num_train: int) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) for a config with `task` or `dataset` fields."""
    if cfg.dataset is not None:
        rows = load_rows(cfg.dataset, cfg.prompt_column)
        if cfg.eval_dataset is not None:
            train, held_out = rows, load_rows(cfg.eval_dataset, cfg.prompt_column)
        else:
            shuffled = rows[:]
            random.Random(cfg.seed).shuffle(shuffled)
            n_eval = max(1, len(rows) // 10) if len(rows) > 1 else 0
            held_out, train = shuffled[:n_eval], shuffled[n_eval:]
        return render_prompts(train, tokenizer), render_prompts(held_out[: cfg.eval_num_prompts], tokenizer)
    from gspo.tasks import get_task

    task = get_task(cfg.task)
    train = task.dataset("train", num_train, cfg.seed)
    held_out = task.dataset("test", cfg.eval_num_prompts, 10_000 + cfg.seed)
    return train, held_out


def columns_of(rows: list[dict], repeat: int = 1) -> dict[str, list]:
    """Columns other than `prompt`, each repeated `repeat` times per row (one per completion)."""
    keys = [k for k in rows[0] if k != "prompt"] if rows else []
    return {k: [r.get(k) for r in rows for _ in range(repeat)] for k in keys}


class PromptSampler:
    """Endless shuffled passes over the training rows; its position is part of a checkpoint."""

    def __init__(self, rows: list[dict], seed: int):
        if not rows:
            raise ValueError("dataset: no training rows")
        self.rows, self.seed = rows, seed
        self.epoch, self.pos = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._shuffle()
            out.append(self.rows[self._order[self.pos]])
            self.pos += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._shuffle()
