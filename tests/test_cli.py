"""The `gspo` command run for real in subprocesses, and the shipped configs."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gspo.config import SFTConfig, TrainConfig, field_docs, load_config
from gspo.tracking import read_jsonl
from gspo.trainer import train

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model": "tiny-dense", "model_overrides": {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                                                   "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16},
        "per_device_batch_size": 2, "num_generations": 2, "num_minibatches": 2, "max_completion_length": 6,
        "eval_num_prompts": 2, "eval_k": 2, "progress": False, "device": "cpu"}


def gspo(*args, cwd):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "gspo", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_train_from_yaml_with_override_and_plot_and_eval(tmp_path):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({**TINY, "max_steps": 3, "output_dir": "out"}))
    done = gspo("train", "--config", "run.yaml", "max_steps=2", "objective=grpo", "learning_rate=1e-3", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]  # the override won over the file's 3 steps
    assert records[1]["lr"] == pytest.approx(1e-3)
    config = json.loads((tmp_path / "out" / "model" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    assert yaml.safe_load("x: 1e-3")["x"] == "1e-3"  # YAML 1.1 quirk the config loader must absorb
    summary = json.loads(done.stdout)
    assert any(p.endswith("eval.png") for p in summary["plots"])

    done = gspo("plot", "out", cwd=tmp_path)
    assert done.returncode == 0 and all(Path(tmp_path, p).is_file() for p in done.stdout.split())

    done = gspo("eval", "--model", "out/model", "--task", "add3", "--num-prompts", "3", "--k", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result) == {"eval/accuracy", "eval/mean_at_k", "eval/pass_at_k"}
    assert 0 <= result["eval/pass_at_k"] <= 1


def test_train_help_lists_every_field_with_its_doc():
    done = gspo("train", "--help", cwd=ROOT)
    assert done.returncode == 0
    docs = field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        assert f"  {f.name} (" in done.stdout, f.name
    assert "Prompts per rollout batch (B)." in done.stdout and docs["num_generations"].startswith("Completions")


@pytest.mark.slow
def test_bad_override_is_one_clear_line(tmp_path):
    done = gspo("train", "learning_rat=1e-5", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "gspo train: error: config: unknown key 'learning_rat'; did you mean 'learning_rate'?"
    done = gspo("train", "num_minibatches=3", cwd=tmp_path)
    assert "is not divisible by num_minibatches=3" in done.stderr and done.returncode == 2
    done = gspo("train", "model=runs/nothing/here", "max_steps=1", cwd=tmp_path)
    assert done.returncode == 2 and "no such directory" in done.stderr


@pytest.mark.slow
def test_sft_command_saves_a_model(tmp_path):
    done = gspo("sft", "model=tiny-dense", "num_examples=8", "max_steps=2", "batch_size=4", "eval_steps=1",
                "eval_num_prompts=2", "output_dir=sft", "progress=false",
                "model_overrides={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64, "
                "num_attention_heads: 2, num_key_value_heads: 1, head_dim: 16}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["steps"] == 2
    records = read_jsonl(tmp_path / "sft" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and records[1]["loss/sft"] < records[0]["loss/sft"] + 1.0
    assert (tmp_path / "sft" / "model" / "model.safetensors").is_file()


def test_every_field_is_documented():
    for cls in (TrainConfig, SFTConfig):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, (cls.__name__, missing)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate_and_run_one_step(path, tmp_path):
    cls = SFTConfig if "sft" in path.name else TrainConfig
    cfg = load_config(cls, path)
    if cls is TrainConfig:
        assert cfg.model.startswith("runs/"), "RL configs start from a cold-start model"
        # Same config, with a tiny preset standing in for the cold-start model, runs a step.
        small = dataclasses.replace(cfg, **{**TINY, "per_device_batch_size": cfg.num_minibatches, "max_steps": 1,
                                            "output_dir": str(tmp_path / "run")})
        train(small)
        assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["objective=ppo"], "objective='ppo' is not one of gspo, grpo"),
        (["learning_rate=abc"], "learning_rate='abc' has the wrong type: expected float"),
        (["num_generations=1"], "num_generations must be >= 2"),
        (["reward_funcs=[a, b]", "reward_weights=[1.0]"], "reward_weights has 1 entries but reward_funcs has 2"),
        (["objective=gspo", "aggregation=token_mean"], "would weight gspo sequences by length"),
        (["top_p=0.9", "use_sampler_logprobs=true"], "truncated"),
        (["task=null"], "set `task`"),
        (["routing_replay=always"], "routing_replay='always' is not one of none, old_policy, rollout"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(TrainConfig, None, overrides)


@pytest.mark.slow
def test_moe_replay_through_the_cli(tmp_path):
    small_moe = ("model_overrides={num_hidden_layers: 2, hidden_size: 32, moe_intermediate_size: 16, "
                 "num_attention_heads: 2, num_key_value_heads: 1, head_dim: 16}")
    common = ["max_steps=1", "per_device_batch_size=2", "num_generations=2", "num_minibatches=2",
              "max_completion_length=6", "eval_num_prompts=2", "eval_k=2", "progress=false", "output_dir=out"]
    done = gspo("train", "model=tiny-moe", small_moe, "routing_replay=rollout", *common, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    step1 = read_jsonl(tmp_path / "out" / "metrics.jsonl")[1]
    assert 0 <= step1["moe/expert_change_frac"] <= 1 and "moe/expert_change_frac/layer_1" in step1
    assert "moe/replay_mismatch_frac" in step1
    done = gspo("train", "model=tiny-dense", "routing_replay=old_policy", *common, "output_dir=dense", cwd=tmp_path)
    assert done.returncode == 2 and "routing replay needs a Mixture-of-Experts model" in done.stderr
