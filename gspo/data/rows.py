"""Prompt data: built-in tasks or users' local files, as rows of plain dicts.

A row has a `prompt` (text, rendered from chat messages when needed) and any other columns,
which reach the reward functions as keyword lists. Each row is a `Row`: a dict that also knows
where it came from (`row.where`, e.g. "data.jsonl line 11"), so every data error names the file
and line. JSON Lines and JSON files are read here (line numbers, one-line errors), CSV with pandas,
Parquet with pyarrow, `save_to_disk` folders with `datasets`.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import random
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from gspo.config import utf8_text  # config files are read with it too
from gspo.given import is_marker, not_rebuildable
from gspo.tasks import get_task

_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
"""What happens to a prompt longer than max_prompt_length (`truncate_prompts`): an error, or keep its last tokens."""


class Row(dict):
    """A data row (column -> value) with `where`: its file and line, or its place in a task."""

    def __init__(self, values: dict, where: str):
        super().__init__(values)
        self.where = where


def load_rows(path: str, prompt_column: str = "prompt", given: dict | None = None, *,
              config: str | None = None, split: str = "train") -> list[Row]:
    """Rows from a local .jsonl/.json/.csv/.parquet file or a `save_to_disk` folder, or, for a name that
    `given` holds ({"object:train_dataset": a datasets.Dataset or a list of dicts}: gspo.Trainer), from memory,
    or, for a name that is neither, the `split` of the dataset of that name and `config` that the `datasets`
    library holds in its local cache (`read_cached`: nothing is downloaded).

    Every problem is a ValueError naming the file and, where there is one, the line.
    """
    p = Path(path)
    if given and path in given:
        rows = _records(path, given[path])
    elif is_marker(path):  # a saved config of a run whose data was handed over from Python
        raise not_rebuildable("dataset", path, "pass the data again (gspo.Trainer(train_dataset=..., "
                                               "eval_dataset=...)), or set dataset to a file")
    elif p.is_dir():
        rows = _read_table(p, None)
    elif p.is_file():
        kind = _FORMATS.get(p.suffix.lower())
        if kind is None:
            raise ValueError(f"dataset: {path} has an unsupported extension; use one of {', '.join(_FORMATS)} "
                             "or a folder")
        rows = _read_json(p) if kind == "json" else _read_table(p, p.suffix.lower()[1:])
    else:
        rows = read_cached(path, config, split)
    if not rows:
        raise ValueError(f"dataset: {path} is empty (no rows)")
    lacking = [r for r in rows if prompt_column not in r]
    if len(lacking) == len(rows):
        columns = sorted({k for r in rows for k in r})
        raise ValueError(f"dataset: {path} has no {prompt_column!r} column (columns: {_names(columns)})")
    if lacking:
        raise ValueError(f"dataset: {lacking[0].where}: no {prompt_column!r} value (keys: {_names(lacking[0])})")
    if prompt_column != "prompt":
        for r in rows:
            r["prompt"] = r.pop(prompt_column)
    return rows


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
"""What a dataset's name on the hub looks like (owner/name, or name): the names read_cached looks for."""


