"""A config in TRL's names gets gspo's defaults, and one note says which differ and what gives TRL's
(gspo/config/trl.py); TRL's published GSPO recipe (configs/trl/gspo.yaml) loads as published and trains."""

import re

import pytest
import yaml

from conftest import ROOT, TINY_MODEL, changed, final_weights, initial_weights, logged_steps, read_metrics
from gspo.algo.objectives import DEFAULT_CLIP
from gspo.config import TrainConfig, load_config, make_config
from gspo.trainer import train

RECIPE = ROOT / "configs" / "trl" / "gspo.yaml"
DEFAULTS_NOTE = re.compile(r"^config: note: TRL names, gspo defaults: (.*)$", re.M)
TRL_DEFAULTS = {"objective": "grpo", "clip_low": 0.2, "clip_high": 0.2, "aggregation": "token_mean",
                "adam_beta2": 0.999, "lr_scheduler": "linear", "max_completion_length": 512, "bf16": True}
"""GRPOConfig's defaults (TRL 1.10-1.16, transformers 5) as gspo settings (steps_per_generation 1: one optimizer step
per rollout of per_device_train_batch_size 8 completions)."""


def defaults_note(err: str) -> str | None:
    found = DEFAULTS_NOTE.findall(err)
    assert len(found) <= 1, err  # one line at most
    return found[0] if found else None


def for_trl(note: str) -> dict:
    """The settings the note says give TRL's behaviour ({} when it names none)."""
    found = re.search(r"; for TRL's add (\{.*\}) \(docs/trl\.md\)$", note)
    return yaml.safe_load(found.group(1)) if found else {}


def test_a_config_in_gspo_names_gets_no_note(capsys):
    make_config(TrainConfig, {"objective": "grpo", "kl_coef": 0.1, "num_minibatches": 2})
    assert capsys.readouterr().err == ""


def test_the_note_names_exactly_the_defaults_that_differ(capsys):
    # TRL's defaults given in TRL's names, but for adam_beta2 and max_steps: the note names those two only
    trl = {"importance_sampling_level": "token", "loss_type": "dapo", "epsilon": 0.2, "steps_per_generation": 1,
           "per_device_train_batch_size": 8, "lr_scheduler_type": "linear", "max_completion_length": 512,
           "bf16": True}
    make_config(TrainConfig, trl)
    assert defaults_note(capsys.readouterr().err) == (
        "adam_beta2 0.99 (TRL: 0.999); max_steps 200 RL steps (TRL: num_train_epochs 3); for TRL's add "
        "{adam_beta2: 0.999} (docs/trl.md)")
    make_config(TrainConfig, {**trl, "adam_beta2": 0.999, "max_steps": 10})
    assert defaults_note(capsys.readouterr().err) is None


@pytest.mark.parametrize("trl", [
    {"beta": 0.04, "max_steps": 5},  # no importance_sampling_level: gspo's objective, clip, aggregation, ...
    {"scale_rewards": "batch", "num_generations": 4, "max_steps": 5},
    {"importance_sampling_level": "token", "epsilon_high": 0.28, "max_steps": 5},
    {"gradient_accumulation_steps": 4, "optim": "adamw_torch", "max_steps": 5},
    {"cast_lm_head_to_fp32": False, "max_steps": 5},  # a TRL-only name, even one gspo drops, reads as TRL's
])
def test_the_settings_the_note_names_give_trls_defaults(trl, capsys):
    make_config(TrainConfig, trl)
    note = defaults_note(capsys.readouterr().err)
    assert ("objective gspo (TRL: importance_sampling_level token)" in note) == ("importance_sampling_level" not in trl)
    cfg = make_config(TrainConfig, {**trl, **for_trl(note)})
    assert defaults_note(capsys.readouterr().err) is None  # nothing left that differs
    expected = {**TRL_DEFAULTS, **({"clip_high": 0.28} if "epsilon_high" in trl else {})}
    low, high = DEFAULT_CLIP[cfg.objective]  # an unset clip is the objective's default
    effective = {**vars(cfg), "clip_low": cfg.clip_low or low, "clip_high": cfg.clip_high or high}
    assert {name: effective[name] for name in expected} == expected
    micro = trl.get("gradient_accumulation_steps", 1)  # TRL: one optimizer step of that many micro-batches of 8
    assert cfg.num_minibatches == 1 and cfg.per_device_batch_size * cfg.num_generations == 8 * micro


