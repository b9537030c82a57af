"""The stability lab: GSPO paper claims rerun in miniature, side by side (`gspo lab`).

A lab is a folder of short RL runs from shared cold-start models:
  main grid   objectives x {dense, moe} x routing replay (MoE only) x seeds   (claims C1, C2, C4, C5)
  depth sweep GRPO on MoE models of several depths                         (claim C3)
  search      GRPO vs GSPO under settings that might separate them         (where do they differ?)
  regimes     methods x regime axes (sampler mismatch, staleness, off-policy degree, answer length,
              MoE shape) x seeds: the stability map (gspo/apps/lab/regimes.py, gspo/apps/lab/stability_map.py)
Every run is an ordinary `gspo.trainer.train` run with its own metrics.jsonl; a run is complete
when its `done.json` exists, so rerunning the same command skips finished runs and restarts
the one that was interrupted. `gspo.apps.lab.report` turns the folder into report.md with plots.

What we simplified: one cold start per architecture (seed 0), so the spread over seeds is the
RL's own; every run uses the same task (3-digit addition by default) and CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gspo.apps.lab.regimes import check_regimes, regime_runs, train_settings
from gspo.apps.lab.workers import as_completed, one_thread, pool
from gspo.config import SFTConfig, TrainConfig, check_choice, check_positive, load_config, make_config, to_dict

PRESETS = {"dense": "tiny-dense", "moe": "tiny-moe"}
DONE = "done.json"
# Keys of a run's TrainConfig that may differ between two invocations of the same lab (paths, display).
_VOLATILE = ("output_dir", "model", "progress")


@dataclass
class LabConfig:
    """Stability lab (`gspo lab`): a grid of short RL runs comparing objectives on dense and MoE models."""

    output_dir: str = "runs/lab"
    """Lab folder: cold starts, one folder per run, report.md and plots. Rerunning continues where it stopped."""
    task: str = "add3"
    """Built-in task every run trains and evaluates on."""
    objectives: list = field(default_factory=lambda: ["grpo", "gspo", "gspo_token"])
    """Objectives compared in the main grid."""
    models: list = field(default_factory=lambda: ["dense", "moe"])
    """Architectures: dense (tiny-dense preset) and/or moe (tiny-moe preset), at depth `num_layers`."""
    routing_replay: list = field(default_factory=lambda: ["none", "old_policy"])
    """Routing replay modes tried on MoE runs (dense runs use none); replay runs use GRPO only unless
    `replay_all_objectives`."""
    replay_all_objectives: bool = False
    """Also run GSPO variants with routing replay (the paper's claim needs GRPO with replay only)."""
    seeds: list = field(default_factory=lambda: [0, 1, 2])
    """RL seeds; every seed starts from the same cold-start model, so the spread is the RL's own."""
    num_layers: int = 4
    """Decoder layers of the main grid's models."""
    max_steps: int = 40
    """RL steps per run."""
    per_device_batch_size: int = 8
    """Prompts per rollout batch (B)."""
    num_generations: int = 8
    """Completions per prompt (G)."""
    num_minibatches: int = 4
    """Optimizer steps per rollout batch: the off-policy degree (GSPO paper: 4)."""
    max_completion_length: int = 48
    """Maximum new tokens per completion."""
    learning_rate: float = 1e-4
    """AdamW learning rate of the RL runs."""
    warmup_steps: int = 4
    """Linear warmup of the RL runs, in optimizer steps."""
    eval_steps: int = 10
    """Held-out evaluation every this many RL steps (and before and after)."""
    eval_num_prompts: int = 100
    """Held-out prompts per evaluation."""
    eval_k: int = 4
    """Samples per held-out prompt (mean@k, pass@k)."""
    depths: list = field(default_factory=lambda: [2, 4, 8])
    """MoE depths of the routing-drift sweep (claim C3); empty skips it."""
    depth_steps: int = 10
    """RL steps of each depth-sweep run (GRPO, no replay)."""
    search: dict = field(default_factory=lambda: {"lr_3e-4": {"learning_rate": 3e-4}})
    """Search for a regime where the objectives differ: label -> TrainConfig overrides, run for `search_objectives`
    on `search_model`. More minibatches and a mismatched sampler are axes of the regimes lab
    (configs/lab_regimes.yaml), with 3 seeds."""
    search_objectives: list = field(default_factory=lambda: ["grpo", "gspo"])
    """Objectives run under each search setting."""
    search_model: str = "moe"
    """Architecture of the search runs (the paper's instability is an MoE one), no routing replay."""
    search_seeds: list | None = field(default_factory=lambda: [0, 1])
    """Seeds of the search runs; null: `seeds`."""
    main_grid: bool = True
    """Run the main grid (objectives x models x routing replay); false for a lab of regimes only."""
    regimes: dict = field(default_factory=dict)
    """Regimes: axis -> level -> settings, {TrainConfig field: value} plus `arch` (config overrides of the
    cold-start model, e.g. {num_hidden_layers: 16}); every level runs each method of `regime_methods` that applies
    to it, beside a shared `baseline` level (the lab's own settings). Empty: no regimes (gspo/apps/lab/regimes.py)."""
    regime_methods: dict = field(default_factory=dict)
    """Regimes: method name -> TrainConfig overrides, e.g. {grpo_tis: {objective: grpo, rollout_correction:
    token_tis}}."""
    axis_methods: dict = field(default_factory=dict)
    """Regimes: axis -> the names of `regime_methods` run on its levels (an axis not listed runs them all); the
    baseline runs `axis_methods.baseline` if given, else every method some axis runs. What is left out is listed in
    the report with the reason."""
    regime_model: str = "moe"
    """Architecture of the regime runs (dense or moe; routing replay methods run on moe only)."""
    regime_seeds: list | None = None
    """Seeds of the regime runs; null: `seeds`."""
    sft_max_steps: int = 400
    """Cold-start SFT steps (upper bound; it stops at `sft_target_accuracy`)."""
    sft_target_accuracy: float = 0.4
    """Greedy held-out accuracy at which the cold start stops, leaving room for RL."""
    train_overrides: dict | None = None
    """Extra TrainConfig fields applied to every RL run, e.g. {max_completion_length: 96}."""
    device: str = "cpu"
    """Device of every run: cpu (the lab's timings are CPU ones), cuda or auto."""
    workers: int = 0
    """Runs at a time, each in its own process on one CPU thread; 0: one per CPU core."""

    def validate(self) -> None:
        """The checks `gspo.config.make_config` runs on a LabConfig (allowed values from their owners)."""
        from gspo.algo.objectives import OBJECTIVES
        from gspo.plugs.moe import (
            REPLAY_MODES,  # here, not at the top: importing gspo.apps.lab.runs stays free of torch
        )

        for name, choices in (("objectives", OBJECTIVES), ("models", PRESETS),
                              ("routing_replay", REPLAY_MODES), ("search_objectives", OBJECTIVES)):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"config: {name} is empty")
            for value in values:
                if value not in choices:
                    raise ValueError(f"config: {name} entry {value!r} is not one of {', '.join(choices)}")
        check_choice(self, "search_model", PRESETS)
        for name in ("seeds", "search_seeds", "regime_seeds", "depths"):
            values = getattr(self, name) or []
            if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
                raise ValueError(f"config: {name}={values!r} must be a list of integers")
        if not self.seeds:
            raise ValueError("config: seeds is empty")
        if any(d < 1 for d in self.depths):
            raise ValueError(f"config: depths={self.depths!r} must be >= 1")
        check_positive(self, "num_layers", "max_steps", "per_device_batch_size", "num_generations", "num_minibatches",
                       "max_completion_length", "learning_rate", "eval_num_prompts", "eval_k", "depth_steps",
                       "sft_max_steps")
        check_positive(self, "warmup_steps", "eval_steps", "workers", allow_zero=True)
        if not 0 < self.sft_target_accuracy <= 1:
            raise ValueError(f"config: sft_target_accuracy={self.sft_target_accuracy!r} must be in (0, 1]")
        for label, overrides in self.search.items():
            if not isinstance(overrides, dict):
                raise ValueError(f"config: search[{label!r}] must be a mapping of TrainConfig fields, "
                                 f"got {overrides!r}")
        check_choice(self, "regime_model", PRESETS)
        check_regimes(self.regimes, self.regime_methods, self.axis_methods)
        # Every run's TrainConfig is built (and so checked) by `train_config` before anything runs.


