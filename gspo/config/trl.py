"""TRL's names that gspo has no setting for, and the one line that says where TRL's defaults differ.

gspo.aliases reads TRL's names that gspo has a meaning for; this module holds the rest of what a TRL config
may say (GRPOConfig, transformers' TrainingArguments, TRL's ModelConfig and script arguments):

- `NOT_TAKEN`: each name with what gspo does instead, or "no equivalent". A value that means what gspo does
  anyway (`optim: adamw_torch`, `cast_lm_head_to_fp32: false`) is accepted and dropped; any other is an
  error saying so, never a did-you-mean to an unrelated gspo field.
- `trl_defaults`: a config that uses TRL's names gets gspo's defaults, not TRL's; one note on stderr lists
  the defaults that differ in that config and the TRL settings that give TRL's behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

from gspo.aliases import ALIASES, REFUSED, SAMPLING_LEVELS, note, rollout_shape


@dataclass(frozen=True)
class NotTaken:
    """A TRL name gspo has no setting for."""

    does: str
    """What gspo does instead, or "no equivalent" and why."""
    same: tuple = ()
    """The values that mean what gspo does anyway: accepted, and dropped."""

    def takes(self, value) -> bool:
        return any(_equal(v, value) for v in self.same)


def _equal(a, b) -> bool:
    """a == b, as numbers where both are (1 == 1.0), else of one type (False is not 0)."""
    if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
        return a == b
    return type(a) is type(b) and a == b


_NO_SERVER = "gspo runs vLLM in the training process (generation_backend: vllm); other processes and machines " \
             "sample as endpoints: rollout_workers, rollout_endpoints (gspo serve, or vllm serve with " \
             "--weight-transfer-config '{\"backend\": \"gspo\"}')"
_NO_HUB = "no equivalent: gspo uploads nothing (the model is in output_dir/model)"
_LORA = "set lora_r > 0 (with lora_alpha, lora_dropout, lora_target_modules), or a full LoraConfig as peft"

NOT_TAKEN: dict[str, NotTaken] = {
    # GRPOConfig
    "model_init_kwargs": NotTaken("set dtype, attn_implementation, trust_remote_code; model_overrides patches "
                                  "the model's config", (None, {})),
    "disable_dropout": NotTaken("gspo trains with the model's own dropout; for none, set its dropout to 0 in "
                                "model_overrides", (False,)),
    "cast_lm_head_to_fp32": NotTaken("no equivalent", (False,)),
    "remove_unused_columns": NotTaken("gspo passes every column to the reward functions", (False,)),
    "num_generations_eval": NotTaken("evaluation samples eval_k completions per held-out prompt, and a greedy one",
                                     (None,)),
    "ds3_gather_for_generation": NotTaken("no DeepSpeed in gspo: distributed: fsdp shards parameters (FSDP2)"),
    "shuffle_dataset": NotTaken("gspo always shuffles the training rows (by seed)", (True,)),
    "generation_kwargs": NotTaken("set the sampling settings: temperature, top_p, top_k, min_p, "
                                  "repetition_penalty", (None, {})),
    "use_transformers_paged": NotTaken("generation_backend picks the sampler: auto, gspo, hf, vllm", (False,)),
    "cache_implementation": NotTaken("no equivalent", (None,)),
    "vllm_model_impl": NotTaken("no equivalent", ("vllm",)),
    "vllm_structured_outputs_regex": NotTaken("no equivalent", (None,)),
    "vllm_server_base_url": NotTaken(_NO_SERVER, (None,)),
    "vllm_server_host": NotTaken(_NO_SERVER),
    "vllm_server_port": NotTaken(_NO_SERVER),
    "vllm_server_timeout": NotTaken(_NO_SERVER),
    "vllm_group_port": NotTaken(_NO_SERVER),
    "vllm_max_model_length": NotTaken("no equivalent: gspo's engine holds max_prompt_length + "
                                      "max_completion_length", (None,)),
    "vllm_tensor_parallel_size": NotTaken("no equivalent: one GPU per engine", (1,)),
    "vllm_enable_sleep_mode": NotTaken("set vllm_sleep (gspo's default true; TRL's false)"),
    "delta": NotTaken("no equivalent (INTELLECT-2's two-sided clip)", (None,)),
    "sapo_temperature_pos": NotTaken("objective_options: {sapo_tau_pos: ...} with loss_type: sapo", (1.0,)),
    "sapo_temperature_neg": NotTaken("objective_options: {sapo_tau_neg: ...} with loss_type: sapo", (1.05,)),
    "multi_objective_aggregation": NotTaken("gspo sums the weighted rewards, then normalises (TRL's "
                                            "sum_then_normalize); normalize_then_sum: no equivalent",
                                            ("sum_then_normalize",)),
    "sync_ref_model": NotTaken("no equivalent: the reference stays the initial model", (False,)),
    "ref_model_mixup_alpha": NotTaken("no equivalent (sync_ref_model)", (0.6,)),
    "ref_model_sync_steps": NotTaken("no equivalent (sync_ref_model)", (512,)),
    "top_entropy_quantile": NotTaken("no equivalent: every completion token is in the loss", (1.0,)),
    "max_tool_calling_iterations": NotTaken("max_turns: model turns per episode (tools)", (None,)),
    "off_policy_mask_threshold": NotTaken("no equivalent", (None,)),
    "use_bias_correction_kl": NotTaken("no equivalent", (False,)),
    "log_unique_prompts": NotTaken("samples.jsonl: log_samples_steps, log_samples_count", (False,)),
    "wandb_log_unique_prompts": NotTaken("samples.jsonl: log_samples_steps, log_samples_count", (False,)),
    "log_completions_hub_repo": NotTaken(_NO_HUB, (None,)),
    "use_liger_loss": NotTaken("no equivalent: gspo computes log-probs in row chunks (logprob_chunk_size)",
                               (False,)),
    "use_liger_kernel": NotTaken("no equivalent", (False,)),
    "pad_to_multiple_of": NotTaken("no equivalent: training forwards pack rows without padding (padding_free)",
                                   (None,)),
    "entropy_coef": NotTaken("no equivalent: no entropy bonus", (0.0,)),
    "use_adaptive_entropy": NotTaken("no equivalent: no entropy bonus", (False,)),
    "entropy_coef_min": NotTaken("no equivalent (use_adaptive_entropy)", (0.0,)),
    "entropy_coef_max": NotTaken("no equivalent (use_adaptive_entropy)", (1.0,)),
    "entropy_coef_delta": NotTaken("no equivalent (use_adaptive_entropy)", (0.005,)),
    "entropy_target": NotTaken("no equivalent (use_adaptive_entropy)", (0.2,)),
    "vespo_k_pos": NotTaken("objective_options: {vespo_k_pos: ...} with loss_type: vespo", (2.0,)),
    "vespo_lambda_pos": NotTaken("objective_options: {vespo_lambda_pos: ...} with loss_type: vespo", (3.0,)),
    "vespo_k_neg": NotTaken("objective_options: {vespo_k_neg: ...} with loss_type: vespo", (3.0,)),
    "vespo_lambda_neg": NotTaken("objective_options: {vespo_lambda_neg: ...} with loss_type: vespo", (2.0,)),
    "log_multimodal": NotTaken("no equivalent: gspo trains on text", (True, False)),
    "use_transformers_continuous_batching": NotTaken("generation_backend picks the sampler: auto, gspo, hf, vllm",
                                                     (False,)),
    "transformers_continuous_batching_config": NotTaken("generation_backend picks the sampler", (None,)),
    # transformers' TrainingArguments
    "optim": NotTaken("gspo trains with torch's AdamW, fused where torch has the kernel (adam_state_dtype: "
                      "bfloat16 stores its moments in bfloat16)",
                      ("adamw_torch", "adamw_torch_fused")),
    "adam_epsilon": NotTaken("gspo's AdamW takes torch's eps, 1e-8", (1e-8,)),
    "lr_scheduler_kwargs": NotTaken("no equivalent: gspo's schedules take no options", (None, {})),
    "logging_strategy": NotTaken("metrics.jsonl holds every step; logging_steps paces the progress line",
                                 ("steps",)),
    "logging_first_step": NotTaken("metrics.jsonl holds every step", (False, True)),
    "logging_dir": NotTaken("no equivalent: trackers write under output_dir"),
    "eval_strategy": NotTaken("gspo evaluates before and after training and every eval_steps steps; "
                              "eval_num_prompts: 0 turns it off"),
    "per_device_eval_batch_size": NotTaken("eval_batch_size: held-out prompts per generate call"),
    "eval_on_start": NotTaken("gspo evaluates before training unless eval_num_prompts is 0"),
    "do_train": NotTaken("gspo train trains (TRL's scripts read it, not its trainer)", (True, False)),
    "do_eval": NotTaken("evaluation: eval_num_prompts, eval_steps (TRL's scripts read it, not its trainer)",
                        (True, False)),
    "save_only_model": NotTaken("checkpoints hold the optimizer and RNG state for an exact resume; the model "
                                "alone is output_dir/model", (False,)),
    "save_safetensors": NotTaken("gspo saves safetensors", (True,)),
    "load_best_model_at_end": NotTaken("no equivalent", (False,)),
    "metric_for_best_model": NotTaken("no equivalent", (None,)),
    "data_seed": NotTaken("seed orders the data and seeds the sampling", (None,)),
    "tf32": NotTaken("no equivalent", (None,)),
    "dataloader_num_workers": NotTaken("no equivalent: prompts are read in the training process", (0,)),
    "torch_compile": NotTaken("no equivalent", (False,)),
    "ddp_find_unused_parameters": NotTaken("no equivalent", (None,)),
    "gradient_checkpointing_kwargs": NotTaken("no equivalent: gradient_checkpointing takes transformers' "
                                              "defaults", (None,)),
    "deepspeed": NotTaken("no DeepSpeed in gspo: distributed: fsdp shards parameters and optimizer state (FSDP2, "
                          "under torchrun)", (None,)),
    "fsdp": NotTaken("distributed: fsdp (FSDP2, under torchrun)", (None, "")),
    "fsdp_config": NotTaken("distributed: fsdp (FSDP2, under torchrun)", (None,)),
    "run_name": NotTaken("no equivalent: a run is named by its output_dir"),
    "push_to_hub": NotTaken(_NO_HUB, (False,)),
    "hub_model_id": NotTaken(_NO_HUB, (None,)),
    "log_level": NotTaken("no equivalent", ("passive",)),
    "log_on_each_node": NotTaken("no equivalent", (True,)),
    "disable_tqdm": NotTaken("progress: false", (None,)),
    "use_cpu": NotTaken("device: cpu", (False,)),
    # TRL's ModelConfig and script arguments
    "model_revision": NotTaken("no equivalent: give a local path to pin a revision", (None, "main")),
    "use_peft": NotTaken(_LORA, (False,)),
    "lora_modules_to_save": NotTaken("peft: a full LoraConfig", (None,)),
    "lora_task_type": NotTaken("gspo's adapters are CAUSAL_LM", ("CAUSAL_LM",)),
    "use_rslora": NotTaken("peft: a full LoraConfig", (False,)),
    "use_dora": NotTaken("peft: a full LoraConfig", (False,)),
    "load_in_4bit": NotTaken("no equivalent: no quantized training", (False,)),
    "load_in_8bit": NotTaken("no equivalent: no quantized training", (False,)),
    "dataset_streaming": NotTaken("no equivalent", (False,)),
}
"""TRL name gspo has no setting for -> what gspo does instead (see the module docstring)."""


def not_taken(values: dict, defaults: dict) -> dict:
    """`values` without the NOT_TAKEN names whose value means what gspo does; an error for any other value."""
    for name, value in values.items():
        entry = NOT_TAKEN.get(name)
        if entry is None or name in defaults or entry.takes(value):
            continue
        if entry.same:
            accepted = ", ".join(map(repr, entry.same))
            raise ValueError(f"config: {name}={value!r} is TRL's, and gspo takes it only as {accepted} (what gspo "
                             f"does): {entry.does}")
        raise ValueError(f"config: {name!r} is TRL's, and gspo has no setting of that name: {entry.does}")
    return {k: v for k, v in values.items() if k not in NOT_TAKEN or k in defaults}


def uses_trl_names(values: dict, defaults: dict) -> list[str]:
    """The names in `values` that are TRL's (not gspo's own, nor its former names)."""
    return [n for n in values if n not in defaults and (n in NOT_TAKEN or n in REFUSED or
                                                          (n in ALIASES and not ALIASES[n].old))]


@dataclass(frozen=True)
class Differs:
    """A default of gspo's that differs from TRL's in one config."""

    ours: str
    """gspo's value as the config gets it."""
    trl: str
    """TRL's default."""
    fix: dict | None
    """TRL settings that give TRL's behaviour; None where gspo has none."""


