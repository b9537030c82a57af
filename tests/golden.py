"""Golden outputs of tiny training runs: the behaviour a restructuring of gspo must keep.

    python tests/golden.py record [case ...]    # writes tests/golden/<case>.json
    python tests/golden.py compare [case ...]   # reruns the cases, one line per case

Record from the pristine code: `PYTHONPATH=/path/to/pristine/checkout python tests/golden.py record`
(the gspo used and its commit are printed and stored). Every case runs `gspo.trainer.train` in a
fresh process (torchrun with 2 processes on CPU/gloo for ddp and fsdp), OMP_NUM_THREADS=1, into a
temporary output_dir, and keeps metrics.jsonl without its wall-clock keys and the final weights
(model/model.safetensors: a sha256 over the tensors in sorted key order, and per-tensor sum, norm
and largest magnitude).

Comparison, always made (never skipped). One process: every metric bitwise equal (NaN == NaN) and
the same weight hash, when torch, transformers and the CPU (avx512f, torch's CPU capability) are
those of the recording. Otherwise a tolerance: DIST_EXACT (rewards, lengths, accuracies) exact (a
sampled token that flips changes them, and that is reported, not hidden), every other metric to
rel 1e-3 or abs 1e-6, the weight statistics to 5e-5 of a tensor's largest magnitude, hash skipped.
Measured: goldens recorded with transformers 5.24 on an AVX2 CPU, rerun with 5.25 on AVX-512
(2026-12-04): no token flipped in any case; the largest metric difference was loss/policy of
moe_none_drift, 2.3726e-05 vs 2.3756e-05 (rel 1.3e-3, abs 3e-8). Two processes: always the
tolerance of tests/test_dist.py (metrics rel 1e-3, abs 1e-9, the same exact keys, weights as above).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script too: conftest is beside it
from conftest import SMALL, SMALL_MOE  # noqa: E402  (the tiny models' sizes, defined once)

HERE = Path(__file__).resolve().parent
GOLDEN_DIR = HERE / "golden"
TIMING_PREFIXES = ("time/", "throughput/")  # the only wall-clock keys gspo logs
FALLBACK_REL, FALLBACK_ABS, ABS = 1e-3, 1e-6, 1e-9  # another environment; ABS: two processes
DIST_METRIC_REL, DIST_WEIGHT_REL = 1e-3, 5e-5  # tests/test_dist.py, assert_same_run
DIST_EXACT = ("step", "reward/mean", "reward/std", "completion/mean_len", "completion/max_len",
              "groups/zero_std_frac", "lr", "eval/accuracy", "eval/mean_at_k", "guard/skipped_steps")


def text_hash(prompts, completions, **_):
    """A reward with spread in nearly every group, so every step updates the weights."""
    return [sum(map(ord, c)) % 5 / 4 for c in completions]


BASE = dict(model="tiny-dense", model_overrides=SMALL, task="add3", max_steps=3, per_device_batch_size=2,
            num_generations=4, num_minibatches=2, max_completion_length=8, learning_rate=1e-3,
            reward_funcs=["answer_match", text_hash], eval_num_prompts=2, eval_k=2, progress=False, device="cpu",
            log_samples_steps=0)
MOE = dict(model="tiny-moe", model_overrides=SMALL_MOE, learning_rate=1e-2, max_steps=2)
DIST = dict(per_device_batch_size=2, kl_coef=0.01, sft_coef=0.05, eval_steps=2, seeded_sampling=True)
TWO_PROCESS = {"ddp", "fsdp"}  # run under torchrun --nproc_per_node=2
CASES = {
    "dense_gspo": dict(objective="gspo", eval_steps=2),
    "dense_grpo_kl_epochs": dict(objective="grpo", kl_coef=0.05, num_epochs=2, num_minibatches=2,
                                 warmup_steps=2, lr_scheduler="cosine"),
    "moe_none_drift": dict(MOE, routing_replay="none", log_routing_drift=True),
    "moe_old_policy": dict(MOE, routing_replay="old_policy", num_epochs=2),
    "moe_rollout": dict(MOE, routing_replay="rollout"),
    "multitask_dynamic_sft": dict(
        task=None, tasks=[{"task": "add2", "reward_funcs": ["answer_match"]},  # no reward spread: weight falls
                          {"task": "add3"}, {"name": "hard", "task": "mul3", "weight": 2}],
        task_weighting="dynamic", task_weight_floor=0.1, task_weight_smoothing=0.5, task_progress_coef=1.0,
        sft_coef=0.5, sft_schedule="linear", per_device_batch_size=4),
    "sampler_logprobs": dict(use_sampler_logprobs=True),
    "ppo_gae_kl_in_reward": dict(objective="grpo", advantage_estimator="gae", gae_lambda=0.9, kl_coef=0.05,
                                 kl_in_reward=True, critic_learning_rate=3e-3),  # issue 17: the critic's path
    "ddp": dict(DIST, distributed="ddp"),
    "fsdp": dict(DIST, distributed="fsdp"),
}


def config_of(case: str) -> dict:
    return {**BASE, **CASES[case]}


# ------------------------------------------------------------------------------- one run
def environment() -> dict:
    """What bitwise equality of single-process floats depends on."""
    import torch
    import transformers

    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    return {"torch": torch.__version__, "transformers": transformers.__version__, "avx512f": "avx512f" in flags,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def source_of_gspo() -> dict:
    import gspo

    root = Path(gspo.__file__).resolve().parent.parent

    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True).stdout.strip()

    return {"path": str(root), "commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--", "gspo"))}


def weights_summary(path: Path) -> dict:
    """sha256 of (name, dtype, shape, raw bytes) in sorted key order; per tensor [sum, norm, max |w|, numel]."""
    import torch
    from safetensors.torch import load_file

    tensors, digest, stats = load_file(path), hashlib.sha256(), {}
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        digest.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        w = t.double()
        stats[key] = [w.sum().item(), w.norm().item(), w.abs().max().item(), w.numel()]
    return {"sha256": digest.hexdigest(), "stats": stats}


def read_metrics(path: Path) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in lines]


def worker(case: str, result: Path) -> None:
    """Runs inside the case's process (every rank under torchrun); rank 0 writes the result."""
    from gspo.config import TrainConfig, make_config
    from gspo.trainer import train

    out = result.parent / "run"
    train(make_config(TrainConfig, {**config_of(case), "output_dir": str(out)}))
    if os.environ.get("RANK", "0") == "0":
        result.write_text(json.dumps({"gspo": source_of_gspo(), "env": environment(),
                                      "metrics": read_metrics(out / "metrics.jsonl"),
                                      "weights": weights_summary(out / "model" / "model.safetensors")}))


