"""Checkpoints for exact resume: written atomically, read back without unpickling anything.

    path = save_checkpoint(run_dir, step, model=model, tokenizer=tok, optimizer=opt, scheduler=sched,
                           trainer_state={"sampler": sampler.state_dict()}, config=to_dict(cfg),
                           rng_generators={"shuffle": shuffle}, keep=2)
    state = load_checkpoint(resolve_resume("latest", run_dir), model=model, optimizer=opt,
                            scheduler=sched, rng_generators={"shuffle": shuffle})

A checkpoint is a folder `run_dir/checkpoint-<step>`:
  config.json, generation_config.json, model.safetensors   model.save_pretrained (safetensors)
  tokenizer files                                           tokenizer.save_pretrained
  optimizer.pt, scheduler.pt                                state dicts: tensors and plain values only
  rng.json       Python, NumPy, torch CPU (+ CUDA) RNG states and named torch.Generator states
  trainer_state.json, train_config.json                     the caller's dicts, exact JSON
  checkpoint.json                   manifest (step; size and sha256 of every file), written last
The folder is a valid `from_pretrained` directory, so `gspo eval` or transformers can read it.

Atomicity: everything is written and fsynced in `run_dir/.tmp-checkpoint-<step>-<pid>`, then one
rename gives it its final name, so a kill at any moment leaves every earlier checkpoint intact,
plus at worst a stale `.tmp-*` folder that readers ignore (`clean_stale` removes it). Re-saving a
step that exists, the old copy is renamed aside first: a kill between the two renames loses that
step (its old copy sits in `.tmp-trash-*`) but no other.
Safety: weights are safetensors, `*.pt` files are read with `torch.load(weights_only=True)`, the
rest is JSON, so a tampered checkpoint cannot run code when loaded.
Integrity: the checkpoint resumed from is hashed in full (`verify_checkpoint`); listing and
pruning check sizes only, since hashing every checkpoint of a run on each save costs minutes on
big models. Loaded weights and optimizer state must be finite. "latest" never falls back silently:
a damaged newest checkpoint is an error, "latest_valid" the explicit fallback.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import pickle
import re
import shutil
import sys
import warnings
from collections import OrderedDict
from contextlib import contextmanager, suppress
from pathlib import Path

import torch

from gspo.rng import capture_rng, restore_rng  # noqa: F401 (part of this module's API)

MANIFEST_FILE = "checkpoint.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.json"
TRAINER_STATE_FILE = "trainer_state.json"
CONFIG_FILE = "train_config.json"  # config.json is the model's (save_pretrained)
TMP_PREFIX = ".tmp-"
FORMAT = "gspo-checkpoint"
VERSION = 2  # 1: sizes only (still read, by size); 2: size and sha256 per file
_NAME = re.compile(r"checkpoint-(\d+)")
# What a weights_only unpickler accepts (torch.serialization); checked at save time, so a bad
# state dict fails when written rather than at resume.
_PLAIN = (torch.Tensor, bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


# ------------------------------------------------------------------------------- save
def save_checkpoint(run_dir, step: int, *, model=None, tokenizer=None, optimizer=None, scheduler=None,
                    trainer_state: dict | None = None, config: dict | None = None,
                    rng_generators: dict[str, torch.Generator] | None = None, keep: int | None = 2,
                    model_state_dict: dict | None = None, optimizer_state_dict: dict | None = None,
                    rng_state: dict | None = None) -> Path:
    """Write `run_dir/checkpoint-<step>` atomically; then keep only the newest `keep` checkpoints.

    Each of model/tokenizer/optimizer/scheduler is optional (None: not saved). A sharded (FSDP)
    model or optimizer passes its gathered full state too: `model_state_dict` is what
    `save_pretrained` writes, `optimizer_state_dict` replaces `optimizer.state_dict()`. `trainer_state` and
    `config` must be JSON that reads back equal (no tuples, no non-string keys). The RNG states
    (global ones and `rng_generators`) are captured when this is called, unless `rng_state` (a
    `capture_rng` result taken earlier, say when a step began) is given. An existing checkpoint
    of the same step is replaced; `keep=None` keeps every checkpoint. Returns the checkpoint's path.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be an int >= 1 or None (keep all), got {keep!r}")
    texts = {TRAINER_STATE_FILE: _exact_json("trainer_state", {} if trainer_state is None else trainer_state),
             CONFIG_FILE: _exact_json("config", {} if config is None else config),
             RNG_FILE: json.dumps(capture_rng(rng_generators) if rng_state is None else rng_state)}
    if optimizer_state_dict is not None and optimizer is not None:
        raise ValueError("save_checkpoint: pass optimizer or optimizer_state_dict, not both")
    states = {name: (label, obj.state_dict()) for name, label, obj in
              [(OPTIMIZER_FILE, "optimizer", optimizer), (SCHEDULER_FILE, "scheduler", scheduler)] if obj is not None}
    if optimizer_state_dict is not None:
        states[OPTIMIZER_FILE] = ("optimizer", optimizer_state_dict)
    for label, state in states.values():
        _check_plain(state, label)

    run_dir = Path(run_dir)
    final = run_dir / f"checkpoint-{step}"
    tmp = run_dir / f"{TMP_PREFIX}checkpoint-{step}-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by an earlier failed save of this process
            shutil.rmtree(tmp)
        tmp.mkdir()
        if model is not None:
            with _no_progress_bars():
                model.save_pretrained(tmp, **({} if model_state_dict is None else {"state_dict": model_state_dict}))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, (_, state) in states.items():
            with open(tmp / name, "wb") as f:  # a Python file: torch chains a failed write's OSError
                torch.save(state, f)
        for name, text in texts.items():
            (tmp / name).write_text(text)
        files = _hash_and_fsync_tree(tmp)  # data on disk before the manifest that vouches for it
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "files": files}
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
        _fsync_file(tmp / MANIFEST_FILE)
        _fsync_dir(tmp)
        _move_into_place(tmp, final)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = _write_error(err)
        if cause is None:
            raise
        # One line naming the step and the cause; errno kept (so the subclass too) for callers.
        msg = f"{final.name} could not be written ({cause.strerror or cause}); the previous checkpoints are intact"
        raise (OSError(cause.errno, msg, cause.filename) if cause.errno is not None else OSError(msg)) from err
    if keep is not None:
        prune_checkpoints(run_dir, keep, protect=final)
    return final


