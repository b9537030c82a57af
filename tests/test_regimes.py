"""The regimes lab (gspo/apps/lab/regimes.py): levels x methods, what is left out and why, every knob
reaching its run's config and metrics, and a micro regimes lab end to end."""

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import read_metrics
from gspo.apps.lab.regimes import levels, not_applicable
from gspo.apps.lab.report import load_lab
from gspo.apps.lab.runs import LabConfig, expand_grid, run_lab, sft_config, train_config
from gspo.apps.lab.stability_map import stability_map
from gspo.config import make_config

REGIMES = {"mismatch": {"bf16": {"sampler_dtype": "bfloat16"}, "vllm": {"generation_backend": "vllm"}},
           "staleness": {"lag1": {"sampler_lag": 1}},
           "off_policy": {"mb8": {"num_minibatches": 8}},
           "length": {"long": {"task": "add4", "max_completion_length": 64}},
           "moe_shape": {"deep": {"arch": {"num_hidden_layers": 6}},
                         "wide": {"arch": {"num_experts": 16, "num_experts_per_tok": 4}}}}
METHODS = {"grpo": {"objective": "grpo"}, "gspo": {"objective": "gspo"},
           "grpo_r2": {"objective": "grpo", "routing_replay": "old_policy"},
           "grpo_tis": {"objective": "grpo", "rollout_correction": "token_tis"}}
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def regimes_lab(tmp_path, **values) -> LabConfig:
    return make_config(LabConfig, {"output_dir": str(tmp_path / "lab"), "main_grid": False, "depths": [], "search": {},
                                   "regimes": REGIMES, "regime_methods": METHODS, "seeds": [0, 1], **values})


def test_levels_methods_and_what_is_left_out(tmp_path):
    assert [label for label, _ in levels(REGIMES)] == ["baseline", "mismatch-bf16", "mismatch-vllm", "staleness-lag1",
                                                       "off_policy-mb8", "length-long", "moe_shape-deep",
                                                       "moe_shape-wide"]
    specs = expand_grid(regimes_lab(tmp_path))
    names = [s.name for s in specs]
    assert len(names) == len(set(names)) and {s.group for s in specs} == {"regime"}
    # grpo, gspo, grpo_r2 on every level on MoE; grpo_tis only where the sampler is not pi_old (bf16, lag1, vllm);
    # the vllm level only where vllm is installed
    runnable = 8 if HAS_VLLM else 7
    assert len(specs) == 2 * (3 * runnable + (3 if HAS_VLLM else 2))
    assert "regime-mismatch-bf16-grpo_tis-s1" in names and "regime-baseline-grpo_tis-s0" not in names
    assert not_applicable(METHODS["grpo_tis"], {}, "moe") == ("no sampler mismatch (mu = pi_old): the correction is "
                                                              "the identity")
    assert not_applicable(METHODS["grpo_r2"], {}, "dense") == "routing replay needs an MoE model"
    # R3 replays the sampler's routes: only a sampler that is not pi_old makes it differ from R2
    r3 = {"objective": "grpo", "routing_replay": "rollout"}
    assert not_applicable(r3, {}, "moe").startswith("no sampler mismatch: R3 replays the sampler's routes")
    assert not_applicable(r3, {"arch": {"num_hidden_layers": 6}}, "moe").startswith("no sampler mismatch")
    assert not_applicable(r3, REGIMES["mismatch"]["bf16"], "moe") is None
    assert not_applicable(r3, {"sampler_lag": 1}, "moe") is None
    assert not_applicable(r3, {"rollout_workers": 1, "max_staleness": 2}, "moe") is None  # workers sample ahead
    assert not_applicable(METHODS["grpo_tis"], {"rollout_workers": 1, "max_staleness": 0}, "moe") is not None
    if not HAS_VLLM:
        assert not_applicable(METHODS["grpo"], REGIMES["mismatch"]["vllm"], "moe").startswith("vllm is not installed")
    dense = expand_grid(regimes_lab(tmp_path, regime_model="dense"))
    assert not any(s.method == "grpo_r2" for s in dense) and len(dense) == len(specs) - 2 * runnable


