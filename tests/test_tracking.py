"""Tests for gspo.tracking: metrics.jsonl format, sinks, resume truncation."""

import json
import math
import sys
import types

import numpy as np
import pytest
import torch

from gspo.tracking import MetricsLogger, read_jsonl, truncate_jsonl


def _lines(path):
    return path.read_text(encoding="utf-8").splitlines()


def _strict_loads(line):
    # Python's json accepts NaN/Infinity by default; the file must not contain them.
    def reject(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=reject)


def test_lines_round_trip_exactly(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(0, {"reward/mean": 0.5, "loss/policy": -1.25})
        logger.log(1, {"reward/mean": 0.1, "moe/expert_change_frac/layer_0": 3})
    assert _lines(tmp_path / "metrics.jsonl") == [
        '{"step": 0, "reward/mean": 0.5, "loss/policy": -1.25}',
        '{"step": 1, "reward/mean": 0.1, "moe/expert_change_frac/layer_0": 3.0}',
    ]
    assert read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 0, "reward/mean": 0.5, "loss/policy": -1.25},
        {"step": 1, "reward/mean": 0.1, "moe/expert_change_frac/layer_0": 3.0},
    ]
    # 0.1 survives the text round trip bit for bit (json writes the shortest repr).
    assert read_jsonl(tmp_path / "metrics.jsonl")[1]["reward/mean"] == 0.1


def test_tensors_and_numpy_scalars_become_floats(tmp_path):
    w = torch.tensor(3.0, requires_grad=True)
    loss = w * 0.5  # a 0-d tensor still attached to the graph
    with MetricsLogger(tmp_path) as logger:
        logger.log(7, {
            "loss/policy": loss,                                    # 1.5
            "ratio/mean": torch.tensor([0.25]),                     # one-element 1-d
            "entropy": torch.tensor(1.5, dtype=torch.bfloat16),     # exact in bf16
            "clip/high_frac": np.float32(0.125),
            "completion/mean_len": np.int64(12),
            "eval/accuracy": np.array(0.75),                        # 0-d array
            "groups/zero_std_frac": True,
        })
    (rec,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert rec == {"step": 7, "loss/policy": 1.5, "ratio/mean": 0.25, "entropy": 1.5,
                   "clip/high_frac": 0.125, "completion/mean_len": 12.0, "eval/accuracy": 0.75,
                   "groups/zero_std_frac": 1.0}
    assert all(type(v) is float for k, v in rec.items() if k != "step")


@pytest.mark.parametrize("metrics, match", [
    ({"x": torch.zeros(2)}, r"metric 'x' must be a scalar.*\(2,\)"),
    ({"x": np.zeros((2, 2))}, r"metric 'x' must be a scalar"),
    ({"x": "high"}, r"metric 'x' must be a real number, got str"),
    ({"step": 1.0}, r"other than 'step'"),
    ({"": 1.0}, r"non-empty strings"),
])
def test_bad_metrics_raise(tmp_path, metrics, match):
    with MetricsLogger(tmp_path) as logger, pytest.raises(ValueError, match=match):
        logger.log(0, metrics)


@pytest.mark.parametrize("step", [-1, 1.0, True, "3"])
def test_bad_step_raises(tmp_path, step):
    with MetricsLogger(tmp_path) as logger, pytest.raises(ValueError, match="step must be an int >= 0"):
        logger.log(step, {"x": 1.0})


def test_non_finite_written_as_null_read_as_nan(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(0, {"a": math.nan, "b": math.inf, "c": -math.inf, "d": None,
                       "e": torch.tensor(float("nan")), "f": 2.0})
    (line,) = _lines(tmp_path / "metrics.jsonl")
    assert line == '{"step": 0, "a": null, "b": null, "c": null, "d": null, "e": null, "f": 2.0}'
    _strict_loads(line)
    (rec,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(math.isnan(rec[k]) for k in "abcde") and rec["f"] == 2.0
    # Without the conversion the nulls stay None.
    assert read_jsonl(tmp_path / "metrics.jsonl", null_as_nan=False)[0]["a"] is None


def test_each_log_is_flushed_before_close(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log(3, {"x": 1.0})
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 3, "x": 1.0}]
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(4, {"x": 1.0})


def test_samples_file(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(0, {"x": 1.0})
        assert not (tmp_path / "samples.jsonl").exists()  # created only when samples arrive
        logger.log_samples(0, [{"prompt": "2+2?", "completion": "4", "reward": 1.0},
                               {"prompt": "2+3?", "completion": "6", "reward": None}])
        logger.log_samples(5, [{"prompt": "é", "reward": torch.tensor(0.5), "logps": torch.tensor([-1.0, -0.5]),
                                "adv": float("nan"), "step": 5}])
        with pytest.raises(ValueError, match=r"records\[0\] has step=4"):
            logger.log_samples(5, [{"step": 4}])
        with pytest.raises(ValueError, match=r"records\[0\] is not JSON-serialisable"):
            logger.log_samples(5, [{"obj": object()}])
        with pytest.raises(ValueError, match="list of dicts"):
            logger.log_samples(5, ["text"])
    lines = _lines(tmp_path / "samples.jsonl")
    assert lines == [
        '{"step": 0, "prompt": "2+2?", "completion": "4", "reward": 1.0}',
        '{"step": 0, "prompt": "2+3?", "completion": "6", "reward": null}',
        '{"step": 5, "prompt": "é", "reward": 0.5, "logps": [-1.0, -0.5], "adv": null}',
    ]
    assert read_jsonl(tmp_path / "samples.jsonl", null_as_nan=False)[1]["reward"] is None


def test_disabled_writes_nothing(tmp_path, monkeypatch):
    # Even with tensorboard/wandb requested and not importable: other ranks import nothing.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    run = tmp_path / "run"
    with MetricsLogger(run, tensorboard=True, wandb=True, enabled=False) as logger:
        logger.log(0, {"x": torch.zeros(5)})  # not even validated: no work on other ranks
        logger.log_samples(0, [{"a": 1}])
    assert not run.exists()
    # With an existing run dir, a disabled logger does not truncate or touch it.
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 9, "x": 1.0}\n')
    MetricsLogger(run, enabled=False, truncate_after_step=0).close()
    assert (run / "metrics.jsonl").read_text() == '{"step": 9, "x": 1.0}\n'
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_reopening_appends_and_keeps_earlier_lines(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(0, {"x": 1.0})
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"x": 2.0})
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]


