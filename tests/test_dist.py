"""torchrun on CPU (gloo, 2 processes): DDP and FSDP2 match one process; checkpoints resume; a dead rank does not hang.

Tolerance: the 2-process runs compute every row's log-probs in a different batch (each rank trims
its own part of a minibatch) and on one thread instead of two, so floating-point sums differ in
their last bits; measured differences are ~3e-6 of a tensor's largest weight after 3 steps and
~2e-5 relative on the smallest metrics (kl/approx ~1e-4). We allow 5e-5 and 1e-3. Everything
that does not go through a float reduction (tokens sampled, rewards, lengths) must be equal.
"""

import json
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import (
    SMALL,
    SMALL_MOE,
    changed,
    comparable,
    final_weights,
    gspo_env,
    initial_weights,
    read_metrics,
    run_gspo,
    saved_tensors,
)
from gspo.config import TrainConfig, make_config

EXACT = ("reward/mean", "reward/std", "completion/mean_len", "completion/max_len", "groups/zero_std_frac", "lr",
         "eval/accuracy", "eval/mean_at_k", "guard/skipped_steps")
REWARD = '''
import os
import time


def digit(prompts, completions, **_):
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


calls = 0


def dies(prompts, completions, **_):
    """Rank DIE_RANK (default 1) dies on its second call (the first evaluation's); the others sleep BUSY_S seconds
    on that call (still scoring, not yet in a collective, when torchrun's SIGTERM comes)."""
    global calls
    calls += 1
    if calls == 2:
        if os.environ.get("RANK") == os.environ.get("DIE_RANK", "1"):
            os._exit(7)
        time.sleep(float(os.environ.get("BUSY_S", "0")))
    return digit(prompts, completions)
'''


