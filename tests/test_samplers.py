"""Samplers that are not pi_old (gspo/rollout/policy.py: PolicySampler): a low-precision copy of the weights
(sampler_dtype) and stale weights (sampler_lag), measured with gspo/algo/correction.py; the sections a sampler is
built from (gspo/rollout/sampler.py) and the registry it picks its generator from (gspo/rollout/registry.py)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import read_metrics, starts_with_digit, tiny_cfg
from gspo.algo.correction import mismatch_metrics, mismatch_moments
from gspo.algo.logprobs import completion_logprobs
from gspo.models import seeded_model
from gspo.rollout import PolicySampler, Sampler, SamplerShape, sampler_sections
from gspo.trainer import train

PROMPTS = ["1+2+3=", "4+0+5=", "7+7+1="]


def built(tmp_path, **kw):
    cfg = tiny_cfg(tmp_path, num_generations=4, max_completion_length=16, temperature=1.0, **kw)
    _, model, tokenizer = seeded_model(cfg)
    return cfg, model, tokenizer


def trainer_logprobs(model, rollout) -> torch.Tensor:
    with torch.no_grad():
        logp, _ = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.completion_len)
    return logp  # (N, T)


def mismatch(model, rollout) -> dict:
    moments, _ = mismatch_moments(trainer_logprobs(model, rollout), rollout.sampler_logprobs, rollout.completion_mask)
    return mismatch_metrics(moments)


def step_weights(model, seed: int) -> dict:
    """A stand-in for an optimizer step: nudge every weight; returns a copy of the new weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_without_dtype_or_lag_the_sampler_is_the_policy(tmp_path):
    cfg, model, _ = built(tmp_path)
    sampler = PolicySampler(model, None, sampler_sections(cfg)[0])
    assert sampler.model is model and sampler.push(model) == 0.0


def test_bf16_sampler_mismatch_is_orders_of_magnitude_above_fp32(tmp_path):
    cfg, model, tokenizer = built(tmp_path, log_mismatch=True, seeded_sampling=True)
    fp32 = Sampler(model, tokenizer, *sampler_sections(cfg), seeded=True).sample(PROMPTS, 1, 0)
    cfg16, _, _ = built(tmp_path, sampler_dtype="bfloat16", seeded_sampling=True)
    generator16 = Sampler(model, tokenizer, *sampler_sections(cfg16), seeded=True)
    assert next(generator16.sampler.model.parameters()).dtype == torch.bfloat16
    bf16 = generator16.sample(PROMPTS, 1, 0)
    kl32, kl16 = mismatch(model, fp32)["mismatch/kl"], mismatch(model, bf16)["mismatch/kl"]
    # measured (tiny-dense SMALL, this seed): fp32 1.9e-14 (float rounding), bf16 4.9e-7 (fp16 8.1e-9)
    assert kl32 < 1e-10, kl32
    assert kl16 > 1e3 * max(kl32, 1e-12), (kl16, kl32)
    # the copy follows the policy after a push (in its own dtype)
    step_weights(model, 1)
    generator16.sync(model)
    for (name, p), q in zip(model.named_parameters(), generator16.sampler.model.parameters()):
        assert torch.equal(q, p.detach().to(torch.bfloat16)), name


def test_lag_samples_with_the_policy_of_k_rollouts_ago(tmp_path):
    cfg, model, tokenizer = built(tmp_path, sampler_lag=2, seeded_sampling=True)
    generator = Sampler(model, tokenizer, *sampler_sections(cfg), seeded=True)
    saved = [{k: v.clone() for k, v in model.state_dict().items()}]  # weights after 0, 1, 2, 3 updates
    for step in (1, 2, 3, 4):
        rollout = generator.sample(PROMPTS, step, 0)
        # rollout s samples with the weights of max(0, s - 1 - k) updates
        reference = type(model)(model.config)
        reference.load_state_dict(saved[max(0, step - 1 - 2)])
        reference.eval()
        torch.testing.assert_close(rollout.sampler_logprobs,
                                   trainer_logprobs(reference, rollout) * rollout.completion_mask, atol=1e-5, rtol=0)
        if step > 1:  # and not with the current policy's
            assert mismatch(model, rollout)["mismatch/abs_logp_diff_max"] > 1e-2
        saved.append(step_weights(model, step))
        generator.sync(model)