def test_truncate_after_step_keeps_exactly_the_right_lines(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in range(6):
            logger.log(step, {"x": step / 4})
            if step % 2 == 0:
                logger.log_samples(step, [{"c": f"s{step}"}])
        logger.log(2, {"eval/accuracy": 0.5})  # a second line for step 2, logged after step 5
    before = _lines(tmp_path / "metrics.jsonl")
    with MetricsLogger(tmp_path, truncate_after_step=2) as logger:
        assert _lines(tmp_path / "metrics.jsonl") == before[:3] + [before[-1]]
        assert [r["step"] for r in read_jsonl(tmp_path / "samples.jsonl")] == [0, 2]
        logger.log(3, {"x": 9.0})
    assert [(r["step"], r.get("x")) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [
        (0, 0.0), (1, 0.25), (2, 0.5), (2, None), (3, 9.0)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "samples.jsonl"]  # no temp files


def test_truncate_argument_checks(tmp_path):
    with pytest.raises(ValueError, match="truncate_after_step must be None or an int >= 0"):
        MetricsLogger(tmp_path, truncate_after_step=-1)
    with pytest.raises(ValueError, match="after_step must be an int >= 0"):
        truncate_jsonl(tmp_path / "metrics.jsonl", 1.5)
    assert truncate_jsonl(tmp_path / "missing.jsonl", 3) == 0


def test_torn_last_line_is_dropped_before_appending(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "x": 1.0}\n{"step": 1, "x"')  # crash mid-write
    assert read_jsonl(path) == [{"step": 0, "x": 1.0}]
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"x": 2.0})
    assert _lines(path) == ['{"step": 0, "x": 1.0}', '{"step": 1, "x": 2.0}']
    # A complete last line that only lacks its newline is kept.
    path.write_text('{"step": 0, "x": 1.0}')
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"x": 2.0})
    assert _lines(path) == ['{"step": 0, "x": 1.0}', '{"step": 1, "x": 2.0}']


def test_malformed_interior_line_raises(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not valid JSON"):
        read_jsonl(path)
    with pytest.raises(ValueError, match="line 2"):
        truncate_jsonl(path, 0)
    assert path.read_text() == '{"step": 0}\nnot json\n{"step": 1}\n'  # left untouched
    with pytest.raises(FileNotFoundError, match="no such JSONL file"):
        read_jsonl(tmp_path / "nope.jsonl")


def test_tensorboard_missing_package_gives_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"tensorboard=True needs `pip install tensorboard`"):
        MetricsLogger(tmp_path, tensorboard=True)


