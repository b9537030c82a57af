"""The weight-transfer backend "gspo" for vLLM's own server: `vllm serve ... --weight-transfer-config
'{"backend": "gspo"}'` takes a gspo trainer's weights over the authenticated wire (gspo/rollout/endpoint/wire.py),
through vLLM's four phases (its RL routes, VLLM_SERVER_DEV_MODE=1), on any device, CPU included.

`register` is the `vllm.general_plugins` entry point (pyproject.toml): vLLM calls it in each of its processes, and it
only names the engine class (vLLM imports it where it creates the engine). The engine runs in vLLM's worker: at
init it joins the trainer's listener, both proving the run's secret (GSPO_ROLLOUT_SECRET, or rollout_secret_file's
path in GSPO_ROLLOUT_SECRET_FILE, in the server's environment; an in-process engine, gspo/rollout/vllm_engine.py,
shares its trainer's `in_process_secret`); each update reads one tensors message (a flat buffer
per dtype, checked against the update's names, dtypes and shapes before a byte is read) and loads it with the
model's own `load_weights` between vLLM's layerwise reload start and finish.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

BACKEND = "gspo"
_IN_PROCESS: list[bytes] = []  # the secret of an engine in this very process, where the environment holds none


def register() -> None:
    """Register the "gspo" engine with vLLM's factory, once per process (imported lazily, where it is created)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "gspo.rollout.endpoint.vllm_weights_engine",
                                                    "GspoWeightTransferEngine")


def _environment_secret() -> bytes | None:
    from gspo.config import SamplingSettings, rollout_secret

    return rollout_secret(SamplingSettings(rollout_secret_file=os.environ.get("GSPO_ROLLOUT_SECRET_FILE")))


def run_secret() -> bytes:
    """The run's secret in vLLM's server: GSPO_ROLLOUT_SECRET, else the file GSPO_ROLLOUT_SECRET_FILE names, else
    the in-process trainer's (`in_process_secret`)."""
    secret = _environment_secret() or (_IN_PROCESS[0] if _IN_PROCESS else None)
    if secret is None:
        raise ValueError("the gspo weight-transfer backend needs the run's secret in vLLM's environment: "
                         "GSPO_ROLLOUT_SECRET (or GSPO_ROLLOUT_SECRET_FILE)")
    return secret


def in_process_secret() -> bytes:
    """The secret a trainer and the vLLM engine in its own process share: the environment's where it names one,
    else a fresh one made once for this process (it never leaves it)."""
    import secrets

    secret = _environment_secret()
    if secret is not None:
        return secret
    if not _IN_PROCESS:
        _IN_PROCESS.append(secrets.token_bytes(32))
    return _IN_PROCESS[0]


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

    def split(self, flat: dict):
        """(name, tensor) of each entry in order, views of `flat` (one buffer per dtype name); a ValueError where
        the buffers do not hold exactly what the layout lists."""
        offsets = dict.fromkeys(flat, 0)
        for name, dtype, shape in zip(self.names, self.dtype_names, self.shapes):
            if dtype not in flat:
                raise ValueError(f"{name}: dtype {dtype} has no buffer")
            n, start = math.prod(shape), offsets[dtype]
            if start + n > flat[dtype].numel():
                raise ValueError(f"{name}: the {dtype} buffer ends before it")
            yield name, flat[dtype][start:start + n].view(shape)
            offsets[dtype] = start + n
        left = {d: flat[d].numel() - offsets[d] for d in flat if offsets[d] != flat[d].numel()}
        if left:
            raise ValueError(f"values left in the buffers after the last tensor: {left}")

    @classmethod
    def of(cls, info: dict) -> Layout:
        """The layout an update_info (or checkpoint_payload's info) lists."""
        return cls(list(info["names"]), list(info["dtype_names"]), [list(s) for s in info["shapes"]])


__all__ = ["BACKEND", "Layout", "in_process_secret", "register", "run_secret"]
