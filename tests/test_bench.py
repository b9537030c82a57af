"""`gspo bench` (gspo/apps/bench.py): the FLOP count by hand, the phases from the trainer's clocks, the command."""

import json

import pytest
import torch

from conftest import TINY_MODEL
from gspo.apps.bench import (
    _forwards_per_phase,
    bench,
    compute_dtypes,
    format_bench,
    forward_flops,
    matmul_params,
    read_bandwidths,
    sampling_flops,
    sampling_read_bytes,
)
from gspo.apps.cli import main
from gspo.config import TrainConfig, make_config
from gspo.models import load_model

RUN = dict(model="tiny-dense", model_overrides=TINY_MODEL, task="add3", per_device_batch_size=2, num_generations=2,
           num_minibatches=2, max_completion_length=8, device="cpu")


def test_forward_flops_by_hand():
    # l = 3: matmuls 2 * 10 * 3 = 60; attention 2 layers * 4 * 1 head * 4 dims * (3 * 4 / 2 = 6 query-key pairs) = 192
    assert forward_flops([3], p_mm=10, layers=2, heads=1, head_dim=4) == 252
    assert forward_flops([3, 1], p_mm=10, layers=2, heads=1, head_dim=4) == 252 + 20 + 32


def test_sampling_flops_count_a_groups_prompt_once():
    # 4 sequences of prompt 1 + completion 2 (l = 3: 252 each, as above), 2 per prompt: the prompt's forward (l = 1:
    # 2 * 10 + 32 * 1 = 52) is left out for 2 of the 4 rows; one per prompt (group 1): every forward counts
    shape = (10, 2, 1, 4)
    assert sampling_flops(4, 2, 1.0, 2.0, *shape) == 4 * 252 - 2 * 52
    assert sampling_flops(4, 1, 1.0, 2.0, *shape) == 4 * 252


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


def test_the_reference_dtype_of_each_phase_follows_the_config():
    # The peak a phase is held to is the matmul rate in the dtype it computes in: autocast's where bf16/fp16 is
    # on (every policy forward, sampling included), else the weights', sampling from a sampler_dtype copy in that.
    def dtypes(weights=torch.float32, **kw):
        got = compute_dtypes(make_config(TrainConfig, {**RUN, **kw}), weights)
        return [str(got[p]).removeprefix("torch.") for p in ("generate", "rewards + pi_old/pi_ref + advantages",
                                                              "train (updates)")]

    assert dtypes() == ["float32"] * 3
    assert dtypes(bf16=True) == ["bfloat16"] * 3
    assert dtypes(fp16=True) == ["float16"] * 3
    assert dtypes(sampler_dtype="bfloat16") == ["bfloat16", "float32", "float32"]
    assert dtypes(torch.bfloat16, dtype="bfloat16") == ["bfloat16"] * 3
    assert dtypes(bf16=True, sampler_dtype="float16") == ["bfloat16"] * 3  # the copy is cast by the autocast


def test_sampling_read_bytes_by_hand():
    # 2 sequences, prompt 3, completion 4 (3 decode steps after the prefill's token), 4 forwards of 100 weight bytes:
    # 400; keys and values: steps see 3+1, 3+2, 3+3 tokens = 15 per sequence, 30 in all, each 2 (K, V) * 2 layers *
    # 1 kv head * 8 dims * 2 bytes = 64 bytes: 1920.
    shape = dict(weight_bytes=100, layers=2, kv_heads=1, head_dim=8, kv_itemsize=2)
    assert sampling_read_bytes(2, 3.0, 4.0, 4, **shape) == 2320
    assert sampling_read_bytes(2, 3.0, 1.0, 1, **shape) == 100


def test_read_bandwidth_is_a_rate_of_bytes():
    rates = read_bandwidths(1 << 20, 0.05, windows=3)
    assert len(rates) == 3 and all(1e8 < r < 1e13 for r in rates)  # 0.1 GB/s .. 10 TB/s: bytes per second


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
    prompt = forward_flops([result["mean_prompt_len"]], matmul_params(model), 1, 2, 16) / 1e9
    assert phases["generate"]["model_gflop_per_step"] == pytest.approx(one - 2 * prompt)  # 2 prompts x 2: 2 shared
    assert phases["train (updates)"]["model_gflop_per_step"] == pytest.approx(3 * one)
    assert phases["rewards + pi_old/pi_ref + advantages"]["model_gflop_per_step"] == pytest.approx(0.5 * one)
    assert phases["whole step"]["model_gflop_per_step"] == pytest.approx(4.5 * one - 2 * prompt)  # the phases'
    for v in phases.values():
        assert v["s_per_step"] > 0 and 0 < v["of_peak"] < 1 and v["dtype"] == "float32"
        assert v["gflop_per_s"] == pytest.approx(v["model_gflop_per_step"] / v["s_per_step"])
    assert list(result["peak_matmul_gflop_per_s"]) == ["float32"]
    generate, read = phases["generate"], result["read_gb_per_s"]
    assert generate["roofline_s"] == pytest.approx(generate["gb_read_per_step"] / max(read["before"], read["after"]))
    assert generate["of_roofline"] == pytest.approx(generate["roofline_s"] / generate["s_per_step"])
    peak = max(result["peak_matmul_gflop_per_s"]["float32"].values())
    assert generate["compute_s"] == pytest.approx(generate["model_gflop_per_step"] / peak)
    bound = max(generate["roofline_s"], generate["compute_s"])  # the slower of bytes and FLOPs bounds sampling
    assert generate["bound"] == ("memory" if bound == generate["roofline_s"] else "compute")
    assert generate["of_bound"] == pytest.approx(bound / generate["s_per_step"]) and 0 < generate["of_bound"] < 1
    weights = 4 * matmul_params(model)  # float32, read once per forward: at least once (the prefill)
    assert weights / 1e9 <= generate["gb_read_per_step"] <= weights * 8 / 1e9 + 1e-3  # T = 8 forwards at most
    assert result["tokens_per_s"] > 0 and result["mean_prompt_len"] == 8
    assert "whole step" in format_bench(result) and "of the bandwidth roofline" in format_bench(result)


def test_bench_under_bf16_holds_every_phase_to_the_bf16_peak(tmp_path):
    cfg = make_config(TrainConfig, {**RUN, "bf16": True, "output_dir": str(tmp_path / "kept")})
    result = bench(cfg, steps=2, skip_first=1, peak_seconds=0.05, matmul_n=128)
    assert list(result["peak_matmul_gflop_per_s"]) == ["bfloat16"] and result["sampler_weights_dtype"] == "float32"
    peak = max(result["peak_matmul_gflop_per_s"]["bfloat16"].values())
    for v in result["phases"].values():
        assert v["dtype"] == "bfloat16" and v["of_peak"] == pytest.approx(v["gflop_per_s"] / peak)


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