def test_every_regime_knob_reaches_its_runs_config(tmp_path):
    cfg = regimes_lab(tmp_path, seeds=[3])
    specs = {s.name: s for s in expand_grid(cfg)}
    lab = tmp_path / "lab" / "coldstart"

    def config(name):
        return train_config(cfg, specs[name])

    base = config("regime-baseline-grpo-s3")
    assert (base.objective, base.sampler_dtype, base.sampler_lag, base.num_minibatches, base.task, base.seed) == \
        ("grpo", None, 0, 4, "add3", 3)
    assert base.model == str(lab / "moe-L4" / "model")
    assert config("regime-mismatch-bf16-gspo-s3").sampler_dtype == "bfloat16"
    tis = config("regime-staleness-lag1-grpo_tis-s3")
    assert (tis.sampler_lag, tis.rollout_correction) == (1, "token_tis")
    assert config("regime-off_policy-mb8-grpo-s3").num_minibatches == 8
    assert config("regime-baseline-grpo_r2-s3").routing_replay == "old_policy"
    long = config("regime-length-long-grpo-s3")
    assert (long.task, long.max_completion_length, long.model) == ("add4", 64, str(lab / "moe-L4-add4-len64" / "model"))
    assert config("regime-moe_shape-deep-grpo-s3").model == str(lab / "moe-L6" / "model")
    wide = specs["regime-moe_shape-wide-grpo-s3"]
    assert train_config(cfg, wide).model == str(lab / "moe-L4-num_experts16-num_experts_per_tok4" / "model")
    cold = sft_config(cfg, *wide.cold_key)
    assert cold.model_overrides == {"num_hidden_layers": 4, "num_experts": 16, "num_experts_per_tok": 4}
    long_cold = sft_config(cfg, *specs["regime-length-long-grpo-s3"].cold_key)
    # the cold start's held-out answers are generated as long as the runs' (at the lab's 48 tokens a long answer is
    # cut off and its accuracy reads 0: the cold start would never reach its target)
    assert (long_cold.task, long_cold.max_completion_length, cold.max_completion_length) == ("add4", 64, 48)
    assert sft_config(regimes_lab(tmp_path, train_overrides={"max_completion_length": 96}),
                      *specs["regime-baseline-grpo-s3"].cold_key).max_completion_length == 96


def test_the_shipped_regimes_lab_builds_every_run_and_names_what_it_leaves_out(tmp_path):
    from gspo.apps.lab.regimes import regime_runs
    from gspo.apps.lab.runs import load_lab_config

    cfg = load_lab_config(False, Path(__file__).resolve().parents[1] / "configs" / "lab_regimes.yaml",
                          [f"output_dir={tmp_path / 'lab'}"])
    specs = expand_grid(cfg)
    for spec in specs:
        train_config(cfg, spec)  # every run's TrainConfig is valid
    left_out = regime_runs(cfg.regimes, cfg.regime_methods, cfg.regime_model, cfg.axis_methods)[1]
    # 10 levels (baseline + 9) x 8 methods, each axis running the methods axis_methods picks: baseline 6, bf16 6,
    # lag1 and lag4 4 each, mb8 and mb16 3 each, long 2, deep16 and wide32 4 each, less R3 where the sampler is
    # pi_old (baseline, deep16, wide32); vllm 5 where installed (R3 is left out under vllm)
    vllm = 5 if HAS_VLLM else 0
    assert len(specs) == 3 * (33 + vllm) and len(left_out) == 10 * 8 - len(specs) // 3
    reasons = [x["reason"].split(":")[0] for x in left_out]
    # not chosen: 8 minus the picks of each level (2 2 2 4 4 5 5 6 4 4); the vllm level's 6 picks are left out
    # where vllm is missing, only R3 where it is installed
    assert reasons.count("not chosen for this axis (axis_methods)") == 38
    assert [x["regime"] for x in left_out if x["reason"].startswith("no sampler mismatch: R3")] == \
        ["baseline", "moe_shape-deep16", "moe_shape-wide32"]
    assert sum(r.startswith("vllm") for r in reasons) == (0 if HAS_VLLM else 6)
    assert sum(r.startswith("R3") for r in reasons) == (1 if HAS_VLLM else 0)
    assert len(reasons) == 38 + 3 + (1 if HAS_VLLM else 6)
    assert all(x["reason"] for x in left_out) and {s.seed for s in specs} == {0, 1, 2}


