"""TRL GRPOConfig's names as aliases of gspo settings (gspo/aliases.py): each read into gspo's own,
the ones whose meaning differs refused with a hint, both names an error, saved configs in gspo names; TRL's
names gspo has no setting for (gspo/config/trl.py) refused with what gspo does instead, never a did-you-mean."""

import dataclasses
import json
import re

import pytest

from conftest import ROOT
from gspo.algo.advantages import estimator_choices
from gspo.algo.objectives import AGGREGATIONS, OBJECTIVES
from gspo.aliases import ALIASES, LOSS_TYPES, REFUSED, REPORT_TO, SAMPLING_LEVELS, SCALE_REWARDS
from gspo.config import SFTConfig, TrainConfig, load_config, make_config, renamed, to_dict
from gspo.config.trl import NOT_TAKEN
from gspo.rollout import generator_choices


def settings(cfg, names) -> dict:
    return {name: getattr(cfg, name) for name in names}


@pytest.mark.parametrize("trl, gspo", [
    ({"beta": 0.04}, {"kl_coef": 0.04}),
    # epsilon alone is both clips (TRL: epsilon_high defaults to epsilon), not gspo's per-objective upper default
    ({"importance_sampling_level": "token", "epsilon": 0.1}, {"objective": "grpo", "clip_low": 0.1, "clip_high": 0.1}),
    ({"epsilon": 3e-4, "epsilon_high": 4e-4}, {"clip_low": 3e-4, "clip_high": 4e-4}),
    ({"epsilon": 0.1, "clip_high": 0.3, "importance_sampling_level": "token"},
     {"clip_low": 0.1, "clip_high": 0.3, "objective": "grpo"}),
    ({"importance_sampling_level": "token", "epsilon_high": 0.28}, {"objective": "grpo", "clip_high": 0.28}),
    # cispo: TRL clamps the weight at epsilon_high itself, gspo at 1 + clip_high
    ({"loss_type": "cispo", "epsilon_high": 5.0}, {"objective": "cispo", "clip_high": 4.0}),
    ({"importance_sampling_level": "sequence"}, {"objective": "gspo"}),
    ({"importance_sampling_level": "token"}, {"objective": "grpo"}),
    ({"importance_sampling_level": "sequence", "loss_type": "grpo"},
     {"objective": "gspo", "aggregation": "seq_mean_token_mean"}),
    ({"importance_sampling_level": "token", "loss_type": "dapo"}, {"objective": "grpo", "aggregation": "token_mean"}),
    ({"importance_sampling_level": "token", "loss_type": "dr_grpo"},
     {"objective": "grpo", "aggregation": "seq_mean_token_sum_norm"}),
    ({"loss_type": "cispo"}, {"objective": "cispo"}),
    ({"importance_sampling_level": "token", "loss_type": "sapo"}, {"objective": "sapo"}),
    ({"importance_sampling_level": "sequence", "loss_type": "luspo", "epsilon": 2e-3, "epsilon_high": 2.5e-3},
     {"objective": "luspo", "clip_low": 2e-3, "clip_high": 2.5e-3}),
    ({"importance_sampling_level": "token", "loss_type": "vespo"}, {"objective": "vespo"}),
    ({"importance_sampling_level": "sequence", "loss_type": "vespo"}, {"objective": "vespo"}),
    ({"scale_rewards": "group"}, {"advantage_estimator": "group"}),
    ({"scale_rewards": True}, {"advantage_estimator": "group"}),
    ({"scale_rewards": "batch"}, {"advantage_estimator": "batch"}),
    ({"scale_rewards": "none"}, {"advantage_estimator": "none"}),
    ({"scale_rewards": False}, {"advantage_estimator": "none"}),
    ({"steps_per_generation": 2}, {"num_minibatches": 2}),
    ({"num_iterations": 3}, {"num_epochs": 3}),
    ({"report_to": "tensorboard"}, {"tensorboard": True, "wandb": False}),
    ({"report_to": ["tensorboard", "wandb"]}, {"tensorboard": True, "wandb": True}),
    ({"report_to": "none"}, {"tensorboard": False, "wandb": False}),
    ({"report_to": []}, {"tensorboard": False, "wandb": False}),
    ({"use_vllm": True}, {"generation_backend": "vllm"}),
    ({"use_vllm": True, "vllm_mode": "colocate"}, {"generation_backend": "vllm"}),
    ({"use_vllm": False}, {"generation_backend": "auto"}),
    # completions per step -> prompts per rollout: 16 / 8 generations; with 4 steps per rollout 16 * 4 / 8
    ({"per_device_train_batch_size": 16}, {"per_device_batch_size": 2}),
    ({"per_device_train_batch_size": 16, "steps_per_generation": 4},
     {"per_device_batch_size": 8, "num_minibatches": 4}),
    ({"per_device_train_batch_size": 6, "num_generations": 3, "num_minibatches": 2},
     {"per_device_batch_size": 4, "num_generations": 3, "num_minibatches": 2}),
    ({"advantage_scale": "rloo"}, {"advantage_estimator": "rloo"}),  # gspo's former name
    # an optimizer step of k micro-batches is one minibatch of them: num_minibatches = steps_per_generation / k
    ({"gradient_accumulation_steps": 1}, {"num_minibatches": 1}),  # TRL: steps_per_generation defaults to it
    ({"gradient_accumulation_steps": 4}, {"num_minibatches": 1}),
    ({"gradient_accumulation_steps": 1, "steps_per_generation": 4}, {"num_minibatches": 4}),  # TRL's GSPO recipe
    ({"gradient_accumulation_steps": 2, "steps_per_generation": 8}, {"num_minibatches": 4}),
    ({"gradient_accumulation_steps": 1, "num_minibatches": 2}, {"num_minibatches": 2}),
    # 4 completions x 4 micro-batches = 16 = 2 prompts x 8; 2 optimizer steps of 2 micro-batches (8 completions)
    ({"gradient_accumulation_steps": 2, "steps_per_generation": 4, "per_device_train_batch_size": 4},
     {"num_minibatches": 2, "per_device_batch_size": 2}),
    ({"gradient_accumulation_steps": 2, "per_device_train_batch_size": 8}, {"num_minibatches": 1,
                                                                           "per_device_batch_size": 2}),
    ({"lr_scheduler_type": "linear"}, {"lr_scheduler": "linear"}),
    ({"lr_scheduler_type": "cosine"}, {"lr_scheduler": "cosine"}),
    ({"lr_scheduler_type": "constant"}, {"lr_scheduler": "constant"}),
    ({"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 3}, {"lr_scheduler": "constant", "warmup_steps": 3}),
    # warmup_steps = ceil(optimizer steps x ratio): 30 x 4 x 1 x 0.25 = 30; 3 x 4 x 2 x 0.1 = 2.4 -> 3
    ({"warmup_ratio": 0.25, "max_steps": 30}, {"warmup_steps": 30, "max_steps": 30}),
    ({"warmup_ratio": 0.1, "max_steps": 3, "steps_per_generation": 4, "num_iterations": 2},
     {"warmup_steps": 3, "max_steps": 3, "num_minibatches": 4, "num_epochs": 2}),
    ({"warmup_ratio": 0, "max_steps": 5}, {"warmup_steps": 0, "max_steps": 5}),
    ({"save_strategy": "steps", "save_steps": 5}, {"save_steps": 5}),
    ({"save_strategy": "no"}, {"save_steps": 0}),
    ({"model_name_or_path": "tiny-moe"}, {"model": "tiny-moe"}),
    ({"torch_dtype": "bfloat16"}, {"dtype": "bfloat16"}),
    ({"dataset_name": "openai/gsm8k", "dataset_config": "main"}, {"dataset": "openai/gsm8k",
                                                                  "dataset_config": "main"}),
], ids=lambda case: ",".join(f"{k}={v}" for k, v in case.items()) if isinstance(case, dict) else None)
def test_trl_name_builds_the_same_config_as_the_gspo_name(trl, gspo):
    cfg = make_config(TrainConfig, trl)
    assert settings(cfg, gspo) == gspo
    assert to_dict(cfg) == to_dict(make_config(TrainConfig, gspo))  # nothing else moved


def test_every_alias_and_refusal_has_a_test_or_a_row():
    tested = set()
    for mark in test_trl_name_builds_the_same_config_as_the_gspo_name.pytestmark:
        if mark.name == "parametrize":
            tested |= {name for trl, _ in mark.args[1] for name in trl}
    assert set(ALIASES) <= tested
    assert set(REFUSED) == {name for name, _ in REFUSED_CASES}


def test_loss_type_luspo_is_the_papers_sequence_level_loss_with_a_note_where_trl_would_differ(capsys):
    cfg = make_config(TrainConfig, {"loss_type": "luspo"})
    assert cfg.objective == "luspo" and cfg.aggregation is None  # luspo's own: token sums, mean over sequences
    assert "config: note: loss_type=luspo without importance_sampling_level: TRL's default, token, would weight " \
           "clipped token ratios by length" in capsys.readouterr().err
    make_config(TrainConfig, {"loss_type": "luspo", "importance_sampling_level": "sequence"})
    assert "loss_type=luspo" not in capsys.readouterr().err


def test_per_device_train_batch_size_is_converted_with_a_note(capsys):
    cfg = make_config(TrainConfig, {"per_device_train_batch_size": 16, "num_generations": 4})
    assert (cfg.per_device_batch_size, cfg.num_generations, cfg.num_minibatches) == (4, 4, 4)
    first, defaults = capsys.readouterr().err.splitlines()
    assert first == (
        "config: note: per_device_train_batch_size=16 counts completions per step (TRL): read as "
        "per_device_batch_size=4 prompts x num_generations=4 = 16 completions per rollout, trained in "
        "num_minibatches=4 optimizer steps (TRL: steps_per_generation, default 1)")
    assert defaults.startswith("config: note: TRL names, gspo defaults: ")  # tests/test_trl_defaults.py
    make_config(TrainConfig, {"per_device_batch_size": 4, "num_generations": 4})
    assert capsys.readouterr().err == ""  # gspo's own name: no note


@pytest.mark.parametrize("values, message", [
    ({"per_device_train_batch_size": 12}, "per_device_train_batch_size=12 \\(TRL: completions per step\\) = 12 "
                                          "completions is not a multiple of num_generations=8"),
    ({"per_device_train_batch_size": 6, "steps_per_generation": 2, "num_generations": 8},
     "x steps_per_generation=2 = 12 completions is not a multiple of num_generations=8"),
    ({"per_device_train_batch_size": "8"}, "per_device_train_batch_size='8' has the wrong type: expected int"),
    ({"loss_type": "bnpo"}, "loss_type='bnpo' \\(TRL\\): it normalises by each process's own token count"),
    ({"loss_type": "ppo"}, "loss_type='ppo' is not one of TRL's 'grpo', 'dapo', 'dr_grpo', 'cispo', 'sapo', "
                           "'luspo', 'vespo'"),
    ({"importance_sampling_level": "token", "loss_type": "luspo"},
     "importance_sampling_level='token' with loss_type=luspo: gspo's luspo objective has the sequence ratio only "
     "\\(LUSPO's\\); use importance_sampling_level: sequence"),
    ({"loss_type": "vespo", "epsilon": 0.2}, "epsilon: TRL's loss_type=vespo ignores it \\(a smooth kernel"),
    ({"loss_type": "vespo", "epsilon_high": 0.2}, "epsilon_high: TRL's loss_type=vespo ignores it"),
    # TRL's default objective is token-level; gspo's (gspo) refuses a length-weighted aggregation
    ({"loss_type": "dapo"}, "loss_type='dapo' \\(TRL; aggregation token_mean\\) with objective 'gspo': aggregation: "
                            "'token_mean' would weight gspo sequences by length"),
    ({"loss_type": "dapo"}, "importance_sampling_level: token \\(TRL's default: objective grpo\\)"),
    ({"importance_sampling_level": "sequence", "loss_type": "dr_grpo"},
     "with objective 'gspo'.*; use loss_type: grpo$"),
    ({"importance_sampling_level": "sequence", "loss_type": "cispo"},
     "importance_sampling_level='sequence' with loss_type=cispo: gspo's cispo objective has token ratios only"),
    ({"importance_sampling_level": "seq"}, "importance_sampling_level='seq' is not one of TRL's 'token', 'sequence'"),
    ({"loss_type": "cispo", "epsilon": 0.2}, "epsilon: TRL's loss_type=cispo ignores it"),
    ({"loss_type": "sapo", "epsilon_high": 0.2}, "epsilon_high: TRL's loss_type=sapo ignores it"),
    ({"scale_rewards": "std"}, "scale_rewards='std' is not one of TRL's 'group', True, 'batch', 'none', False"),
    ({"scale_rewards": 1}, "scale_rewards=1 is not one of TRL's"),
    ({"report_to": "all"}, "report_to='all' \\(TRL: every installed integration\\): name them, e.g. "
                           "report_to: \\[tensorboard, wandb\\]"),
    ({"report_to": ["wandb", "mlflow"]}, "report_to: 'mlflow' is not one gspo logs to"),
    ({"use_vllm": "yes"}, "use_vllm='yes' has the wrong type: expected bool"),
    ({"use_vllm": True, "vllm_mode": "server"}, "vllm_mode=server \\(TRL\\): gspo runs vLLM only colocated"),
    ({"vllm_mode": "remote"}, "vllm_mode='remote' is not one of TRL's 'colocate', 'server'"),
    ({"gradient_accumulation_steps": 3, "steps_per_generation": 8}, "steps_per_generation=8 is not a multiple of "
                                                                    "gradient_accumulation_steps=3 \\(TRL\\): an "
                                                                    "optimizer step would take micro-batches of two "
                                                                    "rollouts"),
    ({"gradient_accumulation_steps": 2, "num_minibatches": 4}, "gradient_accumulation_steps=2 \\(TRL\\) with "
                                                               "num_minibatches .*give TRL's steps_per_generation"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0 must be > 0"),
    ({"gradient_accumulation_steps": 1.5}, "gradient_accumulation_steps=1.5 has the wrong type: expected int"),
    ({"lr_scheduler_type": "cosine_with_restarts"}, "lr_scheduler_type='cosine_with_restarts' \\(TRL\\): gspo's "
                                                    "schedules are linear, cosine and constant"),
    ({"lr_scheduler_type": "constant", "warmup_ratio": 0.1, "max_steps": 10},
     "lr_scheduler_type=constant \\(TRL\\) ignores the warmup .* use lr_scheduler_type: constant_with_warmup"),
    ({"warmup_ratio": 0.1}, "warmup_ratio \\(TRL\\) is a fraction of the run's optimizer steps, and max_steps is not "
                            "given: set max_steps"),
    ({"warmup_ratio": 1.5, "max_steps": 10}, "warmup_ratio=1.5 must be in \\[0, 1\\]"),
    ({"warmup_ratio": 0.1, "max_steps": 10, "warmup_steps": 2}, "'warmup_ratio' is TRL's name for 'warmup_steps', "
                                                                "which is given too"),
    ({"save_strategy": "epoch"}, "save_strategy=epoch \\(TRL\\): gspo saves every save_steps RL steps only \\(it "
                                 "runs max_steps RL steps, not epochs\\)"),
    ({"save_strategy": "best"}, "no best checkpoint by a metric"),
    ({"save_strategy": "no", "save_steps": 10}, "save_strategy=no \\(TRL\\) with save_steps: TRL ignores "
                                                "save_steps then"),
    ({"save_strategy": "sometimes"}, "save_strategy='sometimes' is not one of TRL's"),
])
def test_trl_values_without_a_gspo_meaning_are_refused_with_a_hint(values, message):
    with pytest.raises(ValueError, match=message):
        make_config(TrainConfig, values)


REFUSED_CASES = [
    ("generation_batch_size", "set per_device_batch_size"),
    ("num_train_epochs", "gspo runs max_steps RL steps"),
    ("vllm_importance_sampling_correction", "set rollout_correction"),
    ("vllm_importance_sampling_mode", "set rollout_correction"),
    ("vllm_importance_sampling_clip_max", "set rollout_correction_high"),
    ("vllm_importance_sampling_cap", "set rollout_correction_high"),
    ("vllm_importance_sampling_clip_min", "set rollout_correction_low"),
    ("log_completions", "log_samples_steps"),
    ("num_completions_to_print", "set log_samples_count"),
]


@pytest.mark.parametrize("name, hint", REFUSED_CASES)
def test_trl_names_of_another_meaning_are_refused_with_a_hint(name, hint):
    with pytest.raises(ValueError,
                       match=f"^config: '{name}' is TRL's, but gspo has no setting of that meaning: .*{hint}"):
        make_config(TrainConfig, {name: 1})


@pytest.mark.parametrize("values, message", [
    ({"beta": 0.1, "kl_coef": 0.1}, "'beta' is TRL's name for 'kl_coef', which is given too; give only one of them"),
    ({"num_iterations": 2, "num_epochs": 2}, "'num_iterations' is TRL's name for 'num_epochs'"),
    ({"epsilon": 0.1, "clip_low": 0.1}, "'epsilon' is TRL's name for 'clip_low'"),
    ({"epsilon_high": 0.3, "clip_high": 0.3}, "'epsilon_high' is TRL's name for 'clip_high'"),
    ({"importance_sampling_level": "token", "objective": "grpo"}, "'importance_sampling_level' is TRL's name for "
                                                                  "'objective'"),
    ({"loss_type": "cispo", "objective": "cispo"}, "'loss_type' is TRL's name for 'objective'"),
    ({"loss_type": "grpo", "aggregation": "token_mean"}, "'loss_type' is TRL's name for 'aggregation'"),
    ({"scale_rewards": "batch", "advantage_estimator": "batch"}, "'scale_rewards' is TRL's name for "
                                                                 "'advantage_estimator'"),
    ({"scale_rewards": "batch", "advantage_scale": "batch"}, "'advantage_scale' and 'scale_rewards' both set "
                                                             "'advantage_estimator'; give only one of them"),
    ({"steps_per_generation": 2, "num_minibatches": 2}, "'steps_per_generation' is TRL's name for 'num_minibatches'"),
    ({"report_to": "tensorboard", "wandb": True}, "'report_to' is TRL's name for 'wandb'"),
    ({"use_vllm": True, "generation_backend": "vllm"}, "'use_vllm' is TRL's name for 'generation_backend'"),
    ({"per_device_train_batch_size": 16, "per_device_batch_size": 2}, "'per_device_train_batch_size' is TRL's name "
                                                                      "for 'per_device_batch_size'"),
    ({"advantage_scale": "group", "advantage_estimator": "rloo"}, "'advantage_scale' is the old name of "
                                                                  "'advantage_estimator'"),
])
def test_an_alias_with_its_gspo_name_is_an_error_naming_both(values, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_config(TrainConfig, values)


def test_yaml_file_and_overrides_with_trl_names_build_the_gspo_config(tmp_path):
    trl = tmp_path / "trl.yaml"
    trl.write_text("beta: 0.04\nepsilon: 3e-4\nepsilon_high: 4e-4\nimportance_sampling_level: sequence\n"
                   "loss_type: grpo\nscale_rewards: batch\nsteps_per_generation: 2\nnum_iterations: 2\n"
                   "report_to: [tensorboard]\nper_device_train_batch_size: 8\nnum_generations: 4\n")
    ours = tmp_path / "gspo.yaml"
    ours.write_text("kl_coef: 0.04\nclip_low: 3e-4\nclip_high: 4e-4\nobjective: gspo\n"
                    "aggregation: seq_mean_token_mean\nadvantage_estimator: batch\nnum_minibatches: 2\n"
                    "num_epochs: 2\ntensorboard: true\nper_device_batch_size: 4\nnum_generations: 4\n")
    cfg = load_config(TrainConfig, trl)
    assert to_dict(cfg) == to_dict(load_config(TrainConfig, ours))
    assert (cfg.per_device_batch_size, cfg.num_minibatches, cfg.kl_coef,
            cfg.advantage_estimator) == (4, 2, 0.04, "batch")
    # an override in TRL's name wins over the file's value of that name; the saved config has gspo names only
    cfg = load_config(TrainConfig, trl, ["beta=0.1", "num_iterations=3"])
    assert (cfg.kl_coef, cfg.num_epochs) == (0.1, 3)
    saved = json.loads(json.dumps(to_dict(cfg)))
    assert not set(saved) & (set(ALIASES) | set(REFUSED))
    assert make_config(TrainConfig, renamed(saved)) == cfg  # what resume does with a saved train_config.json


def test_every_alias_sets_a_value_gspo_accepts():
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for name, alias in ALIASES.items():
        assert name not in fields and set(alias.targets) <= fields, name
    assert all(see in fields and name not in fields for name, (see, _) in REFUSED.items())
    assert set(SAMPLING_LEVELS.values()) <= set(OBJECTIVES)
    assert {v for k, v in LOSS_TYPES.values() if k == "objective"} <= set(OBJECTIVES)
    assert {v for k, v in LOSS_TYPES.values() if k == "aggregation"} <= set(AGGREGATIONS)
    assert set(SCALE_REWARDS.values()) <= set(estimator_choices())
    assert {"vllm", "auto"} <= set(generator_choices()) and set(REPORT_TO) <= fields


def test_trl_names_are_not_read_into_a_config_without_those_settings():
    with pytest.raises(ValueError, match="unknown key 'beta'"):
        make_config(SFTConfig, {"beta": 0.1})


def test_readme_trl_table_names_every_alias_and_refusal():  # the table moved from README.md to docs/trl.md
    readme = (ROOT / "docs" / "trl.md").read_text()
    table = readme[readme.index("Field names follow TRL"):]
    table = table[:table.index("\n\n", table.index("| gspo |"))]
    for name in [n for n, a in ALIASES.items() if not a.old] + list(REFUSED):
        assert re.search(f"`{name}[`:]", table), name  # `name` or `name: value`


@pytest.mark.parametrize("values, message", [
    # these got "did you mean 'truncate_prompts'?" / "'use_sampler_logprobs'?" before (dataset_name, which got
    # "'dataset'?", is an alias now: tests/test_cached_dataset.py)
    ({"sync_ref_model": True}, "config: sync_ref_model=True is TRL's, and gspo takes it only as False (what gspo "
                               "does): no equivalent: the reference stays the initial model"),
    ({"use_liger_loss": True}, "config: use_liger_loss=True is TRL's, and gspo takes it only as False (what gspo "
                               "does): no equivalent: gspo computes log-probs in row chunks (logprob_chunk_size)"),
    ({"optim": "adafactor"}, "config: optim='adafactor' is TRL's, and gspo takes it only as 'adamw_torch', "
                             "'adamw_torch_fused' (what gspo does): gspo trains with torch's AdamW, fused where torch "
                             "has the kernel (adam_state_dtype: bfloat16 stores its moments in bfloat16)"),
    ({"vllm_server_host": "0.0.0.0"}, "config: 'vllm_server_host' is TRL's, and gspo has no setting of that name: "
                                      "gspo runs vLLM in the training process (generation_backend: vllm); other "
                                      "processes and machines sample as endpoints: rollout_workers, "
                                      "rollout_endpoints (gspo serve, or vllm serve"),
])
def test_a_trl_name_gspo_does_not_take_says_what_gspo_does_never_a_did_you_mean(values, message):
    with pytest.raises(ValueError) as refused:
        make_config(TrainConfig, values)
    assert str(refused.value).startswith(message) and "did you mean" not in str(refused.value)


def test_every_trl_name_gspo_does_not_take_is_accepted_where_it_means_what_gspo_does_else_refused():
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not set(NOT_TAKEN) & (fields | set(ALIASES) | set(REFUSED))
    plain = to_dict(make_config(TrainConfig, {}))
    for name, entry in NOT_TAKEN.items():
        assert entry.does, name
        for value in entry.same:  # dropped: the config is gspo's default one
            assert to_dict(make_config(TrainConfig, {name: value})) == plain, (name, value)
        with pytest.raises(ValueError) as refused:
            make_config(TrainConfig, {name: "something else"})
        assert entry.does in str(refused.value) and "did you mean" not in str(refused.value), name
    everything = {name: entry.same[0] for name, entry in NOT_TAKEN.items() if entry.same}
    assert to_dict(make_config(TrainConfig, everything)) == plain
    assert to_dict(make_config(TrainConfig, {"top_entropy_quantile": 1})) == plain  # YAML's 1 is TRL's 1.0
    with pytest.raises(ValueError, match="gspo takes it only as False"):  # False, not 0
        make_config(TrainConfig, {"sync_ref_model": 0})


def test_docs_name_every_trl_name_gspo_does_not_take():
    docs = (ROOT / "docs" / "trl.md").read_text()
    section = docs[docs.index("## TRL names gspo does not take"):docs.index("## TRL's GSPO recipe")]
    assert [name for name in NOT_TAKEN if f"`{name}`" not in section] == []