def run(tmp: Path, nproc: int, *overrides: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """`gspo train` on tmp/run.yaml (+ overrides) in nproc processes; tmp holds the reward module."""
    return run_gspo("train", "--config", tmp / "run.yaml", *overrides, cwd=tmp, paths=[tmp], nproc=nproc,
                    timeout=timeout)


RUN = {"model": "tiny-dense", "model_overrides": SMALL, "task": "add3", "max_steps": 3, "num_generations": 4,
       "num_minibatches": 2, "max_completion_length": 8, "learning_rate": 1e-3, "eval_num_prompts": 4, "eval_k": 2,
       "progress": False, "device": "cpu", "reward_funcs": ["format", "rewards_mod:digit"], "kl_coef": 0.01,
       "log_samples_steps": 0, "seeded_sampling": True, "eval_steps": 2, "sft_coef": 0.05}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    (tmp / "rewards_mod.py").write_text(REWARD)
    (tmp / "run.yaml").write_text(yaml.safe_dump(RUN))
    done = {
        "one": run(tmp, 1, "per_device_batch_size=4", "output_dir=one", "save_steps=1"),
        "ddp": run(tmp, 2, "per_device_batch_size=2", "output_dir=ddp", "save_steps=1"),
        "fsdp": run(tmp, 2, "per_device_batch_size=2", "output_dir=fsdp", "distributed=fsdp", "save_steps=1"),
    }
    for name, proc in done.items():
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    return tmp


# The routers' load-balancing loss is a statistic of one forward's tokens (E * sum_e f_e P_e, Hugging Face's): each
# rank adds its own, and logs it, so over two ranks the metric is the mean of two halves' losses, not the whole
# batch's (a product of two means does not recombine). Compared for its presence and range, not to one process.
PER_RANK = ("moe/aux_loss",)


def assert_same_run(a: Path, b: Path, rel: float = 5e-5, metric_rel: float = 1e-3, metric_abs: float = 1e-9,
                    ignore: tuple = (), noise: tuple = (), noise_abs: float = 1e-5) -> None:
    """Runs a and b logged the same metrics (but those starting with `ignore`) and saved the same weights.

    Metrics starting with `noise` measure float noise (the sampler's log-probs against the trainer's, 1e-8 here) that
    depends on how a shared sampler happened to batch the rows: they are compared to `noise_abs` only."""
    ma, mb = ([{k: v for k, v in r.items() if not k.startswith(ignore)} for r in comparable(run)] for run in (a, b))
    assert [r["step"] for r in ma] == [r["step"] for r in mb]
    for ra, rb in zip(ma, mb):
        assert set(ra) == set(rb)
        for key, va in ra.items():
            if key in EXACT or key == "step":
                assert va == rb[key], (ra["step"], key, va, rb[key])
            elif key.startswith(noise):
                assert va == pytest.approx(rb[key], abs=noise_abs), (ra["step"], key)
            else:
                assert va == pytest.approx(rb[key], rel=metric_rel, abs=metric_abs), (ra["step"], key)
    wa, wb = saved_tensors(a), saved_tensors(b)  # each expert on its own scale
    for key, tensor in wa.items():
        scale = tensor.abs().max()
        assert (tensor - wb[key]).abs().max() <= rel * scale, key


@pytest.mark.slow
def test_two_process_ddp_and_fsdp_match_one_process(runs):
    one = runs / "one"
    assert_same_run(one, runs / "ddp")
    assert_same_run(one, runs / "fsdp")
    # The runs really moved their weights, so matching them says something.
    trained = final_weights(one)
    assert len(changed(initial_weights(make_config(TrainConfig, RUN)), trained)) > len(trained) // 2


@pytest.mark.slow
def test_only_rank_zero_writes(runs):
    lines = (runs / "ddp" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]  # one writer, no duplicates
    assert sorted(p.name for p in (runs / "ddp").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]


@pytest.mark.slow
@pytest.mark.parametrize("source", ["ddp", "fsdp"])
def test_two_process_checkpoint_resumes_on_two_or_one_processes(runs, source):
    for nproc, batch in ((2, 2), (1, 4)):
        target = runs / f"{source}_resume{nproc}"
        shutil.copytree(runs / source, target)
        shutil.rmtree(target / "checkpoint-3")
        shutil.rmtree(target / "model")
        mode = [f"distributed={source}"] if nproc == 2 else []
        done = run(runs, nproc, f"per_device_batch_size={batch}", f"output_dir={target.name}", "save_steps=1",
                   *mode, "--resume", "latest")
        assert done.returncode == 0, done.stderr[-3000:]
        if nproc == 2:  # same world size: the same computation, bit for bit
            assert comparable(target) == comparable(runs / source)
            wa, wb = saved_tensors(target), saved_tensors(runs / source)
            assert set(wa) == set(wb) and changed(wa, wb) == []
        else:  # another world size: the single-process run's numbers, within the float tolerance
            assert_same_run(runs / "one", target)


@pytest.mark.slow
def test_fsdp_checkpoint_holds_full_weights_and_single_process_optimizer_layout(runs):
    from gspo.checkpoint import load_state_file

    ckpt_fsdp, ckpt_ddp = runs / "fsdp" / "checkpoint-2", runs / "ddp" / "checkpoint-2"
    wf, wd = load_file(ckpt_fsdp / "model.safetensors"), load_file(ckpt_ddp / "model.safetensors")
    assert set(wf) == set(wd) and "lm_head.weight" not in wf  # tied head left out, as save_pretrained does
    of, od = load_state_file(ckpt_fsdp / "optimizer.pt"), load_state_file(ckpt_ddp / "optimizer.pt")
    assert [g["params"] for g in of["param_groups"]] == [g["params"] for g in od["param_groups"]]
    assert sorted(of["state"]) == sorted(od["state"])
    for i, state in od["state"].items():  # same moments, up to the runs' float tolerance
        scale = state["exp_avg_sq"].abs().max() + 1e-30
        assert (of["state"][i]["exp_avg_sq"] - state["exp_avg_sq"]).abs().max() <= 1e-3 * scale, i
        assert float(of["state"][i]["step"]) == float(state["step"]) == 4.0  # 2 RL steps x 2 minibatches


@pytest.mark.slow
def test_a_dead_rank_stops_the_run_with_a_message(runs):
    started = time.monotonic()
    done = run(runs, 2, "per_device_batch_size=2", "output_dir=dead", "reward_funcs=[rewards_mod:dies]",
               "dist_timeout_s=30")
    assert done.returncode != 0
    assert time.monotonic() - started < 120
    # torchrun's failure report names the rank that died and its exit status (os._exit(7) in `dies`).
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\n\s*exitcode\s*: 7 \(pid: \d+\)", done.stderr), done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize(("dead", "busy_s"), [(1, 0), (0, 3)])
def test_the_survivor_of_an_abrupt_exit_names_the_rank_in_one_line(tmp_path, dead, busy_s):
    """A rank that exits abruptly (os._exit in a reward function, in the first evaluation) is named by the other rank
    in one line, without a traceback (gloo's says "Connection reset by peer"), and the survivor exits 2 long before
    dist_timeout_s. Whichever rank dies: rank 0 also holds the run's lock and writes its files. The survivor learns
    of it either way: from a failed collective, or (busy_s: still scoring) from torchrun's SIGTERM, which must not
    kill it before it has named the rank (it did, 1 run in 6 under load, before the loop's signal handling)."""
    (tmp_path / "rewards_mod.py").write_text(REWARD)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(RUN))
    started = time.monotonic()
    done = run_gspo("train", "--config", tmp_path / "run.yaml", "per_device_batch_size=2", "output_dir=dead",
                    "reward_funcs=[rewards_mod:dies]", "dist_timeout_s=300", cwd=tmp_path, nproc=2, timeout=240,
                    env=gspo_env(tmp_path, DIE_RANK=str(dead), BUSY_S=str(busy_s)))
    seconds = time.monotonic() - started
    survivor = 1 - dead
    assert done.returncode != 0 and seconds < 90, (seconds, done.stderr[-3000:])  # 300 s: it waited out the timeout
    ours = [line for line in done.stderr.splitlines() if line.startswith("gspo train:")]
    assert ours == [f"gspo train: error: rank {dead} of 2 exited mid-run (no heartbeat for 2 s); its own output "
                    "above and torchrun's report say why"], done.stderr[-3000:]
    assert f"[rank{survivor}]: Traceback" not in done.stderr and "Connection reset" not in done.stderr
    # torchrun's report: the dead rank's os._exit(7), the survivor's own exit status 2 (not killed by its SIGTERM).
    for rank, code in ((dead, 7), (survivor, 2)):
        assert re.search(rf"rank\s*: {rank} \(local_rank: {rank}\)\n\s*exitcode\s*: {code} ", done.stderr), \
            done.stderr[-3000:]


