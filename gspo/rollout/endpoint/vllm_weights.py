"""The weight-transfer backend "gspo" for vLLM's own server: `vllm serve ... --weight-transfer-config
'{"backend": "gspo"}'` takes a gspo trainer's weights over the authenticated wire (gspo/rollout/endpoint/wire.py),
through vLLM's four phases (its RL routes, VLLM_SERVER_DEV_MODE=1), on any device, CPU included.

`register` is the `vllm.general_plugins` entry point (pyproject.toml): vLLM calls it in each of its processes, and it
only names the engine class (vLLM imports it where it creates the engine). The engine runs in vLLM's worker: at
init it joins the trainer's listener, both proving the run's secret (GSPO_ROLLOUT_SECRET, or rollout_secret_file's
path in GSPO_ROLLOUT_SECRET_FILE, in the server's environment); each update reads one tensors message (a flat buffer
per dtype, checked against the update's names, dtypes and shapes before a byte is read) and loads it with the
model's own `load_weights` between vLLM's layerwise reload start and finish.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

BACKEND = "gspo"


def register() -> None:
    """Register the "gspo" engine with vLLM's factory, once per process (imported lazily, where it is created)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "gspo.rollout.endpoint.vllm_weights_engine",
                                                    "GspoWeightTransferEngine")


def run_secret() -> bytes:
    """The run's secret in vLLM's server: GSPO_ROLLOUT_SECRET, else the file GSPO_ROLLOUT_SECRET_FILE names."""
    from gspo.config import SamplingSettings, rollout_secret

    secret = rollout_secret(SamplingSettings(rollout_secret_file=os.environ.get("GSPO_ROLLOUT_SECRET_FILE")))
    if secret is None:
        raise ValueError("the gspo weight-transfer backend needs the run's secret in vLLM's environment: "
                         "GSPO_ROLLOUT_SECRET (or GSPO_ROLLOUT_SECRET_FILE)")
    return secret


@dataclass
class Layout:
    """What one update carries, in order: each parameter's name, dtype name and shape."""

    names: list
    dtype_names: list
    shapes: list

    def sizes(self) -> dict[str, int]:
        """Values per dtype name."""
        out: dict[str, int] = {}
        for dtype, shape in zip(self.dtype_names, self.shapes):
            out[dtype] = out.get(dtype, 0) + math.prod(shape)
        return out


__all__ = ["BACKEND", "Layout", "register", "run_secret"]