QUICK_LAB = dict(objectives=["grpo", "gspo"], seeds=[0, 1], num_layers=2, max_steps=20, eval_steps=10,
                 eval_num_prompts=50, depths=[2, 4], depth_steps=5, search={"lr_3e-4": {"learning_rate": 3e-4}},
                 search_seeds=[0], sft_max_steps=300)
"""`gspo lab --quick`: 2-layer main grid, fewer objectives, seeds, steps and held-out prompts; one search setting."""


@dataclass
class RunSpec:
    """One RL run of the lab: what distinguishes it from its neighbours in the grid."""

    group: str  # main | depth | search | regime
    objective: str
    model: str  # dense | moe
    layers: int
    replay: str  # none | old_policy | rollout
    seed: int
    label: str = ""  # the search setting's or regime's name
    overrides: dict = field(default_factory=dict)  # TrainConfig fields the search setting (regime + method) changes
    method: str = ""  # a regime run's method name
    arch: dict = field(default_factory=dict)  # a regime's config overrides of the cold-start model

    @property
    def name(self) -> str:
        if self.group == "regime":
            return f"regime-{self.label}-{self.method}-s{self.seed}"
        head = {"main": "", "depth": f"depth{self.layers}-", "search": f"search-{self.label}-"}[self.group]
        return f"{head}{self.objective}-{self.model}-{self.replay}-s{self.seed}"

    @property
    def config_key(self) -> tuple:
        """Runs that differ only by seed share this key (they are averaged in the report)."""
        return (self.group, self.label, self.method, self.objective, self.model, self.layers, self.replay)

    @property
    def cold_key(self) -> tuple:
        """The cold start it needs: architecture, depth, other model config, task and completion length (None:
        the lab's; the cold start's held-out accuracy, which stops it, is scored at the runs' length)."""
        return (self.model, self.layers, tuple(sorted(self.arch.items())), self.overrides.get("task"),
                self.overrides.get("max_completion_length"))


