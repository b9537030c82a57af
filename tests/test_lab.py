"""The stability lab: grid expansion, skip/resume, report builder on synthetic runs, a micro lab end to end."""

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import gspo.sft
import gspo.trainer
from conftest import comparable, gspo_argv, gspo_env, logged_steps, read_metrics
from gspo.apps.lab.claims import claims
from gspo.apps.lab.report import detect_collapse, load_lab, write_report
from gspo.apps.lab.runs import LabConfig, _run_one, expand_grid, run_dir, run_lab, train_config
from gspo.apps.lab.stats import stat
from gspo.config import make_config, to_dict
from gspo.runtime import run_lock
from gspo.tracking import MetricsLogger


def lab(tmp_path, **values) -> LabConfig:
    return make_config(LabConfig, {"output_dir": str(tmp_path / "lab"), **values})


# ------------------------------------------------------------------------------- grid
def test_default_grid_expands_as_configured(tmp_path):
    specs = expand_grid(lab(tmp_path))
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    main = [s for s in specs if s.group == "main"]
    # dense: 3 objectives x 3 seeds; moe without replay: 3 x 3; moe with old_policy replay: GRPO only, 3 seeds
    assert len(main) == 9 + 9 + 3
    assert {s.replay for s in main if s.model == "dense"} == {"none"}
    assert {s.objective for s in main if s.replay == "old_policy"} == {"grpo"}
    depth = [s for s in specs if s.group == "depth"]
    assert sorted({s.layers for s in depth}) == [2, 4, 8] and len(depth) == 9
    search = [s for s in specs if s.group == "search"]
    assert len(search) == 1 * 2 * 2  # 1 setting (lr 3e-4) x (grpo, gspo) x seeds [0, 1]
    assert "search-lr_3e-4-gspo-moe-none-s1" in names and "depth8-grpo-moe-none-s2" in names
    assert len(specs) == 34


def test_grid_knobs_reach_every_run_config(tmp_path):
    cfg = lab(tmp_path, objectives=["gspo"], models=["moe"], routing_replay=["none", "old_policy"],
              replay_all_objectives=True, seeds=[7], depths=[], search={"long": {"max_completion_length": 96}},
              search_seeds=None, num_minibatches=2, learning_rate=3e-5, train_overrides={"kl_coef": 0.01})
    specs = expand_grid(cfg)
    assert [s.name for s in specs] == ["gspo-moe-none-s7", "gspo-moe-old_policy-s7", "search-long-grpo-moe-none-s7",
                                       "search-long-gspo-moe-none-s7"]
    main = train_config(cfg, specs[1])
    assert (main.objective, main.routing_replay, main.seed, main.num_minibatches, main.learning_rate, main.kl_coef) == \
        ("gspo", "old_policy", 7, 2, 3e-5, 0.01)
    assert main.model == str(tmp_path / "lab" / "coldstart" / "moe-L4" / "model")
    search = train_config(cfg, specs[3])
    assert (search.max_completion_length, search.max_steps) == (96, cfg.max_steps)


def test_bad_lab_settings_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="objectives entry 'ppo'"):
        lab(tmp_path, objectives=["ppo"])
    with pytest.raises(ValueError, match="models entry 'dense2'"):
        lab(tmp_path, models=["dense2"])
    with pytest.raises(ValueError, match="unknown key 'seed'.*'seeds'"):
        lab(tmp_path, seed=3)
    cfg = lab(tmp_path, search={"bad": {"num_minibatches": 5}})  # 8 x 8 sequences do not split into 5
    with pytest.raises(ValueError, match="search-bad-grpo-moe-none-s0.*num_minibatches=5"):
        run_lab(cfg, log=lambda _: None)


# ------------------------------------------------------------------------------- skip / resume
class FakeTrainer:
    """Stands in for gspo.trainer.train: writes a short metrics file; can crash on the n-th run."""

    def __init__(self, crash_on: int | None = None):
        self.calls, self.crash_on = [], crash_on

    def __call__(self, cfg):
        self.calls.append(Path(cfg.output_dir).name)
        with MetricsLogger(cfg.output_dir) as logger:
            logger.log(0, {"eval/mean_at_k": 0.2, "eval/accuracy": 0.3})
            if len(self.calls) == self.crash_on:
                raise KeyboardInterrupt  # killed mid-run: metrics exist, done.json does not
            logger.log(1, {"eval/mean_at_k": 0.4, "eval/accuracy": 0.5, "completion/mean_len": 10.0})
        return {"evals": {0: {"eval/mean_at_k": 0.2}, 1: {"eval/mean_at_k": 0.4}}}


