"""Writing and reading a checkpoint: `save_checkpoint` (atomic, fsynced, hashed) and `load_checkpoint`
(verified, finite-checked, nothing unpickled but plain state)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from gspo.checkpoint.files import (
    ADAPTER_FILE,
    CONFIG_FILE,
    FORMAT,
    MANIFEST_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    TMP_PREFIX,
    TRAINER_STATE_FILE,
    VERSION,
    check_plain,
    exact_json,
    fsync_dir,
    fsync_file,
    hash_and_fsync_tree,
    move_into_place,
    prune_checkpoints,
    read_json,
    storage_of,
    umask_modes,
    verify_checkpoint,
    weight_files,
    write_error,
)
from gspo.plugs.lora import is_peft
from gspo.rng import capture_rng, check_rng, restore_rng


# ------------------------------------------------------------------------------- save
def save_checkpoint(run_dir, step: int, *, model=None, tokenizer=None, optimizer=None, scheduler=None,
                    trainer_state: dict | None = None, config: dict | None = None,
                    rng_generators: dict[str, torch.Generator] | None = None, keep: int | None = 2,
                    model_state_dict: dict | None = None, optimizer_state_dict: dict | None = None,
                    rng_state: dict | None = None, extra_states: dict[str, dict] | None = None) -> Path:
    """Write `run_dir/checkpoint-<step>` atomically; then keep only the newest `keep` checkpoints.

    Each of model/tokenizer/optimizer/scheduler is optional (None: not saved). A sharded (FSDP)
    model or optimizer passes its gathered full state too: `model_state_dict` is what
    `save_pretrained` writes, `optimizer_state_dict` replaces `optimizer.state_dict()`. `trainer_state` and
    `config` must be JSON that reads back equal (no tuples, no non-string keys). The RNG states
    (global ones and `rng_generators`) are captured when this is called, unless `rng_state` (a
    `capture_rng` result taken earlier, say when a step began) is given. An existing checkpoint
    of the same step is replaced; `keep=None` keeps every checkpoint. `extra_states`: file name ->
    a plain state (tensors, numbers, strings: a critic's weights and optimizer), `torch.save`d beside
    the others and read back with `load_state_file`. Returns the checkpoint's path.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be an int >= 1 or None (keep all), got {keep!r}")
    texts = {TRAINER_STATE_FILE: exact_json("trainer_state", {} if trainer_state is None else trainer_state),
             CONFIG_FILE: exact_json("config", {} if config is None else config),
             RNG_FILE: json.dumps(capture_rng(rng_generators) if rng_state is None else rng_state)}
    if optimizer_state_dict is not None and optimizer is not None:
        raise ValueError("save_checkpoint: pass optimizer or optimizer_state_dict, not both")
    states = {name: (label, obj.state_dict()) for name, label, obj in
              [(OPTIMIZER_FILE, "optimizer", optimizer), (SCHEDULER_FILE, "scheduler", scheduler)] if obj is not None}
    if optimizer_state_dict is not None:
        states[OPTIMIZER_FILE] = ("optimizer", optimizer_state_dict)
    for name, state in (extra_states or {}).items():
        if name in states or name in texts or "/" in name:
            raise ValueError(f"save_checkpoint: extra state {name!r} would overwrite a checkpoint file")
        states[name] = (name, state)
    for label, state in states.values():
        check_plain(state, label)

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
        umask_modes(tmp)  # safetensors writes 0600: readable as the umask says, like every other file
        files = hash_and_fsync_tree(tmp)  # data on disk before the manifest that vouches for it
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "files": files}
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
        fsync_file(tmp / MANIFEST_FILE)
        fsync_dir(tmp)
        move_into_place(tmp, final)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = write_error(err)
        if cause is None:
            raise
        # One line naming the step and the cause; errno kept (so the subclass too) for callers.
        msg = f"{final.name} could not be written ({cause.strerror or cause}); the previous checkpoints are intact"
        raise (OSError(cause.errno, msg, cause.filename) if cause.errno is not None else OSError(msg)) from err
    if keep is not None:
        prune_checkpoints(run_dir, keep, protect=final)
    return final


