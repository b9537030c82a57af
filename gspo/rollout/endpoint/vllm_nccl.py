"""vLLM's NCCL weight transfer for `vllm serve` endpoints on other GPUs (rollout_weight_transfer: nccl): the trainer
is rank 0 of an NCCL group with the server's workers and broadcasts the checkpoint's tensors, packed, through vLLM's
four phases (`vllm serve ... --weight-transfer-config '{"backend": "nccl"}'`, VLLM_SERVER_DEV_MODE=1).

The group is joined by vLLM's unique-id rendezvous: the trainer mints an ncclUniqueId, sends it (base64) in
/init_weight_transfer_engine with the run's secret as the bearer token, and both sides enter NCCL's init. vLLM's
other rendezvous (master_address + master_port) is not used: it opens a TCPStore that any peer may join and passes
pickled objects through it, which gspo's rule for listeners forbids (docs/distributed.md, threat model).

The trainer imports vLLM (its pynccl communicator and packed broadcast, vLLM's own trainer-side pieces) and needs
a CUDA GPU of its own: NCCL puts one rank on one GPU. Written against vLLM 0.32; its CPU parts (the init and update
messages, the checks) are tested on CPU, the NCCL calls only where two GPUs are (benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import base64
import threading
from dataclasses import dataclass

import torch

BUFFER_BYTES = 256 << 20  # each packed broadcast chunk (vLLM's default is 1 GiB, twice)
BUFFERS = 2


def init_info(unique_id: bytes, workers: int) -> dict:
    """/init_weight_transfer_engine's init_info for a server of `workers` GPU workers (TP x PP x DP): the trainer
    at rank 0, the workers after it."""
    if len(unique_id) != 128:
        raise ValueError(f"an ncclUniqueId is 128 bytes, not {len(unique_id)}")
    return {"nccl_unique_id_b64": base64.b64encode(unique_id).decode(), "rank_offset": 1, "world_size": 1 + workers,
            "packed": True, "packed_buffer_size_bytes": BUFFER_BYTES, "packed_num_buffers": BUFFERS}


def update_info(info: dict) -> dict:
    """/update_weights' update_info: the checkpoint's names, dtype names and shapes, in the order they are sent."""
    return {key: info[key] for key in ("names", "dtype_names", "shapes")}


def workers_of(answer, name: str) -> int:
    """The number of GPU workers in vLLM's /get_world_size answer."""
    size = answer.get("world_size") if isinstance(answer, dict) else None
    if type(size) is not int or size < 1:
        raise ValueError(f"{name}: /get_world_size answered {answer!r}, not a world size")
    return size


def check_trainer_device(device: torch.device) -> None:
    """A ValueError unless the trainer holds a CUDA GPU for its NCCL rank."""
    if device.type != "cuda":
        raise ValueError(f"rollout_weight_transfer=nccl: the trainer is rank 0 of an NCCL group with the vllm serve "
                         f"endpoints' GPUs, and its policy is on {device.type}, not a CUDA GPU (use "
                         "rollout_weight_transfer=gspo: any device, any machine)")


@dataclass
class NcclLink:
    """The trainer's end of one server's NCCL group (vLLM's PyNcclCommunicator, rank 0)."""

    comm: object
    device: torch.device

    def send(self, call, version: int, flat: dict, info: dict) -> None:
        """Broadcast one update between /start_weight_update and /finish_weight_update: /update_weights (the server
        receives) and the packed broadcast run at once, as NCCL needs both sides in the same calls."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        from gspo.rollout.endpoint.vllm_weights import Layout

        on_gpu = {dtype: t.to(self.device, non_blocking=True) for dtype, t in flat.items()}
        loading = _Call(call, "POST", "/update_weights", {"update_info": update_info(info)}, "loading the weights")
        loading.wait(0.0)  # a refused update (a bad request) before the broadcast waits for a peer that never comes
        packed_nccl_broadcast_producer(iterator=Layout.of(info).split(on_gpu), group=self.comm, src=0,
                                       post_iter_func=lambda item: item[1], buffer_size_bytes=BUFFER_BYTES,
                                       num_buffers=BUFFERS)
        torch.cuda.current_stream(self.device).synchronize()
        loading.wait(None)

    def close(self) -> None:
        destroy = getattr(self.comm, "destroy", None)
        if destroy is not None:
            destroy()


def join(call, name: str, device: torch.device, timeout_s: float) -> NcclLink:
    """Open the NCCL group with one `vllm serve` endpoint (`call(method, path, body, what)`: its JSON answer)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    workers = workers_of(call("GET", "/get_world_size", None, "reading its world size"), name)
    unique_id = bytes(NCCLLibrary().ncclGetUniqueId().internal)
    info = init_info(unique_id, workers)
    joining = _Call(call, "POST", "/init_weight_transfer_engine", {"init_info": info},
                    "joining the trainer's NCCL group (is it started with --weight-transfer-config "
                    "'{\"backend\": \"nccl\"}'?)")
    # both sides must be in NCCL's init at once; a server that refuses leaves this one waiting
    opening = _Call(PyNcclCommunicator.from_unique_id_bytes, unique_id, rank=0, world_size=1 + workers, device=device)
    joining.wait(timeout_s)
    opening.wait(timeout_s)
    if opening.thread.is_alive():
        raise TimeoutError(f"{name}: the NCCL group did not form within rollout_timeout_s={timeout_s:g}")
    return NcclLink(opening.result, device)


class _Call:
    """`fn(*args, **kwargs)` on a daemon thread (one NCCL or HTTP call may wait forever for a peer that never comes,
    and must not hold the interpreter's exit); `wait(t)` raises its error where it has failed within t seconds
    (None: until it ends); `result` its value once it has ended."""

    def __init__(self, fn, *args, **kwargs) -> None:
        self.error: BaseException | None = None
        self.result = None
        self.thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True)
        self.thread.start()

    def _run(self, fn, args, kwargs) -> None:
        try:
            self.result = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            self.error = err

    def wait(self, timeout_s: float | None) -> None:
        self.thread.join(timeout_s)
        if self.error is not None:
            raise self.error


__all__ = ["NcclLink", "check_trainer_device", "init_info", "join", "update_info", "workers_of"]
