"""The `gspo` command run for real in subprocesses, and the shipped configs."""

import dataclasses
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, SMALL_MOE, TINY_MODEL, TINY_RUN, gspo_env, logged_steps, read_metrics, run_gspo
from gspo.config import SFTConfig, TrainConfig, field_docs, load_config
from gspo.models import PACKAGED
from gspo.sft import sft
from gspo.trainer import train

TINY_OVERRIDES = "model_overrides=" + json.dumps(TINY_MODEL)  # JSON is YAML: one command-line override


@pytest.mark.slow
def test_train_from_yaml_with_override_and_plot_and_eval(tmp_path):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({**TINY_RUN, "max_steps": 3, "output_dir": "out"}))
    done = run_gspo("train", "--config", "run.yaml", "max_steps=2", "objective=grpo", "learning_rate=1e-3",
                    cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records = read_metrics(tmp_path / "out")
    assert [r["step"] for r in records] == [0, 1, 2]  # the override won over the file's 3 steps
    assert records[1]["lr"] == pytest.approx(1e-3)  # "1e-3" is a string to YAML 1.1: read as the float
    config = json.loads((tmp_path / "out" / "model" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    summary = json.loads(done.stdout)
    assert any(p.endswith("eval.png") for p in summary["plots"])

    done = run_gspo("plot", "out", cwd=tmp_path)
    assert done.returncode == 0 and all(Path(tmp_path, p).is_file() for p in done.stdout.split())

    done = run_gspo("eval", "--model", "out/model", "--task", "add3", "--num-prompts", "3", "--k", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result) == {"eval/accuracy", "eval/reward", "eval/mean_at_k", "eval/pass_at_k", "eval/sampled_reward"}
    assert 0 <= result["eval/pass_at_k"] <= 1


def test_exponent_floats_in_files_and_overrides_are_numbers(tmp_path):
    # YAML 1.1 (PyYAML) reads 1e-3 as the string "1e-3" (it wants 1.0e-3); the loader makes it the number.
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 1e-3\nkl_coef: 5E-2\n")
    cfg = load_config(TrainConfig, path, ["clip_high=3e-1"])
    assert (cfg.learning_rate, cfg.kl_coef, cfg.clip_high) == (1e-3, 5e-2, 3e-1)
    assert all(type(v) is float for v in (cfg.learning_rate, cfg.kl_coef, cfg.clip_high))


def test_exponent_floats_inside_lists_are_numbers(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("reward_funcs: [answer_match, format]\nreward_weights: [1e-1, 2]\nprompt_column: '1e3'\n")
    cfg = load_config(TrainConfig, path)
    assert cfg.reward_weights == [0.1, 2] and type(cfg.reward_weights[0]) is float
    assert cfg.prompt_column == "1e3"  # quoted: a string stays a string


def test_train_help_lists_every_field_with_its_doc():
    done = run_gspo("train", "--help", cwd=ROOT)
    assert done.returncode == 0
    docs = field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        assert f"  {f.name} (" in done.stdout, f.name
    assert "Prompts per rollout batch (B)." in done.stdout and docs["num_generations"].startswith("Completions")


@pytest.mark.slow
def test_bad_override_is_one_clear_line(tmp_path):
    done = run_gspo("train", "learning_rat=1e-5", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "gspo train: error: config: unknown key 'learning_rat'; did you mean 'learning_rate'?"
    done = run_gspo("train", "num_minibatches=3", cwd=tmp_path)
    assert "is not divisible by num_minibatches=3" in done.stderr and done.returncode == 2
    done = run_gspo("train", "model=runs/nothing/here", "max_steps=1", cwd=tmp_path)
    assert done.returncode == 2 and "no such directory" in done.stderr


@pytest.mark.slow
def test_sft_command_saves_a_model(tmp_path):
    # No warmup and a high rate: one update visibly lowers the loss on the same 8 demonstrations.
    done = run_gspo("sft", "model=tiny-dense", "num_examples=8", "max_steps=2", "batch_size=4", "eval_steps=1",
                    "eval_num_prompts=2", "output_dir=sft", "progress=false", "learning_rate=1e-2", "warmup_steps=0",
                    TINY_OVERRIDES, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["steps"] == 2
    records = read_metrics(tmp_path / "sft")
    assert [r["step"] for r in records] == [1, 2]
    first, second = (r["loss/sft"] for r in records)
    assert first > 4.0 and second < first - 0.2, (first, second)  # from about ln(81) = 4.39 (measured: 4.35, 3.99)
    assert (tmp_path / "sft" / "model" / "model.safetensors").is_file()
    card = (tmp_path / "sft" / "model" / "README.md").read_text()  # the model card, with the held-out score
    assert "supervised fine-tuning, 2 steps" in card and "| eval/accuracy | " in card and "Train rows: 8" in card


def test_every_field_is_documented():
    for cls in (TrainConfig, SFTConfig):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, (cls.__name__, missing)


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("lab_")),
                         ids=lambda p: p.name)  # lab configs: tests/test_regimes.py
def test_shipped_configs_validate_and_run_one_step(path, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # their data and reward files are named relative to the repository's root
    cls = SFTConfig if "sft" in path.name else TrainConfig
    cfg = load_config(cls, path)
    if cls is TrainConfig:
        assert cfg.model.startswith("runs/") or cfg.model in PACKAGED, "RL configs start from a cold-start model " \
                                                                       "or a real pretrained one"
        # Same config, with a tiny preset standing in for the cold-start model, runs a step.
        small = dataclasses.replace(cfg, **{**TINY_RUN, "per_device_batch_size": cfg.num_minibatches, "max_steps": 1,
                                            "output_dir": str(tmp_path / "run")})
        train(small)
        assert logged_steps(tmp_path / "run") == [0, 1]
    else:  # an SFT config runs a step too, a tiny model of its preset standing in (its data, task and length)
        tiny = {"tiny-dense": TINY_MODEL, "tiny-moe": SMALL_MOE}[cfg.model]
        small = dataclasses.replace(cfg, model_overrides=tiny, num_examples=8, batch_size=4, max_steps=1,
                                    eval_num_prompts=2, progress=False, output_dir=str(tmp_path / "sft"))
        sft(small)
        assert [r["step"] for r in read_metrics(tmp_path / "sft")] == [1]
        assert (tmp_path / "sft" / "model" / "model.safetensors").is_file()


@pytest.mark.slow
def test_the_own_task_config_resolves_its_data_and_reward_and_runs_with_a_tiny_model_in_its_place(tmp_path,
                                                                                                 monkeypatch):
    from gspo.config import DataSettings, EpisodeSettings, RewardSettings, TaskSettings, section
    from gspo.data.rewards import get_reward_fn
    from gspo.data.source import preflight

    monkeypatch.chdir(ROOT)  # as the config says to run it
    cfg = load_config(TrainConfig, "configs/own_task_smollm2.yaml")
    assert cfg.model == "smollm2" and cfg.model in PACKAGED and (cfg.max_steps, cfg.per_device_batch_size) == (2, 2)
    preflight(*(section(cfg, cls) for cls in (DataSettings, RewardSettings, TaskSettings, EpisodeSettings)),
              note=pytest.fail)  # the file is there, the reward's `capital` column too; no note of a default reward
    reward = get_reward_fn(cfg.reward_funcs[0])
    said = [[{"role": "assistant", "content": text}] for text in ("It is paris.", "Lyon", "Buenos Aires!")]
    assert reward(prompts=[[]] * 3, completions=said, capital=["Paris", "Paris", "Buenos Aires"]) == [1.0, 0.0, 1.0]
    done = run_gspo("train", "--config", "configs/own_task_smollm2.yaml", "model=tiny-dense", TINY_OVERRIDES,
                    f"output_dir={tmp_path / 'run'}", "progress=false", "device=cpu", cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "eval: holding out 4 of 24 rows of examples/own_task/capitals.jsonl (eval_holdout=4)" in done.stderr
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2] and "reward/names_the_capital" in records[1]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["objective=ppo"], "objective='ppo' is not one of gspo, grpo"),
        (["learning_rate=abc"], "learning_rate='abc' has the wrong type: expected float"),
        (["num_generations=1"], "num_generations must be >= 2"),
        (["per_device_batch_size=1", "num_generations=2"], "per_device_batch_size * num_generations = 2 is not "
         "divisible by num_minibatches=4: set num_minibatches=2 (or another divisor of 2), or per_device_batch_size "
         "to a multiple of 2"),
        (["reward_funcs=[a, b]", "reward_weights=[1.0]"], "reward_weights has 1 entries but reward_funcs has 2"),
        (["objective=gspo", "aggregation=token_mean"], "would weight gspo sequences by length"),
        (["top_p=0.9", "use_sampler_logprobs=true"], "use_sampler_logprobs with top_p=0.9 would train on the "
                                                     "log-probs of a reshaped distribution"),
        (["min_p=0.1", "repetition_penalty=1.2", "seeded_sampling=true"],
         "seeded_sampling draws from the full softmax; min_p=0.1, repetition_penalty=1.2 reshape it"),
        (["min_p=1.0"], "min_p=1.0 must be in"),
        (["repetition_penalty=0"], "repetition_penalty"),
        (["task=null"], "set `task`"),
        (["routing_replay=always"], "routing_replay='always' is not one of none, old_policy, rollout"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(TrainConfig, None, overrides)


@pytest.mark.slow
def test_moe_replay_through_the_cli(tmp_path):
    small_moe = ("model_overrides={num_hidden_layers: 2, hidden_size: 32, moe_intermediate_size: 16, "
                 "num_attention_heads: 2, num_key_value_heads: 1, head_dim: 16}")
    common = ["max_steps=1", "per_device_batch_size=2", "num_generations=2", "num_minibatches=2",
              "max_completion_length=6", "eval_num_prompts=2", "eval_k=2", "progress=false", "output_dir=out"]
    done = run_gspo("train", "model=tiny-moe", small_moe, "routing_replay=rollout", *common, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    step1 = read_metrics(tmp_path / "out")[1]
    assert 0 <= step1["moe/expert_change_frac"] <= 1 and "moe/expert_change_frac/layer_1" in step1
    assert "moe/replay_mismatch_frac" in step1
    done = run_gspo("train", "model=tiny-dense", "routing_replay=old_policy", *common, "output_dir=dense",
                    cwd=tmp_path)
    assert done.returncode == 2 and "routing replay needs a Mixture-of-Experts model" in done.stderr


def test_demo_flags_of_the_real_model_are_refused_without_it_and_unknown_models_named(capsys, tmp_path):
    from gspo.apps.cli import main

    assert main(["demo", "--lora", "--output-dir", str(tmp_path / "a")]) == 2
    assert "--lora, --smoke, --rollout-correction and --precision go with --model" in capsys.readouterr().err
    assert main(["demo", "--rollout-correction", "token_tis", "--output-dir", str(tmp_path / "a")]) == 2
    assert "--rollout-correction and --precision go with --model" in capsys.readouterr().err
    assert main(["demo", "--precision", "fp32", "--output-dir", str(tmp_path / "a")]) == 2
    assert "--precision go with --model" in capsys.readouterr().err
    assert main(["demo", "--model", "gpt5", "--output-dir", str(tmp_path / "b")]) == 2
    assert "unknown packaged model 'gpt5'; known: smollm2" in capsys.readouterr().err
    assert main(["demo", "--tools", "--objective", "grpo", "--output-dir", str(tmp_path / "c")]) == 2
    assert "--tools runs its own tiny model with GSPO" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()  # refused before anything was written


def test_gspo_demo_takes_the_resume_its_stop_message_names(capsys, tmp_path):
    from gspo.apps.cli import build_parser, main, parse_args
    from gspo.runtime import TrainingInterrupted

    said = str(TrainingInterrupted(signal.SIGINT, 5, Path("runs/demo/rl/checkpoint-5")))
    hint = said.split("continue with ")[1]
    assert hint == "--resume latest"
    for how in ([], ["--tools"], ["--model", "smollm2"]):  # each demo takes it, as `gspo train` does
        args = parse_args(build_parser(), ["demo", *how, *hint.split()])
        assert args.resume == "latest" and parse_args(build_parser(), ["train", *hint.split()]).resume == "latest"
    assert parse_args(build_parser(), ["demo"]).resume is None
    elsewhere = str(tmp_path / "other" / "rl" / "checkpoint-3")  # not one of the tool demo's two runs
    assert main(["demo", "--tools", "--resume", elsewhere, "--output-dir", str(tmp_path / "c")]) == 2
    assert f"--resume {elsewhere}: not a checkpoint of this demo's runs" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()  # refused before anything was written


CTRL_C_AFTER = [1]  # the demo test's Ctrl-C: training steps scored before it; [] once it was sent


def digits_then_ctrl_c(prompts, completions, **_):
    """starts_with_digit's reward; sends this process one SIGINT as the second training step is scored (its 4
    completions: the evaluations score 2 at a time)."""
    if len(completions) == 4 and CTRL_C_AFTER:
        CTRL_C_AFTER[0] -= 1
        if CTRL_C_AFTER[0] < 0:
            CTRL_C_AFTER.clear()
            signal.raise_signal(signal.SIGINT)
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


@pytest.mark.slow
def test_a_demo_stopped_by_ctrl_c_resumes_with_its_cold_start_and_its_rl_checkpoint(tmp_path, capsys):
    from gspo.apps.demo import run_demo
    from gspo.runtime import TrainingInterrupted

    sft = dict(model_overrides=TINY_MODEL, num_examples=16, max_steps=2, batch_size=4, eval_steps=1,
               eval_num_prompts=2, eval_batch_size=2, max_completion_length=6, progress=False)
    rl = dict(max_steps=3, per_device_batch_size=2, num_generations=2, num_minibatches=2, max_completion_length=6,
              eval_num_prompts=2, eval_batch_size=2, eval_k=1, eval_steps=0, log_samples_steps=0, progress=False,
              warmup_steps=0, reward_funcs=[digits_then_ctrl_c], device="cpu")
    out = tmp_path / "demo"
    with pytest.raises(TrainingInterrupted, match="SIGINT after step 1; .*continue with --resume latest"):
        run_demo(str(out), sft_overrides=sft, rl_overrides=rl)  # Ctrl-C as step 2 is scored: step 1 is kept
    assert logged_steps(out / "rl") == [0, 1] and (out / "rl" / "checkpoint-1").is_dir()
    sft_model = (out / "sft" / "model" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    summary = run_demo(str(out), resume="latest", sft_overrides=sft, rl_overrides=rl)
    said = capsys.readouterr()
    assert "[1/3] cold start: done before (2 SFT steps" in said.out and "(resumed: latest)" in said.out
    assert f"resume: continuing from {out / 'rl' / 'checkpoint-1'} (after step 1)" in said.err
    assert (out / "sft" / "model" / "model.safetensors").stat().st_mtime_ns == sft_model  # not trained again
    assert logged_steps(out / "rl") == [0, 1, 2, 3] and summary["sft_steps"] == 2
    assert summary["before_rl"] == {k: v for k, v in read_metrics(out / "rl")[0].items() if k != "step"}


# ------------------------------------------------------------------------------- gspo eval
EVAL_REWARDS = '''
CALLS = []


def counted(prompts, completions, target, **_):
    CALLS.append(len(completions))
    return [float(t in c) for c, t in zip(completions, target)]


def fails_on_bad(prompts, completions, target, **_):
    if "bad" in target:
        raise ValueError("a bad target")
    return [0.0] * len(completions)
'''


@pytest.fixture
def eval_run(tmp_path, monkeypatch):
    """A run's config (tiny model, a reward reading the `target` column) and a 7-row data file, in the working
    directory; yields the reward module's record of how many completions each call scored."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the reward file's folder is added: taken back after
    (tmp_path / "eval_rewards.py").write_text(EVAL_REWARDS)
    rows = [{"prompt": f"{i}+{i}=", "target": "bad" if i == 5 else str(2 * i)} for i in range(7)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {**TINY_RUN, "task": None, "dataset": "d.jsonl", "reward_funcs": ["eval_rewards.py:counted"]}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    yield lambda: sys.modules["eval_rewards"].CALLS
    sys.modules.pop("eval_rewards", None)


def gspo_eval(capsys, *args) -> tuple[int, dict, str]:
    """`gspo eval --config run.yaml <args>` in this process: (exit status, the scores printed, stderr)."""
    from gspo.apps.cli import main

    capsys.readouterr()
    status = main(["eval", "--config", "run.yaml", *args])
    out, err = capsys.readouterr()
    return status, json.loads(out) if status == 0 else {}, err


def test_eval_scores_every_row_of_the_file_it_is_given_with_the_run_s_rewards(capsys, eval_run):
    status, scores, err = gspo_eval(capsys, "--dataset", "d.jsonl")
    assert status == 0, err
    assert eval_run() == [7, 14]  # every row, greedy then the config's eval_k=2 samples each: none held out
    assert "eval: every one of the 7 rows of d.jsonl" in err and 0 <= scores["eval/pass_at_k"] <= 1
    status, _, err = gspo_eval(capsys, "--dataset", "d.jsonl", "--num-prompts", "3", "--k", "2")
    assert status == 0 and eval_run()[2:] == [3, 6] and "eval: the first 3 of the 7 rows of d.jsonl" in err
    status, _, err = gspo_eval(capsys)  # no file given: the held-out rows the run evaluates, and which
    assert status == 0 and eval_run()[4:] == [1, 2]
    assert "eval: holding out 1 of 7 rows of d.jsonl (eval_holdout=0.1)" in err


def test_eval_takes_overrides_and_checks_the_rewards_before_loading_the_model(capsys, eval_run):
    status, _, err = gspo_eval(capsys, "--dataset", "d.jsonl", "--model", "runs/no/such/model",
                               "reward_funcs=[answer_match]")
    assert status == 2 and err.splitlines()[-1] == ("gspo eval: error: dataset: d.jsonl: reward 'answer_match' "
                                                    "needs column 'answer'; columns: prompt, target")
    assert "d.jsonl is scored by answer_match, the default reward_funcs" in err
    status, _, err = gspo_eval(capsys, "--dataset", "d.jsonl", "reward_funcs=[eval_rewards.py:fails_on_bad]")
    assert status == 2 and "raised ValueError: a bad target on sample 5" in err and "drop_bad_rewards=true" in err
    status, scores, err = gspo_eval(capsys, "--dataset", "d.jsonl", "reward_funcs=[eval_rewards.py:fails_on_bad]",
                                    "drop_bad_rewards=true")  # what the message says to set
    assert status == 0 and scores["eval/reward"] == 0.0, err


def test_eval_needs_a_model_or_a_config(capsys):
    from gspo.apps.cli import main

    assert main(["eval", "--task", "add3"]) == 2
    assert "give --model (a saved model directory, a preset or a packaged model) or --config" in \
        capsys.readouterr().err


# ------------------------------------------------------------------------------- the lab extra (matplotlib)
NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None  # as if it were not installed\n"
MISSING = "plots need matplotlib, which is not installed: pip install 'gspo[lab]'"


def python_c(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=gspo_env(), capture_output=True, text=True,
                          timeout=300)


def test_train_imports_neither_the_lab_nor_matplotlib():
    code = ("import contextlib, io, sys\n"
            "from gspo.apps import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    cli.main(['train', '--help'])\n"
            "import gspo.apps.api, gspo.report, gspo.trainer  # what `gspo train` runs\n"
            "loaded = sorted(m for m in sys.modules\n"
            "                if m.split('.')[0] == 'matplotlib' or m.startswith('gspo.apps.lab'))\n"
            "assert 'gspo.trainer' in sys.modules and loaded == [], loaded\n"
            "print('clean')\n")
    done = python_c(code, ROOT)
    assert (done.returncode, done.stdout) == (0, "clean\n"), done.stderr[-2000:]


def test_lab_help_lists_the_lab_fields(capsys):
    from gspo.apps.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["lab", "--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and "pip install 'gspo[lab]'" in out
    assert "  sft_target_accuracy (float, default 0.4)" in out and "Greedy held-out accuracy at which" in out


def test_plot_and_lab_without_matplotlib_fail_in_one_line_naming_the_fix(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 0.5}\n')
    code = NO_MATPLOTLIB + ("from gspo.apps.cli import main\n"
                            "for argv in (['plot', 'run'], ['lab', '--report-only', 'output_dir=lab'], "
                            "['lab', '--quick', 'output_dir=lab']):\n"
                            "    print(main(argv))\n")
    done = python_c(code, tmp_path)
    assert done.stdout.split() == ["2", "2", "2"], done.stderr[-2000:]
    assert done.stderr.splitlines() == [f"gspo plot: error: {MISSING}", f"gspo lab: error: {MISSING}",
                                        f"gspo lab: error: {MISSING}"]
    assert not (tmp_path / "lab").exists() and not (tmp_path / "run" / "plots").exists()  # refused before any run


@pytest.mark.slow
def test_train_without_matplotlib_finishes_and_says_the_plots_were_skipped(tmp_path):
    overrides = [f"{k}={json.dumps(v)}" for k, v in {**TINY_RUN, "max_steps": 1, "output_dir": "out"}.items()]
    code = NO_MATPLOTLIB + f"from gspo.apps.cli import main\nsys.exit(main(['train', *{overrides!r}]))\n"
    done = python_c(code, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["plots"] == [] and logged_steps(tmp_path / "out") == [0, 1]
    skipped = [line for line in done.stderr.splitlines() if "plots" in line]
    assert skipped == ["plots skipped: matplotlib is not installed; pip install 'gspo[lab]', then `gspo plot out` "
                       "draws them"]
    assert not (tmp_path / "out" / "plots").exists()