@pytest.mark.parametrize("part, runs", [("part3_policy", 63), ("part3_moe", 90), ("part4_length", 15),
                                       ("part4_router", 36), ("part4_corrections", 12),
                                       ("dapo", 60)])
def test_the_shipped_part3_and_part4_labs_build_every_run(tmp_path, part, runs):
    # policy: baseline 3, mb1 5, mb8 8, stale2 5 (21 x 3); moe: baseline 2, bf16 4, fp16 4, lag4 4, autocast-bf16
    # and -fp16 2 each, lr3e-4, lr1e-3, e64top1 and e64top1_lr2e-4 3 each (30 x 3): the axis_methods picks, each
    # applicable there
    from gspo.apps.lab.runs import load_lab_config

    cfg = load_lab_config(False, Path(__file__).resolve().parents[1] / "configs" / f"lab_{part}.yaml",
                          [f"output_dir={tmp_path / 'lab'}"])
    specs = expand_grid(cfg)
    for spec in specs:
        train_config(cfg, spec)  # every run's TrainConfig is valid
    assert len(specs) == runs and {s.seed for s in specs} == {0, 1, 2}


def test_axis_methods_pick_each_axis_methods_and_the_baseline_runs_their_union(tmp_path):
    picks = {"mismatch": ["grpo", "grpo_tis"], "off_policy": ["gspo"], "length": ["gspo"], "moe_shape": ["grpo_r2"]}
    specs = expand_grid(regimes_lab(tmp_path, seeds=[0], axis_methods=picks))
    by_regime = {}
    for s in specs:
        by_regime.setdefault(s.label, []).append(s.method)
    # staleness is not listed: it runs every method that applies; so the baseline runs all four (grpo_tis is
    # still left out there: no mismatch)
    assert by_regime == {"baseline": ["grpo", "gspo", "grpo_r2"], "mismatch-bf16": ["grpo", "grpo_tis"],
                         **({"mismatch-vllm": ["grpo", "grpo_tis"]} if HAS_VLLM else {}),
                         "staleness-lag1": ["grpo", "gspo", "grpo_r2", "grpo_tis"], "off_policy-mb8": ["gspo"],
                         "length-long": ["gspo"], "moe_shape-deep": ["grpo_r2"], "moe_shape-wide": ["grpo_r2"]}
    from gspo.apps.lab.regimes import regime_runs

    left_out = regime_runs(REGIMES, METHODS, "moe", picks)[1]
    assert {"regime": "off_policy-mb8", "method": "grpo",
            "reason": "not chosen for this axis (axis_methods): the grid's budget"} in left_out
    assert len(left_out) == 8 * 4 - len(specs)
    # with every axis listed, the baseline runs only what some axis runs
    only = {"mismatch": ["grpo"], "staleness": ["grpo"], "off_policy": ["gspo"], "length": ["gspo"],
            "moe_shape": ["gspo"]}
    base = [s.method for s in expand_grid(regimes_lab(tmp_path, seeds=[0], axis_methods=only)) if s.label == "baseline"]
    assert base == ["grpo", "gspo"]
    # or what axis_methods.baseline names
    own = [s.method
           for s in expand_grid(regimes_lab(tmp_path, seeds=[0], axis_methods={**only, "baseline": ["grpo_r2"]}))
           if s.label == "baseline"]
    assert own == ["grpo_r2"]
    # or nothing: an empty baseline list runs no baseline, and says so
    none = expand_grid(regimes_lab(tmp_path, seeds=[0], axis_methods={**only, "baseline": []}))
    assert [s.label for s in none if s.label == "baseline"] == [] and len(none) == 6 + HAS_VLLM
    left_out = regime_runs(REGIMES, METHODS, "moe", {**only, "baseline": []})[1]
    assert [x["method"] for x in left_out if x["regime"] == "baseline"] == list(METHODS)