def read_cached(name: str, config: str | None, split: str) -> list[Row]:
    """The rows of `split` of the dataset `name` (configuration `config`; None: the only one cached) as the
    `datasets` library's local cache holds it (HF_DATASETS_CACHE: where `datasets.load_dataset(name)` saved it),
    read from its files alone, never from the network. A name that is not there is a ValueError that says what to
    do; so is a missing configuration or split, naming the ones there are."""
    missing = f"dataset: {name} does not exist"
    if Path(name).suffix.lower() in _FORMATS or not _HUB_NAME.fullmatch(name):
        raise ValueError(missing)
    try:
        import datasets
        from datasets.naming import camelcase_to_snakecase
        from datasets.packaged_modules.cache.cache import Cache
    except ImportError:
        raise ValueError(f"{missing} as a local file or folder (a dataset's name is read from the datasets "
                         "library's cache, and it is not installed: pip install datasets)") from None
    root = Path(datasets.config.HF_DATASETS_CACHE).expanduser()
    *owner, base = name.split("/")
    cached = root / "___".join([*owner, camelcase_to_snakecase(base)])
    configs = sorted({p.parts[-3] for p in cached.glob("*/*/*") if p.is_dir()})
    if not configs:
        raise ValueError(f"{missing} as a local file or folder, and the datasets library's cache ({root}) does not "
                         f"hold a dataset of that name; gspo never downloads: save it there once, online, with "
                         f"python -c \"import datasets; datasets.load_dataset('{name}')\" (add the configuration "
                         "if it has several), or set dataset to a local file")
    if config is None and len(configs) > 1:
        raise ValueError(f"dataset: {name}: the datasets cache holds {len(configs)} configurations of it ("
                         f"{', '.join(configs)}); set dataset_config to one")
    if config is not None and config not in configs:
        raise ValueError(f"dataset: {name}: the datasets cache holds no configuration {config!r} of it (it holds "
                         f"{', '.join(configs)}); set dataset_config to one of them")
    import logging

    quiet = logging.getLogger("datasets")
    level, quiet.level = quiet.level, logging.ERROR  # not its "Found the latest cached ..." warning
    try:
        builder = Cache(cache_dir=str(root), repo_id=name, dataset_name=base, config_name=config, version="auto",
                        hash="auto")
        splits = list(builder.info.splits or {})
        if split not in splits:
            raise ValueError(f"dataset: {name} ({builder.config.name}) has no split {split!r} in the datasets cache "
                             f"(splits: {', '.join(splits)}); set dataset_train_split / dataset_test_split")
        table = builder.as_dataset(split=split)
    finally:
        quiet.level = level
    where = f"{name} ({builder.config.name}, {split})"
    return [Row(dict(record), f"{where} row {i}") for i, record in enumerate(table)]


def _records(name: str, records) -> list[Row]:
    """Rows of in-memory records (a datasets.Dataset, a list of dicts), each a copy: training renders chat prompts
    in place."""
    rows = []
    for i, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise ValueError(f"dataset: {name} row {i}: expected a mapping of column: value, got "
                             f"{type(record).__name__}")
        rows.append(Row(dict(record), f"{name} row {i}"))
    return rows


def _names(keys) -> str:
    """Column names for a one-line message (a name may hold a line break)."""
    return ", ".join(str(k).replace("\n", "\\n").replace("\r", "\\r") for k in keys)


def _read_json(path: Path) -> list[Row]:
    """JSON Lines (one object per line), or one JSON array of objects; errors name the line."""
    text = utf8_text(path.read_bytes(), f"dataset: {path}")
    rows, first_error = [], None
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            value = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as err:
            first_error = first_error or (where, err)
            break
        if not isinstance(value, dict):
            if not rows and isinstance(value, list):  # a whole JSON array on one line
                break
            raise ValueError(f"dataset: {where}: expected a JSON object (one row per line), got "
                             f"{type(value).__name__}")
        rows.append(Row(value, where))
    else:
        return rows
    if rows:  # JSON Lines that went wrong on a later line
        where, err = first_error
        raise ValueError(f"dataset: {where}: invalid JSON ({_json_problem(err)})") from None
    try:  # not JSON Lines: one JSON document (a list of row objects)
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        if first_error is not None and text.lstrip()[:1] == "{":  # meant as JSON Lines
            where, err = first_error
            raise ValueError(f"dataset: {where}: invalid JSON ({_json_problem(err)})") from None
        line = getattr(err, "lineno", None)
        raise ValueError(f"dataset: {path}{f' line {line}' if line else ''}: invalid JSON "
                         f"({_json_problem(err)})") from None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError(f"dataset: {path}: expected one JSON object per line or a JSON list of objects, got "
                         f"{type(value).__name__}")
    return [Row(v, f"{path} record {i}") for i, v in enumerate(value)]


def _json_problem(err: Exception) -> str:
    if isinstance(err, json.JSONDecodeError):
        return f"{err.msg} at column {err.colno}"
    return "nested too deeply"


def _read_table(path: Path, kind: str | None) -> list[Row]:
    """CSV (pandas, as `datasets` reads it), Parquet (pyarrow) or a `save_to_disk` folder (datasets).

    CSV rows carry the line they start on; an empty cell reads None.
    """
    try:
        if kind == "csv":
            import pandas

            text = utf8_text(path.read_bytes(), f"dataset: {path}")
            if not text.strip():
                return []
            frame = pandas.read_csv(io.StringIO(text))
            records = [{k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()}  # NaN: empty
                       for r in frame.to_dict("records")]
            starts = _csv_record_lines(text)
            if len(starts) == len(records):
                return [Row(r, f"{path} line {line}") for r, line in zip(records, starts)]
        elif kind == "parquet":
            import pyarrow.parquet

            records = pyarrow.parquet.read_table(path).to_pylist()
        else:
            import datasets  # lazy: only user data needs it

            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise ValueError(f"dataset: {path} holds splits {list(ds)}; save a single split or one named "
                                     "'train'")
                ds = ds["train"]
            records = [dict(r) for r in ds]
    except ValueError as err:
        if str(err).startswith("dataset: "):
            raise
        raise ValueError(f"dataset: {path}: cannot be read as {kind or 'a save_to_disk folder'} "
                         f"({_first_line(err)})") from None
    except Exception as err:  # pandas/pyarrow/datasets raise many types (ParserError, ArrowInvalid, ...)
        raise ValueError(f"dataset: {path}: cannot be read as {kind or 'a save_to_disk folder'} "
                         f"({type(err).__name__}: {_first_line(err)})") from None
    return [Row(r, f"{path} row {i}") for i, r in enumerate(records)]


