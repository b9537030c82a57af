"""The rules of a resume: which checkpoint ("latest", "latest_valid", a path), which settings may
change, and what happens to newer checkpoints."""

from __future__ import annotations

import itertools
import os
from dataclasses import MISSING, fields
from pathlib import Path

from gspo.checkpoint.files import (
    MANIFEST_FILE,
    fsync_dir,
    list_checkpoints,
    named_checkpoints,
    problem_of,
    remove_checkpoint,
    step_of,
    verify_checkpoint,
)
from gspo.config import renamed, to_dict
from gspo.data.mixture import saved_tasks
from gspo.data.rewards import reward_spec


def resolve_resume(spec: str, run_dir) -> Path:
    """`--resume` value -> checkpoint folder, hashed in full; renames and deletes nothing (runs on every rank).

    "latest": the newest checkpoint-<step> folder in `run_dir`, complete or not, must verify (no
    silent fall back); "latest_valid": the newest that verifies (`set_aside_damaged` those above
    it, on one rank); anything else is a checkpoint folder.
    """
    if not isinstance(spec, (str, os.PathLike)) or not str(spec):
        raise ValueError(f"resume must be 'latest', 'latest_valid' or a checkpoint folder, got {spec!r}")
    spec, named = str(spec), named_checkpoints(Path(run_dir))
    if spec in ("latest", "latest_valid") and not named:
        raise ValueError(f"resume={spec!r}: no complete checkpoint under {run_dir} "
                         "(folders named checkpoint-<step> with a checkpoint.json manifest)")
    if spec == "latest":
        if (problem := problem_of(named[-1])) is not None:
            raise ValueError(f"resume='latest': the newest checkpoint fails verification: {problem}. Resume with "
                             "--resume latest_valid to fall back to the newest checkpoint that verifies (newer "
                             "damaged ones are set aside, not deleted), or pass a checkpoint folder")
        return named[-1]
    if spec == "latest_valid":
        problems = []
        for path in reversed(named):
            if (problem := problem_of(path)) is None:
                return path
            problems.append(problem)
        raise ValueError(f"resume='latest_valid': no checkpoint under {run_dir} verifies: {'; '.join(problems[:3])}")
    path = Path(spec)
    if path.is_dir() and not (path / MANIFEST_FILE).exists() and named_checkpoints(path):
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
    for path in named_checkpoints(Path(run_dir)):
        if step_of(path) > newer_than and problem_of(path) is not None:
            names = (f"{path.name}.damaged" + (f"-{n}" if n > 1 else "") for n in itertools.count(1))
            moved.append(next(path.with_name(n) for n in names if not path.with_name(n).exists()))
            os.rename(path, moved[-1])
    if moved:
        fsync_dir(Path(run_dir))
    return moved


# Settings that may change when resuming: where and how much is logged, not what is computed.
RESUME_MAY_CHANGE = ("max_steps", "output_dir", "overwrite_output_dir", "resume_from_checkpoint",
                     "resume_allow_changed_data", "progress",
                     "save_steps", "save_total_limit", "eval_steps", "log_samples_steps", "log_samples_count",
                     "tensorboard", "wandb", "wandb_project", "max_consecutive_skips", "dist_timeout_s",
                     "distributed",  # checkpoints hold full weights and optimizer state in one layout
                     "generation_backend",  # gspo and hf draw the same tokens for the same seed (vllm: its own)
                     "log_mismatch", "vllm_gpu_memory_utilization", "vllm_kv_cache_bytes", "vllm_sleep",
                     "rollout_timeout_s", "rollout_address", "rollout_secret", "rollout_secret_file",
                     "rollout_endpoints")


def saved_config(cfg, world_size: int = 1) -> dict:
    """The config as JSON: reward functions passed as Python callables become "module:name", or "object:..." where
    no import path gives them back (an instance, a lambda: `reward_spec`).

    Two settings are stored as they act: the global batch (per-device batch x world size), and
    seeded_sampling (always on under torchrun), so a run can resume on another number of ranks.
    """
    out = to_dict(cfg)
    out["per_device_batch_size"] *= world_size
    out["seeded_sampling"] = cfg.seeded_sampling or world_size > 1
    out["reward_funcs"] = [reward_spec(f) for f in out["reward_funcs"]]
    out["tasks"] = saved_tasks(out["tasks"])  # the same for each task's reward functions
    return out