def run_case(case: str) -> dict:
    """The case in a fresh process (2 under torchrun); its result and how long it took."""
    nproc = 2 if case in TWO_PROCESS else 1
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(prefix=f"golden_{case}_") as tmp:
        result, started = Path(tmp) / "result.json", time.perf_counter()
        done = subprocess.run([*launcher, str(Path(__file__).resolve()), "worker", case, str(result)], cwd=tmp,
                              env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0 or not result.exists():
            raise RuntimeError(f"case {case}: exit status {done.returncode}\n{done.stderr[-4000:]}")
        return {"case": case, "nproc": nproc, "config": config_of(case), **json.loads(result.read_text()),
                "seconds": time.perf_counter() - started}


# ------------------------------------------------------------------------------- comparison
def same(a, b) -> bool:
    return a == b or (a is None and b is None)  # metrics.jsonl writes NaN as null


def close(a, b, rel: float, abs_tol: float = ABS) -> bool:
    if a is None or b is None or isinstance(a, bool) or not isinstance(a, (int, float)):
        return same(a, b)
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_tol)


def metric_difference(old: list[dict], new: list[dict], mode: str) -> str | None:
    """The first difference ('step S key K: old vs new'), or None."""
    for i, (ro, rn) in enumerate(zip(old, new)):
        step = ro.get("step", i)
        for key in sorted(set(ro) | set(rn)):
            if key not in ro or key not in rn:
                return f"step {step}: key {key!r} only in the {'golden' if key in ro else 'new run'}"
            a, b = ro[key], rn[key]
            ok = (same(a, b) if mode == "exact" or key in DIST_EXACT  # a flipped token changes these
                  else close(a, b, FALLBACK_REL, FALLBACK_ABS) if mode == "fallback" else close(a, b, DIST_METRIC_REL))
            if not ok:
                return f"step {step} {key}: golden {a!r}, now {b!r}"
    if len(old) != len(new):
        return f"{len(old)} metric lines in the golden, {len(new)} now"
    return None


