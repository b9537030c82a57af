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
  checkpoint.json                                           manifest (step, file sizes), written last
The folder is a valid `from_pretrained` directory, so `gspo eval` or transformers can read it.

Atomicity: everything is written and fsynced in `run_dir/.tmp-checkpoint-<step>-<pid>`, then one
rename gives it its final name, so a kill at any moment leaves every earlier checkpoint intact,
plus at worst a stale `.tmp-*` folder that readers ignore (`clean_stale` removes it). Re-saving a
step that exists, the old copy is renamed aside first: a kill between the two renames loses that
step (its old copy sits in `.tmp-trash-*`) but no other.
Safety: weights are safetensors, `*.pt` files are read with `torch.load(weights_only=True)`, the
rest is JSON, so a tampered checkpoint cannot run code when loaded.
"""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import random
import re
import shutil
import sys
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

MANIFEST_FILE = "checkpoint.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.json"
TRAINER_STATE_FILE = "trainer_state.json"
CONFIG_FILE = "train_config.json"  # config.json is the model's (save_pretrained)
TMP_PREFIX = ".tmp-"
FORMAT = "gspo-checkpoint"
VERSION = 1
_NAME = re.compile(r"checkpoint-(\d+)")
# What a weights_only unpickler accepts (torch.serialization); checked at save time, so a bad
# state dict fails when written rather than at resume.
_PLAIN = (torch.Tensor, bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


# ------------------------------------------------------------------------------- save
def save_checkpoint(run_dir, step: int, *, model=None, tokenizer=None, optimizer=None, scheduler=None,
                    trainer_state: dict | None = None, config: dict | None = None,
                    rng_generators: dict[str, torch.Generator] | None = None, keep: int | None = 2,
                    model_state_dict: dict | None = None, optimizer_state_dict: dict | None = None) -> Path:
    """Write `run_dir/checkpoint-<step>` atomically; then keep only the newest `keep` checkpoints.

    Each of model/tokenizer/optimizer/scheduler is optional (None: not saved). A sharded (FSDP)
    model or optimizer passes its gathered full state too: `model_state_dict` is what
    `save_pretrained` writes, `optimizer_state_dict` replaces `optimizer.state_dict()`. `trainer_state` and
    `config` must be JSON that reads back equal (no tuples, no non-string keys). The RNG states
    (global ones and `rng_generators`) are captured when this is called. An existing checkpoint of
    the same step is replaced; `keep=None` keeps every checkpoint. Returns the checkpoint's path.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be an int >= 1 or None (keep all), got {keep!r}")
    texts = {TRAINER_STATE_FILE: _exact_json("trainer_state", {} if trainer_state is None else trainer_state),
             CONFIG_FILE: _exact_json("config", {} if config is None else config),
             RNG_FILE: json.dumps(capture_rng(rng_generators))}
    if optimizer_state_dict is not None and optimizer is not None:
        raise ValueError("save_checkpoint: pass optimizer or optimizer_state_dict, not both")
    states = {name: (label, obj.state_dict()) for name, label, obj in
              [(OPTIMIZER_FILE, "optimizer", optimizer), (SCHEDULER_FILE, "scheduler", scheduler)] if obj is not None}
    if optimizer_state_dict is not None:
        states[OPTIMIZER_FILE] = ("optimizer", optimizer_state_dict)
    for label, state in states.values():
        _check_plain(state, label)

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / f"checkpoint-{step}"
    tmp = run_dir / f"{TMP_PREFIX}checkpoint-{step}-{os.getpid()}"
    if tmp.exists():  # left by an earlier failed save of this process
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        if model is not None:
            with _no_progress_bars():
                model.save_pretrained(tmp, **({} if model_state_dict is None else {"state_dict": model_state_dict}))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, (_, state) in states.items():
            torch.save(state, tmp / name)
        for name, text in texts.items():
            (tmp / name).write_text(text)
        files = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        _fsync_tree(tmp)  # data on disk before the manifest that vouches for it
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "files": files}
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
        _fsync_file(tmp / MANIFEST_FILE)
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _move_into_place(tmp, final)
    if keep is not None:
        prune_checkpoints(run_dir, keep, protect=final)
    return final


def prune_checkpoints(run_dir, keep: int, *, protect=None) -> list[Path]:
    """Delete all but the `keep` highest-step checkpoints (never `protect`); returns what was deleted."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    protect = Path(protect).resolve() if protect is not None else None
    doomed = [p for p in _named_checkpoints(Path(run_dir))[:-keep] if p.resolve() != protect]
    for path in doomed:
        _remove_atomically(path)
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
    """Complete checkpoints under `run_dir`, oldest (lowest step) first; partial or foreign folders are skipped."""
    out = []
    for path in _named_checkpoints(Path(run_dir)):
        try:
            verify_checkpoint(path)
        except ValueError:
            continue
        out.append(path)
    return out


def latest_checkpoint(run_dir) -> Path | None:
    """The complete checkpoint with the highest step under `run_dir`, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def resolve_resume(spec: str, run_dir) -> Path:
    """`--resume` value -> checkpoint folder: "latest" (newest complete one in `run_dir`) or a path."""
    if not isinstance(spec, (str, os.PathLike)) or not str(spec):
        raise ValueError(f"resume must be 'latest' or a checkpoint folder, got {spec!r}")
    if str(spec) == "latest":
        found = latest_checkpoint(run_dir)
        if found is None:
            raise ValueError(f"resume='latest': no complete checkpoint under {run_dir} "
                             "(folders named checkpoint-<step> with a checkpoint.json manifest)")
        return found
    path = Path(spec)
    if path.is_dir() and not (path / MANIFEST_FILE).exists() and _named_checkpoints(path):
        raise ValueError(f"resume={str(spec)!r} is a run folder, not a checkpoint; pass one of its "
                         "checkpoint-<step> folders, or 'latest'")
    verify_checkpoint(path, what=f"resume={str(spec)!r}")
    return path


