"""The model card: README.md beside the saved weights, with the config, the data and the final metrics."""

import json
import re

from conftest import tiny_cfg
from gspo.checkpoint import saved_config
from gspo.config import TrainConfig, make_config
from gspo.data.rows import data_fingerprint
from gspo.model_card import model_card
from gspo.tasks import get_task
from gspo.tracking import read_jsonl
from gspo.trainer import train


def card_config(card: str) -> dict:
    return json.loads(re.search(r"```json\n(.*?)\n```", card, re.S).group(1))


def test_a_run_writes_a_card_with_its_config_data_and_metrics(tmp_path):
    rows = list(get_task("add3").dataset("train", 12, seed=0))
    data = tmp_path / "add.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_cfg(tmp_path, task=None, dataset=str(data), max_steps=2, eval_holdout=4, eval_num_prompts=4)
    result = train(cfg)
    card = (tmp_path / "run" / "model" / "README.md").read_text()

    assert "library_name: transformers" in card and "GSPO reinforcement learning, 2 steps of 2 prompts x 4" in card
    assert card_config(card) == json.loads(json.dumps(saved_config(cfg)))  # the whole config, as a checkpoint saves it
    # ...and it builds a config again: the card's block is a config file.
    assert make_config(TrainConfig, card_config(card)) == make_config(TrainConfig, saved_config(cfg))
    assert f"`{data}`: 12 rows, sha256 {data_fingerprint(rows)['sha256']}" in card
    assert "Train rows: 8" in card and "Held out rows: 4" in card and "Rewards: answer_match" in card
    for step in (0, 2):  # before and after, as the summary has them
        assert f"step {step}" in card
    for key, value in result["evals"][2].items():
        before = result["evals"][0][key]
        assert f"| {key} | {before:.4g} | {value:.4g} |" in card
    last = read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]
    assert last["step"] == 2 and f"| reward/mean | {last['reward/mean']:.4g} |" in card


def test_a_card_without_evaluation_or_data_files_says_so():
    card = model_card({"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "objective": "grpo", "max_steps": 5,
                       "task": "add3", "seed": 3, "reward_funcs": ["answer_match", "format"],
                       "reward_weights": [1.0, 0.5]}, kind="rl", evals={}, adapter=True)
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card  # a hub name is linked; a local path is not
    assert "library_name: peft" in card and "AutoPeftModelForCausalLM" in card
    assert "No held-out evaluation ran" in card and "Built-in task: `add3` (generated, seed 3)" in card
    assert "Rewards: answer_match (weight 1.0), format (weight 0.5)" in card
    assert "base_model" not in model_card({"model": "."}, kind="sft")