def expand_grid(cfg: LabConfig) -> list[RunSpec]:
    """Every run of the lab, in the order they are run (cheapest claims first)."""
    runs = []
    for model in cfg.models if cfg.main_grid else []:
        replays = [r for r in cfg.routing_replay if model == "moe" or r == "none"] or ["none"]
        for replay in replays:
            for objective in cfg.objectives:
                if replay != "none" and objective != "grpo" and not cfg.replay_all_objectives:
                    continue  # C4 compares GRPO with replay against both objectives without it
                runs += [RunSpec("main", objective, model, cfg.num_layers, replay, s) for s in cfg.seeds]
    runs += [RunSpec("depth", "grpo", "moe", depth, "none", s) for depth in cfg.depths for s in cfg.seeds]
    for label, overrides in cfg.search.items():
        for objective in cfg.search_objectives:
            seeds = cfg.search_seeds if cfg.search_seeds is not None else cfg.seeds
            runs += [RunSpec("search", objective, cfg.search_model, cfg.num_layers, "none", s, label, dict(overrides))
                     for s in seeds]
    seeds = cfg.regime_seeds if cfg.regime_seeds is not None else cfg.seeds
    for label, settings, method, overrides in regime_runs(cfg.regimes, cfg.regime_methods, cfg.regime_model,
                                                                  cfg.axis_methods)[0]:
        train, arch = {**train_settings(settings), **overrides}, dict(settings.get("arch", {}))
        layers = arch.pop("num_hidden_layers", cfg.num_layers)
        runs += [RunSpec("regime", train.get("objective", "grpo"), cfg.regime_model, layers,
                         train.get("routing_replay", "none"), s, label, train, method, arch) for s in seeds]
    return runs