def weight_difference(old: dict, new: dict, rel: float) -> str | None:
    """Per tensor: sum, norm and max |w| within what a largest difference of rel * max |w| allows."""
    if set(old) != set(new):
        return f"weight names differ: {sorted(set(old) ^ set(new))}"
    for key, (s, n, m, numel) in old.items():
        s2, n2, m2, _ = new[key]
        delta = rel * m
        if not (abs(s - s2) <= numel * delta and abs(n - n2) <= math.sqrt(numel) * delta and abs(m - m2) <= delta):
            return f"weights {key}: golden [sum, norm, max |w|] {[s, n, m]}, now {[s2, n2, m2]}"
    return None


def compare(golden: dict, new: dict) -> tuple[bool, str]:
    """(passed, one line: identical / within tolerance (why) / differs: first difference).

    A metric the golden run did not log at all (a newly added one) is named, not compared: new
    metrics are additive; every metric the golden has must still be there and agree.
    """
    known = {k for row in golden["metrics"] for k in row}
    added = sorted({k for row in new["metrics"] for k in row} - known)
    new = {**new, "metrics": [{k: v for k, v in row.items() if k in known} for row in new["metrics"]]}
    bitwise = new["metrics"] == golden["metrics"] and new["weights"]["sha256"] == golden["weights"]["sha256"]
    if golden["nproc"] > 1:
        problem = (metric_difference(golden["metrics"], new["metrics"], "dist")
                   or weight_difference(golden["weights"]["stats"], new["weights"]["stats"], DIST_WEIGHT_REL))
        tolerance = "within the tests/test_dist.py tolerance"
    elif golden["env"] == new["env"]:
        problem = metric_difference(golden["metrics"], new["metrics"], "exact")
        if problem is None and new["weights"]["sha256"] != golden["weights"]["sha256"]:
            problem = "final weights hash differs (metrics identical)"
        tolerance = "identical"
    else:
        changed = {k: (v, new["env"][k]) for k, v in golden["env"].items() if new["env"].get(k) != v}
        problem = (metric_difference(golden["metrics"], new["metrics"], "fallback")
                   or weight_difference(golden["weights"]["stats"], new["weights"]["stats"], DIST_WEIGHT_REL))
        tolerance = (f"within rel {FALLBACK_REL} / abs {FALLBACK_ABS}, rewards and counts exact, weight hash "
                     f"skipped (environment differs: {changed})")
    if problem:
        return False, f"differs: {problem}"
    return True, ("identical" if bitwise else tolerance) + (f" (new metrics, not in the golden: {', '.join(added)})"
                                                            if added else "")


def load_golden(case: str) -> dict:
    return json.loads((GOLDEN_DIR / f"{case}.json").read_text())


def check(case: str) -> tuple[bool, str, float]:
    """Reruns `case` with the importable gspo against its golden: (passed, message, seconds)."""
    new = run_case(case)
    passed, message = compare(load_golden(case), new)
    return passed, message, new["seconds"]


def record(case: str) -> float:
    result = run_case(case)
    seconds = result.pop("seconds")
    GOLDEN_DIR.mkdir(exist_ok=True)
    text = json.dumps(result, indent=1, default=lambda f: f"tests/golden.py:{f.__name__}")  # callables by name
    (GOLDEN_DIR / f"{case}.json").write_text(text + "\n")
    return seconds


def main(argv: list[str]) -> int:
    command, names = (argv[0] if argv else ""), argv[1:]
    if command == "worker":
        worker(names[0], Path(names[1]))
        return 0
    unknown = [n for n in names if n not in CASES]
    if command not in ("record", "compare") or unknown:
        print(__doc__ if not unknown else f"unknown cases {unknown}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    failed, gspo = 0, source_of_gspo()  # the gspo the case processes import (same sys.path as this one)
    print(f"gspo from {gspo['path']} @ {gspo['commit'] or 'no git checkout'}"
          f"{' with uncommitted changes' if gspo['dirty'] else ''}", flush=True)
    if command == "record" and (gspo["dirty"] or not gspo["commit"]):
        print("refusing to record: goldens come from a committed, unmodified gspo", file=sys.stderr)
        return 2
    for case in names or CASES:
        if command == "record":
            seconds = record(case)
            print(f"{case:24s} recorded in {seconds:5.1f}s", flush=True)
        else:
            passed, message, seconds = check(case)
            failed += not passed
            print(f"{case:24s} {seconds:5.1f}s  {message}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
