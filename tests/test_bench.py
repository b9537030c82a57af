"""`gspo bench` (gspo/apps/bench.py): the FLOP count by hand, the phases from the trainer's clocks, the command."""

import json

import pytest

from conftest import TINY_MODEL
from gspo.apps.bench import _forwards_per_phase, bench, format_bench, forward_flops, matmul_params
from gspo.apps.cli import main
from gspo.config import TrainConfig, make_config
from gspo.models import load_model

RUN = dict(model="tiny-dense", model_overrides=TINY_MODEL, task="add3", per_device_batch_size=2, num_generations=2,
           num_minibatches=2, max_completion_length=8, device="cpu")


def test_forward_flops_by_hand():
    # l = 3: matmuls 2 * 10 * 3 = 60; attention 2 layers * 4 * 1 head * 4 dims * (3 * 4 / 2 = 6 query-key pairs) = 192
    assert forward_flops([3], p_mm=10, layers=2, heads=1, head_dim=4) == 252
    assert forward_flops([3, 1], p_mm=10, layers=2, heads=1, head_dim=4) == 252 + 20 + 32


def test_matmul_params_count_the_tied_head_once_and_skip_the_embedding_lookup():
    model, _ = load_model("tiny-dense", overrides=TINY_MODEL)
    assert model.config.tie_word_embeddings
    V, H, I, L = model.config.vocab_size, 32, 64, 1  # TINY_MODEL: 1 layer of hidden 32, MLP 64, 2 heads / 1 kv of 16
    attention = H * 2 * 16 + 2 * H * 16 + 2 * 16 * H  # q (2 heads), k and v (1 head), o
    mlp = 3 * H * I
    assert matmul_params(model) == L * (attention + mlp) + V * H


def test_forwards_per_phase_by_hand():
    def forwards(**kw):
        return _forwards_per_phase(make_config(TrainConfig, {**RUN, **kw}))

    assert forwards(num_minibatches=4) == {"generate": 1, "rewards + pi_old/pi_ref + advantages": 0.75,
                                           "train (updates)": 3, "whole step": 4.75}
    assert forwards(num_minibatches=4, kl_coef=0.1, num_epochs=2)["rewards + pi_old/pi_ref + advantages"] == 1.75
    assert forwards(num_minibatches=4, num_epochs=2)["train (updates)"] == 6
    assert forwards(use_sampler_logprobs=True)["rewards + pi_old/pi_ref + advantages"] == 0


def test_bench_reports_the_trainers_phases_and_their_utilisation(tmp_path):
    cfg = make_config(TrainConfig, {**RUN, "output_dir": str(tmp_path / "kept")})
    result = bench(cfg, steps=2, skip_first=1, peak_seconds=0.05, matmul_n=256)
    assert result["timed_steps"] == 1 and not (tmp_path / "kept").exists()  # nothing written where the config says
    phases = result["phases"]
    parts = sum(phases[p]["s_per_step"]
                for p in ("generate", "rewards + pi_old/pi_ref + advantages", "train (updates)"))
    assert phases["whole step"]["s_per_step"] == pytest.approx(parts)  # one timed step: the medians add up
    model, _ = load_model("tiny-dense", overrides=TINY_MODEL)
    l = result["mean_prompt_len"] + result["mean_completion_len"]
    one = forward_flops([l] * 4, matmul_params(model), 1, 2, 16) / 1e9  # one forward of the step's 4 sequences
    assert phases["generate"]["model_gflop_per_step"] == pytest.approx(one)
    assert phases["train (updates)"]["model_gflop_per_step"] == pytest.approx(3 * one)
    assert phases["rewards + pi_old/pi_ref + advantages"]["model_gflop_per_step"] == pytest.approx(0.5 * one)
    for v in phases.values():
        assert v["s_per_step"] > 0 and 0 < v["of_peak"] < 1
        assert v["gflop_per_s"] == pytest.approx(v["model_gflop_per_step"] / v["s_per_step"])
    assert result["tokens_per_s"] > 0 and result["mean_prompt_len"] == 8
    assert "whole step" in format_bench(result)


def test_bench_command_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    overrides = [f"{k}={json.dumps(v)}" for k, v in RUN.items()]
    assert main(["bench", *overrides, f"output_dir={tmp_path / 'run'}", "--steps", "2", "--peak-seconds", "0.05",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "completion tokens/s" in printed and "train (updates)" in printed
    assert json.loads(out.read_text())["timed_steps"] == 1
    assert main(["bench", *overrides, "--steps", "1", "--skip-first", "1"]) == 2  # nothing left to time
    assert "need steps >= 1 and 0 <= skip_first < steps" in capsys.readouterr().err
