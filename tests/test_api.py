"""The Python API (gspo/apps/api.py): Trainer / GRPOTrainer / GSPOTrainer with objects, callbacks, the summary and
plots; TrainConfig's type checks; what a saved config records for objects, and resuming with and without them."""

import json
import math
import re
import shutil
from pathlib import Path

import datasets
import pytest
import torch

from conftest import ROOT, SMALL, read_metrics
from gspo import GRPOTrainer, GSPOTrainer, TrainConfig, Trainer
from gspo.apps.cli import main
from gspo.config import load_config
from gspo.data.rewards import answer_match, format_reward, get_reward_fn, reward_spec
from gspo.models import load_model
from gspo.tasks import get_task

SETTINGS = dict(per_device_batch_size=2, num_generations=4, num_minibatches=2, max_completion_length=12,
                learning_rate=1e-3, eval_num_prompts=4, eval_k=2, progress=False, device="cpu", max_steps=4)


class DigitShare:
    """A stateful reward: each completion's share of digits; it keeps every call's `answer` column and values."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, answer, **columns):
        values = [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]
        self.calls.append({"prompts": list(prompts), "answer": list(answer), "values": values})
        return values


def training_calls(reward: DigitShare) -> list[dict]:
    """The calls that scored a rollout: 2 prompts x G=4 completions, in groups (evaluations call it too)."""
    return [c for c in reward.calls if len(c["prompts"]) == 8 and all(p == c["prompts"][i // 4 * 4]
                                                                       for i, p in enumerate(c["prompts"]))]


class Recorder:
    """A callback object: every step's metrics."""

    def __init__(self):
        self.steps = []

    def on_step_end(self, step, metrics):
        self.steps.append((step, metrics))


def importable_reward(prompts, completions, **_):
    return [0.0 for _ in completions]