def _objective(values: dict, out: dict, defaults: dict) -> Differs | None:
    if "objective" in out or defaults["objective"] == "grpo":
        return None
    return Differs(f"objective {defaults['objective']}", "importance_sampling_level token",
                   {"importance_sampling_level": "token"})


def _clip(values: dict, out: dict, defaults: dict) -> Differs | None:
    from gspo.algo.objectives import DEFAULT_CLIP

    objective = out.get("objective", defaults["objective"])
    if objective not in SAMPLING_LEVELS.values():  # TRL's epsilon clips its token / sequence ratio only
        return None
    ours = [f"{name} {value:g}" for name, value in zip(("clip_low", "clip_high"), DEFAULT_CLIP[objective])
            if name not in out and value != 0.2]
    if not ours:
        return None
    return Differs(" / ".join(ours), "epsilon 0.2", {"epsilon": 0.2} if "clip_low" not in out else
                   {"epsilon_high": 0.2})


def _aggregation(values: dict, out: dict, defaults: dict) -> Differs | None:
    from gspo.algo.objectives import DEFAULT_AGGREGATION, check_aggregation

    objective = out.get("objective", defaults["objective"])
    if "aggregation" in out or "loss_type" in values or objective not in SAMPLING_LEVELS.values():
        return None
    if DEFAULT_AGGREGATION[objective] == "token_mean":
        return None
    try:  # TRL's default level is token (grpo); a given one stays
        check_aggregation(objective if "objective" in out else "grpo", "token_mean")
        fix = {"loss_type": "dapo"}
    except ValueError:  # TRL's dapo weighs GSPO's sequences by length; gspo refuses it
        fix = None
    return Differs(f"aggregation {DEFAULT_AGGREGATION[objective]}",
                   "loss_type dapo" + ("" if fix else ", refused with sequence ratios"), fix)