def test_unavailable_backend_or_bad_mode_is_a_clear_error(monkeypatch):
    import torch.distributed as tdist

    from gspo.plugs.parallel import Topology

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(tdist, "is_gloo_available", lambda: False)
    with pytest.raises(ValueError, match="backend 'gloo' .*not available"):
        Topology.setup(torch.device("cpu"), "ddp", 30)
    with pytest.raises(ValueError, match="distributed='zero3' is not one of ddp, fsdp"):
        Topology.setup(torch.device("cpu"), "zero3", 30)
    monkeypatch.setenv("WORLD_SIZE", "1")  # no launcher: nothing distributed, whatever the mode
    assert Topology.setup(torch.device("cpu"), "fsdp", 30) == Topology(mode="fsdp")


@pytest.mark.slow
def test_moe_routing_replay_and_drift_match_one_process(tmp_path):
    """old_policy replay (2 epochs: rows recorded on one rank are replayed on another) under ddp, and
    rollout replay (records gathered with the rollout) under fsdp, log what one process logs."""
    (tmp_path / "rewards_mod.py").write_text(REWARD)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "model": "tiny-moe", "model_overrides": SMALL_MOE, "task": "add3", "max_steps": 2, "num_generations": 4,
        "num_minibatches": 2, "num_epochs": 2, "max_completion_length": 8, "learning_rate": 1e-3,
        "eval_num_prompts": 2, "eval_k": 1, "progress": False, "device": "cpu", "log_samples_steps": 0,
        "reward_funcs": ["rewards_mod:digit"], "seeded_sampling": True, "log_routing_drift": True}))
    for replay, mode in (("old_policy", "ddp"), ("rollout", "fsdp")):
        one = run(tmp_path, 1, "per_device_batch_size=4", f"output_dir=one_{replay}", f"routing_replay={replay}")
        two = run(tmp_path, 2, "per_device_batch_size=2", f"output_dir=two_{replay}", f"routing_replay={replay}",
                  f"distributed={mode}")
        assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
        assert_same_run(tmp_path / f"one_{replay}", tmp_path / f"two_{replay}", ignore=PER_RANK)
        last = read_metrics(tmp_path / f"two_{replay}")[-1]
        assert "moe/expert_change_frac" in last and "moe/replay_mismatch_frac" in last
        assert 2.0 <= last["moe/aux_loss"] <= 8.0  # top-2 of the experts: balanced 2


