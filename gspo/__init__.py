"""gspo: stable RL post-training of language models (GSPO, GRPO, MoE routing replay)."""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from gspo.version import __version__

# Modules that moved in 0.1's restructuring (docs/layout.md): their old names still import, with a
# DeprecationWarning naming the new one, until 0.3. A package maps its submodules too (gspo.lab.runs).
MOVED = {
    **{f"gspo.{m}": f"gspo.algo.{m}" for m in ("objectives", "advantages", "values", "correction", "logprobs",
                                                "schedules")},
    **{f"gspo.{m}": f"gspo.plugs.{m}" for m in ("baselines", "critic", "routing", "moe", "reference", "auxiliary",
                                                 "supervised", "lora", "precision", "parallel")},
    **{f"gspo.{m}": f"gspo.apps.{m}" for m in ("cli", "api", "bench", "demo", "demo_real", "demo_tools", "lab")},
    "gspo.rollout.wire": "gspo.rollout.endpoint.wire",
    "gspo.rollout.remote.wire": "gspo.rollout.endpoint.wire",
    "gspo.rollout.remote": "gspo.rollout.endpoint",  # its other modules are retired (issue 51)
    "gspo.data.sandbox": "gspo.sandbox.runner",
    **{f"gspo.data.sandbox_{m}": f"gspo.sandbox.{m}" for m in ("child", "judge", "kernel", "launch", "wire")},
    "gspo.data.sandbox_exec": "gspo.sandbox.execute",
}


def moved_to(name: str) -> str | None:
    """The new name of a moved module `name` (or of a module inside a moved package); None: not moved."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module's old name as the new module itself (one module object, not a copy)."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if moved_to(name) else None

    def create_module(self, spec):
        new = moved_to(spec.name)
        warnings.warn(f"{spec.name} moved to {new}: import that (the old name is removed in gspo 0.3)",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        """Nothing: the new module ran when it was imported."""


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())

from gspo.apps.api import GRPOTrainer, GSPOTrainer, Trainer  # noqa: E402  (light: torch loads when training starts)
from gspo.config import TrainConfig  # noqa: E402

__all__ = ["GRPOTrainer", "GSPOTrainer", "TrainConfig", "Trainer", "__version__"]