def _batch(values: dict, out: dict, defaults: dict) -> Differs | None:
    if "per_device_batch_size" in out:
        return None
    steps, g = rollout_shape(values, defaults)[0], out.get("num_generations", defaults["num_generations"])
    ours = defaults["per_device_batch_size"]
    if (8 * steps) % g or 8 * steps == ours * g:  # TRL's default: 8 completions per micro-batch
        return None
    return Differs(f"per_device_batch_size {ours} prompts = {ours * g} completions per rollout",
                   f"per_device_train_batch_size 8 = {8 * steps} completions", {"per_device_train_batch_size": 8})


SAME_NAMED = (("num_minibatches", 1, "steps_per_generation", 1), ("adam_beta2", 0.999, "adam_beta2", 0.999),
              ("lr_scheduler", "linear", "lr_scheduler_type", "linear"),
              ("max_completion_length", 512, "max_completion_length", 512))
"""(gspo setting, its value for TRL's default, TRL's name, TRL's default) where gspo's default differs."""


def _plain(values: dict, out: dict, defaults: dict) -> list[Differs]:
    found = [Differs(f"{ours} {defaults[ours]}", f"{name} {trl}" if name != ours else str(trl), {name: trl})
             for ours, same, name, trl in SAME_NAMED if ours not in out and defaults[ours] != same]
    if not ({"bf16", "fp16"} & set(out)) and out.get("dtype", defaults["dtype"]) == "float32":
        found.append(Differs("bf16 off", "bf16 on", {"bf16": True}))  # TRL: bf16 unless fp16
    if "max_steps" not in out:
        found.append(Differs(f"max_steps {defaults['max_steps']} RL steps", "num_train_epochs 3", None))
    if out.get("generation_backend") == "vllm" and "rollout_correction" not in out:
        found.append(Differs("rollout_correction none", "vllm_importance_sampling_correction on, sequence_mask "
                             "at 3.0", None))
    return found