@pytest.mark.slow
def test_training_with_a_stale_sampler_logs_its_mismatch(tmp_path):
    # lag 1: rollout 1 samples with the initial weights = pi_old; rollout 2 still with them, pi_old moved on
    cfg = tiny_cfg(tmp_path, sampler_lag=1, max_steps=3, rollout_correction="token_tis", rollout_correction_high=1.5,
                   reward_funcs=[starts_with_digit], per_device_batch_size=4)
    train(cfg)
    steps = [m for m in read_metrics(cfg.output_dir) if m["step"] > 0]
    assert steps[0]["mismatch/kl"] < 1e-9 and steps[0]["mismatch/clipped_frac"] == 0
    assert steps[1]["mismatch/kl"] > 1e-4 and steps[2]["mismatch/kl"] > 1e-4
    assert all("time/sync_s" in m and 0 <= m["mismatch/ess"] <= 1 for m in steps)
    assert steps[0]["time/sampler_start_s"] > 0 and "time/sampler_start_s" not in steps[1]  # the copy, made once


def test_a_checkpoint_older_than_the_sampler_settings_resumes_at_their_defaults(tmp_path):
    from gspo.checkpoint import check_resumable, saved_config

    cfg = tiny_cfg(tmp_path)
    old = {k: v for k, v in saved_config(cfg).items()
           if k not in ("sampler_dtype", "sampler_lag", "rollout_correction", "rollout_correction_low",
                        "rollout_correction_high", "log_mismatch", "vllm_sleep")}
    check_resumable(old, cfg, 1)  # the new settings at their defaults: what the old run did
    check_resumable(old, tiny_cfg(tmp_path, log_mismatch=True, vllm_sleep=False), 1)  # logging / memory only
    with pytest.raises(ValueError, match=r"sampler_lag=0 \(now 2\)"):
        check_resumable(old, tiny_cfg(tmp_path, sampler_lag=2), 1)


# ------------------------------------------------------------------------------- what a sampler is built from
def test_the_registry_names_the_built_in_generators_and_imports_each_on_first_use(tmp_path, monkeypatch):
    from gspo.rollout import registry

    tree = ast.parse(Path(registry.__file__).read_text())
    imported = [getattr(node, "module", None) or node.names[0].name for node in tree.body
                if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert imported and not [name for name in imported if name.startswith("gspo")]  # the config imports it
    assert registry.generator_choices()[:4] == ("auto", "gspo", "hf", "vllm")  # "auto" tries them in this order
    (tmp_path / "late_generator.py").write_text("BACKEND = 'imported'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "late_generator", raising=False)
    lazy = registry.Generators({"late": "late_generator:BACKEND"})
    assert list(lazy) == ["late"] and "late_generator" not in sys.modules  # known by name only
    assert lazy["late"] == "imported" and "late_generator" in sys.modules
    with pytest.raises(ValueError, match="generator 'hf' is already registered"):
        registry.register_generator("hf", registry.GENERATORS["hf"])
    # importing the package registers nothing as a side effect: vllm's module loads when "vllm" is first read
    code = ("import sys, gspo.rollout as r; assert 'gspo.rollout.vllm_engine' not in sys.modules; "
            "assert r.GENERATORS['vllm'].start is not None and 'gspo.rollout.vllm_engine' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("settings,kept", [
    ({}, False),  # mu == pi_old and nothing reads mu
    ({"log_mismatch": True}, True),
    ({"use_sampler_logprobs": True}, True),
    ({"rollout_correction": "token_tis", "rollout_correction_high": 2.0}, True),
    ({"sampler_dtype": "bfloat16"}, True),
    ({"sampler_lag": 1}, True),
    ({"rollout_workers": 1}, False),  # a worker at staleness 0 samples pi_old itself
    ({"rollout_workers": 1, "max_staleness": 1}, True),
])
def test_the_shape_keeps_mu_where_the_run_reads_it_or_mu_may_differ(tmp_path, settings, kept):
    cfg = tiny_cfg(tmp_path, **settings)
    sampling, episodes, shape = sampler_sections(cfg)
    assert shape == SamplerShape(num_generations=4, per_device_batch_size=2, seed=cfg.seed, keep_logprobs=kept,
                                 chat_template_kwargs=None, sandbox=cfg.sandbox)
    assert (sampling.max_completion_length, episodes.environment) == (12, None)


# ------------------------------------------------------------------------------- joining workers' shares
def test_join_rollouts_lays_shares_out_as_one_sampler_would():
    from gspo.rollout.batch import Rollout, join_rollouts

    # share 1: one row, prompt of 2 tokens (5 6), completion of 3 (7 8 EOS=2); share 2: two rows, prompt of 1
    # token (9, the first row's own padding 0 on the left), completions of 1 column
    a = Rollout(input_ids=torch.tensor([[5, 6, 7, 8, 2]]), attention_mask=torch.tensor([[1, 1, 1, 1, 1]]),
                completion_mask=torch.tensor([[True, True, True]]), prompts=["ab"], completions=["xy"],
                sampler_logprobs=torch.tensor([[-0.5, -0.25, -1.0]]))
    b = Rollout(input_ids=torch.tensor([[9, 4], [9, 2]]), attention_mask=torch.tensor([[1, 1], [1, 1]]),
                completion_mask=torch.tensor([[True], [True]]), prompts=["c", "c"], completions=["z", ""],
                sampler_logprobs=torch.tensor([[-2.0], [-3.0]]))
    joined = join_rollouts([a, b], pad=0)
    assert joined.input_ids.tolist() == [[5, 6, 7, 8, 2], [0, 9, 4, 0, 0], [0, 9, 2, 0, 0]]
    assert joined.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0], [0, 1, 1, 0, 0]]
    assert joined.completion_mask.tolist() == [[True, True, True], [True, False, False], [True, False, False]]
    assert joined.sampler_logprobs.tolist() == [[-0.5, -0.25, -1.0], [-2.0, 0.0, 0.0], [-3.0, 0.0, 0.0]]
    assert joined.prompts == ["ab", "c", "c"] and joined.completions == ["xy", "z", ""]
    assert joined.completion_len == 3 and joined.rewards is None
    assert torch.equal(join_rollouts([a], pad=0).input_ids, a.input_ids)  # one share: itself
    with pytest.raises(ValueError, match="sampler_logprobs is set in some parts only"):
        join_rollouts([a, Rollout(b.input_ids, b.attention_mask, b.completion_mask, b.prompts, b.completions)], pad=0)