def load_checkpoint(path, *, model=None, optimizer=None, scheduler=None,
                    rng_generators: dict[str, torch.Generator] | None = None, rng: bool = True,
                    hashes: bool = True) -> dict:
    """Restore what is passed from the checkpoint at `path`; returns {step, path, trainer_state, config}.

    `model` gets its weights in place (`load_model_weights`), so an optimizer built over its
    parameters stays valid; build optimizer and scheduler as in a fresh run, then pass them here.
    Verified first (`hashes=False`: sizes only, for a folder `resolve_resume` just hashed); weights
    and optimizer/scheduler state are checked finite, and the RNG states checked settable, before any is
    copied in, so a refused checkpoint leaves all three untouched. RNG states (global and `rng_generators`)
    are restored last, after anything that might draw; `rng=False` leaves every RNG as it is.
    """
    path = Path(path)
    manifest = verify_checkpoint(path, hashes=hashes)
    texts = {name: read_json(path / name) for name in (RNG_FILE, TRAINER_STATE_FILE, CONFIG_FILE)}
    states = []
    for label, obj, name in [("optimizer", optimizer, OPTIMIZER_FILE), ("scheduler", scheduler, SCHEDULER_FILE)]:
        if obj is None:
            continue
        if name not in manifest["files"]:
            raise ValueError(f"checkpoint {path}: no {name}, but a {label} was passed to restore")
        states.append((obj, load_state_file(path / name)))
        check_finite_state(states[-1][1], str(path / name))
    if rng:  # an RNG file it cannot restore is refused before anything is copied in, too
        _rng_checked(path, lambda: check_rng(texts[RNG_FILE], rng_generators))
    if model is not None:
        load_model_weights(model, path)
    for obj, state in states:
        obj.load_state_dict(state)
    if rng:
        _rng_checked(path, lambda: restore_rng(texts[RNG_FILE], rng_generators))
    return {"step": manifest["step"], "path": path, "trainer_state": texts[TRAINER_STATE_FILE],
            "config": texts[CONFIG_FILE]}


def _rng_checked(path: Path, call) -> None:
    """`call()` (checking or restoring the checkpoint's RNG states), its errors named as the RNG file's."""
    try:
        call()
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        if str(err).startswith("rng_generators:"):
            raise
        raise ValueError(f"{path / RNG_FILE}: not the RNG states gspo writes ({type(err).__name__}: {err})") from None


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
    if is_peft(model):  # a LoRA policy (gspo/plugs/lora.py): its checkpoint holds the adapters only
        _load_adapter_weights(model, path)
        return
    saved = {}
    for file in weight_files(path):
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
    filled = {storage_of(own[k]) for k in saved}
    missing = [k for k in own if k not in saved and storage_of(own[k]) not in filled]
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights the model has: {missing[:5]}")
    with torch.no_grad():
        model.load_state_dict(saved, strict=False)


def _load_adapter_weights(model, path: Path) -> None:
    """Copy PEFT's `save_pretrained` adapter weights (adapter_model.safetensors) into the PeftModel `model`."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = path / ADAPTER_FILE
    if not file.is_file():
        raise ValueError(f"checkpoint {path}: no {ADAPTER_FILE}, but the model has LoRA adapters (was it saved by a "
                         "run with the same lora_* / peft settings?)")
    saved = load_file(str(file))
    check_finite_state(saved, str(file))
    own = {k for k in model.state_dict() if "lora_" in k}
    result = set_peft_model_state_dict(model, saved)
    missing = sorted(k for k in result.missing_keys if k in own)
    if result.unexpected_keys or missing:
        raise ValueError(f"checkpoint {path} does not fit the model's adapters: unexpected "
                         f"{sorted(result.unexpected_keys)[:3]}, missing {missing[:3]}")


def _first_nonfinite(obj, keys: tuple) -> tuple | None:
    if isinstance(obj, torch.Tensor):
        floating = obj.is_floating_point() or obj.is_complex()
        return keys if floating and not bool(torch.isfinite(obj).all()) else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return next((found for k, v in items if (found := _first_nonfinite(v, keys + (k,))) is not None), None)


def _load_via_from_pretrained(model, path: Path) -> None:
    with torch.random.fork_rng(devices=[]):  # loading must not move the caller's CPU RNG
        fresh, info = type(model).from_pretrained(path, dtype=model.dtype, output_loading_info=True)
    problems = {k: sorted(map(str, info.get(k) or ())) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {k: v for k, v in problems.items() if v}
    if problems:
        raise ValueError(f"checkpoint {path} does not fit the model: {problems}")
    with torch.no_grad():
        model.load_state_dict(fresh.state_dict(), strict=True)


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