def trl_defaults(values: dict, out: dict, defaults: dict) -> str | None:
    """The note for a config in TRL's names (`values`; `out` in gspo's): the defaults of gspo's it gets where TRL's
    differ, and the settings that give TRL's; None when it uses no TRL name, or nothing differs."""
    if not uses_trl_names(values, defaults) or not {"objective", "max_steps"} <= set(defaults):
        return None
    found = [d for check in (_objective, _clip, _aggregation, _batch) if (d := check(values, out, defaults))]
    found += _plain(values, out, defaults)
    if not found:
        return None
    fix = {k: v for d in found if d.fix for k, v in d.fix.items()}
    line = "TRL names, gspo defaults: " + "; ".join(f"{d.ours} (TRL: {d.trl})" for d in found)
    if fix:
        line += "; for TRL's add " + yaml.safe_dump(fix, default_flow_style=True, width=1 << 16, sort_keys=False)
    return line.strip() + " (docs/trl.md)"


def read_trl(values: dict, out: dict, defaults: dict) -> dict:
    """`out` (gspo.aliases.translate's reading of `values`) without the NOT_TAKEN names that mean what gspo does;
    an error for any other of them; the note on TRL's defaults where `values` uses TRL's names."""
    out = not_taken(out, defaults)
    line = trl_defaults(values, out, defaults)
    if line:
        note(line)
    return out