def coldstart_dir(lab_dir: Path, model: str, layers: int, arch: tuple = (), task: str | None = None,
                  length: int | None = None) -> Path:
    """lab/coldstart/<model>-L<layers>[-<field><value>...][-<task>][-len<n>]: one per architecture, task and length."""
    name = (f"{model}-L{layers}" + "".join(f"-{k}{v}" for k, v in arch) + (f"-{task}" if task else "") +
            (f"-len{length}" if length else ""))
    return Path(lab_dir) / "coldstart" / name


def sft_config(cfg: LabConfig, model: str, layers: int, arch: tuple = (), task: str | None = None,
               length: int | None = None) -> SFTConfig:
    """The cold start: the demo's partial SFT (stops at `sft_target_accuracy`), one per architecture, task and
    completion length (held-out answers are generated up to the runs' length: a shorter one cuts long answers
    off, so the accuracy that stops the cold start would read 0)."""
    generate = length or (cfg.train_overrides or {}).get("max_completion_length", cfg.max_completion_length)
    return make_config(SFTConfig, dict(
        model=PRESETS[model], model_overrides={"num_hidden_layers": layers, **dict(arch)}, task=task or cfg.task,
        num_examples=2000,
        max_steps=cfg.sft_max_steps, batch_size=32, learning_rate=2e-3, warmup_steps=20,
        target_accuracy=cfg.sft_target_accuracy, eval_steps=20, eval_num_prompts=100,
        max_completion_length=generate, seed=0, device=cfg.device, progress=False,
        output_dir=str(coldstart_dir(cfg.output_dir, model, layers, arch, task, length))))


def train_config(cfg: LabConfig, spec: RunSpec) -> TrainConfig:
    """The run's full TrainConfig (validated): lab settings, then the search overrides, then `train_overrides`."""
    values = dict(
        model=str(coldstart_dir(cfg.output_dir, *spec.cold_key) / "model"), task=cfg.task,
        objective=spec.objective, routing_replay=spec.replay, seed=spec.seed, device=cfg.device,
        max_steps=cfg.depth_steps if spec.group == "depth" else cfg.max_steps,
        per_device_batch_size=cfg.per_device_batch_size, num_generations=cfg.num_generations,
        num_minibatches=cfg.num_minibatches, max_completion_length=cfg.max_completion_length,
        learning_rate=cfg.learning_rate, warmup_steps=cfg.warmup_steps, eval_steps=cfg.eval_steps,
        eval_num_prompts=cfg.eval_num_prompts, eval_k=cfg.eval_k, log_samples_steps=0, progress=False,
        output_dir=str(run_dir(cfg.output_dir, spec)))
    values.update(spec.overrides)
    values.update(cfg.train_overrides or {})
    try:
        return make_config(TrainConfig, values)
    except ValueError as err:
        raise ValueError(f"lab run {spec.name}: {err}") from err


def run_dir(lab_dir, spec: RunSpec) -> Path:
    return Path(lab_dir) / "runs" / spec.name


def is_done(path: Path) -> bool:
    return (Path(path) / DONE).is_file()


def _comparable(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in _VOLATILE}


def _check_same_settings(spec: RunSpec, path: Path, expected: TrainConfig) -> None:
    """A finished run found on disk must have been made with the settings asked for now."""
    stored = _comparable(json.loads((path / DONE).read_text())["config"])
    wanted = _comparable(json.loads(json.dumps(to_dict(expected))))
    changed = sorted(k for k in set(stored) | set(wanted) if stored.get(k) != wanted.get(k))
    if changed:
        raise ValueError(f"lab run {spec.name} in {path} was made with other settings ({', '.join(changed)}); "
                         "use a new output_dir, or delete that run to redo it")