def check_resumable(saved: dict, cfg, step: int, world: int = 1) -> None:
    """A resumed run must compute what the checkpointed one did: same settings, and steps left to run."""
    now = saved_config(cfg, world)
    saved = renamed(saved)  # a checkpoint written before a setting was renamed
    # a setting newer than the checkpoint acted as its default then
    saved = {**{f.name: f.default for f in fields(cfg) if f.default is not MISSING and f.name not in saved}, **saved}
    changed = sorted(k for k in set(saved) | set(now) if k not in RESUME_MAY_CHANGE and saved.get(k) != now.get(k))
    if changed:
        def describe(k: str) -> str:
            if k == "per_device_batch_size":  # stored as the global batch, so other world sizes can resume
                return (f"global batch (per_device_batch_size x processes)={saved.get(k)!r} "
                        f"(now {cfg.per_device_batch_size} x {world} = {now.get(k)!r})")
            return f"{k}={saved.get(k)!r} (now {now.get(k)!r})"

        raise ValueError("resume: the checkpoint was made with other settings: " + ", ".join(map(describe, changed)))
    if step >= cfg.max_steps:
        raise ValueError(f"resume: the checkpoint is at step {step} and max_steps={cfg.max_steps}: nothing left to "
                         "run (raise max_steps to train further)")


def check_data(saved: dict | None, now: dict, checkpoint: str, allow: bool) -> list[str]:
    """A resumed run reads the data the checkpoint was made with: per file, the same rows in the same order.

    `saved`, `now`: {data file: `gspo.data.rows.data_fingerprint`} (rows and sha256) as the checkpoint
    recorded them and as loaded now. A changed file is a ValueError naming it and what changed, unless
    `allow` (resume_allow_changed_data); returns the warnings to print: for that, or for a checkpoint
    that records no fingerprints (saved None: an older gspo), which resumes unchecked.
    """
    if saved is None:
        return [f"resume: {checkpoint} records no fingerprint of the data (an older gspo saved it): a change to "
                f"{', '.join(now)} since then cannot be detected"] if now else []
    if not (isinstance(saved, dict) and all(isinstance(fp, dict) and type(fp.get("rows")) is int
                                            and isinstance(fp.get("sha256"), str) for fp in saved.values())):
        raise ValueError(f"{checkpoint}/trainer_state.json: not the trainer state gspo writes (data must map each "
                         f"data file to its rows and sha256, got {saved!r:.80})")
    changes = []
    for file, fp in now.items():
        then = saved.get(file)  # None: not a file of the checkpointed run (check_resumable names that setting)
        if then is None or (fp["rows"], fp["sha256"]) == (then["rows"], then["sha256"]):
            continue
        changes.append(f"{file} has {fp['rows']} rows ({then['rows']} then)" if fp["rows"] != then["rows"]
                       else f"{file} has the same {fp['rows']} rows, but other content")
    if not changes:
        return []
    what = f"resume: the data changed since {checkpoint} was saved: {'; '.join(changes)}"
    if not allow:
        raise ValueError(f"{what}. Restore the data, or set resume_allow_changed_data=true to train on the new rows "
                         "from the saved position")
    return [f"{what}; resume_allow_changed_data=true: training goes on with the new rows from the saved position"]


def discard_newer_checkpoints(out_dir: Path, step: int, allowed: bool) -> None:
    """Resuming from an older checkpoint abandons the newer ones: only with overwrite_output_dir."""
    newer = [c for c in list_checkpoints(out_dir) if int(c.name.rsplit("-", 1)[1]) > step]
    if newer and not allowed:
        raise ValueError(f"resume: {newer[-1].name} is newer than checkpoint-{step}; resume from latest, or set "
                         "overwrite_output_dir=true to delete the newer checkpoints")
    for path in newer:
        remove_checkpoint(path)


def load_trainer_state(path: Path, state, source, guard, past_end: bool = False) -> dict[int, dict]:
    """The prompt source's and the guard's states from a checkpoint's trainer_state.json; returns the
    evaluations so far ({step: metrics}). The file is JSON a user may edit: anything but what gspo
    writes is a ValueError naming it, before anything on disk changes. `past_end`: a sampler position
    past its rows is allowed (the data changed since, and the user said so)."""
    try:
        if not isinstance(state, dict):
            raise ValueError(f"expected a mapping, got {type(state).__name__}")
        missing = [key for key in ("sampler", "guard", "evals") if key not in state]
        if missing:
            raise ValueError(f"no {missing[0]!r} entry")
        evals = state["evals"]
        if not (isinstance(evals, dict) and all(k.isdigit() and isinstance(v, dict) for k, v in evals.items())):
            raise ValueError(f"evals must be a mapping of step: metrics, got {type(evals).__name__}")
        source.load_state_dict(state["sampler"], past_end=past_end)
        guard.load_state_dict(state["guard"])
    except (KeyError, TypeError, ValueError) as err:
        problem = f"no {err.args[0]!r} entry" if isinstance(err, KeyError) else str(err)
        raise ValueError(f"{path}: not the trainer state gspo writes ({problem})") from None
    return {int(k): v for k, v in evals.items()}