def _csv_record_lines(text: str) -> list[int]:
    """The line on which each CSV record (after the header) starts; a quoted field may span lines."""
    starts, previous_end = [], 0
    reader = csv.reader(io.StringIO(text, newline=""))
    for i, _ in enumerate(reader):
        if i > 0:
            starts.append(previous_end + 1)
        previous_end = reader.line_num
    return starts


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def where(row: dict, index: int) -> str:
    """Where a row came from: its `Row.where`, or its index for a plain dict."""
    return getattr(row, "where", f"row {index}")


MESSAGES = "prompt_messages"
"""Where `render_prompts` keeps a chat prompt's messages: reward functions get them, as in TRL (`chat_prompts`)."""


def render_prompts(rows: list[dict], tokenizer, template_kwargs: dict | None = None) -> list[dict]:
    """Turn chat-message prompts into text with the tokenizer's chat template (in place), given
    `template_kwargs` (chat_template_kwargs, e.g. {"enable_thinking": False}); the messages stay in the
    row under `MESSAGES`, for rewards written for conversational data."""
    for i, r in enumerate(rows):
        prompt = r["prompt"]
        if isinstance(prompt, list):
            if getattr(tokenizer, "chat_template", None) is None:
                raise RowError(f"dataset: {where(r, i)}: chat messages, but the tokenizer has no chat template", i)
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in prompt) or not prompt:
                raise RowError(f"dataset: {where(r, i)}: chat messages must be a non-empty list of "
                               f"{{role, content}} string pairs, got {prompt!r:.80}", i)
            try:
                r["prompt"] = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                                            **(template_kwargs or {}))
                r[MESSAGES] = prompt
            except Exception as err:  # the template is user data too (jinja errors, missing roles)
                raise RowError(f"dataset: {where(r, i)}: the chat template failed on these messages "
                               f"({type(err).__name__}: {_first_line(err)})", i) from None
        elif not isinstance(prompt, str) or not prompt.strip():  # blank is empty: nothing to answer
            raise RowError(f"dataset: {where(r, i)}: prompt must be a non-empty string or a list of messages, "
                           f"got {prompt!r:.80}", i)
    return rows