def test_a_gspo_config_in_trl_names_is_told_trls_dapo_is_refused_with_sequence_ratios(capsys):
    make_config(TrainConfig, {"importance_sampling_level": "sequence", "max_steps": 5})
    note = defaults_note(capsys.readouterr().err)
    assert "aggregation seq_mean_token_mean (TRL: loss_type dapo, refused with sequence ratios)" in note
    assert "objective" not in note and "loss_type" not in for_trl(note)


def test_gradient_accumulation_and_dapo_over_several_minibatches_say_how_they_are_read(capsys):
    cfg = make_config(TrainConfig, {"gradient_accumulation_steps": 2, "steps_per_generation": 8,
                                    "per_device_train_batch_size": 4, "importance_sampling_level": "token",
                                    "loss_type": "dapo"})
    assert (cfg.num_minibatches, cfg.per_device_batch_size, cfg.aggregation) == (4, 4, "token_mean")  # 4 x 8 / 8
    err = capsys.readouterr().err
    assert ("config: note: gradient_accumulation_steps=2 (TRL): gspo takes no micro-batches; each of the "
            "num_minibatches=4 optimizer steps per rollout trains on its 2 micro-batches in one forward (the same "
            "loss as TRL's accumulated one; the memory of all of them)\n") in err
    assert ("config: note: loss_type=dapo with num_minibatches=4: TRL divides each optimizer step's token sum by the "
            "token count of the whole rollout, gspo's token_mean by its minibatch's") in err
    make_config(TrainConfig, {"warmup_ratio": 0.1, "max_steps": 3, "steps_per_generation": 4})
    assert ("config: note: warmup_ratio=0.1 (TRL): read as warmup_steps=2 of the 12 optimizer steps (max_steps=3 x "
            "num_minibatches=4 x num_epochs=1)\n") in capsys.readouterr().err  # transformers: ceil(12 x 0.1)


def test_trls_gspo_recipe_loads_as_published(capsys):
    published = yaml.safe_load(RECIPE.read_text())  # PyYAML reads 3e-4 as a string; gspo's loader as a float
    assert published == {"importance_sampling_level": "sequence", "loss_type": "grpo", "beta": 0.0, "epsilon": "3e-4",
                         "epsilon_high": "4e-4", "gradient_accumulation_steps": 1, "steps_per_generation": 4}
    cfg = load_config(TrainConfig, RECIPE)
    # GSPO paper (v2) sec. 5.1 as TRL publishes it: gspo's own defaults, written out
    assert (cfg.objective, cfg.aggregation, cfg.kl_coef, cfg.clip_low, cfg.clip_high, cfg.num_minibatches,
            cfg.num_epochs) == ("gspo", "seq_mean_token_mean", 0.0, 3e-4, 4e-4, 4, 1)
    gspo = make_config(TrainConfig, {})
    assert (gspo.objective, gspo.kl_coef, gspo.num_minibatches) == ("gspo", 0.0, 4)
    note = defaults_note(capsys.readouterr().err)  # what the recipe leaves to the defaults
    assert for_trl(note) == {"per_device_train_batch_size": 8, "adam_beta2": 0.999, "lr_scheduler_type": "linear",
                             "max_completion_length": 512, "bf16": True}


@pytest.mark.slow  # ~5 s: two steps of four minibatches each, with the recipe's tiny GSPO clip
def test_trls_gspo_recipe_trains_two_steps_on_the_tiny_model(tmp_path):
    tiny = ["model=tiny-dense", f"model_overrides={TINY_MODEL}", "task=add3", "max_steps=2", "per_device_batch_size=2",
            "num_generations=4", "max_completion_length=6", "learning_rate=1e-3", "eval_num_prompts=0",
            "reward_funcs=[conftest:starts_with_digit]", "progress=false", "device=cpu",
            f"output_dir={tmp_path / 'run'}"]
    cfg = load_config(TrainConfig, RECIPE, tiny)
    assert (cfg.objective, cfg.clip_low, cfg.clip_high, cfg.num_minibatches) == ("gspo", 3e-4, 4e-4, 4)
    before = initial_weights(cfg)
    train(cfg)
    assert logged_steps(tmp_path / "run") == [1, 2]
    assert changed(before, final_weights(tmp_path / "run"))  # it trained
    assert all(r["grad/norm_std"] >= 0 and "clip/high_frac" in r for r in read_metrics(tmp_path / "run"))
