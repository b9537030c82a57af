"""The code sandbox: runs a model's program and its tests with an OS boundary (docs/episodes.md).

Standard library only (nothing of gspo outside this package, no torch): it could ship as a distribution of
its own. runner.py (run_sandboxed, describe_sandbox: the public face), launch.py (bubblewrap), kernel.py
(seccomp, cgroups), execute.py (driving a run), child.py and judge.py (the program's process and the judge,
run as `python -c` with wire.py's text first), wire.py (their data-only channel).
"""

from gspo.sandbox.runner import SANDBOX_MODES, SandboxResult, describe_sandbox, run_sandboxed

__all__ = ["SANDBOX_MODES", "SandboxResult", "describe_sandbox", "run_sandboxed"]
