"""A checkpoint folder on disk: names, manifest (size and sha256 per file), verification, atomic
moves, listing and pruning. The format is described in gspo/checkpoint/__init__.py."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import warnings
from collections import OrderedDict
from contextlib import suppress
from pathlib import Path

import torch

MANIFEST_FILE = "checkpoint.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.json"
TRAINER_STATE_FILE = "trainer_state.json"
CRITIC_FILE = "critic.pt"  # PPO's critic: weights, optimizer, schedule, guard (gspo/plugs/baselines.py)
ADAPTER_FILE = "adapter_model.safetensors"  # a LoRA run's weights (PEFT save_pretrained)
CONFIG_FILE = "train_config.json"  # config.json is the model's (save_pretrained)
TMP_PREFIX = ".tmp-"
FORMAT = "gspo-checkpoint"
VERSION = 2  # 1: sizes only (still read, by size); 2: size and sha256 per file
_NAME = re.compile(r"checkpoint-(\d+)")
# What a weights_only unpickler accepts (torch.serialization); checked at save time, so a bad
# state dict fails when written rather than at resume.
_PLAIN = (torch.Tensor, bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)





def prune_checkpoints(run_dir, keep: int, *, protect=None) -> list[Path]:
    """Delete the checkpoint-<step> folders older than the `keep` newest complete ones (never `protect`).

    Complete as `list_checkpoints` says: a damaged folder does not count toward `keep`, and one
    newer than the kept ones stays (for `set_aside_damaged`). Returns what was deleted.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    protect = Path(protect).resolve() if protect is not None else None
    kept = list_checkpoints(run_dir)[-keep:]
    oldest = step_of(kept[0]) if len(kept) == keep else -1
    doomed = [p for p in named_checkpoints(Path(run_dir)) if step_of(p) < oldest and p.resolve() != protect]
    for path in doomed:
        remove_checkpoint(path)
    return doomed


def clean_stale(run_dir) -> list[Path]:
    """Remove `.tmp-*` folders left by interrupted saves; call when no other process is saving there."""
    run_dir = Path(run_dir)
    stale = sorted(p for p in run_dir.glob(f"{TMP_PREFIX}*")) if run_dir.is_dir() else []
    for path in stale:
        remove_tree(path)
    return stale


def remove_tree(path) -> None:
    """Delete the folder, file or link at `path`; a link is removed, never followed (its target stays).

    An OSError names `path` (shutil.rmtree's own errors may name none: "Cannot call rmtree on a
    symbolic link").
    """
    path = Path(path)
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            shutil.rmtree(path)
    except OSError as err:
        msg = f"cannot remove {path} ({err.strerror or err})"
        raise (OSError(err.errno, msg, err.filename) if err.errno is not None else OSError(msg)) from err


def list_checkpoints(run_dir) -> list[Path]:
    """Complete checkpoints under `run_dir`, oldest (lowest step) first.

    Partial, damaged or foreign folders are skipped, as far as a size check finds: nothing is
    hashed here (pruning lists on every save). `resolve_resume` hashes, and skips nothing.
    """
    return [p for p in named_checkpoints(Path(run_dir)) if problem_of(p, hashes=False) is None]


