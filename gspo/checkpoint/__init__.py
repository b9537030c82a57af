"""Checkpoints for exact resume: written atomically, read back without unpickling anything.

    path = save_checkpoint(run_dir, step, model=model, tokenizer=tok, optimizer=opt, scheduler=sched,
                           trainer_state={"sampler": sampler.state_dict()}, config=to_dict(cfg),
                           rng_generators={"shuffle": shuffle}, keep=2)
    state = load_checkpoint(resolve_resume("latest", run_dir), model=model, optimizer=opt,
                            scheduler=sched, rng_generators={"shuffle": shuffle})

A checkpoint is a folder `run_dir/checkpoint-<step>`:
  config.json, generation_config.json, model.safetensors   model.save_pretrained (safetensors)
    (a LoRA run: adapter_config.json, adapter_model.safetensors: PEFT's save_pretrained, adapters only)
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

Files: gspo/checkpoint/files.py (layout on disk, manifest, verification, listing), store.py
(save and load), resume.py (which checkpoint, which settings may change, newer checkpoints).
"""

from gspo.checkpoint.files import (
    CONFIG_FILE,
    CRITIC_FILE,
    MANIFEST_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    TRAINER_STATE_FILE,
    clean_stale,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    remove_checkpoint,
    remove_tree,
    umask_modes,
    verify_checkpoint,
)
from gspo.checkpoint.resume import (
    RESUME_MAY_CHANGE,
    check_data,
    check_resumable,
    discard_newer_checkpoints,
    load_trainer_state,
    resolve_resume,
    saved_config,
    set_aside_damaged,
)
from gspo.checkpoint.store import (
    capture_rng,
    check_finite_state,
    load_checkpoint,
    load_model_weights,
    load_state_file,
    restore_rng,
    save_checkpoint,
)

__all__ = ["CONFIG_FILE", "CRITIC_FILE", "MANIFEST_FILE", "OPTIMIZER_FILE", "RNG_FILE", "SCHEDULER_FILE",
           "TRAINER_STATE_FILE", "RESUME_MAY_CHANGE", "capture_rng", "check_data", "check_finite_state",
           "check_resumable", "clean_stale", "discard_newer_checkpoints", "latest_checkpoint", "list_checkpoints",
           "load_checkpoint", "load_model_weights", "load_state_file", "load_trainer_state", "prune_checkpoints",
           "remove_checkpoint", "remove_tree", "resolve_resume", "restore_rng", "save_checkpoint", "saved_config",
           "set_aside_damaged", "umask_modes", "verify_checkpoint"]