def test_join_rollouts_widens_routing_records_on_input_ids_columns():
    from gspo.plugs.moe import RoutingRecord
    from gspo.rollout.batch import Rollout, join_rollouts

    # one router (layer 3), top-1; share a: 1 row of P=2, T=2 (record 4 positions: experts 1 2 3 4);
    # share b: 1 row of P=1, T=1 (experts 7 8). The joined layout is P=2, T=2: b gets one column on the left
    # (its prompt padding) and one on the right (its completion padding), both -1 (route freely).
    a = Rollout(input_ids=torch.tensor([[5, 6, 7, 2]]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                completion_mask=torch.tensor([[True, True]]), prompts=["p"], completions=["x"],
                routing=RoutingRecord(torch.tensor([[[[1], [2], [3], [4]]]]), (3,)))
    b = Rollout(input_ids=torch.tensor([[9, 2]]), attention_mask=torch.ones(1, 2, dtype=torch.long),
                completion_mask=torch.tensor([[True]]), prompts=["q"], completions=[""],
                routing=RoutingRecord(torch.tensor([[[[7], [8]]]]), (3,)))
    joined = join_rollouts([a, b], pad=0)
    assert joined.input_ids.tolist() == [[5, 6, 7, 2], [0, 9, 2, 0]]
    assert joined.routing.layers == (3,)
    assert joined.routing.indices[0, :, :, 0].tolist() == [[1, 2, 3, 4], [-1, 7, 8, -1]]
    other = Rollout(b.input_ids, b.attention_mask, b.completion_mask, b.prompts, b.completions,
                    routing=RoutingRecord(torch.tensor([[[[7], [8]]]]), (4,)))
    with pytest.raises(ValueError, match="different routers"):
        join_rollouts([a, other], pad=0)


def test_rollouts_sampled_ahead_under_torchrun_go_back_to_their_rank():
    from gspo.rollout.feed import all_ranks_pending, rank_pending

    mine, theirs = {"steps": [3], "rank": 0}, {"steps": [3], "rank": 1}
    assert all_ranks_pending([mine]) is mine  # one process: the file as it always was
    both = all_ranks_pending([mine, theirs])
    assert rank_pending(both, 1, 2) is theirs and rank_pending(both, 0, 2) is mine
    assert rank_pending(mine, 0, 1) is mine and rank_pending(None, 0, 2) is None
    with pytest.raises(ValueError, match=r"sampled ahead .* by the workers of 2 trainer process\(es\).*resume it "
                                         r"with 2 process\(es\) \(this run has 1\)"):
        rank_pending(both, 0, 1)
    nothing = all_ranks_pending([{"steps": []}, {"steps": []}])  # max_staleness 0: any world size resumes
    assert rank_pending(nothing, 0, 1) is None