def verify_checkpoint(path, *, what: str | None = None) -> dict:
    """The manifest of the checkpoint at `path`; ValueError if it is missing, incomplete or altered in size."""
    path = Path(path)
    what = what or f"checkpoint {path}"
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
    if manifest.get("version") != VERSION:
        raise ValueError(f"{what}: format version {manifest.get('version')!r}, this gspo reads version {VERSION}")
    for name, size in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise ValueError(f"{what}: incomplete, {name} is missing")
        if file.stat().st_size != size:
            raise ValueError(f"{what}: {name} has {file.stat().st_size} bytes, the manifest says {size} "
                             "(truncated or modified)")
    return manifest


# ------------------------------------------------------------------------------- load
def load_checkpoint(path, *, model=None, optimizer=None, scheduler=None,
                    rng_generators: dict[str, torch.Generator] | None = None, rng: bool = True) -> dict:
    """Restore what is passed from the checkpoint at `path`; returns {step, path, trainer_state, config}.

    `model` gets its weights in place (`load_model_weights`), so an optimizer built over its
    parameters stays valid; build optimizer and scheduler as in a fresh run, then pass them here.
    RNG states (global and `rng_generators`) are restored last, after anything that might draw;
    `rng=False` leaves every RNG as it is.
    """
    path = Path(path)
    manifest = verify_checkpoint(path)
    if model is not None:
        load_model_weights(model, path)
    for label, obj, name in [("optimizer", optimizer, OPTIMIZER_FILE), ("scheduler", scheduler, SCHEDULER_FILE)]:
        if obj is None:
            continue
        if name not in manifest["files"]:
            raise ValueError(f"checkpoint {path}: no {name}, but a {label} was passed to restore")
        obj.load_state_dict(load_state_file(path / name))
    if rng:
        restore_rng(json.loads((path / RNG_FILE).read_text()), rng_generators)
    return {"step": manifest["step"], "path": path,
            "trainer_state": json.loads((path / TRAINER_STATE_FILE).read_text()),
            "config": json.loads((path / CONFIG_FILE).read_text())}


def load_state_file(file) -> dict:
    """A `torch.save`d state dict read with `weights_only=True`: tensors and plain values, no code."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0]
        raise ValueError(f"{file}: refused, it holds objects other than tensors and plain values "
                         f"(torch.load weights_only=True: {first}); gspo never unpickles code from a checkpoint"
                         ) from err


def load_model_weights(model, path) -> None:
    """Copy the `save_pretrained` weights in folder `path` into `model`, in place.

    Fast path: the safetensors keys are the model's own (tied aliases such as lm_head.weight,
    which transformers leaves out of the file, are filled through their shared storage).
    Otherwise the model type converts names on load (transformers 5 fuses MoE experts in memory
    but saves them per expert), so `type(model).from_pretrained` reads the folder and its
    state dict is copied in. `model` must be the bare model (no DDP/compile wrapper).
    """
    from safetensors.torch import load_file

    path = Path(path)
    saved = {}
    for file in _weight_files(path):
        saved.update(load_file(str(file)))
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


# ------------------------------------------------------------------------------- RNG
def capture_rng(generators: dict[str, torch.Generator] | None = None) -> dict:
    """Every RNG state as JSON-able data: Python, NumPy, torch CPU, CUDA (if in use), named generators."""
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {"bit_generator": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": _b64(torch.get_rng_state()),
        "generators": {k: _b64(g.get_state()) for k, g in (generators or {}).items()},
    }
    # Only when CUDA is already initialised: asking would otherwise start a context on every GPU.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict, generators: dict[str, torch.Generator] | None = None) -> None:
    """Undo `capture_rng`: set every global RNG and each named generator to the captured state.

    The generator names must match the captured ones exactly. CUDA states are set for the GPUs
    present (none on a CPU-only machine, where a CUDA run cannot be resumed bit for bit anyway).
    """
    generators = generators or {}
    saved = state.get("generators", {})
    if set(saved) != set(generators):
        raise ValueError(f"rng_generators: names {sorted(generators)} do not match the checkpoint's {sorted(saved)}")
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state((npy["bit_generator"], np.asarray(npy["keys"], dtype=np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(_unb64(state["torch"]))
    for name, gen in generators.items():
        gen.set_state(_unb64(saved[name]))
    if state.get("cuda") and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_unb64(s), i)


# ------------------------------------------------------------------------------- helpers
def _named_checkpoints(run_dir: Path) -> list[Path]:
    """Folders named checkpoint-<step> (complete or not), by step."""
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := _NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def _move_into_place(tmp: Path, final: Path) -> None:
    if final.exists():  # re-saving a step: the old folder steps aside first (a rename, so still atomic)
        trash = final.parent / f"{TMP_PREFIX}trash-{final.name}-{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        shutil.rmtree(trash)
    else:
        os.replace(tmp, final)
        _fsync_dir(final.parent)


def _remove_atomically(path: Path) -> None:
    # Renamed out of the checkpoint-<step> namespace first, so a kill mid-delete leaves no half checkpoint.
    trash = path.parent / f"{TMP_PREFIX}trash-{path.name}-{os.getpid()}"
    os.replace(path, trash)
    shutil.rmtree(trash)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_file():
            _fsync_file(path)
        elif path.is_dir():
            _fsync_dir(path)
    _fsync_dir(root)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; the file fsyncs still hold
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
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
    hf = sys.modules.get("transformers")  # not imported: not a transformers model, no bar
    if hf is None:
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


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


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