module_lambda = lambda prompts, completions, **_: [0.0] * len(completions)  # noqa: E731


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One API run: a model object, a datasets.Dataset, a stateful reward, a recorder and a callback that stops
    it after step 2 of max_steps=4."""
    out = tmp_path_factory.mktemp("api") / "run"
    model, tokenizer = load_model("tiny-dense", overrides=SMALL)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = get_task("add3").dataset("train", 40, 0)
    reward, recorder = DigitShare(), Recorder()
    trainer = GRPOTrainer(model, [reward], train_dataset=datasets.Dataset.from_list(rows), tokenizer=tokenizer,
                          output_dir=str(out), callbacks=[recorder, lambda step, m: "stop" if step == 2 else None],
                          **SETTINGS)
    summary = trainer.train()
    return dict(out=out, model=model, before=before, rows=rows, reward=reward, recorder=recorder, summary=summary,
                trainer=trainer)


def test_trainer_trains_a_model_object_on_a_dataset_with_a_stateful_reward(run):
    # the object itself was trained (in place), and by finite steps
    changed = [k for k, v in run["model"].state_dict().items() if not torch.equal(v.cpu(), run["before"][k])]
    assert len(changed) > 10 and all(torch.isfinite(v).all() for v in run["model"].state_dict().values())
    # the reward instance scored each step's rollout, with the rows' own `answer` column aligned with the prompts
    answers = {r["prompt"]: r["answer"] for r in run["rows"]}
    assert len(training_calls(run["reward"])) == 2
    for call in run["reward"].calls:  # evaluations' calls too
        assert call["answer"] == [answers[p] for p in call["prompts"]]
    # the callback saw each step's metrics line: the reward's own numbers, the loss
    assert [step for step, _ in run["recorder"].steps] == [1, 2]
    for (_, metrics), call in zip(run["recorder"].steps, training_calls(run["reward"])):
        mean = sum(call["values"]) / len(call["values"])
        assert metrics["reward/mean"] == pytest.approx(mean, abs=1e-6)
        assert metrics["reward/DigitShare"] == pytest.approx(mean, abs=1e-6)
        assert math.isfinite(metrics["loss/policy"]) and metrics["ratio/mean"] > 0


def test_a_callback_stop_ends_the_run_like_max_steps(run):
    out, summary = run["out"], run["summary"]
    assert sorted(summary["evals"]) == [0, 2]
    lines = read_metrics(out)
    assert [r["step"] for r in lines] == [0, 1, 2] and "eval/accuracy" in lines[-1]  # the final evaluation
    assert "eval/accuracy" not in run["recorder"].steps[-1][1]  # made after the callback said stop
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-3").exists()
    assert (out / "model" / "config.json").is_file() and summary["model"] == f"{out}/model"


def test_summary_and_plots_as_the_cli_writes_them(run):
    plots = [Path(p) for p in run["summary"]["plots"]]
    assert {"reward.png", "loss.png", "eval.png"} <= {p.name for p in plots}
    assert all(p.parent == run["out"] / "plots" and p.stat().st_size > 1000 for p in plots)
    assert run["summary"]["output_dir"] == str(run["out"]) and run["summary"]["seconds"] > 0


def test_saved_config_names_the_objects(run):
    saved = json.loads((run["out"] / "checkpoint-2" / "train_config.json").read_text())
    assert saved["reward_funcs"] == ["object:test_api:DigitShare(...)"]
    assert saved["model"] == "object:Qwen3ForCausalLM"
    assert (saved["task"], saved["dataset"], saved["objective"]) == (None, "object:train_dataset", "grpo")


def test_resume_without_the_objects_is_one_line_naming_them(run, capsys):
    saved = run["out"] / "checkpoint-2" / "train_config.json"
    # the CLI on the saved config: the model object first
    assert main(["train", "--config", str(saved), "--resume", "latest"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model 'object:Qwen3ForCausalLM' was a Python object given to the trainer" in err
    # from Python with the model and data again but not the reward instance
    model, tokenizer = load_model("tiny-dense", overrides=SMALL)
    trainer = Trainer(model, tokenizer=tokenizer, train_dataset=run["rows"], config=load_config(TrainConfig, saved),
                      resume_from_checkpoint="latest")
    with pytest.raises(ValueError, match=re.escape("reward 'object:test_api:DigitShare(...)' was a Python object "
                                                   "given to the trainer, which a saved config cannot rebuild: pass "
                                                   "the same reward functions again")) as err:
        trainer.train()
    assert "\n" not in str(err.value)
    assert [r["step"] for r in read_metrics(run["out"])] == [0, 1, 2]  # nothing was written


def test_resume_with_the_same_objects_passed_again_continues(run, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(run["out"], out)
    model, tokenizer = load_model("tiny-dense", overrides=SMALL)  # its weights come from the checkpoint
    reward = DigitShare()  # another instance of the same class: the config names the class
    summary = GRPOTrainer(model, [reward], train_dataset=datasets.Dataset.from_list(run["rows"]), tokenizer=tokenizer,
                          output_dir=str(out), resume_from_checkpoint="latest", **{**SETTINGS, "max_steps": 3}).train()
    assert sorted(summary["evals"]) == [0, 2, 3] and len(training_calls(reward)) == 1
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2, 3]
    # other rows under the same name: refused, as a changed data file is
    with pytest.raises(ValueError, match="the data changed since checkpoint-3 was saved: object:train_dataset has 39"):
        GRPOTrainer(model, [reward], train_dataset=run["rows"][1:], tokenizer=tokenizer, output_dir=str(out),
                    resume_from_checkpoint="latest", **{**SETTINGS, "max_steps": 5}).train()


def test_reward_specs_of_functions_instances_and_lambdas():
    def nested(prompts, completions, **_):
        return [0.0] * len(completions)

    assert reward_spec(importable_reward) == "test_api:importable_reward"
    assert get_reward_fn(reward_spec(importable_reward)) is importable_reward  # resumes as before
    assert reward_spec(answer_match) == "gspo.data.rewards:answer_match"
    assert reward_spec(format_reward) == "format"  # its qualname is not importable; its built-in name is
    assert reward_spec(module_lambda) == "object:test_api:<lambda>"
    assert reward_spec(nested) == "object:test_api:test_reward_specs_of_functions_instances_and_lambdas.<locals>.nested"
    assert reward_spec(DigitShare()) == "object:test_api:DigitShare(...)"
    with pytest.raises(ValueError, match=r"^reward 'object:test_api:<lambda>' was a Python object"):
        get_reward_fn("object:test_api:<lambda>")


@pytest.mark.parametrize("field, value, message", [
    ("learning_rate", "abc", "config: learning_rate='abc' has the wrong type: expected float"),
    ("max_steps", 2.5, "config: max_steps=2.5 has the wrong type: expected int"),
    ("bf16", "yes", "config: bf16='yes' has the wrong type: expected bool"),
    ("reward_weights", 3, "config: reward_weights=3 has the wrong type: expected list | None"),
    ("model", None, "config: model may not be null (expected str)"),
    ("seed", True, "config: seed=True has the wrong type: expected int"),
])
def test_train_config_checks_types_when_built(field, value, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        TrainConfig(**{field: value})


def test_train_config_converts_what_it_can():
    cfg = TrainConfig(learning_rate=1, clip_low="3e-4", reward_funcs="format")
    assert (cfg.learning_rate, cfg.clip_low, cfg.reward_funcs) == (1.0, 3e-4, ["format"])
    assert type(cfg.learning_rate) is float


def test_presets_set_the_objective():
    assert GRPOTrainer("tiny-dense").config.objective == "grpo"
    assert GSPOTrainer("tiny-dense", config=TrainConfig(objective="grpo")).config.objective == "gspo"
    assert Trainer("tiny-dense", objective="cispo").config.objective == "cispo"
    assert Trainer(config=TrainConfig(objective="sapo")).config.objective == "sapo"
    with pytest.raises(ValueError, match="GRPOTrainer sets objective='grpo'; use Trainer"):
        GRPOTrainer("tiny-dense", objective="gspo")


def test_trainer_arguments_are_checked_before_training(tmp_path):
    with pytest.raises(ValueError, match="unknown key 'learning_rat'; did you mean 'learning_rate'"):
        Trainer("tiny-dense", learning_rat=1e-5)
    with pytest.raises(ValueError, match="objective='ppo' is not one of"):
        Trainer("tiny-dense", objective="ppo")
    with pytest.raises(ValueError, match=r"train_dataset is a mapping \(a DatasetDict\?\); pass one split"):
        Trainer("tiny-dense", train_dataset=datasets.DatasetDict({"train": datasets.Dataset.from_list([{"a": 1}])}))
    with pytest.raises(ValueError, match=r"callbacks\[0\]=3 has no on_step_end\(step, metrics\) method"):
        Trainer("tiny-dense", callbacks=[3])
    model, _ = load_model("tiny-dense", overrides=SMALL)
    with pytest.raises(ValueError, match="the Qwen3ForCausalLM object has no name_or_path to load its tokenizer"):
        Trainer(model)
    trainer = Trainer("tiny-dense", train_dataset=[{"question": "1+2="}], output_dir=str(tmp_path / "run"), **SETTINGS)
    with pytest.raises(ValueError, match=r"^dataset: object:train_dataset has no 'prompt' column \(columns: question"):
        trainer.train()


@pytest.mark.slow
def test_readme_python_api_example_runs(tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python API"):]
    start = section.index("```python\n") + len("```python\n")
    code = section[start:section.index("\n```", start)]
    assert len(code.splitlines()) <= 15
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    summary, reward = scope["summary"], scope["trainer"].config.reward_funcs[0]
    assert sorted(summary["evals"]) == [0, 2] and reward.calls >= 2  # the instance scored (evaluations call it too)
    assert [r["step"] for r in read_metrics(tmp_path / "runs" / "api")] == [0, 1, 2]
    assert {"reward.png", "loss.png"} <= {Path(p).name for p in summary["plots"]}
    assert all((tmp_path / p).is_file() for p in summary["plots"])