def prune_checkpoints(run_dir, keep: int, *, protect=None) -> list[Path]:
    """Delete the checkpoint-<step> folders older than the `keep` newest complete ones (never `protect`).

    Complete as `list_checkpoints` says: a damaged folder does not count toward `keep`, and one
    newer than the kept ones stays (for `set_aside_damaged`). Returns what was deleted.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    protect = Path(protect).resolve() if protect is not None else None
    kept = list_checkpoints(run_dir)[-keep:]
    oldest = _step(kept[0]) if len(kept) == keep else -1
    doomed = [p for p in _named_checkpoints(Path(run_dir)) if _step(p) < oldest and p.resolve() != protect]
    for path in doomed:
        remove_checkpoint(path)
    return doomed


def clean_stale(run_dir) -> list[Path]:
    """Remove `.tmp-*` folders left by interrupted saves; call when no other process is saving there."""
    run_dir = Path(run_dir)
    stale = sorted(p for p in run_dir.glob(f"{TMP_PREFIX}*")) if run_dir.is_dir() else []
    for path in stale:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return stale


# ------------------------------------------------------------------------------- find
def list_checkpoints(run_dir) -> list[Path]:
    """Complete checkpoints under `run_dir`, oldest (lowest step) first.

    Partial, damaged or foreign folders are skipped, as far as a size check finds: nothing is
    hashed here (pruning lists on every save). `resolve_resume` hashes, and skips nothing.
    """
    return [p for p in _named_checkpoints(Path(run_dir)) if _problem(p, hashes=False) is None]


def latest_checkpoint(run_dir) -> Path | None:
    """The highest-step checkpoint `list_checkpoints` finds, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def resolve_resume(spec: str, run_dir) -> Path:
    """`--resume` value -> checkpoint folder, hashed in full; renames and deletes nothing (runs on every rank).

    "latest": the newest checkpoint-<step> folder in `run_dir`, complete or not, must verify (no
    silent fall back); "latest_valid": the newest that verifies (`set_aside_damaged` those above
    it, on one rank); anything else is a checkpoint folder.
    """
    if not isinstance(spec, (str, os.PathLike)) or not str(spec):
        raise ValueError(f"resume must be 'latest', 'latest_valid' or a checkpoint folder, got {spec!r}")
    spec, named = str(spec), _named_checkpoints(Path(run_dir))
    if spec in ("latest", "latest_valid") and not named:
        raise ValueError(f"resume={spec!r}: no complete checkpoint under {run_dir} "
                         "(folders named checkpoint-<step> with a checkpoint.json manifest)")
    if spec == "latest":
        if (problem := _problem(named[-1])) is not None:
            raise ValueError(f"resume='latest': the newest checkpoint fails verification: {problem}. Resume with "
                             "--resume latest_valid to fall back to the newest checkpoint that verifies (newer "
                             "damaged ones are set aside, not deleted), or pass a checkpoint folder")
        return named[-1]
    if spec == "latest_valid":
        problems = []
        for path in reversed(named):
            if (problem := _problem(path)) is None:
                return path
            problems.append(problem)
        raise ValueError(f"resume='latest_valid': no checkpoint under {run_dir} verifies: {'; '.join(problems[:3])}")
    path = Path(spec)
    if path.is_dir() and not (path / MANIFEST_FILE).exists() and _named_checkpoints(path):
        raise ValueError(f"resume={spec!r} is a run folder, not a checkpoint; pass one of its "
                         "checkpoint-<step> folders, 'latest' or 'latest_valid'")
    verify_checkpoint(path, what=f"resume={spec!r}")
    return path


