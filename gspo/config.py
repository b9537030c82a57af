"""Configs as plain dataclasses; YAML files and `key=value` overrides; validation.

Each field carries its documentation as a string literal right below it; `field_docs`
reads those strings from the source, so `gspo train --help` prints them.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gspo.aliases import translate
from gspo.data.rows import utf8_text
from gspo.schedules import SCHEDULES


@dataclass
class ModelConfig:
    """Fields shared by every command that loads a model."""

    model: str = "tiny-dense"
    """Preset name (`tiny-dense`, `tiny-moe`: built from config, random init) or a local path / hub name of a causal LM."""
    model_overrides: dict | None = None
    """Config fields patched into a preset before it is built, e.g. {num_hidden_layers: 2}."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16, float16 or auto."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda or cuda:<i>."""
    trust_remote_code: bool = False
    """Run model code shipped with a checkpoint. Off unless you trust its source."""
    attn_implementation: str | None = None
    """Attention kernel transformers runs: None (its default: sdpa where the model has it), eager, sdpa,
    flash_attention_2 (needs flash-attn and a CUDA device; padding-free forwards then run varlen, from the
    restarting position ids), or any other name transformers accepts."""
    seed: int = 0
    """Seed for model init (presets), data order and sampling."""
    output_dir: str = "runs/gspo"
    """Where metrics, samples, plots and the final model are written."""
    overwrite_output_dir: bool = False
    """Start afresh in an output_dir that already holds a run (its metrics and checkpoints are deleted); off: that is an error."""
    task: str | None = "add3"
    """Built-in task (see `gspo.tasks.TASKS`) giving train and held-out prompts; set to null to use `dataset`."""
    dataset: str | None = None
    """Local data: a .jsonl/.json/.csv/.parquet file or a `save_to_disk` folder with a `prompt` column."""
    eval_dataset: str | None = None
    """Held-out data in the same format; by default the task's test split, or `eval_holdout` of `dataset`."""
    eval_holdout: float = 0.1
    """Rows of `dataset` held out for evaluation when no `eval_dataset` is given (said on stderr): a fraction below 1 (at least one row), or a whole number of rows; 0 holds out none (every row trains, and nothing is evaluated)."""
    prompt_column: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages rendered with the chat template."""
    chat_template_kwargs: dict | None = None
    """Extra arguments for the tokenizer's chat template when it renders chat prompts, e.g. {enable_thinking: false} for Qwen3 (TRL's name)."""
    eval_num_prompts: int = 200
    """How many held-out prompts each evaluation uses; 0 turns evaluation off (nothing held out, no eval/* metrics)."""
    eval_k: int = 4
    """Samples per held-out prompt for the sampled metrics mean@k and pass@k."""
    eval_temperature: float = 1.0
    """Temperature of the sampled evaluation."""
    eval_success_threshold: float | None = None
    """A held-out completion succeeds (eval/accuracy greedy; eval/mean_at_k, eval/pass_at_k sampled) when its total reward (reward_funcs with reward_weights, as in training) is at least this; null: full marks, the sum of the positive reward weights (every reward in [0, 1] at 1, every penalty at 0), i.e. 1 for one 0/1 reward such as answer_match or math. eval/reward is the mean total reward either way."""
    eval_batch_size: int = 16
    """Held-out prompts per generate call of an evaluation (the sampled pass holds this many x eval_k sequences), which bounds its memory. With seeded_sampling the results do not depend on it; without, the sampled completions are other random draws for another value."""
    reward_timeout_s: float = 300.0
    """Longest a reward function may take on one batch; one that has not returned by then is abandoned and is an error naming it (with drop_bad_rewards the samples it hangs on are dropped). 0: no limit (the function then runs in the trainer's own thread, e.g. for rewards that use signals)."""
    sandbox: str = "os"
    """Isolation of the code_tests reward: os (an operating-system boundary, bubblewrap; a machine without one refuses code_tests) or weak (accept rlimits and an in-process audit hook as the only file-system barrier)."""
    reward_model_device: str = "cpu"
    """Where an `rm:<path>` reward model scores: cpu, auto (cuda where available), cuda, cuda:<i> or mps."""
    reward_model_dtype: str = "float32"
    """The dtype an `rm:<path>` reward model is loaded in: float32, bfloat16, float16 or auto (the checkpoint's own)."""

    def __post_init__(self):
        # Types are checked as the config is built, from Python too: TrainConfig(learning_rate="abc") is an error
        # naming the field, not a failure deep in training. An int given for a float becomes that float, a string
        # for a list a one-item list. Choices, ranges and consistency: `validate` (make_config, gspo.Trainer).
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(f.name, getattr(self, f.name), hints[f.name]))


@dataclass
class TrainConfig(ModelConfig):
    """GRPO/GSPO training run. Field names follow TRL where TRL has one."""

    max_steps: int = 200
    """RL steps; each samples a rollout batch and takes `num_minibatches * num_epochs` optimizer steps."""
    per_device_batch_size: int = 8
    """Prompts per rollout batch (B)."""
    num_generations: int = 8
    """Completions sampled per prompt (G); advantages are normalised within each group."""
    max_prompt_length: int = 512
    """Longest prompt in tokens; every train and held-out prompt is checked before training starts (see truncate_prompts)."""
    truncate_prompts: str = "error"
    """A prompt longer than max_prompt_length: error (naming its file and line) or left (keep its last max_prompt_length tokens, as TRL does)."""
    max_completion_length: int = 64
    """Maximum new tokens per completion."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling; below 1 the sampler's distribution is truncated and no longer the one trained on."""
    top_k: int = 0
    """Top-k sampling; 0 disables it (transformers would otherwise apply 50)."""
    min_p: float = 0.0
    """Min-p sampling: keep the tokens whose probability is at least min_p x the most likely one's; 0 disables it. Like top_p it truncates the sampler's distribution."""
    repetition_penalty: float = 1.0
    """HF's repetition penalty for sampling: above 1, tokens already in the prompt or completion are made less likely; 1 disables it. The sampler's distribution then differs from the one trained on."""
    reward_funcs: list = field(default_factory=lambda: ["answer_match"])
    """Reward functions: built-in names (answer_match, math: math-verify against an `answer` column, format, code_tests: sandboxed Python against a `tests` column), `rm:<path>` or `module:function` import paths (TRL's reward signature); from Python also the functions or instances themselves (gspo.Trainer)."""
    reward_weights: list | None = None
    """One weight per reward function; default all 1."""
    tasks: list | None = None
    """Multi-task run (docs/multitask.md): entries {name, task or dataset, eval_dataset, reward_funcs, reward_weights, weight}; each batch draws its prompts from them by weight. Null: the single `task`/`dataset`."""
    task_weighting: str = "static"
    """Task sampling weights: static (the entries' `weight`, normalised) or dynamic (follows each task's share of groups with reward spread, with a floor)."""
    task_weight_floor: float = 0.05
    """Dynamic weighting: every task keeps at least this sampling weight (at most 1 / number of tasks)."""
    task_weight_smoothing: float = 0.8
    """Dynamic weighting: EMA factor in [0, 1) of each task's learning signal; higher moves the weights more slowly."""
    task_progress_coef: float = 0.0
    """Dynamic weighting: weight of a task's recent progress (|EMA of the change in its mean reward|) added to its signal; 0: off."""
    sft_coef: float = 0.0
    """Add sft_coef * NLL(reference | prompt) to each minibatch's policy loss, for rows with a `sft_column` text (logged as loss/sft); 0: off."""
    sft_schedule: str = "constant"
    """Schedule of sft_coef over the run: constant, linear (to 0) or cosine (to 0)."""
    sft_column: str = "solution"
    """Column holding the reference completion of the supervised term (built-in tasks: the worked solution)."""
    objective: str = "gspo"
    """Policy objective: gspo (sequence ratio), grpo (token ratio), gspo_token, cispo, sapo, or one registered with gspo.objectives.register_objective."""
    clip_low: float | None = None
    """Lower clip range: ratio >= 1 - clip_low. Default per objective: gspo 3e-4, grpo 0.2."""
    clip_high: float | None = None
    """Upper clip range: ratio <= 1 + clip_high. Default per objective: gspo 4e-4, grpo 0.2."""
    aggregation: str | None = None
    """Loss aggregation: seq_mean_token_mean, token_mean (DAPO) or seq_mean_token_sum_norm (Dr. GRPO); default per objective."""
    advantage_estimator: str = "group"
    """Advantages: group (GRPO: centred in the group, divided by its std), batch (centred in the group, the batch's std), none (Dr. GRPO: centred only), rloo (leave-one-out baseline), reinforce_pp (REINFORCE++: the batch's mean and std, no group), gae (PPO: a learned critic, GAE per token; needs an objective that takes per-token advantages, e.g. grpo), or one registered with gspo.advantages.register_estimator. Formerly advantage_scale (still accepted)."""
    critic_model: str | None = None
    """gae: the critic's decoder: null copies the policy's (its architecture and initial weights), else a local path or hub name of a causal LM, or a `critic` folder a gspo PPO run wrote; a scalar value head (zero at the start) on top."""
    critic_learning_rate: float | None = None
    """gae: AdamW learning rate of the critic, which has its own optimizer (the policy's betas, weight decay, warmup and lr_scheduler); null: learning_rate."""
    vf_coef: float = 1.0
    """gae: weight of the value loss. The critic has its own AdamW, which ignores a constant scale of its loss; vf_coef acts through max_grad_norm, which clips the critic's gradient (on its own)."""
    value_clip: float | None = 0.2
    """gae: PPO's clipped value loss: a value moved more than this from its rollout-time estimate gets no further pull; null: unclipped 0.5 * (V - R)^2."""
    gae_gamma: float = 1.0
    """gae: discount per completion token (1: the terminal reward counts in full at every token)."""
    gae_lambda: float = 0.95
    """gae: GAE's lambda in [0, 1]: 1 uses the whole return (high variance), 0 only the critic's next value (high bias)."""
    kl_in_reward: bool = False
    """gae: fold the KL penalty into the per-token rewards, r_t -= kl_coef * (log pi_old - log pi_ref) (InstructGPT), instead of adding kl_coef * KL to the loss; needs kl_coef > 0."""
    whiten_advantages: bool = True
    """gae: normalise the advantages over the rollout's tokens (mean 0, std 1) before the policy loss, as PPO implementations do; the sequence estimators are normalised by their own rule."""
    num_minibatches: int = 4
    """Optimizer steps per rollout batch (GSPO paper: 4); minibatches after the first are off-policy."""
    num_epochs: int = 1
    """Passes over each rollout batch (TRL's num_iterations, PPO epochs)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (initial) model; 0 loads no reference model."""
    kl_estimator: str = "k3"
    """KL estimator: k1, k2 or k3 (DeepSeekMath)."""
    use_sampler_logprobs: bool = False
    """Use the sampler's own log-probs as pi_old instead of recomputing them (GSPO sec. 5.4)."""
    drop_bad_rewards: bool = False
    """A sample whose reward function raises or returns NaN/inf is dropped (advantage 0, counted in reward/dropped) instead of stopping the run."""
    max_consecutive_skips: int = 5
    """Non-finite guard: an optimizer step with a NaN/inf loss or gradient is skipped (guard/skipped_steps); this many in a row abort the run."""
    learning_rate: float = 1e-6
    """AdamW peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.99
    """AdamW beta2."""
    warmup_steps: int = 0
    """Linear warmup, in optimizer steps."""
    lr_scheduler: str = "constant"
    """Schedule after warmup: constant, linear (to 0) or cosine (to 0)."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables it."""
    lora_r: int = 0
    """LoRA rank (PEFT, pip install 'gspo[peft]'): > 0 trains low-rank adapters on the frozen base instead of every weight; only the adapters are optimised and checkpointed, and the reference policy (kl_coef > 0) is the base with its adapters off (no second model). 0: full fine-tuning."""
    lora_alpha: float = 32.0
    """LoRA scale numerator: the adapter's update is scaled by lora_alpha / lora_r."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input while training. Above 0, pi_old (computed in train mode) and each training forward draw their own dropout masks, so the ratios of minibatches 2..M carry dropout noise (the first minibatch's pi_old is its own forward: ratio 1)."""
    lora_target_modules: str | list = "all-linear"
    """Layers that get adapters: "all-linear" (every nn.Linear, GPT-2's Conv1D too, but the output head), or a list of module names such as [q_proj, v_proj]. MoE routers never get one; the fused experts of transformers-5 MoEs are parameters, not layers: name them in a `peft:` block's target_parameters."""
    peft: dict | None = None
    """A full peft.LoraConfig as a mapping, e.g. {r: 16, lora_alpha: 32, target_modules: [q_proj, v_proj], use_rslora: true}, instead of the lora_* fields (not both)."""
    lora_save_merged: bool = False
    """With LoRA, also write the base with the adapters merged into it to output_dir/merged (a plain transformers model); output_dir/model holds the adapter (PEFT's save_pretrained) either way."""
    bf16: bool = False
    """bf16 mixed precision: every policy forward (sampling, pi_old, pi_ref, training, evaluation) runs under torch.autocast(bfloat16), while weights, gradients and optimizer state stay float32 (dtype must be float32). CPU and bf16-capable GPUs; elsewhere an error. With LoRA prefer dtype=bfloat16 instead (a bfloat16 base, float32 adapters): autocast re-casts a frozen float32 base at every decode step."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (HF activation checkpointing, non-reentrant): less memory for the training forwards, about one more forward of time. Sampling is unaffected (it runs in eval mode, with its KV cache)."""
    padding_free: bool = True
    """Training forwards (pi_old, pi_ref, updates, the SFT term) without padding: each minibatch's sequences packed several to a row (rows as long as the longest) with per-sequence position ids, so attention stays within each sequence (transformers' packed-sequence masks), and the output head only on real completion tokens. Same log-probs and gradients as the padded layout to float tolerance; MoE routing replay and the drift meter too (their records are packed into the rows and back). Models without a separable backbone and head (a DDP wrapper, FSDP2 at the root, logit softcapping) run padded."""
    logprob_chunk_size: int | None = None
    """Rows of the output head computed at once when taking log-probs (memory vs speed); None: rows that keep a chunk's fp32 logits at 2**26 elements (441 at V=151,936)."""
    generation_backend: str = "auto"
    """Sampler: gspo (own KV-cached loop, HF's tokens for the same seed, no per-step cache copies), hf (HF generate), vllm (a vLLM engine in the training process, weights pushed after each step's updates; `make test-vllm`, pip install 'gspo[vllm]') or auto (gspo where the model allows: plain KV-cache attention, not FSDP-sharded; never vllm)."""
    sampler_dtype: str | None = None
    """The sampler's parameter dtype, e.g. bfloat16: gspo/hf sample from a copy of the weights in it (refreshed after each step's updates), vllm runs its engine in it; null: the policy's own. A stand-in for an inference engine's numerics (mu != pi_old: see mismatch/*)."""
    sampler_lag: int = 0
    """The sampler uses the policy of this many rollouts ago (gspo/hf backends), a stand-in for asynchronous training with stale weights; 0: the current policy."""
    rollout_correction: str = "none"
    """Correction for a sampler that is not pi_old (mu != pi_old), from the behaviour weight pi_old/mu: none, token_tis / seq_tis (truncated at rollout_correction_high), token_mis / seq_mis / geo_mis (tokens or sequences outside [low, high] masked out)."""
    rollout_correction_low: float | None = None
    """Lower threshold of the *_mis corrections (default: 0.5; geo_mis 0.99); unused by *_tis."""
    rollout_correction_high: float | None = None
    """Truncation of *_tis and upper threshold of *_mis (default: 2.0; geo_mis 1.01)."""
    log_mismatch: bool = False
    """Keep the sampler's log-probs (mu) and log mismatch/* every step even when the sampler is the policy itself (its decode against the trainer's forward: float rounding); on by itself with sampler_dtype, sampler_lag, rollout_correction or an engine (vllm)."""
    vllm_gpu_memory_utilization: float = 0.3
    """vllm on CUDA: the fraction of GPU memory the colocated engine may take (weights and KV cache); the trainer keeps the rest."""
    vllm_kv_cache_bytes: int | None = None
    """vllm: the KV cache size in bytes (on CPU always set, the default reserves GiBs); null: room for one rollout (on CUDA: from vllm_gpu_memory_utilization)."""
    vllm_sleep: bool = True
    """vllm on CUDA: the engine sleeps (frees its KV cache and weights' memory) while the trainer updates, and wakes for the next rollout; refused on CPU, ignored there."""
    seeded_sampling: bool = False
    """Sample every completion from its own seeded generator (Gumbel-max): the tokens then do not depend on the batch layout or the number of ranks. Always on under torchrun."""
    distributed: str = "ddp"
    """Under torchrun: ddp (a replica per rank, gradients averaged) or fsdp (FSDP2: parameters, gradients and optimizer state sharded)."""
    dist_timeout_s: float = 600.0
    """Under torchrun: how long a rank waits in a collective before giving up (a dead rank must not hang the others)."""
    routing_replay: str = "none"
    """MoE routing replay: none, old_policy (record at pi_old, replay in training) or rollout (record at generation)."""
    log_routing_drift: bool = True
    """MoE only: log moe/expert_change_frac, the experts an optimizer step changes; costs one extra no-grad forward per optimizer step (two under routing replay)."""
    eval_steps: int = 0
    """Evaluate on held-out prompts every this many steps (and before and after training); 0: only before and after."""
    save_steps: int = 0
    """Write a checkpoint (model, optimizer, scheduler, RNG states, data position) every this many steps; 0: only at the end."""
    save_total_limit: int = 2
    """Keep the newest this many checkpoints (older ones are deleted)."""
    resume_from_checkpoint: str | None = None
    """Continue a run exactly: a checkpoint folder, `latest` (the newest under output_dir; damaged: an error) or `latest_valid` (the newest that verifies; damaged newer ones are renamed *.damaged). `gspo train --resume`."""
    resume_allow_changed_data: bool = False
    """Resume even though a data file (dataset, eval_dataset, a task's) has other rows than when the checkpoint was saved: train on the new rows from the saved position, with a warning. Otherwise a resume on changed data is refused, naming the file."""
    log_samples_steps: int = 10
    """Write sample completions with rewards to samples.jsonl every this many steps."""
    log_samples_count: int = 4
    """How many sample completions each time."""
    tensorboard: bool = False
    """Also log to TensorBoard (needs `pip install tensorboard`)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb`)."""
    wandb_project: str | None = None
    """Weights & Biases project name."""
    progress: bool = True
    """Show progress: on a terminal a bar; otherwise (stdout to a file or a job's log) a line of metrics on stderr every logging_steps steps. Either way a line on stderr as each long phase starts (loading the model, each evaluation with its size, the sampler chosen). false: none of these."""
    logging_steps: int = 1
    """Without a terminal, print the progress line of metrics every this many steps (and at the last); metrics.jsonl gets every step whatever it is (TRL's name)."""


@dataclass
class SFTConfig(ModelConfig):
    """Cold-start supervised fine-tuning on prompt/answer pairs (loss on answer tokens only)."""

    output_dir: str = "runs/sft"
    """Where metrics and the final model are written."""
    answer_column: str = "solution"
    """Column holding the target completion (built-in tasks: the worked solution)."""
    num_examples: int = 0
    """Demonstrations to train on; 0 uses all of `dataset` (built-in tasks need a number)."""
    max_steps: int = 300
    """Optimizer steps (upper bound when `target_accuracy` stops earlier)."""
    batch_size: int = 32
    """Examples per optimizer step."""
    learning_rate: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    max_length: int = 512
    """Longer prompt+answer sequences are an error."""
    target_accuracy: float | None = None
    """Stop once greedy held-out accuracy reaches this (a deliberately partial cold start)."""
    eval_steps: int = 50
    """Evaluate greedy held-out accuracy every this many steps."""
    reward_funcs: list = field(default_factory=lambda: ["answer_match"])
    """Reward functions used to score held-out answers (eval/accuracy: the share whose total reward reaches eval_success_threshold)."""
    max_completion_length: int = 64
    """Maximum new tokens when evaluating."""
    progress: bool = True
    """Show progress: on a terminal a bar; otherwise (stdout to a file or a job's log) a line of metrics on stderr every logging_steps steps. Either way a line on stderr as each long phase starts (loading the model, each evaluation with its size, the sampler chosen). false: none of these."""
    logging_steps: int = 1
    """Without a terminal, print the progress line of metrics every this many steps (and at the last); metrics.jsonl gets every step whatever it is (TRL's name)."""


# ------------------------------------------------------------------------------- machinery
def field_docs(cls) -> dict[str, str]:
    """Field name -> the docstring written under it (searching base classes too)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def config_help(cls) -> str:
    """One block per field: name, type, default and its docstring."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    lines = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  {f.name} ({_type_name(hints[f.name])}, default {default!r})")
        lines.append(textwrap.fill(docs.get(f.name, ""), width=96, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


def load_config(cls, path: str | Path | None = None, overrides: list[str] | None = None, defaults: dict | None = None):
    """Build `cls` from `defaults`, then an optional YAML file, then `key=value` overrides (which win)."""
    values: dict = dict(defaults or {})
    if path is not None:
        values.update(_read_yaml_file(Path(path)))
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        values[key.strip()] = _yaml_value(raw, f"override {item!r}") if raw.strip() else None
    return make_config(cls, values)


def _read_yaml_file(path: Path) -> dict:
    """The mapping in a YAML config file; every problem is a ValueError naming the file (and line)."""
    if not path.is_file():
        raise ValueError(f"config: file not found: {path}" + (" (it is a folder)" if path.is_dir() else ""))
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"config: {path}: cannot be read ({err.strerror})") from None
    text = utf8_text(data, f"config: {path}")
    loaded = _yaml_value(text, f"config: {path}") or {}
    if not isinstance(loaded, dict):
        raise ValueError(f"config: {path} must hold a mapping of field: value, got {type(loaded).__name__}")
    return loaded


class _YAML12Floats(yaml.SafeLoader):
    """PyYAML's safe loader, reading 1e-3 (no dot, as YAML 1.2 and JSON allow) as a float, not a string,
    and refusing a key given twice in one mapping (PyYAML keeps the last silently; YAML forbids it)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<` merges may be overridden; complex keys are left to PyYAML
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    problem=f"duplicate key {key!r}, first given on line {seen[key] + 1}",
                    problem_mark=key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_YAML12Floats.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _yaml_value(text: str, where: str):
    """yaml.safe_load (exponent floats included), with a syntax error as one line: where, line, column, problem."""
    try:
        return yaml.load(text, Loader=_YAML12Floats)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{where}{at}: invalid YAML ({problem})") from None
    except RecursionError:
        raise ValueError(f"{where}: invalid YAML (nested too deeply)") from None


def renamed(values: dict, cls=None) -> dict:
    """`values` with other names of `cls`'s settings (gspo.aliases: former names, TRL's) read into its own;
    a name given with the setting it stands for is an error. cls: TrainConfig unless given."""
    cls = TrainConfig if cls is None else cls
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None
                for f in dataclasses.fields(cls)}
    return translate(values, defaults)


def make_config(cls, values: dict):
    """Type-check a mapping against the dataclass and build it, then validate."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in renamed(values, cls).items():
        if key not in hints or key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"config: unknown key {key!r}{hint}")
        kwargs[key] = _coerce(key, value, hints[key])
    cfg = cls(**kwargs)
    validate(cfg)
    return cfg


def to_dict(cfg) -> dict:
    """Field -> value, its lists and mappings copied (the rest: plain values, or a reward function or instance given
    from Python, kept as it is: `dataclasses.asdict` would deep-copy a stateful reward, its model and all)."""
    def copied(value):
        if isinstance(value, dict):
            return {k: copied(v) for k, v in value.items()}
        return type(value)(map(copied, value)) if isinstance(value, (list, tuple)) else value

    return {f.name: copied(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def check_choice(cfg, name: str, choices) -> None:
    """ValueError unless `cfg.<name>` is one of `choices` (a tuple, or a registry's names)."""
    value = getattr(cfg, name)
    if value not in choices:
        raise ValueError(f"config: {name}={value!r} is not one of {', '.join(map(str, choices))}")


def check_positive(cfg, *names: str, allow_zero: bool = False) -> None:
    """ValueError unless each `cfg.<name>` is > 0 (>= 0 with allow_zero); None (an automatic value) passes."""
    for name in names:
        value = getattr(cfg, name)
        if value is None:  # an optional setting left to its automatic value
            continue
        if value < 0 or (value == 0 and not allow_zero):
            raise ValueError(f"config: {name}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def validate(cfg) -> None:
    """Check choices, ranges and consistency before anything is loaded.

    Allowed values are read from the modules that own them (objectives and advantage estimators from
    their registries). Those imports are made here, not at the top, so that `import gspo.config` (and
    so `gspo --help`) stays free of torch. A config class outside the ModelConfig family
    (gspo.lab.LabConfig) brings its own `validate` method.
    """
    if not isinstance(cfg, ModelConfig):
        return cfg.validate()
    from gspo.data.sandbox import (
        SANDBOX_MODES,  # light: the probe runs only when code_tests is built
    )
    from gspo.models import DTYPES

    check_choice(cfg, "dtype", DTYPES)
    check_choice(cfg, "reward_model_dtype", DTYPES)
    for name in ("device", "reward_model_device"):
        device = getattr(cfg, name)
        if not (device in ("auto", "cpu", "cuda", "mps") or (device.startswith("cuda:") and device[5:].isdigit())):
            raise ValueError(f"config: {name}={device!r} is not one of auto, cpu, cuda, cuda:<i>, mps")
    if cfg.task is None and cfg.dataset is None and getattr(cfg, "tasks", None) is None:
        raise ValueError("config: set `task` (a built-in task) or `dataset` (a local data file or folder)")
    check_positive(cfg, "eval_k", "eval_temperature", "eval_batch_size")
    check_positive(cfg, "eval_num_prompts", "eval_holdout", allow_zero=True)  # 0: evaluation off, nothing held out
    if cfg.eval_holdout >= 1 and cfg.eval_holdout != int(cfg.eval_holdout):
        raise ValueError(f"config: eval_holdout={cfg.eval_holdout!r} must be a fraction below 1 or a whole number of rows")
    check_positive(cfg, "reward_timeout_s", allow_zero=True)
    check_choice(cfg, "sandbox", SANDBOX_MODES)
    _reward_specs(cfg.reward_funcs if hasattr(cfg, "reward_funcs") else [])
    if isinstance(cfg, TrainConfig):
        _validate_train(cfg)
    if isinstance(cfg, SFTConfig):
        check_positive(cfg, "max_steps", "batch_size", "learning_rate", "max_length", "eval_steps",
                       "max_completion_length", "logging_steps")
        check_positive(cfg, "num_examples", "warmup_steps", "weight_decay", allow_zero=True)
        if cfg.target_accuracy is not None and not 0 < cfg.target_accuracy <= 1:
            raise ValueError(f"config: target_accuracy={cfg.target_accuracy!r} must be in (0, 1]")
        if cfg.target_accuracy is not None and cfg.eval_num_prompts == 0:
            raise ValueError("config: target_accuracy needs an evaluation; set eval_num_prompts > 0")
        if cfg.task is not None and cfg.dataset is None and cfg.num_examples == 0:
            raise ValueError("config: num_examples must be > 0 for a built-in task (its generator is endless)")


def _validate_train(cfg: TrainConfig) -> None:
    from gspo.advantages import estimator_choices
    from gspo.data.mixture import WEIGHTINGS, check_tasks
    from gspo.moe import REPLAY_MODES
    from gspo.objectives import (
        AGGREGATIONS,
        KL_ESTIMATORS,
        OBJECTIVES,
        check_aggregation,
        check_clip,
    )
    from gspo.correction import CORRECTIONS, thresholds
    from gspo.lora import check_lora
    from gspo.models import DTYPES
    from gspo.parallel import MODES
    from gspo.rollout import generator_choices
    from gspo.rollout.batch import TRUNCATIONS

    check_choice(cfg, "objective", OBJECTIVES)
    check_choice(cfg, "lr_scheduler", SCHEDULES)
    check_choice(cfg, "advantage_estimator", estimator_choices())
    _validate_critic(cfg, OBJECTIVES)
    check_choice(cfg, "kl_estimator", KL_ESTIMATORS)
    check_choice(cfg, "routing_replay", REPLAY_MODES)
    check_choice(cfg, "distributed", MODES)
    check_positive(cfg, "dist_timeout_s")
    reshaped = [f"{k}={getattr(cfg, k)!r}" for k, off in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                                                         ("repetition_penalty", 1.0)) if getattr(cfg, k) != off]
    if cfg.seeded_sampling and reshaped:
        raise ValueError(f"config: seeded_sampling draws from the full softmax; {', '.join(reshaped)} reshape it "
                         "(set top_p=1, top_k=0, min_p=0, repetition_penalty=1)")
    if cfg.aggregation is not None:
        check_choice(cfg, "aggregation", AGGREGATIONS)
        _prefixed(check_aggregation, cfg.objective, cfg.aggregation)  # GSPO: no weighting by length
    check_positive(cfg, "max_steps", "per_device_batch_size", "num_generations", "max_prompt_length",
                   "max_completion_length", "temperature", "num_minibatches", "num_epochs", "learning_rate",
                   "logprob_chunk_size", "log_samples_count", "max_consecutive_skips", "save_total_limit")
    check_positive(cfg, "kl_coef", "weight_decay", "warmup_steps", "max_grad_norm", "top_k", "eval_steps",
                   "save_steps", "log_samples_steps", allow_zero=True)
    check_positive(cfg, "logging_steps")
    if not 0 < cfg.top_p <= 1:
        raise ValueError(f"config: top_p={cfg.top_p!r} must be in (0, 1]")
    if not 0 <= cfg.min_p < 1:
        raise ValueError(f"config: min_p={cfg.min_p!r} must be in [0, 1)")
    check_positive(cfg, "repetition_penalty")
    _prefixed(check_clip, cfg.objective, cfg.clip_low, cfg.clip_high)
    check_choice(cfg, "truncate_prompts", TRUNCATIONS)
    kwargs = cfg.chat_template_kwargs
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise ValueError(f"config: chat_template_kwargs={kwargs!r} must be a mapping of names to values, "
                         "e.g. {enable_thinking: false}")
    if cfg.num_generations < 2:
        raise ValueError("config: num_generations must be >= 2: group advantages need at least two completions")
    n = cfg.per_device_batch_size * cfg.num_generations
    if n % cfg.num_minibatches:
        raise ValueError(f"config: per_device_batch_size * num_generations = {n} is not divisible by "
                         f"num_minibatches={cfg.num_minibatches}")
    if not cfg.reward_funcs:
        raise ValueError("config: reward_funcs is empty; give at least one reward function")
    if cfg.reward_weights is not None and len(cfg.reward_weights) != len(cfg.reward_funcs):
        raise ValueError(f"config: reward_weights has {len(cfg.reward_weights)} entries but reward_funcs has "
                         f"{len(cfg.reward_funcs)}")
    for i, w in enumerate(cfg.reward_weights or []):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"config: reward_weights[{i}]={w!r} must be a finite number")
    if cfg.use_sampler_logprobs and cfg.routing_replay == "old_policy":
        raise ValueError("config: routing_replay=old_policy records the experts in the pi_old forward, which "
                         "use_sampler_logprobs skips; use routing_replay=rollout (experts from the sampler)")
    if cfg.use_sampler_logprobs and reshaped:
        raise ValueError(f"config: use_sampler_logprobs with {', '.join(reshaped)} would train on the log-probs of "
                         "a reshaped distribution, not the policy's; disable one of them")
    check_choice(cfg, "task_weighting", WEIGHTINGS)
    check_choice(cfg, "generation_backend", generator_choices())
    if cfg.sampler_dtype is not None:  # null: the policy's own dtype
        check_choice(cfg, "sampler_dtype", tuple(d for d in DTYPES if d != "auto"))
    check_positive(cfg, "sampler_lag", allow_zero=True)
    check_choice(cfg, "rollout_correction", CORRECTIONS)
    _prefixed(thresholds, cfg.rollout_correction, cfg.rollout_correction_low, cfg.rollout_correction_high)
    if cfg.rollout_correction != "none" and cfg.use_sampler_logprobs:
        raise ValueError("config: rollout_correction weighs by pi_old/mu, but use_sampler_logprobs makes pi_old = mu "
                         "(every weight 1); use one of them")
    if cfg.rollout_correction != "none" and not OBJECTIVES[cfg.objective].corrects:
        raise ValueError(f"config: objective {cfg.objective!r} does not apply a rollout correction "
                         "(registered without corrects=True); use rollout_correction=none")
    if not 0 < cfg.vllm_gpu_memory_utilization <= 1:
        raise ValueError(f"config: vllm_gpu_memory_utilization={cfg.vllm_gpu_memory_utilization!r} must be in (0, 1]")
    check_positive(cfg, "vllm_kv_cache_bytes")
    check_positive(cfg, "lora_r", allow_zero=True)
    check_positive(cfg, "lora_alpha")
    if not 0 <= cfg.lora_dropout < 1:
        raise ValueError(f"config: lora_dropout={cfg.lora_dropout!r} must be in [0, 1)")
    check_lora(cfg)
    if cfg.bf16 and cfg.dtype != "float32":
        raise ValueError(f"config: bf16 mixed precision keeps float32 master weights, but dtype={cfg.dtype!r}; "
                         "set dtype=float32 (or bf16=false to train in the dtype itself)")
    check_choice(cfg, "sft_schedule", SCHEDULES)
    check_positive(cfg, "task_weight_floor", "task_progress_coef", "sft_coef", allow_zero=True)
    if not 0 <= cfg.task_weight_smoothing < 1:
        raise ValueError(f"config: task_weight_smoothing={cfg.task_weight_smoothing!r} must be in [0, 1)")
    if cfg.tasks is not None:  # the entries are checked where they are parsed
        check_tasks(cfg)


def _validate_critic(cfg: TrainConfig, objectives) -> None:
    """advantage_estimator=gae and its fields (the critic: gspo/baselines.py)."""
    check_positive(cfg, "critic_learning_rate", "vf_coef", "value_clip")
    for name in ("gae_gamma", "gae_lambda"):
        if not 0 <= getattr(cfg, name) <= 1:
            raise ValueError(f"config: {name}={getattr(cfg, name)!r} must be in [0, 1]")
    gae = cfg.advantage_estimator == "gae"
    if gae and not objectives[cfg.objective].token_advantages:
        raise ValueError(f"config: advantage_estimator=gae gives one advantage per token, but objective "
                         f"{cfg.objective!r} takes one per sequence; use objective grpo (PPO's token ratio), "
                         "gspo_token, cispo or sapo")
    if cfg.kl_in_reward and not gae:
        raise ValueError("config: kl_in_reward folds the KL into GAE's per-token rewards: it needs "
                         "advantage_estimator=gae (with another estimator the KL stays in the loss: kl_coef)")
    if cfg.kl_in_reward and cfg.kl_coef <= 0:
        raise ValueError("config: kl_in_reward needs kl_coef > 0 (the weight of the KL in the reward)")
    if not gae and (cfg.critic_model is not None or cfg.critic_learning_rate is not None):
        raise ValueError(f"config: critic_model / critic_learning_rate set, but advantage_estimator="
                         f"{cfg.advantage_estimator!r} trains no critic; set advantage_estimator=gae")


def _prefixed(check, *args) -> None:
    """Run another module's check; its ValueError is raised again as a config error."""
    try:
        check(*args)
    except ValueError as err:
        raise ValueError(f"config: {err}") from None


def _reward_specs(specs: list) -> None:
    """Reward entries are names or import paths (callables, from Python); anything else is named here."""
    for i, spec in enumerate(specs):
        if not callable(spec) and not (isinstance(spec, str) and spec.strip()):
            raise ValueError(f"config: reward_funcs[{i}]={spec!r} must be a reward name or 'module:function'")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, value, tp):
    """Check `value` against annotation `tp`; ints are accepted for floats."""
    options = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else (tp,)
    if value is None:
        if type(None) in options:
            return None
        raise ValueError(f"config: {key} may not be null (expected {_type_name(tp)})")
    for option in options:
        if option is type(None):
            continue
        if option is float and isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ValueError(f"config: {key}={value!r} must be a finite number")
            return float(value)
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is bool and isinstance(value, bool):
            return value
        if option is str and isinstance(value, str):
            return value
        if option is list and isinstance(value, (list, tuple)):
            return list(value)
        if option is list and isinstance(value, str):
            return [value]
        if option is dict and isinstance(value, dict):
            return value
    raise ValueError(f"config: {key}={value!r} has the wrong type: expected {_type_name(tp)}")