class RowError(ValueError):
    """A ValueError about one row; `index`: its place in the rows checked."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


def check_rows(rows: list[dict], tokenizer, max_prompt_length: int | None = None, truncate: str = "error",
               template_kwargs: dict | None = None) -> list[dict]:
    """`render_prompts`, then (given `max_prompt_length`) `check_prompt_lengths`: of several bad rows,
    whatever is wrong with each, the first is named. Returns `rows`, rendered in place."""
    try:
        render_prompts(rows, tokenizer, template_kwargs)
    except RowError as err:
        if max_prompt_length is not None:  # a too-long prompt before the row render_prompts refused comes first
            check_prompt_lengths(rows[: err.index], tokenizer, max_prompt_length, truncate)
        raise
    if max_prompt_length is not None:
        check_prompt_lengths(rows, tokenizer, max_prompt_length, truncate)
    return rows


def check_prompt_lengths(rows: list[dict], tokenizer, max_prompt_length: int, truncate: str = "error") -> int:
    """Tokenize every prompt once, before training: ValueError naming the first one that is empty, or
    longer than `max_prompt_length` when `truncate` is "error". Returns how many are longer (with
    "left" they are cut to their last `max_prompt_length` tokens when encoded).
    """
    longer, step = 0, 1024
    for start in range(0, len(rows), step):
        chunk = rows[start : start + step]
        lengths = [len(ids) for ids in tokenizer([r["prompt"] for r in chunk])["input_ids"]]
        for offset, (r, n) in enumerate(zip(chunk, lengths)):
            if n == 0:
                raise ValueError(f"dataset: {where(r, start + offset)}: the prompt encodes to no tokens")
            if n > max_prompt_length:
                if truncate == "error":
                    raise ValueError(f"dataset: {where(r, start + offset)}: the prompt has {n} tokens > "
                                     f"max_prompt_length={max_prompt_length}; raise max_prompt_length, or set "
                                     "truncate_prompts=left to keep its last tokens")
                longer += 1
    return longer


def data_fingerprint(rows: list[dict]) -> dict:
    """{"rows": count, "sha256": hex digest of the rows in order}, of rows as `load_rows` read them.

    A checkpoint records one per data file, so a resume can tell that a file changed under the same
    name. Each row is hashed as sorted-key JSON; a value JSON cannot hold (bytes, a date) by its repr.
    """
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=repr).encode() + b"\n")
    return {"rows": len(rows), "sha256": digest.hexdigest()}


def holdout_count(rows: int, holdout: float, name: str = "dataset") -> int:
    """How many of `rows` rows `eval_holdout` holds out: a fraction (< 1) of them, at least one; or a count (>= 1);
    0: none. At least one row is left to train on; a count that leaves none is a ValueError naming `name`.
    Example: 0.1 of 30 rows: 3 (of 9 rows: 1; of 1 row: 0)."""
    if holdout >= 1:
        if holdout >= rows:
            raise ValueError(f"dataset: eval_holdout={holdout:g} holds out every row of {name} ({rows} rows); hold "
                             "out fewer, or give an eval_dataset")
        return int(holdout)
    if holdout <= 0 or rows < 2:
        return 0
    return min(rows - 1, max(1, int(rows * holdout + 1e-9)))  # 1e-9: 0.1 * 70 is 7, not 6.99...


def stderr_line(line: str) -> None:
    """Print a notice (one line) to stderr at once."""
    print(line, file=sys.stderr, flush=True)


@dataclasses.dataclass
class SplitLoader:
    """`load_splits` with the values a run's data sections share: call it with a DataSettings (one task's) for
    its (train rows, held-out rows); `fingerprints` gathers {data file: data_fingerprint} of every file read."""

    tokenizer: object
    num_train: int  # the training rows a built-in task generates
    eval_num_prompts: int  # held-out rows kept (EvalSettings); 0: none
    seed: int  # the run's: the held-out split of a dataset, a task's rows
    max_prompt_length: int | None = None  # longer prompts: `truncate_prompts` says (None: no limit)
    truncate_prompts: str = "error"
    given: dict | None = None  # in-memory data by the names the data settings hold (`load_rows`)
    note: Callable[[str], None] = stderr_line  # where the held-out split is said (the trainer's other ranks: no-op)
    fingerprints: dict = dataclasses.field(default_factory=dict)

    def __call__(self, data) -> tuple[list[dict], list[dict]]:
        return load_splits(data, self.tokenizer, self.num_train, eval_num_prompts=self.eval_num_prompts,
                           seed=self.seed, max_prompt_length=self.max_prompt_length,
                           truncate_prompts=self.truncate_prompts, fingerprints=self.fingerprints, given=self.given,
                           note=self.note)


def load_splits(data, tokenizer, num_train: int, *, eval_num_prompts: int, seed: int,
                max_prompt_length: int | None = None, truncate_prompts: str = "error",
                fingerprints: dict | None = None, given: dict | None = None,
                note=stderr_line) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) of a DataSettings (gspo.config): its `task` or `dataset`.

    `fingerprints` (a dict), when given, gets {file: data_fingerprint(its rows)} of each data file read.
    `given`: in-memory data by the name `dataset` / `eval_dataset` hold ("object:train_dataset", see load_rows).
    Every prompt used is checked here (`check_rows`; with max_prompt_length, its length).
    A `dataset` without `eval_dataset` gives `eval_holdout` of its rows to evaluation and says so through
    `note` (a line to stderr; the trainer's other ranks pass a no-op). eval_num_prompts=0: no held-out rows.
    """
    limits = (max_prompt_length, truncate_prompts, data.chat_template_kwargs)
    if data.dataset is not None:
        rows = load_rows(data.dataset, data.prompt_column, given, config=data.dataset_config,
                         split=data.dataset_train_split)
        if fingerprints is not None:  # before rendering, which rewrites chat prompts in place
            fingerprints[data.dataset] = data_fingerprint(rows)
        check_rows(rows, tokenizer, *limits)  # every row in file order, before a split shuffles them
        if data.eval_dataset is not None:
            train, held_out = rows, load_rows(data.eval_dataset, data.prompt_column, given,
                                              config=data.dataset_config, split=data.dataset_test_split)
            if fingerprints is not None:
                fingerprints[data.eval_dataset] = data_fingerprint(held_out)
            check_rows(held_out[:eval_num_prompts], tokenizer, *limits)
        else:
            shuffled = rows[:]
            random.Random(seed).shuffle(shuffled)
            holdout = data.eval_holdout
            n_eval = holdout_count(len(rows), holdout, data.dataset) if eval_num_prompts else 0  # 0: eval off
            held_out, train = shuffled[:n_eval], shuffled[n_eval:]
            if eval_num_prompts:
                used = (f"; each evaluation uses {eval_num_prompts} of them (eval_num_prompts)"
                        if n_eval > eval_num_prompts else "" if n_eval else ": no evaluation")
                note(f"eval: holding out {n_eval} of {len(rows)} rows of {data.dataset} (eval_holdout={holdout:g})"
                     f"{used}")
        return train, held_out[:eval_num_prompts]
    task = get_task(data.task)
    train = [Row(r, f"task {data.task} train example {i}") for i, r in enumerate(task.dataset("train", num_train,
                                                                                              seed))]
    held_out = [Row(r, f"task {data.task} test example {i}")
                for i, r in enumerate(task.dataset("test", eval_num_prompts, 10_000 + seed))]
    return check_rows(train, tokenizer, *limits), check_rows(held_out, tokenizer, *limits)