@pytest.mark.slow
def test_stale_sampler_mismatch_and_correction_match_one_process(tmp_path):
    """A sampler one rollout behind (sampler_lag=1) with truncated IS: mismatch/* (moments of every
    rank's rows) and mismatch/clipped_frac (minibatch parts) recombine to one process's; fsdp refuses a copy."""
    (tmp_path / "rewards_mod.py").write_text(REWARD)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        **RUN, "kl_coef": 0.0, "sft_coef": 0.0, "eval_steps": 0, "sampler_lag": 1, "rollout_correction": "token_tis",
        "rollout_correction_high": 1.02}))
    one = run(tmp_path, 1, "per_device_batch_size=4", "output_dir=one")
    two = run(tmp_path, 2, "per_device_batch_size=2", "output_dir=two")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    # step 1 samples with pi_old's own weights: its mismatch/* are float rounding (~1e-7), which differs
    # with the batch layout; the later steps' mismatch is ~1e-3 and matches to 1e-3 relative
    assert_same_run(tmp_path / "one", tmp_path / "two", metric_abs=1e-6)
    last = read_metrics(tmp_path / "two")[-1]
    assert last["mismatch/kl"] > 1e-5 and 0 < last["mismatch/clipped_frac"] < 1, last
    fsdp = run(tmp_path, 2, "per_device_batch_size=2", "output_dir=fsdp", "distributed=fsdp")
    assert fsdp.returncode != 0 and "which fsdp shards" in fsdp.stderr, fsdp.stderr[-2000:]


@pytest.mark.slow
def test_multitask_mixture_with_dynamic_weights_matches_one_process(tmp_path):
    (tmp_path / "rewards_mod.py").write_text(REWARD)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "model": "tiny-dense", "model_overrides": SMALL, "task": None, "max_steps": 3, "num_generations": 4,
        "tasks": [{"task": "add2"}, {"task": "add3", "reward_funcs": ["answer_match", "rewards_mod:digit"]},
                  {"name": "hard", "task": "mul3", "weight": 2}],
        "task_weighting": "dynamic", "task_weight_floor": 0.1, "sft_coef": 0.5, "num_minibatches": 2,
        "max_completion_length": 8, "learning_rate": 1e-3, "eval_num_prompts": 2, "eval_k": 1, "progress": False,
        "device": "cpu", "log_samples_steps": 0, "seeded_sampling": True}))
    one = run(tmp_path, 1, "per_device_batch_size=4", "output_dir=one")
    two = run(tmp_path, 2, "per_device_batch_size=2", "output_dir=two")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    assert_same_run(tmp_path / "one", tmp_path / "two")
    last = read_metrics(tmp_path / "two")[-1]
    assert last["loss/sft"] > 0 and "task/hard/weight" in last


