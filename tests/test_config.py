"""Configs made of sections: flat names outside, a section per plug inside, checks once at the boundary."""

import dataclasses
import inspect
import json

import pytest
import torch

from gspo.algo.objectives import check_loss_options, policy_loss
from gspo.config import (
    CHECKS,
    TRAIN_SECTIONS,
    LoraSettings,
    ObjectiveSettings,
    SamplingSettings,
    SFTConfig,
    TrainConfig,
    make_config,
    section,
    sections,
    to_dict,
)
from gspo.step import loss_options


def test_train_config_is_its_sections_and_nothing_else():
    own = [f.name for f in dataclasses.fields(TrainConfig)]
    by_section = [f.name for s in TRAIN_SECTIONS for f in dataclasses.fields(s)]
    assert own == by_section and len(own) == len(set(own)) == 150  # each field in exactly one section, in order
    assert sections(TrainConfig)[:-1] == list(TRAIN_SECTIONS)  # the last is TrainConfig itself (no fields of its own)
    assert all(s in CHECKS for s in TRAIN_SECTIONS if s.__name__ not in ("OutputSettings",))


def test_a_section_holds_its_fields_only():
    cfg = make_config(TrainConfig, {"temperature": 0.7, "lora_r": 4, "learning_rate": 1e-4})
    sampling = section(cfg, SamplingSettings)
    assert type(sampling) is SamplingSettings and sampling.temperature == 0.7
    with pytest.raises(AttributeError):
        sampling.learning_rate  # noqa: B018  a plug built from its section cannot read another's field
    lora = section(cfg, LoraSettings)
    assert (lora.lora_r, lora.lora_alpha) == (4, 32.0)


def test_flat_names_resume_and_round_trip():
    # saved configs are flat JSON: one written before the sections existed still builds the same config
    cfg = make_config(TrainConfig, {"objective": "grpo", "num_generations": 4, "top_p": 0.9, "sandbox": "weak"})
    saved = json.loads(json.dumps(to_dict(cfg)))
    assert make_config(TrainConfig, saved) == cfg
    assert "per_device_batch_size" in saved and "sampling" not in saved


def test_each_section_check_runs_on_its_own_fields_and_names_the_field():
    for values, message in [({"top_p": 1.5}, "top_p=1.5 must be in"),  # SamplingSettings
                            ({"kl_estimator": "k9"}, "kl_estimator='k9' is not one of k1, k2, k3"),  # ObjectiveSettings
                            ({"lora_dropout": 1.0}, "lora_dropout=1.0 must be in"),  # LoraSettings
                            ({"reward_funcs": []}, "reward_funcs is empty"),  # RewardSettings
                            ({"eval_k": 0}, "eval_k=0 must be > 0"),  # EvalSettings
                            ({"rollout_workers": 1, "sampler_lag": 1}, "sampler_lag=1 simulates in one process"),
                            ({"max_staleness": 1}, "max_staleness=1 overlaps sampling with training in rollout worker "
                                                   "processes or endpoints; set rollout_workers: 1 or "
                                                   "rollout_endpoints"),
                            ({"rollout_workers": 1, "max_staleness": -1}, "max_staleness=-1 must be >= 0"),
                            ({"rollout_workers": 1, "rollout_address": "10.0.0.5:29600"},
                             "rollout_address='10.0.0.5:29600' and gspo rollout-server are retired: .* start `gspo "
                             "serve")]:
        with pytest.raises(ValueError, match=message):
            make_config(TrainConfig, values)
    # checks across sections: in the config class's own check
    with pytest.raises(ValueError, match="bf16 mixed precision keeps float32 master weights"):
        make_config(TrainConfig, {"bf16": True, "dtype": "bfloat16"})
    with pytest.raises(ValueError, match="rollout_workers=3 share per_device_batch_size=2 prompts per step"):
        make_config(TrainConfig, {"rollout_workers": 3, "per_device_batch_size": 2})
    with pytest.raises(ValueError, match="LoRA with distributed=fsdp is not supported"):
        make_config(TrainConfig, {"lora_r": 4, "distributed": "fsdp"})
    with pytest.raises(ValueError, match="num_examples must be > 0 for a built-in task"):
        make_config(SFTConfig, {})


def test_loss_options_are_checked_once_and_the_minibatch_loss_skips_the_checks():
    cfg = make_config(TrainConfig, {"objective": "grpo", "kl_coef": 0.1})
    options = loss_options(section(cfg, ObjectiveSettings), norm_length=8, kl_in_reward=False)
    assert options["validate"] is False and options["kl_estimator"] == "k3"
    with pytest.raises(ValueError, match="kl_estimator: unknown 'k9'"):
        check_loss_options("grpo", None, 8, 0.1, "k9")
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9], [-0.5, -0.8]])
    adv, mask, ref = torch.tensor([1.0, -1.0]), torch.ones(2, 2, dtype=torch.bool), torch.tensor([[-1.0, -2.0],
                                                                                                   [-0.6, -0.7]])
    checked, _ = policy_loss(logp, old, adv, mask, ref_logprobs=ref, **{**options, "validate": True})
    unchecked, _ = policy_loss(logp, old, adv, mask, ref_logprobs=ref, **options)
    assert checked.item() == unchecked.item()
    bad = old.clone()
    bad[0, 1] = float("nan")
    with pytest.raises(ValueError, match=r"old_logprobs: non-finite value nan at \[0, 1\]"):
        policy_loss(logp, bad, adv, mask, ref_logprobs=ref, **{**options, "validate": True})
    loss, _ = policy_loss(logp, bad, adv, mask, ref_logprobs=ref, **options)  # unchecked: the guard's business
    assert torch.isnan(loss)