def test_wandb_missing_package_gives_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"wandb=True needs `pip install wandb`"):
        MetricsLogger(tmp_path, wandb=True)


def test_tensorboard_sink_writes_scalars(tmp_path, monkeypatch):
    calls = []

    class FakeWriter:
        def __init__(self, log_dir, purge_step=None):
            calls.append(("init", log_dir, purge_step))

        def add_scalar(self, tag, value, global_step=None):
            calls.append(("scalar", tag, value, global_step))

        def close(self):
            calls.append(("close",))

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    with MetricsLogger(tmp_path, tensorboard=True, truncate_after_step=4) as logger:
        logger.log(5, {"loss/policy": torch.tensor(0.5), "entropy": 2})
    assert calls == [
        ("init", str(tmp_path / "tensorboard"), 5),  # resume at 4: purge events from step 5 on
        ("scalar", "loss/policy", 0.5, 5),
        ("scalar", "entropy", 2.0, 5),
        ("close",),
    ]


def test_wandb_sink_logs_with_step(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, metrics, step=None):
            calls.append(("log", metrics, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with MetricsLogger(tmp_path, wandb=True, wandb_project="p", run_name="r", config={"lr": 1e-6}) as logger:
        logger.log(2, {"reward/mean": np.float64(0.75)})
    assert calls == [
        ("init", {"project": "p", "name": "r", "config": {"lr": 1e-6}, "dir": str(tmp_path)}),
        ("log", {"reward/mean": 0.75}, 2),
        ("finish",),
    ]
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 2, "reward/mean": 0.75}]  # JSONL always on


# ------------------------------------------------------------------------------- samples of a run
def test_sample_records_hold_each_reward_function_s_value_beside_the_total(tmp_path):
    from gspo.rollout import Rollout
    from gspo.step import sample_records

    ones = torch.ones(3, 4, dtype=torch.long)
    rollout = Rollout(ones, ones, ones[:, 2:].bool(), ["1+1=", "1+1=", "2+2="], ["2", "3", "4"],
                      rewards=torch.tensor([2.0, float("nan"), 0.5]), advantages=torch.tensor([1.0, 0.0, -1.0]))
    per_fn = {"correct": torch.tensor([1.0, float("nan"), 0.0]), "short": torch.tensor([0.5, 0.25, 0.25])}
    records = sample_records(rollout, 2, per_fn)  # the first 2 rows
    assert records[0]["rewards"] == {"correct": 1.0, "short": 0.5} and len(records) == 2
    assert math.isnan(records[1]["rewards"]["correct"]) and records[1]["rewards"]["short"] == 0.25
    with MetricsLogger(tmp_path) as logger:
        logger.log_samples(3, records)
    assert _lines(tmp_path / "samples.jsonl") == [
        '{"step": 3, "prompt": "1+1=", "completion": "2", "reward": 2.0, "rewards": {"correct": 1.0, "short": 0.5}, '
        '"advantage": 1.0}',
        '{"step": 3, "prompt": "1+1=", "completion": "3", "reward": null, "rewards": {"correct": null, '
        '"short": 0.25}, "advantage": 0.0}']


def digit_first(prompts, completions, **_):
    return [float(c[:1].isdigit()) for c in completions]


def brevity(prompts, completions, **_):
    return [1.0 / (1 + len(c)) for c in completions]


def test_a_run_s_samples_hold_each_reward_function_s_value_and_their_weighted_total(tmp_path):
    from conftest import tiny_cfg
    from gspo.trainer import train

    train(tiny_cfg(tmp_path, max_steps=1, eval_num_prompts=0, reward_funcs=[digit_first, brevity],
                   reward_weights=[1.0, 2.0], log_samples_count=8))
    samples = read_jsonl(tmp_path / "run" / "samples.jsonl", null_as_nan=False)
    assert len(samples) == 8 and [s["step"] for s in samples] == [1] * 8
    for s in samples:  # each function's value, as the function gives it for the completion
        expected = {"digit_first": digit_first([], [s["completion"]])[0], "brevity": brevity([], [s["completion"]])[0]}
        assert s["rewards"] == pytest.approx(expected, rel=1e-6)
        assert s["reward"] == pytest.approx(expected["digit_first"] + 2.0 * expected["brevity"], rel=1e-6)
    assert len({s["rewards"]["brevity"] for s in samples}) > 1  # completions of several lengths: not one value
