"""Other names for config settings: gspo's former names and TRL GRPOConfig's (TRL 1.16).

A YAML file, a `key=value` override or a mapping given to `make_config` may use them. `translate`
reads each into gspo's own settings before the config is built, so a run's saved
train_config.json holds gspo names only. Two tables, each the single source of its names:

- `ALIASES`: a name whose meaning gspo has, with the gspo setting it sets, a converter where the
  value needs one (TRL's `per_device_train_batch_size` counts completions, gspo's setting prompts)
  and a note on how the meanings line up. A value whose TRL meaning gspo lacks is refused by the
  converter, with a hint.
- `REFUSED`: TRL names whose meaning differs from every gspo setting; each is an error with a hint
  instead of "unknown key". TRL's names that gspo has no setting for at all (each with what gspo does
  instead, or "no equivalent") are in gspo/config/trl.py, with the note on TRL's defaults.

An alias given together with a gspo setting it sets is an error naming both. Nothing here imports
torch; the values an alias produces are checked by `gspo.config.validate` like any others.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Alias:
    """Another name for a gspo setting."""

    target: str | tuple[str, ...]
    """The gspo setting(s) it sets (report_to sets several)."""
    convert: Callable[[object, dict, dict], dict] | None = None
    """(value, the whole mapping given, the config's defaults) -> {gspo setting: value}; None: the value as given."""
    note: str = ""
    """How the meanings line up (docs/trl.md's table says the same)."""
    old: bool = False
    """gspo's own former name rather than TRL's."""

    @property
    def targets(self) -> tuple[str, ...]:
        return (self.target,) if isinstance(self.target, str) else self.target


def _whole(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config: {name}={value!r} has the wrong type: expected int")
    return value


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config: {name}={value!r} has the wrong type: expected float")
    return float(value)


def note(text: str) -> None:
    """One line on stderr: how a name given was read (`config: note: ...`)."""
    print(f"config: note: {text}", file=sys.stderr, flush=True)


def _choose(name: str, value, table: dict):
    """table[value] for a TRL value gspo has the meaning of; an error listing TRL's values otherwise."""
    if isinstance(value, (str, bool)) and value in table:
        return table[value]
    raise ValueError(f"config: {name}={value!r} is not one of TRL's {', '.join(map(repr, table))}")


def _cispo(values: dict) -> bool:
    return values.get("loss_type") == "cispo" or values.get("objective") == "cispo"


def _epsilon(value, values: dict, defaults: dict) -> dict:
    """TRL's epsilon: the lower clip, and the upper one too unless epsilon_high (clip_high) is given."""
    loss = values.get("loss_type")
    if loss in ("cispo", "sapo", "vespo"):
        raise ValueError(f"config: epsilon: TRL's loss_type={loss} ignores it ("
                         + {"cispo": "no lower clip; gspo's cispo default clip_low 1.0 is the same",
                            "sapo": "a soft gate, no clip", "vespo": "a smooth kernel, no clip"}[loss] + "); drop it")
    both = "epsilon_high" not in values and "clip_high" not in values  # TRL: epsilon_high defaults to epsilon
    return {"clip_low": value, **({"clip_high": value} if both else {})}


def _epsilon_high(value, values: dict, defaults: dict) -> dict:
    """TRL's epsilon_high: ratio <= 1 + epsilon_high; under cispo the largest weight itself."""
    if values.get("loss_type") in ("sapo", "vespo"):
        raise ValueError(f"config: epsilon_high: TRL's loss_type={values['loss_type']} ignores it (no clip); drop it")
    if _cispo(values):  # TRL clamps cispo's weight at epsilon_high itself; gspo at 1 + clip_high
        high = _number("epsilon_high", value) - 1.0
        note(f"epsilon_high={value!r} is cispo's largest weight in TRL: read as clip_high={high!r} (1 + clip_high)")
        return {"clip_high": high}
    return {"clip_high": value}


SAMPLING_LEVELS = {"token": "grpo", "sequence": "gspo"}
"""TRL's importance_sampling_level -> gspo's objective (for TRL's clipped losses)."""

LOSS_TYPES = {"grpo": ("aggregation", "seq_mean_token_mean"), "dapo": ("aggregation", "token_mean"),
              "dr_grpo": ("aggregation", "seq_mean_token_sum_norm"), "cispo": ("objective", "cispo"),
              "sapo": ("objective", "sapo"), "luspo": ("objective", "luspo"), "vespo": ("objective", "vespo")}
"""TRL's loss_type -> the gspo setting and value of the same meaning: an aggregation of the clipped
ratio loss (grpo: mean over tokens then sequences; dapo: over all the step's tokens, as gspo's
token_mean, across processes too; dr_grpo: token sums over max_completion_length), or an objective
that comes with its own (cispo: token_mean; sapo: seq_mean_token_mean; luspo: token sums, then the mean
over sequences; vespo: token_mean; TRL's too)."""

OBJECTIVE_LEVELS = {"cispo": "token", "sapo": "token", "luspo": "sequence", "vespo": None}
"""The importance_sampling_level that each loss_type's objective has (None: either is read the same: VESPO's
kernel forms its own sequence weight, in TRL too). LUSPO is the paper's sequence-level ratio."""

LOSS_TYPES_REFUSED = {
    "bnpo": "it normalises by each process's own token count; gspo's token_mean counts the whole step's "
            "tokens across processes (TRL's dapo): use loss_type: dapo",
}
"""TRL loss types whose meaning gspo lacks -> the hint."""


def _objective_of_loss(values: dict):
    """The objective TRL's loss_type names (cispo, sapo), or None for the clipped-ratio losses."""
    setting = LOSS_TYPES.get(values.get("loss_type"), (None, None))
    return setting[1] if setting[0] == "objective" else None


def _sampling_level(value, values: dict, defaults: dict) -> dict:
    objective = _choose("importance_sampling_level", value, SAMPLING_LEVELS)
    named = _objective_of_loss(values)
    if named is None:
        return {"objective": objective}
    level = OBJECTIVE_LEVELS[named]
    if level is not None and value != level:  # TRL's sequence-level cispo / sapo, token-level luspo
        ratios = "token ratios only" if level == "token" else "the sequence ratio only (LUSPO's)"
        raise ValueError(f"config: importance_sampling_level={value!r} with loss_type={named}: gspo's {named} "
                         f"objective has {ratios}; use importance_sampling_level: {level}")
    return {}  # the loss_type sets the objective


def _loss_type(value, values: dict, defaults: dict) -> dict:
    if value in LOSS_TYPES_REFUSED:
        raise ValueError(f"config: loss_type={value!r} (TRL): {LOSS_TYPES_REFUSED[value]}")
    key, gspo_value = _choose("loss_type", value, LOSS_TYPES)
    if key == "aggregation":  # the objective it aggregates must accept it (GSPO: only a mean over sequences)
        from gspo.algo.objectives import OBJECTIVES, check_aggregation

        level = values.get("importance_sampling_level")
        objective = SAMPLING_LEVELS.get(level) or values.get("objective", defaults["objective"])
        try:
            if objective in OBJECTIVES:  # an unknown objective is named by validation
                check_aggregation(objective, gspo_value)
        except ValueError as err:
            hint = ("use loss_type: grpo" if level else
                    "use loss_type: grpo, or importance_sampling_level: token (TRL's default: objective grpo)")
            raise ValueError(f"config: loss_type={value!r} (TRL; aggregation {gspo_value}) with objective "
                             f"{objective!r}: {err}; {hint}") from None
    if value == "luspo" and "importance_sampling_level" not in values:
        note("loss_type=luspo without importance_sampling_level: TRL's default, token, would weight clipped token "
             "ratios by length; gspo's luspo is the paper's sequence ratio (TRL: importance_sampling_level: sequence)")
    minibatches = rollout_shape(values, defaults)[1]
    if value in ("dapo", "cispo") and minibatches > 1:  # TRL: num_items_in_batch counts the generation batch's
        note(f"loss_type={value} with num_minibatches={minibatches}: TRL divides each optimizer step's token sum by "
             "the token count of the whole rollout, gspo's token_mean by its minibatch's: the same direction, a "
             f"gradient about {minibatches}x TRL's (clipped at max_grad_norm sooner)")
    return {key: gspo_value}


SCALE_REWARDS = {"group": "group", True: "group", "batch": "batch", "none": "none", False: "none"}
"""TRL's scale_rewards -> gspo's advantage_estimator: the same centring in the group and division by
the group's / the batch's std or none (gspo's std is the population one; TRL's divides by n - 1)."""


def _scale_rewards(value, values: dict, defaults: dict) -> dict:
    return {"advantage_estimator": _choose("scale_rewards", value, SCALE_REWARDS)}


REPORT_TO = ("tensorboard", "wandb")
"""TRL's report_to integrations gspo logs to: each is a gspo setting of the same name (metrics.jsonl is always
written)."""


def _report_to(value, values: dict, defaults: dict) -> dict:
    names = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"config: report_to={value!r} must be a name or a list of names")
    names = [n for n in names if n != "none"]
    if "all" in names:
        raise ValueError("config: report_to='all' (TRL: every installed integration): name them, e.g. "
                         f"report_to: [{', '.join(REPORT_TO)}]")
    unknown = [n for n in names if n not in REPORT_TO]
    if unknown:
        raise ValueError(f"config: report_to: {', '.join(map(repr, unknown))} is not one gspo logs to; it writes "
                         f"metrics.jsonl and, if asked, {', '.join(REPORT_TO)}")
    return {name: name in names for name in REPORT_TO}


def _use_vllm(value, values: dict, defaults: dict) -> dict:
    if not isinstance(value, bool):
        raise ValueError(f"config: use_vllm={value!r} has the wrong type: expected bool")
    return {"generation_backend": "vllm" if value else "auto"}  # auto never picks vllm


def _vllm_mode(value, values: dict, defaults: dict) -> dict:
    if value == "server":
        raise ValueError("config: vllm_mode=server (TRL): gspo runs vLLM only colocated in the training process "
                         "(generation_backend: vllm); a separate vLLM server is not supported")
    if value != "colocate":
        raise ValueError(f"config: vllm_mode={value!r} is not one of TRL's 'colocate', 'server'")
    return {}  # colocated is what use_vllm / generation_backend: vllm runs


def _positive(name: str, value) -> int:
    if _whole(name, value) < 1:
        raise ValueError(f"config: {name}={value!r} must be > 0")
    return value


def _accumulation(values: dict) -> int:
    """TRL's gradient_accumulation_steps (default 1): micro-batches per optimizer step."""
    return _positive("gradient_accumulation_steps", values.get("gradient_accumulation_steps", 1))


def rollout_shape(values: dict, defaults: dict) -> tuple[int, int, str]:
    """(S, M, said): a rollout is S of TRL's micro-batches of per_device_train_batch_size completions, trained
    in M optimizer steps of S / M micro-batches each (TRL's gradient_accumulation_steps); `said`: the settings
    read, "" when none was given (TRL's S is then 1, gspo's M its default).

    TRL divides each micro-batch's loss by gradient_accumulation_steps (grpo, dr_grpo), or every token's by one
    token count for all of a rollout's micro-batches (dapo, cispo): an optimizer step's loss is the loss of its
    micro-batches together, as one gspo minibatch of them computes it (dapo and cispo over several minibatches:
    see _loss_type's note). An optimizer step across two rollouts has no gspo equivalent.
    """
    k = _accumulation(values)
    if "steps_per_generation" in values:
        s = _positive("steps_per_generation", values["steps_per_generation"])
        if s % k:
            raise ValueError(f"config: steps_per_generation={s} is not a multiple of gradient_accumulation_steps={k} "
                             "(TRL): an optimizer step would take micro-batches of two rollouts; gspo's optimizer "
                             "steps each train on a part of one rollout")
        return s, s // k, f"steps_per_generation={s}"
    if "num_minibatches" in values:
        m = _positive("num_minibatches", values["num_minibatches"])
        if k > 1:
            raise ValueError(f"config: gradient_accumulation_steps={k} (TRL) with num_minibatches (gspo's optimizer "
                             "steps per rollout): give TRL's steps_per_generation instead of num_minibatches, or "
                             "drop gradient_accumulation_steps")
        return m, m, f"num_minibatches={m}"
    if "gradient_accumulation_steps" in values:  # TRL: steps_per_generation defaults to it
        return k, 1, f"gradient_accumulation_steps={k}"
    return 1, defaults["num_minibatches"], ""


def _steps_per_generation(value, values: dict, defaults: dict) -> dict:
    """TRL's steps_per_generation: micro-batches per rollout, gradient_accumulation_steps of them per optimizer step."""
    return {"num_minibatches": rollout_shape(values, defaults)[1]}


def _gradient_accumulation(value, values: dict, defaults: dict) -> dict:
    """TRL's gradient_accumulation_steps: micro-batches per optimizer step. gspo takes an optimizer step's batch
    at once, so only the number of optimizer steps per rollout is left of it (see rollout_shape)."""
    m, k = rollout_shape(values, defaults)[1], _accumulation(values)
    if k > 1:
        note(f"gradient_accumulation_steps={k} (TRL): gspo takes no micro-batches; each of the num_minibatches={m} "
             f"optimizer steps per rollout trains on its {k} micro-batches in one forward (the same loss as TRL's "
             "accumulated one; the memory of all of them)")
    return {} if "steps_per_generation" in values or "num_minibatches" in values else {"num_minibatches": m}


def _completions_to_prompts(value, values: dict, defaults: dict) -> dict:
    """TRL's per_device_train_batch_size: completions per micro-batch; one rollout is steps_per_generation
    (default gradient_accumulation_steps, 1) of them, and gspo's per_device_batch_size counts its prompts."""
    per_step = _whole("per_device_train_batch_size", value)
    g = _whole("num_generations", values.get("num_generations", defaults["num_generations"]))
    steps, minibatches, said = rollout_shape(values, defaults)
    completions = per_step * steps
    times = f" x {said}" if said else ""
    if completions % g:
        raise ValueError(f"config: per_device_train_batch_size={per_step} (TRL: completions per step){times} = "
                         f"{completions} completions is not a multiple of num_generations={g}; gspo counts "
                         "prompts: set per_device_batch_size")
    note(f"per_device_train_batch_size={per_step} counts completions per step (TRL){times}: read as "
         f"per_device_batch_size={completions // g} prompts x num_generations={g} = {completions} completions per "
         f"rollout, trained in num_minibatches={minibatches} optimizer steps"
         + ("" if said else " (TRL: steps_per_generation, default 1)"))
    return {"per_device_batch_size": completions // g}


LR_SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant_with_warmup": "constant", "constant": "constant"}
"""transformers' lr_scheduler_type -> gspo's lr_scheduler of the same shape after the warmup (linear and cosine to 0,
cosine as transformers' default num_cycles 0.5). transformers' constant has no warmup, gspo's constant has one."""


def _lr_scheduler_type(value, values: dict, defaults: dict) -> dict:
    if not isinstance(value, str) or value not in LR_SCHEDULERS:
        raise ValueError(f"config: lr_scheduler_type={value!r} (TRL): gspo's schedules are linear, cosine and "
                         "constant after a linear warmup; TRL's " + ", ".join(LR_SCHEDULERS) + " map to them")
    if value == "constant" and (values.get("warmup_steps") or values.get("warmup_ratio")):
        raise ValueError("config: lr_scheduler_type=constant (TRL) ignores the warmup (transformers' constant "
                         "schedule has none), gspo's constant warms up: use lr_scheduler_type: constant_with_warmup, "
                         "or drop the warmup")
    return {"lr_scheduler": LR_SCHEDULERS[value]}


def _warmup_ratio(value, values: dict, defaults: dict) -> dict:
    """TRL's warmup_ratio: warmup over that fraction of the optimizer steps (transformers: ceil(steps x ratio))."""
    ratio = _number("warmup_ratio", value)
    if not 0 <= ratio <= 1:
        raise ValueError(f"config: warmup_ratio={value!r} must be in [0, 1]")
    if "max_steps" not in values:
        raise ValueError("config: warmup_ratio (TRL) is a fraction of the run's optimizer steps, and max_steps is not "
                         "given: set max_steps (warmup_steps is then ceil(max_steps x num_minibatches x num_epochs x "
                         "warmup_ratio)), or set warmup_steps")
    steps = _positive("max_steps", values["max_steps"])
    minibatches = rollout_shape(values, defaults)[1]
    epochs = _positive("num_epochs", values.get("num_iterations", values.get("num_epochs", defaults["num_epochs"])))
    total = steps * minibatches * epochs
    warmup = math.ceil(total * ratio)
    note(f"warmup_ratio={value!r} (TRL): read as warmup_steps={warmup} of the {total} optimizer steps (max_steps="
         f"{steps} x num_minibatches={minibatches} x num_epochs={epochs})")
    return {"warmup_steps": warmup}


def _save_strategy(value, values: dict, defaults: dict) -> dict:
    if value == "steps":
        if "save_steps" not in values:
            note("save_strategy=steps (TRL) without save_steps: gspo's save_steps default 0 writes the checkpoint at "
                 "the end only (transformers': every 500 optimizer steps); set save_steps (gspo: RL steps)")
        return {}
    if value == "no":
        if "save_steps" in values:
            raise ValueError("config: save_strategy=no (TRL) with save_steps: TRL ignores save_steps then; give one")
        return {"save_steps": 0}  # no checkpoint during the run; gspo's final one and the model at the end
    if value in ("epoch", "best"):
        raise ValueError(f"config: save_strategy={value} (TRL): gspo saves every save_steps RL steps only ("
                         + ("it runs max_steps RL steps, not epochs" if value == "epoch" else
                            "no best checkpoint by a metric") + "); use save_strategy: steps with save_steps")
    raise ValueError(f"config: save_strategy={value!r} is not one of TRL's 'no', 'steps', 'epoch', 'best'")


ALIASES: dict[str, Alias] = {
    "advantage_scale": Alias("advantage_estimator", old=True, note="gspo's former name"),
    "beta": Alias("kl_coef", note="KL penalty weight; 0 loads no reference model"),
    "epsilon": Alias(("clip_low", "clip_high"), _epsilon,
                     "lower clip, ratio >= 1 - epsilon; also the upper one unless epsilon_high is given"),
    "epsilon_high": Alias("clip_high", _epsilon_high,
                          "upper clip, ratio <= 1 + epsilon_high; with cispo TRL's largest weight: clip_high = "
                          "epsilon_high - 1"),
    "importance_sampling_level": Alias("objective", _sampling_level, "token: grpo, sequence: gspo"),
    "loss_type": Alias(("aggregation", "objective"), _loss_type,
                       "grpo: seq_mean_token_mean, dapo: token_mean, dr_grpo: seq_mean_token_sum_norm, "
                       "cispo / sapo / luspo / vespo: the objective; bnpo refused"),
    "scale_rewards": Alias("advantage_estimator", _scale_rewards,
                           "group / true: group, batch: batch, none / false: none"),
    "steps_per_generation": Alias("num_minibatches", _steps_per_generation,
                                  "micro-batches per rollout: num_minibatches = steps_per_generation / "
                                  "gradient_accumulation_steps"),
    "gradient_accumulation_steps": Alias("num_minibatches", _gradient_accumulation,
                                         "micro-batches per optimizer step: gspo takes them in one forward; without "
                                         "steps_per_generation num_minibatches = 1 (TRL: one step per rollout)"),
    "num_iterations": Alias("num_epochs", note="passes over each rollout batch"),
    "report_to": Alias(REPORT_TO, _report_to, "tensorboard, wandb, none: the booleans of those names"),
    "use_vllm": Alias("generation_backend", _use_vllm, "true: vllm, false: auto"),
    "vllm_mode": Alias("generation_backend", _vllm_mode, "colocate: what gspo's vllm runs; server refused"),
    "per_device_train_batch_size": Alias("per_device_batch_size", _completions_to_prompts,
                                         "completions per step x steps_per_generation / num_generations (a note says "
                                         "the result)"),
    "lr_scheduler_type": Alias("lr_scheduler", _lr_scheduler_type,
                               "linear, cosine, constant_with_warmup (constant: without a warmup only)"),
    "warmup_ratio": Alias("warmup_steps", _warmup_ratio, "ceil(max_steps x num_minibatches x num_epochs x ratio); "
                          "needs max_steps"),
    "save_strategy": Alias("save_steps", _save_strategy, "steps: save_steps as given; no: 0 (at the end only); "
                           "epoch, best refused"),
    "model_name_or_path": Alias("model", note="a preset, local path or hub name (TRL's ModelConfig)"),
    "dataset_name": Alias("dataset", note="read from the datasets library's local cache, never downloaded (TRL's "
                          "script arguments; dataset_config, dataset_train_split, dataset_test_split are gspo's too)"),
    "torch_dtype": Alias("dtype", note="the dtype the model is loaded in (transformers' former name)"),
}
"""Other name -> what it sets (see the module docstring)."""

REFUSED: dict[str, tuple[str, str]] = {
    "generation_batch_size": ("per_device_batch_size", "TRL counts the completions of all processes; gspo samples "
                              "per_device_batch_size prompts x num_generations per process; set per_device_batch_size"),
    "num_train_epochs": ("max_steps", "gspo runs max_steps RL steps of one rollout batch each, not passes over the "
                         "dataset; set max_steps"),
    "vllm_importance_sampling_correction": ("rollout_correction", "TRL corrects vLLM's mismatch by default; gspo "
                                            "only when asked: set rollout_correction (default none)"),
    "vllm_importance_sampling_mode": ("rollout_correction", "set rollout_correction (token_tis, seq_tis, token_mis, "
                                      "seq_mis or geo_mis); its thresholds have other defaults"),
    "vllm_importance_sampling_clip_max": ("rollout_correction_high", "set rollout_correction_high (with "
                                          "rollout_correction)"),
    "vllm_importance_sampling_cap": ("rollout_correction_high", "set rollout_correction_high (with "
                                     "rollout_correction)"),
    "vllm_importance_sampling_clip_min": ("rollout_correction_low", "set rollout_correction_low (with "
                                          "rollout_correction; *_tis take none)"),
    "log_completions": ("log_samples_steps", "gspo writes log_samples_count completions to samples.jsonl every "
                        "log_samples_steps steps; set those"),
    "num_completions_to_print": ("log_samples_count", "gspo writes log_samples_count completions to samples.jsonl "
                                 "every log_samples_steps steps; set log_samples_count"),
}
"""TRL name whose meaning differs -> (the gspo setting to use instead, the hint)."""


def translate(values: dict, defaults: dict) -> dict:
    """`values` with every other name read into gspo settings.

    defaults: the config class's fields and their defaults. A name whose settings the class does
    not have is left alone (it then fails as an unknown key). Both names given: an error.
    """
    for name in values:
        if name in REFUSED and name not in defaults and REFUSED[name][0] in defaults:
            raise ValueError(f"config: {name!r} is TRL's, but gspo has no setting of that meaning: {REFUSED[name][1]}")
    out = dict(values)
    set_by: dict[str, str] = {}
    for name, alias in ALIASES.items():
        if name not in values or name in defaults or not all(t in defaults for t in alias.targets):
            continue
        value = out.pop(name)
        settings = alias.convert(value, values, defaults) if alias.convert else {alias.target: value}
        for key, setting in settings.items():
            if key in values:
                whose = "the old name of" if alias.old else "TRL's name for"
                raise ValueError(f"config: {name!r} is {whose} {key!r}, which is given too; give only one of them")
            if key in set_by:
                raise ValueError(f"config: {set_by[key]!r} and {name!r} both set {key!r}; give only one of them")
            set_by[key] = name
            out[key] = setting
    return out