def set_aside_damaged(run_dir, newer_than: int) -> list[Path]:
    """Rename each checkpoint-<step> folder above step `newer_than` that fails `verify_checkpoint`.

    `checkpoint-12` becomes `checkpoint-12.damaged` (`.damaged-2`, ... if taken): its bytes kept,
    outside the names that saves, prunes and `clean_stale` touch. Call it on one process (rank 0),
    after `resolve_resume`; returns the new paths, to tell the user.
    """
    if isinstance(newer_than, bool) or not isinstance(newer_than, int):
        raise ValueError(f"newer_than must be a step (an int), got {newer_than!r}")
    moved = []
    for path in _named_checkpoints(Path(run_dir)):
        if _step(path) > newer_than and _problem(path) is not None:
            names = (f"{path.name}.damaged" + (f"-{n}" if n > 1 else "") for n in itertools.count(1))
            moved.append(next(path.with_name(n) for n in names if not path.with_name(n).exists()))
            os.rename(path, moved[-1])
    if moved:
        _fsync_dir(Path(run_dir))
    return moved


def verify_checkpoint(path, *, what: str | None = None, hashes: bool = True) -> dict:
    """The manifest of the checkpoint at `path`; ValueError if it is missing, incomplete or altered.

    Every file's size is checked, then (`hashes=True`) its sha256, read in chunks. A version-1
    manifest (sizes only) verifies by size, with a warning when hashes were asked for.
    """
    path = Path(path)
    what = what or str(path)
    if not path.is_dir():
        raise ValueError(f"{what}: no such folder")
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise ValueError(f"{what}: no {MANIFEST_FILE}, so it is not a gspo checkpoint or its writing never finished")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{what}: unreadable {MANIFEST_FILE} ({err})") from None
    if not (isinstance(manifest, dict) and manifest.get("format") == FORMAT
            and isinstance(manifest.get("files"), dict) and isinstance(manifest.get("step"), int)):
        raise ValueError(f"{what}: {MANIFEST_FILE} is not a {FORMAT} manifest")
    version = manifest.get("version")
    if version not in (1, VERSION):
        raise ValueError(f"{what}: format version {version!r}, this gspo reads versions 1 and {VERSION}")
    files = {k: {"size": v} if version == 1 else v for k, v in manifest["files"].items()}  # name -> {size, sha256}
    bad = [k for k, f in files.items() if not (isinstance(f, dict) and isinstance(f.get("size"), int)
                                               and (version == 1 or isinstance(f.get("sha256"), str)))]
    if bad:
        raise ValueError(f"{what}: {MANIFEST_FILE} is not a {FORMAT} manifest (its entry for {bad[0]!r})")
    for name, entry in files.items():  # every size before any hash: a truncation is found at once
        if not (path / name).is_file():
            raise ValueError(f"{what}: incomplete, {name} is missing")
        if (size := (path / name).stat().st_size) != entry["size"]:
            raise ValueError(f"{what}: {name} has {size} bytes, the manifest says {entry['size']} "
                             "(truncated or modified)")
    if hashes and version == 1:
        warnings.warn(f"{what}: a version-1 checkpoint: its {MANIFEST_FILE} carries no content hashes, so only "
                      "file sizes were verified", stacklevel=2)
    for name, entry in files.items() if hashes else ():
        if "sha256" in entry and _sha256(path / name) != entry["sha256"]:
            raise ValueError(f"{what}: {name} does not match its sha256 in {MANIFEST_FILE} (damaged or modified)")
    return manifest