@pytest.mark.slow
def test_ppo_critic_matches_one_process_under_ddp_and_fsdp_and_resumes(tmp_path):
    """advantage_estimator=gae: the critic's values, GAE whitening (moments of every rank's tokens), its
    value loss (each rank's share by tokens; stand-in rows in minibatches of 2 of 8 sequences) and its
    checkpoint (gathered under fsdp) recombine to one process's run."""
    (tmp_path / "rewards_mod.py").write_text(REWARD)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        **RUN, "sft_coef": 0.0, "eval_steps": 0, "objective": "grpo", "advantage_estimator": "gae",
        "kl_in_reward": True, "gae_lambda": 0.9, "num_generations": 2, "num_minibatches": 4, "save_steps": 1}))
    done = {name: run(tmp_path, nproc, f"per_device_batch_size={4 // nproc}", f"output_dir={name}", *extra)
            for name, nproc, extra in (("one", 1, ()), ("ddp", 2, ()), ("fsdp", 2, ("distributed=fsdp",)))}
    for name, proc in done.items():
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    # Per-token advantages carry the critic's float noise too; AdamW turns it into whole steps on elements
    # whose gradient is near 0: measured 1.2e-4 of the largest weight in one policy tensor (o_proj), <= 1.2e-5
    # elsewhere, 3.5e-6 in the critic, after 3 steps
    for name in ("ddp", "fsdp"):
        assert_same_run(tmp_path / "one", tmp_path / name, rel=5e-4, metric_abs=1e-6)
        a, b = (load_file(tmp_path / d / "critic" / "model.safetensors") for d in ("one", name))
        assert set(a) == set(b) and all((a[k] - b[k]).abs().max() <= 5e-5 * a[k].abs().max() for k in a)
    last = read_metrics(tmp_path / "fsdp")[-1]
    assert last["loss/value"] > 0 and last["value/mean"] != 0 and last["advantages/std"] > 0, last
    # fsdp's checkpoint holds the critic in the single-process layout: resumed on one process it continues
    target = tmp_path / "fsdp_resume1"
    shutil.copytree(tmp_path / "fsdp", target)
    for name in ("checkpoint-3", "model", "critic"):
        shutil.rmtree(target / name)
    resumed = run(tmp_path, 1, "per_device_batch_size=4", f"output_dir={target.name}", "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "one", target, rel=5e-4, metric_abs=1e-6)
    # ... and on two fsdp processes (the critic's optimizer state sharded again): the same run, bit for bit
    target = tmp_path / "fsdp_resume2"
    shutil.copytree(tmp_path / "fsdp", target)
    for name in ("checkpoint-3", "model", "critic"):
        shutil.rmtree(target / name)
    resumed = run(tmp_path, 2, "per_device_batch_size=2", f"output_dir={target.name}", "distributed=fsdp",
                  "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert comparable(target) == comparable(tmp_path / "fsdp")
    a, b = (load_file(d / "critic" / "model.safetensors") for d in (target, tmp_path / "fsdp"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_on_another_world_size_needs_the_same_global_batch():
    from gspo.checkpoint import check_resumable, saved_config
    from gspo.config import TrainConfig, make_config

    def cfg(batch: int, **extra):
        return make_config(TrainConfig, {"task": "add3", "per_device_batch_size": batch, "max_steps": 3, **extra})

    saved = saved_config(cfg(4), 2)  # a 2-process run: global batch 8, seeded sampling (always on under torchrun)
    check_resumable(saved, cfg(8, seeded_sampling=True), 1)  # one process: must ask for seeded sampling itself
    check_resumable(saved, cfg(2), 1, 4)
    with pytest.raises(ValueError, match=r"global batch \(per_device_batch_size x processes\)=8 \(now 3 x 2 = 6\)"):
        check_resumable(saved, cfg(3), 1, 2)
    with pytest.raises(ValueError, match=r"seeded_sampling=True \(now False\)"):
        check_resumable(saved, cfg(8), 1)


@pytest.mark.slow
def test_a_rank_holding_no_row_of_a_minibatch_trains_a_stand_in_of_weight_zero(tmp_path):
    """Minibatches of two of the eight sequences: in some, one rank holds no row and runs a stand-in row
    (fsdp's forwards are collective) that must count for nothing. Token-mean losses (cispo) weigh each
    rank by its tokens; an MoE model checks that experts only the stand-in used get no update."""
    seed, steps, N, M = TrainConfig.seed, 3, 8, 4
    shuffle = torch.Generator().manual_seed(seed)  # the trainer's minibatch plans, drawn the same way
    plans = [torch.randperm(N, generator=shuffle).chunk(M) for _ in range(steps)]
    one_sided = sum(bool((idx < N // 2).all() or (idx >= N // 2).all()) for plan in plans for idx in plan)
    assert one_sided >= 2  # the path under test is taken (rank 0 holds rows 0-3, rank 1 rows 4-7)
    (tmp_path / "rewards_mod.py").write_text(REWARD)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "model": "tiny-moe", "model_overrides": SMALL_MOE, "task": "add3", "max_steps": steps, "num_generations": 2,
        "num_minibatches": M, "objective": "cispo", "max_completion_length": 8, "learning_rate": 1e-3,
        "eval_num_prompts": 2, "eval_k": 1, "progress": False, "device": "cpu", "log_samples_steps": 0,
        "reward_funcs": ["rewards_mod:digit"], "seeded_sampling": True, "eval_steps": 0, "seed": seed}))
    one = run(tmp_path, 1, "per_device_batch_size=4", "output_dir=one")
    assert one.returncode == 0, one.stderr[-2000:]
    for mode in ("ddp", "fsdp"):
        two = run(tmp_path, 2, "per_device_batch_size=2", f"output_dir={mode}", f"distributed={mode}")
        assert two.returncode == 0, two.stderr[-2000:]
        assert_same_run(tmp_path / "one", tmp_path / mode, ignore=PER_RANK)
    rewards = [r["reward/mean"] for r in read_metrics(tmp_path / "one")[1:]]
    assert any(r > 0 for r in rewards)  # a learning signal: the weights moved


@pytest.mark.slow
def test_lora_under_ddp_matches_one_process(tmp_path):
    """LoRA adapters (gspo/plugs/lora.py) on 2 DDP ranks: the same run as one process, adapters only saved."""
    pytest.importorskip("peft")
    (tmp_path / "rewards_mod.py").write_text(REWARD)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({**RUN, "lora_r": 4, "lora_alpha": 8.0, "learning_rate": 1e-2}))
    for name, nproc, batch in (("one", 1, 4), ("ddp", 2, 2)):
        proc = run(tmp_path, nproc, f"per_device_batch_size={batch}", f"output_dir={name}")
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    ma, mb = comparable(tmp_path / "one"), comparable(tmp_path / "ddp")
    assert [r["step"] for r in ma] == [r["step"] for r in mb] == [0, 1, 2, 3]
    for ra, rb in zip(ma, mb):
        for key in EXACT:
            assert ra.get(key) == rb.get(key), (ra["step"], key)
        assert ra.get("loss/kl", 0) == pytest.approx(rb.get("loss/kl", 0), rel=1e-3, abs=1e-9)
    a = load_file(tmp_path / "one" / "model" / "adapter_model.safetensors")
    b = load_file(tmp_path / "ddp" / "model" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and not (tmp_path / "ddp" / "model" / "model.safetensors").exists()
    lora_b = [k for k in a if ".lora_B." in k]
    assert any(a[k].abs().max() > 0 for k in lora_b)  # trained (B starts at 0)
    for key, tensor in a.items():
        assert (tensor - b[key]).abs().max() <= 5e-5 * max(float(tensor.abs().max()), 1e-3), key


def without_async(run_dir) -> list[dict]:
    """`comparable` without the async/* bookkeeping that only a run with rollout workers logs."""
    return [{k: v for k, v in r.items() if not k.startswith("async/")} for r in comparable(run_dir)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_torchrun_ranks_with_rollout_workers_train_as_without(tmp_path, mode):
    """Each rank has a worker of its own (a gspo serve endpoint it starts) for its share of the batch (fsdp: every
    rank gathers each parameter whole, then pushes it to its worker, which loaded the model from the config).
    Sampling under torchrun is seeded, so at max_staleness 0 the run is the run without workers, metric for metric
    and bit for bit."""
    (tmp_path / "rewards_mod.py").write_text(REWARD)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({**RUN, "max_steps": 2, "eval_num_prompts": 0,
                                                       "per_device_batch_size": 2, "distributed": mode}))
    for name, extra in (("plain", []), ("workers", ["rollout_workers=1"])):
        proc = run(tmp_path, 2, f"output_dir={name}", *extra)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    names = ["workers"]  # (rollout endpoints shared by the ranks: tests/test_rollout_endpoints.py)
    a = saved_tensors(tmp_path / "plain")
    for name in names:
        assert without_async(tmp_path / "plain") == without_async(tmp_path / name), name
        metrics = read_metrics(tmp_path / name)
        assert [r["async/staleness_max"] for r in metrics] == [0.0, 0.0] and metrics[0]["async/sync_bytes"] > 0
        b = saved_tensors(tmp_path / name)
        assert a.keys() == b.keys() and changed(a, b) == [], name


@pytest.mark.slow
def test_torchrun_ranks_resume_with_the_rollouts_their_workers_sampled_ahead(tmp_path):
    """max_staleness 1 under ddp: each rank's checkpointed share of the rollout sampled ahead goes back to its
    rank, so the resumed run is the uninterrupted one, bit for bit; another world size is refused by name."""
    (tmp_path / "rewards_mod.py").write_text(REWARD)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({**RUN, "max_steps": 3, "eval_num_prompts": 0,
                                                       "per_device_batch_size": 2, "rollout_workers": 1,
                                                       "max_staleness": 1, "save_steps": 1}))
    whole = run(tmp_path, 2, "output_dir=whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    pending = torch.load(tmp_path / "whole" / "checkpoint-2" / "rollouts.pt", weights_only=True)
    assert [part["steps"] for part in pending["ranks"]] == [[3], [3]]  # each rank's share of step 3
    shutil.copytree(tmp_path / "whole", tmp_path / "parts")
    shutil.rmtree(tmp_path / "parts" / "checkpoint-3")
    shutil.rmtree(tmp_path / "parts" / "model")
    resumed = run(tmp_path, 2, "output_dir=parts", "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert without_async(tmp_path / "whole") == without_async(tmp_path / "parts")
    staleness = [r["async/staleness_max"] for r in read_metrics(tmp_path / "parts")]
    assert staleness == [0.0, 1.0, 1.0]
    assert changed(saved_tensors(tmp_path / "whole"), saved_tensors(tmp_path / "parts")) == []
    shutil.rmtree(tmp_path / "parts" / "checkpoint-3")
    shutil.rmtree(tmp_path / "parts" / "model")
    alone = run(tmp_path, 1, "output_dir=parts", "per_device_batch_size=4", "--resume", "latest")
    assert alone.returncode != 0 and "resume it with 2 process(es) (this run has 1)" in alone.stderr


class _Heartbeat:
    """Heartbeat.lost() as a test sets it; a SIGTERM arrives while it looks (torchrun's, after a rank's death)."""

    def __init__(self, gone):
        self.gone = gone

    def lost(self):
        signal.raise_signal(signal.SIGTERM)
        return self.gone


def test_a_lost_rank_is_named_and_torchruns_sigterm_can_no_longer_cut_the_line_short():
    from gspo.plugs.parallel import RankLost, Topology
    from gspo.runtime import StopSignals

    before = signal.getsignal(signal.SIGTERM)
    try:
        stop = StopSignals()  # the loop's handler, in place when the collective fails
        topology = Topology(1, 2, 1, "ddp", _Heartbeat([0]))
        err = RuntimeError("Connection reset by peer")
        with pytest.raises(RankLost, match=r"^rank 0 of 2 exited mid-run \(no heartbeat for 2 s\)"):
            topology.raise_if_rank_lost(err)
        assert not stop.requested  # the SIGTERM that came meanwhile was held, then dropped
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        stop.restore()  # the loop's `finally`: SIGTERM stays ignored until the process has said why it ends
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        topology.raise_if_rank_lost(err)  # train() sees the same error: not looked at twice
        # no rank lost (a bug's RuntimeError): the held SIGTERM is delivered to the loop's handler
        stop = StopSignals()
        Topology(1, 2, 1, "ddp", _Heartbeat([])).raise_if_rank_lost(RuntimeError("a bug"))
        assert stop.requested == signal.SIGTERM and signal.getsignal(signal.SIGTERM) == stop._handle
        stop.restore()
    finally:
        signal.signal(signal.SIGTERM, before)


HALF_INFORMATIVE = '''
import zlib


def half_informative(prompts, completions, **_):
    return [float(zlib.crc32(c.encode()) % 2) if zlib.crc32(p.encode()) % 2 == 0 else 0.0
            for p, c in zip(prompts, completions)]
'''


@pytest.mark.slow
def test_dynamic_sampling_fills_every_rank_s_share_under_ddp_and_fsdp(tmp_path):
    """dynamic_sampling under torchrun: every rank runs the same rounds (sized by the rank missing most) and keeps
    per_device_batch_size informative groups of its own; ddp and fsdp (whose sampling forwards are collective) run
    the same rounds and train the same."""
    (tmp_path / "rewards_mod.py").write_text(HALF_INFORMATIVE)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        **RUN, "reward_funcs": ["rewards_mod:half_informative"], "kl_coef": 0.0, "sft_coef": 0.0, "eval_steps": 0,
        "eval_num_prompts": 0, "per_device_batch_size": 2, "dynamic_sampling": True, "max_sampling_rounds": 8}))
    done = {mode: run(tmp_path, 2, f"output_dir={mode}", f"distributed={mode}") for mode in ("ddp", "fsdp")}
    for mode, proc in done.items():
        assert proc.returncode == 0, (mode, proc.stderr[-3000:])
    assert_same_run(tmp_path / "ddp", tmp_path / "fsdp")
    lines = [r for r in read_metrics(tmp_path / "ddp") if r["step"] >= 1]
    assert any(r["groups/sampling_rounds"] > 1 for r in lines)  # the case under test
    for r in lines:  # both ranks' 2 groups inform (zero_std_frac is every rank's rows')
        assert r["groups/kept"] == 4 and r["groups/filled_frac"] == 1.0 and r["groups/zero_std_frac"] == 0.0
        assert (r["groups/sampled"] > 4) == (r["groups/sampling_rounds"] > 1)  # 2 x n groups a round after the first
