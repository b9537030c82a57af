"""The "gspo" WeightTransferEngine, in vLLM's worker process (registered by gspo/rollout/endpoint/vllm_weights.py;
imports vLLM, so only vLLM imports it).

Everything here is vLLM's public weight-transfer interface (WeightTransferEngine, layerwise reload: vLLM's
docs/training/layerwise) but one workaround, `repack_cpu_experts`: vLLM 0.32's CPU MoE kernel packs its experts
on the first load only, so after a layerwise reload an MoE model samples from unpacked (wrong) experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from gspo.rollout.endpoint.vllm_weights import BACKEND, Layout, run_secret
from gspo.rollout.endpoint.weights import TO_ENDPOINT
from gspo.rollout.endpoint.wire import DTYPE_NAMES, DTYPES, WireError, connect, recv

CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 30.0, 600.0


@dataclass
class GspoInitInfo(WeightTransferInitInfo):
    """Where the trainer listens for this server, and the rank it waits for."""

    host: str
    port: int
    rank: int
    backend: str = BACKEND


@dataclass
class GspoUpdateInfo(WeightTransferUpdateInfo):
    """One update: the weights' version, whether only trained parameters come, and their layout in order."""

    version: int
    trained_only: bool
    names: list
    dtype_names: list
    shapes: list


class GspoWeightTransferEngine(WeightTransferEngine[GspoInitInfo, GspoUpdateInfo]):
    """Receives a gspo trainer's weights over the authenticated wire and loads them with `load_weights`."""

    init_info_cls = GspoInitInfo
    update_info_cls = GspoUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.sock = None

    def init_transfer_engine(self, init_info: GspoInitInfo) -> None:
        if init_info.backend != BACKEND:
            raise ValueError(f"init_info.backend {init_info.backend!r}: this server's backend is {BACKEND!r}")
        self.shutdown()
        self.sock = connect(init_info.host, int(init_info.port), run_secret(), int(init_info.rank), CONNECT_TIMEOUT_S)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_cpu_experts(self.model)

    def receive_weights(self, update_info: GspoUpdateInfo) -> None:
        if self.sock is None:
            raise ValueError("update_weights before init_weight_transfer_engine")
        layout = Layout.of(vars(update_info))
        if not (len(layout.names) == len(layout.dtype_names) == len(layout.shapes)) or any(
                d not in DTYPES for d in layout.dtype_names):
            raise ValueError("update_info: names, dtype_names and shapes must be lists of one length, dtypes gspo's")
        sizes = layout.sizes()

        def fits(kind, header, specs):  # before a byte of the tensors is read
            sent = {DTYPE_NAMES[dtype]: tuple(shape)[0] for _, dtype, shape in specs}
            if sent != sizes or header["version"] != update_info.version:
                raise WireError(f"the weights message ({sent}, version {header['version']}) is not the one "
                                f"update_weights announced ({sizes}, version {update_info.version})")

        self.sock.settimeout(READ_TIMEOUT_S)
        message = recv(self.sock, TO_ENDPOINT, check=fits)
        self.model.load_weights(weights=[(name, t.to(self.device)) for name, t in layout.split(message.tensors)])

    def shutdown(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def repack_cpu_experts(model) -> int:
    """Put the MoE experts back into the CPU kernel's packed layout after a layerwise reload; how many tensors it
    packed (0 off CPU, or without MoE). vLLM 0.32 packs them (`cpu_prepack_moe_weight`) only when the experts'
    kernel is first built (UnquantizedFusedMoEMethod._setup_kernel, called from process_weights_after_loading), and
    layerwise reload's finalize does not build it again: the reloaded experts stay in the plain layout the kernel
    misreads (tiny-moe's probe log-probs 0.655 off after a push; 4.8e-7 with this). The nearest upstream threads:
    vllm-project/vllm#42821 and the RFC #48312 (layerwise reload and kernels' post-load processing)."""
    packed = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not type(experts).__module__.endswith("cpu_moe") or not hasattr(experts, "isa"):
            continue
        if getattr(experts, "_use_zentorch", False):  # zentorch reads the plain layout
            continue
        from vllm._custom_ops import cpu_prepack_moe_weight  # the one internal: only where CPU MoE experts are

        for name in ("w13_weight", "w2_weight"):
            weight = getattr(module, name)
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
            packed += 1
    return packed


__all__ = ["GspoInitInfo", "GspoUpdateInfo", "GspoWeightTransferEngine", "repack_cpu_experts"]