class _Clock:
    """ETA for the remaining runs, from the time per unit of work of the runs done so far.

    A unit is one RL step on one dense layer; MoE layers cost about twice as much.
    """

    def __init__(self):
        self.units = self.seconds = 0.0

    @staticmethod
    def cost(spec: RunSpec, tcfg: TrainConfig) -> float:
        return tcfg.max_steps * spec.layers * (2.0 if spec.model == "moe" else 1.0)

    def add(self, units: float, seconds: float) -> None:
        self.units += units
        self.seconds += seconds

    def eta(self, units_left: float) -> str:
        if not self.units:
            return "?"
        left = self.seconds / self.units * units_left
        return f"{left / 60:.1f} min"


def run_lab(cfg: LabConfig, *, log=print, command: str | None = None) -> dict:
    """Run (or continue) the lab in `cfg.output_dir`, then write its report. Returns a summary.

    Runs go to `cfg.workers` processes, each on one CPU thread: small models use a core best
    this way, and one thread makes every run's numbers independent of how many cores there are.
    Without matplotlib (the `lab` extra, which the report's plots need) it refuses before anything runs.
    """
    from gspo.apps.lab.report import write_report
    from gspo.report import check_plotting
    from gspo.runtime import run_lock

    check_plotting()
    started = time.perf_counter()
    lab_dir = Path(cfg.output_dir)
    specs = expand_grid(cfg)
    configs = {spec.name: train_config(cfg, spec) for spec in specs}  # every setting checked before any run
    for spec in specs:
        if is_done(run_dir(lab_dir, spec)):
            _check_same_settings(spec, run_dir(lab_dir, spec), configs[spec.name])
    workers = cfg.workers or os.cpu_count() or 1

    with run_lock(lab_dir), pool(workers) as executor:  # one lab per folder at a time (the lock creates it)
        (lab_dir / "lab.json").write_text(json.dumps({"command": command, "config": to_dict(cfg)}, indent=2))
        colds, todo = _pending(cfg, specs, log)
        skipped = len(specs) - len(todo)
        _run_all(executor, cfg, colds, todo, configs, log=log, workers=workers, skipped=skipped)
    report = write_report(lab_dir)
    seconds = time.perf_counter() - started
    log(f"report: {report}  ({len(todo)} runs in {seconds / 60:.1f} min, {workers} at a time)")
    return {"report": str(report), "runs": len(specs), "ran": len(todo), "skipped": skipped, "seconds": seconds}


def _pending(cfg: LabConfig, specs: list[RunSpec], log) -> tuple[list[tuple], list[RunSpec]]:
    """(cold starts to make, runs to run): those not done yet, their folders checked free of live processes
    before anything runs, and what is made, skipped or restarted said in `log`."""
    lab_dir = Path(cfg.output_dir)
    # Cold starts, one per architecture and task the runs use; long-answer tasks and deep models first.
    colds = sorted({s.cold_key for s in specs}, key=lambda key: (key[4] or 0, key[1]), reverse=True)
    colds = [key for key in colds if not is_done(coldstart_dir(lab_dir, *key))]
    todo = [s for s in specs if not is_done(run_dir(lab_dir, s))]
    for path in [*(coldstart_dir(lab_dir, *key) for key in colds), *(run_dir(lab_dir, s) for s in todo)]:
        _check_not_in_use(path)  # all of them before anything runs
    for key in colds:
        log(f"cold start {coldstart_dir(lab_dir, *key).name}: SFT until greedy accuracy "
            f"{cfg.sft_target_accuracy:.0%}")
    skipped = len(specs) - len(todo)
    if skipped:
        log(f"{skipped} of {len(specs)} runs already complete: skipped")
    for spec in todo:
        if run_dir(lab_dir, spec).exists():
            log(f"  {spec.name}: interrupted earlier, restarting it")
    return colds, todo