def fake_sft(cfg):
    (Path(cfg.output_dir) / "model").mkdir(parents=True)
    return {"steps": 0}


def test_completed_runs_are_skipped_and_an_interrupted_lab_resumes(tmp_path, monkeypatch):
    cfg = lab(tmp_path, objectives=["grpo", "gspo"], models=["dense"], seeds=[0, 1], depths=[], search={}, workers=1)
    monkeypatch.setattr(gspo.sft, "sft", fake_sft)
    crashing = FakeTrainer(crash_on=3)
    monkeypatch.setattr(gspo.trainer, "train", crashing)
    with pytest.raises(KeyboardInterrupt):
        run_lab(cfg, log=lambda _: None)
    assert crashing.calls == ["grpo-dense-none-s0", "grpo-dense-none-s1", "gspo-dense-none-s0"]
    partial = run_dir(cfg.output_dir, expand_grid(cfg)[2])
    assert (partial / "metrics.jsonl").exists() and not (partial / "done.json").exists()

    lines = []
    resumed = FakeTrainer()
    monkeypatch.setattr(gspo.trainer, "train", resumed)
    summary = run_lab(cfg, log=lines.append)
    assert resumed.calls == ["gspo-dense-none-s0", "gspo-dense-none-s1"]  # the two finished runs were skipped
    assert "2 of 4 runs already complete: skipped" in lines
    assert any("gspo-dense-none-s0: interrupted earlier, restarting it" in line for line in lines)
    assert logged_steps(partial) == [0, 1]  # restarted clean, not appended
    assert (summary["ran"], summary["skipped"]) == (2, 2)
    assert Path(summary["report"]).is_file()

    again = FakeTrainer()
    monkeypatch.setattr(gspo.trainer, "train", again)
    assert run_lab(cfg, log=lambda _: None)["ran"] == 0 and again.calls == []
    changed = lab(tmp_path, objectives=["grpo", "gspo"], models=["dense"], seeds=[0, 1], depths=[], search={},
                  learning_rate=5e-4, workers=1)
    with pytest.raises(ValueError, match="grpo-dense-none-s0 .* other settings \\(learning_rate\\)"):
        run_lab(changed, log=lambda _: None)


def test_a_relaunch_leaves_a_run_folder_in_use_alone(tmp_path, monkeypatch):
    """An unfinished run whose lock a live process holds (an earlier lab's worker still training it) is not
    deleted and restarted: the lab stops with one line naming the folder, before running anything."""
    cfg = lab(tmp_path, objectives=["grpo"], models=["dense"], seeds=[0], depths=[], search={}, workers=1)
    monkeypatch.setattr(gspo.sft, "sft", fake_sft)
    trainer = FakeTrainer()
    monkeypatch.setattr(gspo.trainer, "train", trainer)
    folder = run_dir(cfg.output_dir, expand_grid(cfg)[0])
    in_use = re.escape(f"lab run folder {folder} is in use by a live process (pid {os.getpid()} on ")
    with run_lock(folder):  # this process holds it, as the earlier worker would
        (folder / "metrics.jsonl").write_text('{"step": 0}\n')
        with pytest.raises(ValueError, match=in_use):
            run_lab(cfg, log=lambda _: None)
        assert (folder / "metrics.jsonl").read_text() == '{"step": 0}\n' and trainer.calls == []
        assert not (tmp_path / "lab" / "coldstart").exists()  # refused before any cold start ran
        with pytest.raises(ValueError, match=in_use):  # a worker that finds it taken since: the same refusal
            _run_one(train_config(cfg, expand_grid(cfg)[0]), {})
        assert (folder / "metrics.jsonl").exists()
    with run_lock(cfg.output_dir):  # a second lab into a folder whose lab is still running
        with pytest.raises(ValueError, match=re.escape(f"output_dir {cfg.output_dir} is in use by another run")):
            run_lab(cfg, log=lambda _: None)
    assert run_lab(cfg, log=lambda _: None)["ran"] == 1  # released: the relaunch restarts it from scratch
    assert trainer.calls == ["grpo-dense-none-s0"] and logged_steps(folder) == [0, 1]