def test_bad_regime_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"axis_methods\['speed'\]: no such axis in regimes \(mismatch, staleness"):
        regimes_lab(tmp_path, axis_methods={"speed": ["grpo"]})
    with pytest.raises(ValueError, match=r"axis_methods\['mismatch'\] names \['ppo'\], not in regime_methods"):
        regimes_lab(tmp_path, axis_methods={"mismatch": ["grpo", "ppo"]})
    with pytest.raises(ValueError, match=r"axis_methods\['mismatch'\] must be a non-empty list"):
        regimes_lab(tmp_path, axis_methods={"mismatch": []})
    with pytest.raises(ValueError, match="axis name 'off-policy' must not be 'baseline' nor contain '-'"):
        regimes_lab(tmp_path, regimes={"off-policy": {"mb8": {"num_minibatches": 8}}})
    with pytest.raises(ValueError, match="regimes are set but regime_methods is empty"):
        regimes_lab(tmp_path, regime_methods={})
    with pytest.raises(ValueError, match=r"regimes\['mismatch'\]\['bf16'\] must be a mapping"):
        regimes_lab(tmp_path, regimes={"mismatch": {"bf16": "bfloat16"}})
    with pytest.raises(ValueError, match=r"regime_methods\['grpo'\] must be a mapping"):
        regimes_lab(tmp_path, regime_methods={"grpo": "grpo"})
    with pytest.raises(ValueError, match="regime_model='big' is not one of dense, moe"):
        regimes_lab(tmp_path, regime_model="big")
    cfg = regimes_lab(tmp_path, regimes={"off_policy": {"mb7": {"num_minibatches": 7}}})
    spec = next(s for s in expand_grid(cfg) if s.name == "regime-off_policy-mb7-grpo-s0")
    with pytest.raises(ValueError, match="lab run regime-off_policy-mb7-grpo-s0: .*not divisible by num_minibatches=7"):
        train_config(cfg, spec)