def latest_checkpoint(run_dir) -> Path | None:
    """The highest-step checkpoint `list_checkpoints` finds, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


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


def read_json(file: Path):
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file}: not the JSON gspo writes ({err})") from None


def named_checkpoints(run_dir: Path) -> list[Path]:
    """Folders named checkpoint-<step> (complete or not), by step."""
    if not run_dir.is_dir():
        return []
    return sorted((p for p in run_dir.iterdir() if p.is_dir() and _NAME.fullmatch(p.name)), key=step_of)


def problem_of(path: Path, hashes: bool = True) -> str | None:
    """Why `verify_checkpoint` refuses `path`, or None."""
    try:
        verify_checkpoint(path, hashes=hashes)
    except ValueError as err:
        return str(err)
    return None


def step_of(path: Path) -> int:
    return int(path.name.rsplit("-", 1)[1])


def move_into_place(tmp: Path, final: Path) -> None:
    if final.exists():  # re-saving a step: the old folder steps aside first (a rename, so still atomic)
        trash = final.parent / f"{TMP_PREFIX}trash-{final.name}-{os.getpid()}"
        os.replace(final, trash)
        try:
            os.replace(tmp, final)
        except OSError:
            os.replace(trash, final)  # the old copy comes back: a failed save loses nothing
            raise
        fsync_dir(final.parent)
        with suppress(OSError):  # saved already; a leftover is clean_stale's
            remove_tree(trash)  # the old copy, or the link that stood for it (its target kept)
    else:
        os.replace(tmp, final)
        fsync_dir(final.parent)


def remove_checkpoint(path) -> None:
    """Delete a checkpoint folder; renamed out of the checkpoint-<step> names first, so a kill midway
    leaves no half checkpoint for `resolve_resume("latest")` to refuse. A linked checkpoint: the link goes,
    its target stays."""
    path = Path(path)
    trash = path.parent / f"{TMP_PREFIX}trash-{path.name}-{os.getpid()}"
    os.replace(path, trash)
    remove_tree(trash)


def hash_and_fsync_tree(root: Path) -> dict:
    """{relative name: {size, sha256}} of every file under `root`, hashed right after writing; all fsynced."""
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            files[path.relative_to(root).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
            fsync_file(path)
    for path in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        fsync_dir(path)
    fsync_dir(root)
    return files


def new_file_mode() -> int:
    """The mode `open()` gives a new file in this process: 0o666 less the umask."""
    try:  # Linux names the umask here; elsewhere it can only be read by setting it
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def umask_modes(root) -> None:
    """Give every file under folder `root` the mode the umask says (`new_file_mode`).

    safetensors writes its files 0600 whatever the umask, so saved weights would be the only files
    of a model that the user's group (or a serving account) cannot read.
    """
    mode = new_file_mode()
    for path in Path(root).rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def _sha256(file: Path) -> str:
    """Hex sha256 of `file`, read 16 MiB at a time (weights run to many GB)."""
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def write_error(err: BaseException) -> OSError | None:
    """The OSError behind a failed write: torch.save raises a bare RuntimeError chained to it,
    safetensors (so save_pretrained) a SafetensorError that names it as "(os error 28)"."""
    if isinstance(err, OSError) or (isinstance(err, RuntimeError) and isinstance(err.__context__, OSError)):
        return err if isinstance(err, OSError) else err.__context__
    found = re.search(r"\(os error (\d+)\)", str(err)) if type(err).__name__ == "SafetensorError" else None
    return OSError(int(found[1]), os.strerror(int(found[1]))) if found else None


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    with suppress(OSError):  # some platforms cannot open or fsync folders; the file fsyncs still hold
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def weight_files(path: Path) -> list[Path]:
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    raise ValueError(f"checkpoint {path}: no model.safetensors (or its index); was a model saved in it?")


def storage_of(t: torch.Tensor) -> tuple:
    return t.device, t.untyped_storage().data_ptr()


def exact_json(name: str, value) -> str:
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


def check_plain(obj, where: str) -> None:
    """ValueError unless `obj` is made of what `torch.load(weights_only=True)` reads back."""
    if type(obj) in (dict, OrderedDict):  # not subclasses: defaultdict, for one, is refused on load
        for k, v in obj.items():
            check_plain(k, f"{where} key")
            check_plain(v, f"{where}[{k!r}]")
    elif type(obj) in (list, tuple, set, torch.Size):  # not namedtuples
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
    elif not isinstance(obj, _PLAIN):
        raise ValueError(f"{where} is a {type(obj).__name__}: a checkpoint state may hold only tensors and plain "
                         "values (it is read back with torch.load(weights_only=True))")
