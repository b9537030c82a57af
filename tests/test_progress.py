"""What a run prints while it runs when stdout is not a terminal (a log file, a batch job)."""

import json

from conftest import TINY_MODEL, read_metrics
from gspo.apps.cli import main

TINY = ["model=tiny-dense", "model_overrides=" + json.dumps(TINY_MODEL), "task=add3", "per_device_batch_size=2",
        "num_generations=2", "num_minibatches=2", "max_completion_length=6", "eval_k=2", "device=cpu",
        "log_samples_steps=0", "output_dir=out"]


def test_train_without_a_terminal_prints_its_phases_and_a_metrics_line_every_logging_steps(tmp_path, monkeypatch,
                                                                                            capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "max_steps=5", "logging_steps=2", "eval_num_prompts=3"]) == 0  # capsys: no tty
    out, err = capsys.readouterr()
    lines = err.splitlines()
    steps = [line for line in lines if line.startswith("train step ")]
    assert [line.split()[2] for line in steps] == ["2/5", "4/5", "5/5"]  # every 2 steps, and the last
    assert "reward/mean" in steps[0] and "eval/accuracy" in steps[-1]  # the run evaluated at its end
    assert "eval/accuracy" not in steps[0]
    loading = lines.index("gspo: loading model tiny-dense ...")
    evaluating = [i for i, line in enumerate(lines) if line == "gspo: evaluating 3 prompts x (greedy + 2 samples) ..."]
    assert len(evaluating) == 2 and loading < evaluating[0] < lines.index(steps[0]) < evaluating[1]
    assert any(line.startswith("gspo: sampler: gspo") for line in lines)  # which sampler, and why
    assert set(json.loads(out)["evals"]) == {"0", "5"}  # stdout keeps the summary alone


def test_evaluation_off_is_said_and_logs_no_eval_metrics(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "max_steps=2", "eval_num_prompts=0", "eval_steps=1"]) == 0
    out, err = capsys.readouterr()
    assert "gspo: evaluation off (eval_num_prompts=0)" in err.splitlines()
    assert "evaluating" not in err
    records = read_metrics(tmp_path / "out")
    assert [r["step"] for r in records] == [1, 2]  # nothing before training
    assert not [key for r in records for key in r if key.startswith("eval/")]
    assert json.loads(out)["evals"] == "off (no held-out prompts)"