# ------------------------------------------------------------------------------- load
def load_checkpoint(path, *, model=None, optimizer=None, scheduler=None,
                    rng_generators: dict[str, torch.Generator] | None = None, rng: bool = True,
                    hashes: bool = True) -> dict:
    """Restore what is passed from the checkpoint at `path`; returns {step, path, trainer_state, config}.

    `model` gets its weights in place (`load_model_weights`), so an optimizer built over its
    parameters stays valid; build optimizer and scheduler as in a fresh run, then pass them here.
    Verified first (`hashes=False`: sizes only, for a folder `resolve_resume` just hashed); weights
    and optimizer/scheduler state are checked finite before any is copied in, so a refused
    checkpoint leaves all three untouched. RNG states (global and `rng_generators`) are restored
    last, after anything that might draw; `rng=False` leaves every RNG as it is.
    """
    path = Path(path)
    manifest = verify_checkpoint(path, hashes=hashes)
    texts = {name: _read_json(path / name) for name in (RNG_FILE, TRAINER_STATE_FILE, CONFIG_FILE)}
    states = []
    for label, obj, name in [("optimizer", optimizer, OPTIMIZER_FILE), ("scheduler", scheduler, SCHEDULER_FILE)]:
        if obj is None:
            continue
        if name not in manifest["files"]:
            raise ValueError(f"checkpoint {path}: no {name}, but a {label} was passed to restore")
        states.append((obj, load_state_file(path / name)))
        check_finite_state(states[-1][1], str(path / name))
    if model is not None:
        load_model_weights(model, path)
    for obj, state in states:
        obj.load_state_dict(state)
    if rng:
        try:
            restore_rng(texts[RNG_FILE], rng_generators)
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            if str(err).startswith("rng_generators:"):
                raise
            raise ValueError(f"{path / RNG_FILE}: not the RNG states gspo writes ({type(err).__name__}: {err})") from None
    return {"step": manifest["step"], "path": path, "trainer_state": texts[TRAINER_STATE_FILE],
            "config": texts[CONFIG_FILE]}


def _read_json(file: Path):
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file}: not the JSON gspo writes ({err})") from None


