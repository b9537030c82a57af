"""Helpers shared by the benchmark scripts: machine description, medians, tables, JSON results."""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# The "50M" dense model of the sampler benchmarks (49.2M parameters with the add3 vocabulary):
# model_overrides of the tiny-dense preset, the same in every table that names it
MODEL_50M = {"num_hidden_layers": 8, "hidden_size": 640, "intermediate_size": 2560, "num_attention_heads": 10,
             "num_key_value_heads": 5, "head_dim": 64}
REPO = Path(__file__).resolve().parent.parent


def machine() -> dict:
    """Cores, CPU model, memory and library versions: every figure says where it was measured."""
    import torch

    cpu, flags = platform.processor() or platform.machine(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):  # the vector units that decide CPU kernel speed (machines here differ)
                have = set(line.split(":", 1)[1].split())
                flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in have]
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    info = {
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu,
        "cpu_flags": flags,
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        # the machine may be shared: the 1/5/15-minute load averages when the result was written
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def command_line() -> str:
    """The command that produced a result, as one would type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(REPO)
    except ValueError:
        pass
    return " ".join(["python", str(script), *map(shlex.quote, sys.argv[1:])])


def median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def table(headers: list[str], rows: list[list]) -> str:
    """A markdown table; floats get 3 significant digits unless already formatted."""
    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e5 else f"{v:.3e}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(name: str, payload: dict, out: str | None = None) -> Path:
    """Write `payload` plus machine, command and date to benchmarks/results/<name>.json (or `out`)."""
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name, "command": command_line(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": machine(), **payload}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM: the peak RSS, reset by writing 5 to clear_refs)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def served_as_worker(spec: str | None, worker) -> bool:
    """In a worker process (`--worker SPEC`, SPEC a JSON dict): print `RESULT {worker(spec)}` for
    `worker_result` and return True; in the parent (no spec) return False."""
    if spec is None:
        return False
    print("RESULT " + json.dumps(worker(json.loads(spec))))
    return True


def worker_result(argv: list[str], what: str, env: dict | None = None) -> dict:
    """Run a worker process (`argv`) and return the dict it printed last as `RESULT {json}`; a failed
    worker stops the benchmark with its output, named `what`."""
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"{what} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def baseline_tree(rev: str, work: Path) -> Path:
    """A git worktree of this repository at `rev` (made once, under `work`), for the baseline side."""
    repo = REPO
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=repo, capture_output=True,
                            text=True)
    if commit.returncode:
        sys.exit(f"--baseline {rev}: not a commit of {repo}: {commit.stderr.strip()}")
    tree = work / f"baseline_{commit.stdout.strip()[:12]}"
    if not (tree / "gspo" / "trainer.py").exists():
        subprocess.run(["git", "worktree", "add", "--detach", "--force", str(tree), commit.stdout.strip()], cwd=repo,
                       check=True, capture_output=True)
    return tree