@pytest.mark.parametrize("cls", [TrainConfig, SFTConfig])
def test_every_duration_field_is_bounded_at_a_week(cls):
    # rollout_timeout_s=1e15 was accepted and then overflowed a C timeout as the rollout worker started;
    # every field named *_s (seconds) is bounded where the config is built, naming the field and the bound.
    durations = [f.name for f in dataclasses.fields(cls) if f.name.endswith("_s")]
    assert "reward_timeout_s" in durations
    if cls is TrainConfig:
        assert {"rollout_timeout_s", "tool_timeout_s", "dist_timeout_s"} <= set(durations)
    base = {} if cls is TrainConfig else {"num_examples": 8}
    for name in durations:
        with pytest.raises(ValueError) as refused:
            make_config(cls, {**base, name: 1e15})
        assert str(refused.value) == f"config: {name}=1e+15 is more than a week (604800 s); lower it"
        assert getattr(make_config(cls, {**base, name: 604800}), name) == 604800.0  # a week itself is fine


def test_an_int_too_large_for_a_float_field_is_a_config_error():
    with pytest.raises(ValueError) as refused:  # float(10**400): an OverflowError before
        make_config(TrainConfig, {"rollout_timeout_s": 10**400})
    assert str(refused.value) == "config: rollout_timeout_s=100000... (401 digits) is too large for a float"
    with pytest.raises(ValueError) as refused:
        make_config(TrainConfig, {"learning_rate": -(10**5000)})
    assert str(refused.value) == "config: learning_rate=-100000... (5001 digits) is too large for a float"


def test_names_the_runtime_implements_are_written_once_in_the_config():
    # the config imports no runtime module (tests/test_layout.py): the names it allows are its own, and each
    # module implementing them checks at import that it implements exactly those
    import gspo.config as config
    from gspo.data import mixture
    from gspo.env import BUILTIN_TOOLS, OBSERVATIONS, STYLES
    from gspo.models import DTYPES

    assert STYLES is config.TOOL_CALL_STYLES and set(OBSERVATIONS) == set(STYLES) == {"hermes", "text"}
    assert set(BUILTIN_TOOLS) == set(config.BUILTIN_TOOL_NAMES) == {"python"}
    assert set(DTYPES) == set(config.MODEL_DTYPES)
    assert (mixture.WEIGHTINGS, mixture.parse_tasks, mixture.TaskSpec) == (config.WEIGHTINGS, config.parse_tasks,
                                                                           config.TaskSpec)
    config.check_implemented(("a", "b"), {"b": 1, "a": 2}, "x")  # the order is the config's to choose
    with pytest.raises(RuntimeError) as refused:
        config.check_implemented(config.TOOL_CALL_STYLES, {"hermes": "..."}, "gspo.env.OBSERVATIONS")
    assert str(refused.value) == ("gspo.env.OBSERVATIONS implements hermes but the config allows hermes, text: "
                                  "implement each allowed name, or allow it in gspo/config")


def test_the_split_config_keeps_every_name_where_it_was():
    # gspo/config/train.py was split (sampling.py, tasks.py): its names still import from it and from gspo.config
    import gspo.config as config
    import gspo.config.train as train

    for name in ("SamplingSettings", "EpisodeSettings", "TaskSettings", "rollout_secret",
                 "reshaping", "SECRET_ENV", "MIN_SECRET_CHARS", "renamed", "TrainConfig", "TRAIN_SECTIONS"):
        assert getattr(train, name) is getattr(config, name, getattr(train, name)), name
    assert config.renamed({"num_iterations": 2}) == {"num_epochs": 2}  # TRL's name, for a TrainConfig by default
    with pytest.raises(ValueError, match=r"config: tasks\[1\].task='add9' is not a built-in task"):
        config.parse_tasks([{"task": "add3"}, {"task": "add9"}], ["answer_match"])
    with pytest.raises(ValueError) as refused:
        config.utf8_text(b"ok\n\xff", "config: x.yaml")
    assert str(refused.value) == "config: x.yaml line 2: not UTF-8 text (byte 0xff at column 1)"


def test_train_config_takes_other_names_and_names_an_unknown_key_as_make_config_does():
    # TrainConfig(beta=0.04) was a bare TypeError while GRPOTrainer(beta=0.04) worked: both read gspo.aliases now
    assert TrainConfig(beta=0.04) == TrainConfig(kl_coef=0.04) == make_config(TrainConfig, {"beta": 0.04})
    assert TrainConfig(importance_sampling_level="token", num_iterations=2).objective == "grpo"
    assert TrainConfig(optim="adamw_torch") == TrainConfig()  # a TRL value that means what gspo does
    for values, message in [({"kl_coeff": 0.1}, "config: unknown key 'kl_coeff'; did you mean 'kl_coef'?"),
                            ({"beta": 0.1, "kl_coef": 0.1}, "config: 'beta' is TRL's name for 'kl_coef', which is "
                                                            "given too; give only one of them"),
                            ({"use_liger_loss": True}, "config: use_liger_loss=True is TRL's, and gspo takes it only "
                                                       "as False")]:
        with pytest.raises(ValueError) as refused:
            TrainConfig(**values)
        assert str(refused.value).startswith(message)
    cfg = dataclasses.replace(TrainConfig(beta=0.04), max_steps=3)  # replace() rebuilds through __init__ too
    assert (cfg.kl_coef, cfg.max_steps) == (0.04, 3)
    assert "kl_coef" in inspect.signature(TrainConfig).parameters  # the fields still show as its signature
    with pytest.raises(ValueError, match="learning_rate='abc' has the wrong type"):  # types checked as before
        TrainConfig(learning_rate="abc")