@pytest.mark.slow
def test_micro_regimes_lab_end_to_end(tmp_path):
    cfg = regimes_lab(
        tmp_path, regime_model="dense", seeds=[0], num_layers=1, max_steps=2, eval_steps=1, per_device_batch_size=2,
        num_generations=4, num_minibatches=2, max_completion_length=8, eval_num_prompts=4, eval_k=2, sft_max_steps=3,
        learning_rate=1e-3, workers=1, warmup_steps=4,
        regimes={"mismatch": {"bf16": {"sampler_dtype": "bfloat16"}}, "off_policy": {"mb4": {"num_minibatches": 4}},
                 "length": {"long": {"task": "add4", "max_completion_length": 12}}},
        regime_methods={"grpo": {"objective": "grpo"}, "grpo_tis": {"objective": "grpo",
                                                                     "rollout_correction": "token_tis"}})
    summary = run_lab(cfg, log=lambda _: None)
    assert (summary["runs"], summary["ran"]) == (5, 5)
    runs = tmp_path / "lab" / "runs"
    base, bf16 = read_metrics(runs / "regime-baseline-grpo-s0"), read_metrics(runs / "regime-mismatch-bf16-grpo_tis-s0")
    # config -> metrics: the bf16 sampler's mismatch is measured (fp32 logs none), the correction acts
    assert "mismatch/kl" not in base[1] and bf16[1]["mismatch/kl"] > 1e-9 and "mismatch/clipped_frac" in bf16[1]
    # 4 minibatches: 4 optimizer steps per rollout, so the warmup (4 steps) is done after step 1; 2: half done
    assert base[1]["lr"] == pytest.approx(1e-3 * 3 / 4) and read_metrics(runs / "regime-off_policy-mb4-grpo-s0")[1][
        "lr"] == pytest.approx(1e-3)
    long = json.loads((runs / "regime-length-long-grpo-s0" / "done.json").read_text())["config"]
    assert (long["task"], long["max_completion_length"]) == ("add4", 12)
    assert max(r["completion/max_len"] for r in read_metrics(runs / "regime-length-long-grpo-s0")[1:]) <= 12
    assert (tmp_path / "lab" / "coldstart" / "dense-L1-add4-len12" / "done.json").is_file()
    smap = stability_map(load_lab(tmp_path / "lab"), method_of=lambda r: r["spec"]["method"],
                         regime_of=lambda r: r["spec"]["label"])
    assert set(smap["cells"]) == {("grpo", "baseline"), ("grpo", "mismatch-bf16"), ("grpo_tis", "mismatch-bf16"),
                                  ("grpo", "off_policy-mb4"), ("grpo", "length-long")}
    report = Path(summary["report"]).read_text()
    assert "## Regimes: the stability map" in report and "(plots/stability_map.png)" in report
    assert "- baseline: grpo_tis: no sampler mismatch (mu = pi_old): the correction is the identity" in report
    row = next(line for line in report.splitlines() if line.startswith("| mismatch-bf16 | grpo_tis |"))
    assert row.split(" | ")[4] != "–" and "| baseline | grpo |" in report  # the bf16 sampler's mismatch/kl
    assert (tmp_path / "lab" / "plots" / "stability_map.png").stat().st_size > 5000


@pytest.mark.slow
def test_micro_moe_regimes_lab_staleness_and_shape_reach_their_runs(tmp_path):
    # The two knobs the dense micro lab cannot show: a stale sampler and an MoE shape, config -> metrics.
    cfg = regimes_lab(
        tmp_path, seeds=[0], num_layers=1, max_steps=3, eval_steps=3, per_device_batch_size=2, num_generations=4,
        num_minibatches=2, max_completion_length=8, eval_num_prompts=4, eval_k=2, sft_max_steps=3, workers=1,
        learning_rate=1e-3, train_overrides={"reward_funcs": ["conftest:starts_with_digit"]},  # a reward with signal
        regimes={"staleness": {"lag1": {"sampler_lag": 1}},
                 "moe_shape": {"wide": {"arch": {"num_experts": 4, "num_experts_per_tok": 1}}}},
        regime_methods={"grpo": {"objective": "grpo"},
                        "grpo_r2": {"objective": "grpo", "routing_replay": "old_policy"}},
        axis_methods={"staleness": ["grpo"], "moe_shape": ["grpo_r2"], "baseline": ["grpo"]})
    summary = run_lab(cfg, log=lambda _: None)
    assert (summary["runs"], summary["ran"]) == (3, 3)
    runs = tmp_path / "lab" / "runs"
    lag = read_metrics(runs / "regime-staleness-lag1-grpo-s0")
    # rollout 1 samples from the initial weights, which are pi_old then; rollout 2 still from them, one update behind
    assert lag[1]["grad/norm"] > 0 and lag[1]["mismatch/kl"] < 1e-9 and lag[2]["mismatch/kl"] > 1e-7
    assert "mismatch/kl" not in read_metrics(runs / "regime-baseline-grpo-s0")[1]
    wide = json.loads((tmp_path / "lab" / "coldstart" / "moe-L1-num_experts4-num_experts_per_tok1" / "model" /
                       "config.json").read_text())
    # num_local_experts: the name the config is saved under
    assert (wide["num_local_experts"], wide["num_experts_per_tok"], wide["num_hidden_layers"]) == (4, 1, 1)
    shape = read_metrics(runs / "regime-moe_shape-wide-grpo_r2-s0")
    assert "moe/expert_change_frac/layer_0" in shape[1] and "moe/expert_change_frac/layer_1" not in shape[1]