def load_state_file(file) -> dict:
    """A `torch.save`d state dict read with `weights_only=True`: tensors and plain values, no code."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0]
        raise ValueError(f"{file}: refused, it holds objects other than tensors and plain values "
                         f"(torch.load weights_only=True: {first}); gspo never unpickles code from a checkpoint"
                         ) from err


def check_finite_state(state, where: str) -> None:
    """ValueError naming the first floating tensor in a (nested) state dict that holds NaN/inf.

    Python floats are not checked: some are legitimately inf (ReduceLROnPlateau's `best`).
    """
    keys = _first_nonfinite(state, ())
    if keys is not None:
        what = (f"state of parameter {keys[1]} ({keys[2]!r})" if len(keys) == 3 and keys[0] == "state"
                else str(keys[0]) if len(keys) == 1 else "".join(f"[{k!r}]" for k in keys) or "the tensor")
        raise ValueError(f"{where}: {what} holds NaN/inf")


def load_model_weights(model, path) -> None:
    """Copy the `save_pretrained` weights in folder `path` into `model`, in place.

    Fast path: the safetensors keys are the model's own (tied aliases such as lm_head.weight,
    which transformers leaves out of the file, are filled through their shared storage).
    Otherwise the model type converts names on load (transformers 5 fuses MoE experts in memory
    but saves them per expert), so `type(model).from_pretrained` reads the folder and its
    state dict is copied in. `model` must be the bare model (no DDP/compile wrapper). Every saved
    tensor is checked finite first: a ValueError names the file and tensor, the model untouched.
    """
    from safetensors.torch import load_file

    path = Path(path)
    saved = {}
    for file in _weight_files(path):
        tensors = load_file(str(file))
        check_finite_state(tensors, str(file))
        saved.update(tensors)
    own = model.state_dict()
    if not set(saved) <= set(own):
        _load_via_from_pretrained(model, path)
        return
    wrong = [f"{k}: saved {tuple(v.shape)}, model {tuple(own[k].shape)}" for k, v in saved.items()
             if v.shape != own[k].shape]
    if wrong:
        raise ValueError(f"checkpoint {path} does not fit the model: {'; '.join(wrong[:3])}")
    filled = {_storage(own[k]) for k in saved}
    missing = [k for k in own if k not in saved and _storage(own[k]) not in filled]
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights the model has: {missing[:5]}")
    with torch.no_grad():
        model.load_state_dict(saved, strict=False)


# ------------------------------------------------------------------------------- helpers
def _named_checkpoints(run_dir: Path) -> list[Path]:
    """Folders named checkpoint-<step> (complete or not), by step."""
    if not run_dir.is_dir():
        return []
    return sorted((p for p in run_dir.iterdir() if p.is_dir() and _NAME.fullmatch(p.name)), key=_step)


def _problem(path: Path, hashes: bool = True) -> str | None:
    """Why `verify_checkpoint` refuses `path`, or None."""
    try:
        verify_checkpoint(path, hashes=hashes)
    except ValueError as err:
        return str(err)
    return None


def _step(path: Path) -> int:
    return int(path.name.rsplit("-", 1)[1])


def _first_nonfinite(obj, keys: tuple) -> tuple | None:
    if isinstance(obj, torch.Tensor):
        floating = obj.is_floating_point() or obj.is_complex()
        return keys if floating and not bool(torch.isfinite(obj).all()) else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return next((found for k, v in items if (found := _first_nonfinite(v, keys + (k,))) is not None), None)


def _move_into_place(tmp: Path, final: Path) -> None:
    if final.exists():  # re-saving a step: the old folder steps aside first (a rename, so still atomic)
        trash = final.parent / f"{TMP_PREFIX}trash-{final.name}-{os.getpid()}"
        os.replace(final, trash)
        try:
            os.replace(tmp, final)
        except OSError:
            os.replace(trash, final)  # the old copy comes back: a failed save loses nothing
            raise
        _fsync_dir(final.parent)
        shutil.rmtree(trash, ignore_errors=True)  # saved already; a leftover is clean_stale's
    else:
        os.replace(tmp, final)
        _fsync_dir(final.parent)


def remove_checkpoint(path) -> None:
    """Delete a checkpoint folder; renamed out of the checkpoint-<step> names first, so a kill midway
    leaves no half checkpoint for `resolve_resume("latest")` to refuse."""
    path = Path(path)
    trash = path.parent / f"{TMP_PREFIX}trash-{path.name}-{os.getpid()}"
    os.replace(path, trash)
    shutil.rmtree(trash)


def _hash_and_fsync_tree(root: Path) -> dict:
    """{relative name: {size, sha256}} of every file under `root`, hashed right after writing; all fsynced."""
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            files[path.relative_to(root).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
            _fsync_file(path)
    for path in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        _fsync_dir(path)
    _fsync_dir(root)
    return files


def _sha256(file: Path) -> str:
    """Hex sha256 of `file`, read 16 MiB at a time (weights run to many GB)."""
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _write_error(err: BaseException) -> OSError | None:
    """The OSError behind a failed write: torch.save raises a bare RuntimeError chained to it,
    safetensors (so save_pretrained) a SafetensorError that names it as "(os error 28)"."""
    if isinstance(err, OSError) or (isinstance(err, RuntimeError) and isinstance(err.__context__, OSError)):
        return err if isinstance(err, OSError) else err.__context__
    found = re.search(r"\(os error (\d+)\)", str(err)) if type(err).__name__ == "SafetensorError" else None
    return OSError(int(found[1]), os.strerror(int(found[1]))) if found else None


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    with suppress(OSError):  # some platforms cannot open or fsync folders; the file fsyncs still hold
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _weight_files(path: Path) -> list[Path]:
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    raise ValueError(f"checkpoint {path}: no model.safetensors (or its index); was a model saved in it?")


def _load_via_from_pretrained(model, path: Path) -> None:
    with torch.random.fork_rng(devices=[]):  # loading must not move the caller's CPU RNG
        fresh, info = type(model).from_pretrained(path, dtype=model.dtype, output_loading_info=True)
    problems = {k: sorted(map(str, info.get(k) or ())) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {k: v for k, v in problems.items() if v}
    if problems:
        raise ValueError(f"checkpoint {path} does not fit the model: {problems}")
    with torch.no_grad():
        model.load_state_dict(fresh.state_dict(), strict=True)


def _storage(t: torch.Tensor) -> tuple:
    return t.device, t.untyped_storage().data_ptr()


@contextmanager
def _no_progress_bars():
    """Silence transformers' "Writing model shards" bar (it would break the trainer's own bar)."""
    if "transformers" not in sys.modules:  # not imported: not a transformers model, no bar
        yield
        return
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _exact_json(name: str, value) -> str:
    """`value` as JSON text, or a ValueError if it is not JSON or would read back different."""
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict, got {type(value).__name__}")
    try:
        text = json.dumps(value, indent=1)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name}: not JSON-serialisable ({err})") from None
    where = _first_difference(value, json.loads(text), name)
    if where is not None:
        raise ValueError(f"{name}: {where} would not read back equal from JSON "
                         "(use lists not tuples, string dict keys, plain numbers)")
    return text


def _first_difference(a, b, where: str) -> str | None:
    if isinstance(a, dict):
        bad = next((k for k in a if not isinstance(k, str)), None)
        if bad is not None:
            return f"{where}[{bad!r}] (a non-string key)"
        return next((d for k in a if (d := _first_difference(a[k], b[k], f"{where}[{k!r}]"))), None)
    if isinstance(a, (list, tuple)):
        if type(a) is not list:
            return f"{where} (a {type(a).__name__})"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _first_difference(x, y, f"{where}[{i}]"))),
                    None)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    return None if type(a) is type(b) and a == b else f"{where} ({type(a).__name__} {a!r})"


def _check_plain(obj, where: str) -> None:
    """ValueError unless `obj` is made of what `torch.load(weights_only=True)` reads back."""
    if type(obj) in (dict, OrderedDict):  # not subclasses: defaultdict, for one, is refused on load
        for k, v in obj.items():
            _check_plain(k, f"{where} key")
            _check_plain(v, f"{where}[{k!r}]")
    elif type(obj) in (list, tuple, set, torch.Size):  # not namedtuples
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
    elif not isinstance(obj, _PLAIN):
        raise ValueError(f"{where} is a {type(obj).__name__}: a checkpoint state may hold only tensors and plain "
                         "values (it is read back with torch.load(weights_only=True))")