def _run_all(executor, cfg: LabConfig, colds: list[tuple], todo: list[RunSpec], configs: dict, *, log,
             workers: int, skipped: int) -> None:
    """The cold starts, then the runs: a run is queued as soon as its cold start exists, so the other workers do
    not wait for the slowest; one line with an ETA per finished run. A failure cancels everything queued."""
    total = skipped + len(todo)
    clock = _Clock()
    units_left = sum(clock.cost(s, configs[s.name]) for s in todo)
    cold_futures, futures = {}, {}

    def queue(ready):
        futures.update({executor.submit(_run_one, configs[s.name], asdict(s)): s for s in todo if ready(s.cold_key)})

    try:
        cold_futures = {executor.submit(_cold_start, sft_config(cfg, *key)): key for key in colds}
        queue(lambda key: key not in colds)
        for future in as_completed(cold_futures):
            future.result()
            queue(lambda key, done=cold_futures[future]: key == done)
        for i, future in enumerate(as_completed(futures), 1):
            spec, done = futures[future], future.result()
            units = clock.cost(spec, configs[spec.name])
            clock.add(units, done["seconds"] / min(workers, len(todo)))  # wall time per unit, runs in parallel
            units_left -= units
            log(f"[{skipped + i}/{total}] {spec.name}: {done['seconds']:.0f} s, held-out mean@{cfg.eval_k} "
                f"{done['first']:.1%} -> {done['last']:.1%}   ETA {clock.eta(units_left)}")
    except BaseException:
        for future in [*cold_futures, *futures]:  # a failure stops the lab: nothing queued runs after it
            future.cancel()
        raise


def _cold_start(scfg: SFTConfig) -> None:
    from gspo.sft import sft

    out = Path(scfg.output_dir)
    _clear(out)  # an interrupted cold start is redone from scratch
    summary = one_thread(sft, scfg)
    (out / DONE).write_text(json.dumps(summary, indent=2, default=str))


def _run_one(tcfg: TrainConfig, spec: dict) -> dict:
    """One lab run, from scratch (an interrupted one is deleted first); writes its done.json."""
    from gspo import trainer

    out = Path(tcfg.output_dir)
    _clear(out)
    t0 = time.perf_counter()
    result = one_thread(trainer.train, tcfg)
    seconds = time.perf_counter() - t0
    (out / DONE).write_text(json.dumps({"spec": spec, "config": to_dict(tcfg), "seconds": seconds,
                                        "evals": {str(k): v for k, v in result["evals"].items()}}, indent=2))
    for path in [out / "model", *out.glob("checkpoint-*")]:  # the lab keeps metrics, not 42 model copies
        shutil.rmtree(path, ignore_errors=True)
    evals = result["evals"]
    return {"seconds": seconds, "first": evals[0]["eval/mean_at_k"], "last": evals[max(evals)]["eval/mean_at_k"]}


def _check_not_in_use(path: Path) -> None:
    """An unfinished run's folder is deleted and redone, unless a live process still holds its run lock."""
    from gspo.runtime import lock_holder  # here: importing gspo.apps.lab.runs stays free of torch

    holder = lock_holder(path)
    if holder:
        raise ValueError(f"lab run folder {path} is in use by a live process ({holder}); left as it is: stop that "
                         "process (an earlier lab's worker?) or wait for it to end, then rerun the lab")


def _clear(path: Path) -> None:
    """Delete an interrupted run's folder to redo it (refused while a live process holds its lock)."""
    _check_not_in_use(path)
    shutil.rmtree(path, ignore_errors=True)


def load_lab_config(quick: bool = False, path=None, overrides: list[str] | None = None) -> LabConfig:
    """`gspo lab` settings: the full lab or `--quick`, then a YAML file, then key=value overrides."""
    return load_config(LabConfig, path, overrides,
                       defaults={**QUICK_LAB, "output_dir": "runs/lab-quick"} if quick else None)