def columns_of(rows: list[dict], repeat: int = 1) -> dict[str, list]:
    """Columns other than the prompt's, each repeated `repeat` times per row (one per completion)."""
    keys = list(dict.fromkeys(k for r in rows for k in r if k not in ("prompt", MESSAGES)))
    return {k: [r.get(k) for r in rows for _ in range(repeat)] for k in keys}  # a row may lack a key: None


EPISODE_COLUMNS = ("env_reward", "turns", "tool_calls", "tool_errors", "truncated", "final_turn")


def episode_columns(episodes: list[dict] | None) -> dict[str, list]:
    """What reward functions read of multi-turn episodes (one value per completion): the environment's summed
    reward (None: it gave none), turns, tool calls and errors, whether a limit ended it, and the text of the
    model's last turn (its final answer: the completion is the whole transcript); {} for single turns."""
    return {} if episodes is None else {k: [e[k] for e in episodes] for k in EPISODE_COLUMNS}


def zero_agent_errors(rewards, episodes: list[dict] | None):
    """`rewards` (N,) with 0 for each episode whose agent raised (docs/agents.md): it scores 0 whatever the reward
    functions make of its transcript."""
    for i, episode in enumerate(episodes or ()):
        if episode.get("agent_error"):
            rewards[i] = 0.0
    return rewards


def chat_prompts(rows: list[dict], repeat: int = 1) -> list | None:
    """Each completion's prompt as chat messages (a row without them: its text), or None when no row
    was a chat: the `chat` that `score_completions` hands to conversational reward functions."""
    if not any(MESSAGES in r for r in rows):
        return None
    return [r.get(MESSAGES, r["prompt"]) for r in rows for _ in range(repeat)]


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
            if self.pos >= len(self._order):  # past the end too: a resume on fewer rows starts the next pass
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._shuffle()
            out.append(self.rows[self._order[self.pos]])
            self.pos += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict, past_end: bool = False) -> None:
        """{"epoch", "pos"} as `state_dict` gave them (a checkpoint's JSON: checked, a ValueError otherwise).
        A position past the last row is refused unless `past_end` (the rows changed since, and the user
        allowed it: the next pass starts)."""
        if not isinstance(state, dict):
            raise ValueError(f"sampler state must be a mapping, got {type(state).__name__}")
        epoch, pos = (state_count(state, key, "sampler") for key in ("epoch", "pos"))
        if pos > len(self.rows) and not past_end:
            raise ValueError(f"sampler pos={pos} is past the end of its {len(self.rows)} rows")
        self.epoch, self.pos = epoch, pos
        self._order = self._shuffle()


def state_count(state: dict, key: str, owner: str) -> int:
    """`state[key]` where it is an int >= 0 (a count or position in a checkpoint's state); else a ValueError."""
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{owner} {key}={value!r} must be an int >= 0")
    return value