# ------------------------------------------------------------------------------- a killed lab takes its workers along
def proc_stat(pid) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state, ppid, ...); None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def children(pid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and (fields := proc_stat(p.name)) and int(fields[1]) == pid]


def alive(pid: int) -> bool:
    fields = proc_stat(pid)
    return fields is not None and fields[0] != "Z"  # a zombie has ended (only its exit status is left)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_lab_takes_its_workers_along(tmp_path, signum):
    """Two workers in two cold starts (dense and MoE SFT that would go on for hours); the lab process is killed:
    its workers, and every other child of it, are gone within seconds instead of training on as orphans."""
    (tmp_path / "lab.yaml").write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "lab"), "objectives": ["grpo"], "models": ["dense", "moe"],
        "routing_replay": ["none"], "seeds": [0], "depths": [], "search": {}, "num_layers": 1,
        "sft_max_steps": 100_000, "sft_target_accuracy": 1.0, "workers": 2}))
    locks = [tmp_path / "lab" / "coldstart" / name / ".gspo.lock" for name in ("dense-L1", "moe-L1")]
    with open(tmp_path / "lab.log", "w") as log:
        lab_process = subprocess.Popen(gspo_argv("lab", "--config", tmp_path / "lab.yaml"), cwd=tmp_path,
                                       env=gspo_env(), stdout=log, stderr=subprocess.STDOUT)
    workers = []
    try:
        deadline = time.monotonic() + 240
        while not all(p.exists() and p.read_text().startswith("pid ") for p in locks):  # both SFTs under way
            assert lab_process.poll() is None and time.monotonic() < deadline, (tmp_path / "lab.log").read_text()
            time.sleep(0.2)
        workers = children(lab_process.pid)
        training = {int(p.read_text().split()[1]) for p in locks}
        assert len(training) == 2 and training <= set(workers), (training, workers)
        os.kill(lab_process.pid, signum)
        assert lab_process.wait(timeout=30) == -signum
        deadline = time.monotonic() + 10
        while any(map(alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in workers if alive(pid)] == []
    finally:
        lab_process.kill()
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)  # what this test started: no orphan outlives it


def test_a_worker_whose_lab_is_already_gone_leaves_at_once():
    """The race of PR_SET_PDEATHSIG: a lab that died before its worker's initializer ran is no longer the
    worker's parent, and the worker leaves (status 1) instead of waiting for work; under its own parent it stays."""
    code = "import os; from gspo.apps.lab.workers import die_with_parent; die_with_parent({}); print('stayed')"
    for parent, expected in (("-1", (1, "")), ("os.getppid()", (0, "stayed\n"))):
        done = subprocess.run([sys.executable, "-c", code.format(parent)], env=gspo_env(), capture_output=True,
                              text=True, timeout=60)
        assert (done.returncode, done.stdout) == expected, done.stderr[-2000:]


# ------------------------------------------------------------------------------- collapse detection
def test_collapse_detection():
    # Best 0.6 at step 20; gap = max(0.1, 0.3) = 0.3: step 30 falls to 0.2 < 0.3 and never climbs back above 0.45.
    assert detect_collapse([(0, 0.2), (10, 0.5), (20, 0.6), (30, 0.2), (40, 0.25)], [])[0] == 30
    # The same dip that recovers to 0.5 (> 0.45) is not a collapse.
    assert detect_collapse([(0, 0.2), (10, 0.5), (20, 0.6), (30, 0.2), (40, 0.5)], [])[0] is None
    # A small drop: best 0.1, gap max(0.1, 0.05) = 0.1 -> 0.0 is not below 0.1 - 0.1.
    assert detect_collapse([(0, 0.05), (10, 0.1), (20, 0.0)], [])[0] is None
    # Entropy from ~1.0 below 0.1 from step 4 to the end (3 steps): collapse at step 4.
    entropy = [(1, 1.0), (2, 1.1), (3, 0.9), (4, 0.05), (5, 0.02), (6, 0.01)]
    step, reason = detect_collapse([], entropy)
    assert step == 4 and "entropy" in reason
    assert detect_collapse([], entropy[:-1])[0] is None  # only 2 steps down: not yet "for good"


# ------------------------------------------------------------------------------- report on synthetic runs
def synthetic_run(lab_dir, group, objective, model, replay, seed, *, acc, clip, ratio_std, drift=None, layers=4,
                  label="", entropy=(1.0, 1.0, 1.0, 1.0)):
    """A finished run with hand-set metrics: accuracy curve at steps 0, 2, 4; flat per-step stats."""
    spec = {"group": group, "objective": objective, "model": model, "layers": layers, "replay": replay, "seed": seed,
            "label": label, "overrides": {}}
    head = {"main": "", "depth": f"depth{layers}-", "search": f"search-{label}-"}[group]
    out = Path(lab_dir) / "runs" / f"{head}{objective}-{model}-{replay}-s{seed}"
    with MetricsLogger(out) as logger:
        for step in range(5):
            m = {}
            if step % 2 == 0:
                m.update({"eval/mean_at_k": acc[step // 2], "eval/accuracy": acc[step // 2]})
            if step:
                m.update({"clip/low_frac": clip / 2, "clip/high_frac": clip / 2, "ratio/std": ratio_std,
                          "grad/norm": 2.0, "grad/norm_std": 0.5, "entropy": entropy[step - 1],
                          "completion/mean_len": 10.0})
                if drift is not None:
                    m["moe/expert_change_frac"] = drift
                    m.update({f"moe/expert_change_frac/layer_{i}": drift for i in range(layers)})
            logger.log(step, m)
    (out / "done.json").write_text(json.dumps({"spec": spec, "config": {"per_device_batch_size": 2,
                                                                        "num_generations": 4}, "seconds": 1.0}))


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_report_builder_on_synthetic_runs(tmp_path):
    d = tmp_path / "lab"
    for seed, wiggle in ((0, 0.0), (1, 0.02), (2, -0.02)):
        for model in ("dense", "moe"):
            drift = 0.002 if model == "moe" else None
            synthetic_run(d, "main", "grpo", model, "none", seed, acc=(0.2, 0.3 + wiggle, 0.4 + wiggle), clip=0.001,
                          ratio_std=0.2, drift=drift)
            synthetic_run(d, "main", "gspo", model, "none", seed, acc=(0.2, 0.5 + wiggle, 0.6 + wiggle), clip=0.15,
                          ratio_std=0.01, drift=drift)
        synthetic_run(d, "main", "grpo", "moe", "old_policy", seed, acc=(0.2, 0.5 + wiggle, 0.6 + wiggle), clip=0.001,
                      ratio_std=0.2, drift=0.002)
        for layers, drift in ((2, 0.001), (8, 0.004 + wiggle / 10)):
            synthetic_run(d, "depth", "grpo", "moe", "none", seed, acc=(0.2, 0.2, 0.2), clip=0.001, ratio_std=0.2,
                          drift=drift, layers=layers)
    # One collapsing search run: 0.2 -> 0.6 -> 0.1.
    synthetic_run(d, "search", "grpo", "moe", "none", 0, acc=(0.2, 0.6, 0.1), clip=0.01, ratio_std=0.3, label="lr")
    synthetic_run(d, "search", "gspo", "moe", "none", 0, acc=(0.2, 0.6, 0.6), clip=0.2, ratio_std=0.01, label="lr")

    runs = load_lab(d)
    assert len(runs) == 3 * (4 + 1 + 2) + 2
    rows = {c["claim"]: c for c in claims(runs)}
    # C1: mean over steps 2 and 4: GSPO 0.55 vs GRPO 0.35 (seed wiggles cancel in the mean), spread ~0.02 -> higher.
    assert rows["C1"]["verdict"] == "reproduced"
    assert "GSPO 55.0 ± 2.0% vs GRPO 35.0 ± 2.0% (Δ +20.0 ± 1.6 pts)" in rows["C1"]["measured"]
    # C2: 0.15 / 0.001 = 150x
    assert rows["C2"]["verdict"] == "reproduced" and "150x" in rows["C2"]["measured"]
    # C3: 2 layers 0.1%, 8 layers 0.4% -> grows, but 0.10 / 0.004 = 25x below the paper.
    assert rows["C3"]["verdict"] == "partly" and "25x below" in rows["C3"]["measured"]
    assert "slope +0.050 pts/layer" in rows["C3"]["measured"]  # (0.4 - 0.1) / 6 layers
    # C4: GRPO without replay (0.35) below GRPO + replay (0.55) and GSPO (0.55): reproduced.
    assert rows["C4"]["verdict"] == "reproduced"
    # C5: ratio std 0.01 vs 0.2, no spread -> lower.
    assert rows["C5"]["verdict"] == "reproduced" and "GSPO 0.01 ± 0 vs GRPO 0.2 ± 0" in rows["C5"]["measured"]

    report = write_report(d).read_text()
    assert "| grpo | moe-L4 | old_policy | 3 | 20.0 ± 0.0% | 60.0 ± 2.0% | 55.0 ± 2.0% |" in report
    assert "| 8 | 3 | 0.40 ± 0.20% |" in report  # depth table: drifts 0.004, 0.006, 0.002
    assert "| search-lr-grpo-moe-none-s0 | 4 | held-out accuracy 60.0% (step 2) -> 10.0% |" in report
    assert "| lr | gspo | 1 |" in report and "+25.0 ± 0.0 pts (higher)" in report  # (0.6+0.6)/2 - (0.6+0.1)/2
    for name in ("learning_curves", "learning_vs_tokens", "clipping_and_spread", "drift_vs_depth", "search"):
        assert f"![{name}](plots/{name}.png)" in report
    assert png_size(d / "plots" / "clipping_and_spread.png") == (1500, 400)  # 3 panels of 5 x 4 inches at 100 dpi


def test_stat_handles_nan_and_single_values():
    assert stat([1.0, 3.0, float("nan")]) == {"mean": 2.0, "std": pytest.approx(2 ** 0.5), "n": 2}
    assert stat([0.5]) == {"mean": 0.5, "std": 0.0, "n": 1}
    assert stat([])["n"] == 0


# ------------------------------------------------------------------------------- micro lab, for real
@pytest.mark.slow
def test_micro_lab_end_to_end(tmp_path):
    cfg = lab(tmp_path, objectives=["grpo", "gspo"], models=["dense"], seeds=[0], depths=[], search={},
              num_layers=1, max_steps=2, eval_steps=1, per_device_batch_size=2, num_generations=4, num_minibatches=2,
              max_completion_length=8, eval_num_prompts=4, eval_k=2, sft_max_steps=3, learning_rate=1e-3, workers=2)
    lines = []  # two worker processes, one thread each
    summary = run_lab(cfg, log=lines.append)
    assert (summary["runs"], summary["ran"]) == (2, 2)
    for name in ("grpo-dense-none-s0", "gspo-dense-none-s0"):
        records = read_metrics(tmp_path / "lab" / "runs" / name)
        assert [r["step"] for r in records] == [0, 1, 2]
        assert "grad/norm_std" in records[1] and "eval/mean_at_k" in records[2]
    coldstart = json.loads((tmp_path / "lab" / "coldstart" / "dense-L1" / "model" / "config.json").read_text())
    assert coldstart["num_hidden_layers"] == 1
    report = Path(summary["report"]).read_text()
    assert report.count("| C") == 5 and "| grpo | dense-L1 | none | 1 |" in report
    # One progress line per finished run, "[i/2] <name>: ...", numbered in the order the workers finished.
    progress = sorted(line.split(":")[0].split(" ") for line in lines if line.startswith("["))
    assert [count for count, _ in progress] == ["[1/2]", "[2/2]"]
    assert sorted(name for _, name in progress) == ["grpo-dense-none-s0", "gspo-dense-none-s0"]
    assert run_lab(cfg, log=lambda _: None)["ran"] == 0
    # The same lab run in this process (one worker) gives the same numbers: one thread everywhere.
    inline = make_config(LabConfig, {**to_dict(cfg), "workers": 1, "output_dir": str(tmp_path / "inline")})
    run_lab(inline, log=lambda _: None)
    for name in ("grpo-dense-none-s0", "gspo-dense-none-s0"):
        assert comparable(tmp_path / "lab" / "runs" / name) == comparable(tmp_path / "inline" / "runs" / name)
