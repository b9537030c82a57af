"""Weight updates of a `gspo serve` endpoint, in the four phases of vLLM's weight-transfer API (its RL routes):
/init_weight_transfer_engine, then per update /start_weight_update, /update_weights, /finish_weight_update.

The control travels by HTTP, each call bearing the run's secret; the tensors travel over gspo's wire
(gspo/rollout/endpoint/wire.py), backend "gspo": at init the endpoint connects to the trainer's listener and both
prove the run's secret (HMAC over fresh nonces) before either reads anything else; a weights message is a
schema-checked JSON header and raw tensor bytes, never a pickle. Not a torch.distributed group: its store and
gloo's sockets read whatever a stranger sends before any secret is proved (docs/distributed.md, "Threat model").

Between /start_weight_update and /finish_weight_update the endpoint samples nothing: the update takes the engine's
lock, so a generator call runs wholly on the old weights or wholly on the new ones; /finish_weight_update sets the
weights' version, which every later response carries (`weight_version`), and answers with the probe's log-probs
(a fixed sequence's, `probe_logprobs`), which the trainer compares with its own.
"""

from __future__ import annotations

import math
import threading

import torch

from gspo.rollout.endpoint.requests import BadRequest
from gspo.rollout.endpoint.wire import DTYPE_NAMES, DTYPES, Kind, WireError, connect, recv

PROBE_LENGTH = 16  # tokens of the probe sequence every weight update is checked on
BACKEND = "gspo"  # the weight-transfer backend's name, as init_info and WeightTransferConfig name it
CONNECT_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 600.0  # the longest pause inside one weights message
# what the trainer sends over the wire: one flat buffer per dtype the model has (`flat_weights`)
TO_ENDPOINT = {"weights": Kind({"version": (int,), "trained_only": (bool,)}, {name: ((name,), 1) for name in DTYPES},
                               optional=tuple(DTYPES))}
ROUTES = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
          "/shutdown_weight_transfer_engine", "/weight_info", "/rng_state")  # the run's secret always


def sent_parameters(model, trained_only: bool) -> list:
    """The parameters a weight broadcast carries, in order (tied ones once): all of them, or (`trained_only`, every
    broadcast after the first) those the optimizer changes: with LoRA the adapters, the frozen base went once."""
    return [p for p in model.parameters() if p.requires_grad or not trained_only]


def flat_weights(model, trained_only: bool = False) -> dict[torch.dtype, torch.Tensor]:
    """The parameters of `model` (`sent_parameters`) flattened into one CPU buffer per dtype (gloo sends from
    the wire). Under fsdp each parameter is gathered whole first, parameter by parameter: a collective, so every
    rank calls this at the same point (each then broadcasts to its own workers)."""
    return flatten(p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()  # fsdp: a DTensor shard
                   for p in sent_parameters(model, trained_only))


def flatten(tensors) -> dict[torch.dtype, torch.Tensor]:
    """The tensors, in order, in one flat CPU buffer per dtype."""
    by_dtype: dict[torch.dtype, list] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t.reshape(-1).cpu())
    return {dtype: torch.cat(parts) for dtype, parts in by_dtype.items()}


def load_flat_weights(model, flat: dict[torch.dtype, torch.Tensor], trained_only: bool = False) -> None:
    """Copy buffers of `flat_weights` back into `model`'s parameters, in the same order."""
    params = sent_parameters(model, trained_only)
    check_fit(model, {DTYPE_NAMES[dtype]: t.numel() for dtype, t in flat.items()}, trained_only)
    offsets = dict.fromkeys(flat, 0)
    with torch.no_grad():
        for p in params:
            start = offsets[p.dtype]
            p.copy_(flat[p.dtype][start : start + p.numel()].view_as(p))
            offsets[p.dtype] = start + p.numel()


def check_fit(model, sent: dict[str, int], trained_only: bool) -> None:
    """A ValueError unless `sent` (dtype name -> values) is what `model`'s broadcast carries."""
    own: dict[str, int] = {}
    for p in sent_parameters(model, trained_only):  # counted, not copied: flat_weights would concatenate them
        own[DTYPE_NAMES[p.dtype]] = own.get(DTYPE_NAMES[p.dtype], 0) + p.numel()
    if own != sent:
        raise ValueError(f"the broadcast weights do not fit this model: {sent} values per dtype sent, this model "
                         f"has {own} (an endpoint must serve the trainer's model, with the same LoRA settings)")


def probe_ids(vocab_size: int) -> torch.Tensor:
    """(1, L) the probe's tokens: a fixed random sequence."""
    return torch.randint(0, vocab_size, (1, PROBE_LENGTH), generator=torch.Generator().manual_seed(0))


def probe_logprobs(model, vocab_size: int) -> torch.Tensor:
    """(L-1,) log-probs of a fixed random sequence under `model`: the weights' fingerprint after a broadcast."""
    ids = probe_ids(vocab_size)  # (1, L)
    with torch.no_grad():
        logits = model(input_ids=ids.to(next(model.parameters()).device)).logits.float()  # (1, L, V)
    return torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None].to(logits.device))[:, 0].cpu()


def load_worker_model(model_settings, lora_settings) -> tuple:
    """(device, model, tokenizer): the run's model loaded as its config names it, with the run's LoRA adapters,
    for a worker that cannot be handed a copy (a worker of an fsdp trainer, whose copy is sharded); its weights then
    come from the trainer's first push."""
    from gspo.models import seeded_model
    from gspo.plugs.lora import attach_adapters

    device, model, tokenizer = seeded_model(model_settings)
    return device, attach_adapters(model, lora_settings), tokenizer


def sent_names(model, trained_only: bool) -> list[str]:
    """The names of the parameters a weight update carries, in its order (`sent_parameters`)."""
    chosen = {id(p) for p in sent_parameters(model, trained_only)}
    return [name for name, p in model.named_parameters() if id(p) in chosen]


class WeightReceiver:
    """The endpoint's side of the four phases: `init`, `start`, `update`, `finish`, `shutdown`; each raises
    `BadRequest` (HTTP 400, or 409 out of order) naming what is wrong. `engine`: the endpoint's Engine (its lock
    pauses sampling; its `version` is the weights'); `model`: the policy it samples; `sync(model)`: what loads new
    weights into the sampler (a copy, an engine; the Sampler plug's `sync`); `secret`: the run's."""

    def __init__(self, engine, model, sync, secret: bytes):
        self.engine, self.model, self.sync, self.secret = engine, model, sync, secret
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.sock, self.pending, self.lock = None, None, threading.Lock()  # lock: one phase at a time

    def init(self, info) -> None:
        """Connect to the trainer's listener (`info`: backend, host, port, rank), both proving the run's secret."""
        if not isinstance(info, dict) or set(info) != {"backend", "host", "port", "rank"}:
            raise BadRequest("init_info must be {backend, host, port, rank}", "init_info")
        if info["backend"] != BACKEND:
            raise BadRequest(f"init_info.backend {info['backend']!r}: gspo serve receives weights by backend "
                             f"{BACKEND!r} only", "init_info")
        if not (isinstance(info["host"], str) and type(info["port"]) is int and type(info["rank"]) is int
                and 0 < info["port"] < 65536 and info["rank"] >= 1):
            raise BadRequest("init_info: host a string, port in 1..65535, rank >= 1", "init_info")
        with self.lock:
            self._close()
            try:
                self.sock = connect(info["host"], info["port"], self.secret, info["rank"], CONNECT_TIMEOUT_S)
            except (OSError, WireError, TimeoutError) as err:
                raise BadRequest(f"init_weight_transfer_engine: could not join the trainer at {info['host']}:"
                                 f"{info['port']}: {err}", "init_info") from None

    def start(self) -> None:
        with self.lock:
            self._joined("start_weight_update")
            self.pending = "started"

    def update(self, info) -> None:
        """Read one weights message from the wire (`info`: version, trained_only, names: what it carries) and load
        it, checked against this model before a byte of it is read."""
        if not isinstance(info, dict) or set(info) != {"version", "trained_only", "names"}:
            raise BadRequest("update_info must be {version, trained_only, names}", "update_info")
        with self.lock:
            self._joined("update_weights")
            if self.pending != "started":
                raise BadRequest("update_weights before start_weight_update", status=409)
            trained_only = info["trained_only"] is True
            names = sent_names(self.model, trained_only)
            if info["names"] != names:
                theirs = info["names"] if isinstance(info["names"], list) else []
                differ = sorted(set(map(str, theirs)) ^ set(names))[:4]
                raise BadRequest(f"update_weights: the trainer sends {len(theirs)} parameters, this model takes "
                                 f"{len(names)} (differing: {', '.join(differ) or 'their order'}); serve the "
                                 "trainer's model, with its LoRA settings", "update_info")

            def fits(kind, header, specs):  # the sizes per dtype, before a byte of the tensors is read
                try:
                    check_fit(self.model, {DTYPE_NAMES[dtype]: math.prod(shape) for _, dtype, shape in specs},
                              header["trained_only"])
                except ValueError as err:
                    raise WireError(str(err)) from None
                if header["version"] != info["version"] or header["trained_only"] != trained_only:
                    raise WireError("the weights message is not the one update_weights announced")

            try:
                self.sock.settimeout(READ_TIMEOUT_S)  # a trainer that stops mid-update frees the endpoint
                message = recv(self.sock, TO_ENDPOINT, check=fits)
            except (OSError, WireError) as err:
                self._close()
                raise BadRequest(f"update_weights: the trainer's weights could not be read: {err}") from None
            with self.engine.lock:  # no generator call runs on half-loaded weights
                load_flat_weights(self.model, {DTYPES[name]: t for name, t in message.tensors.items()}, trained_only)
            self.pending = "updated"

    def finish(self, version) -> list[float]:
        """Load the new weights into the sampler, set their version; the probe's log-probs."""
        if version is not None and not isinstance(version, str):
            raise BadRequest("weight_version must be a string", "weight_version")
        with self.lock:
            if self.pending != "updated":
                raise BadRequest("finish_weight_update before update_weights", status=409)
            with self.engine.lock:
                self.sync(self.model)
                self.engine.version = version
            self.pending = None
            return probe_logprobs(self.model, self.vocab_size).tolist()

    def rng_state(self) -> str:
        """The endpoint's torch random state (what unseeded sampling draws from), base64: a trainer's checkpoint
        keeps it so a resumed run samples on as the uninterrupted one."""
        import base64

        import torch

        with self.engine.lock:
            return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()

    def set_rng_state(self, state) -> None:
        import base64
        import binascii

        import torch

        own = torch.get_rng_state()
        try:
            raw = base64.b64decode(state, validate=True) if isinstance(state, str) else b""
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) != own.numel():
            raise BadRequest(f"rng_state must be the base64 of torch's {own.numel()}-byte random state", "rng_state")
        with self.engine.lock:
            torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    def shutdown(self) -> None:
        with self.lock:
            self._close()

    def _joined(self, what: str) -> None:
        if self.sock is None:
            raise BadRequest(f"{what} before init_weight_transfer_engine", status=409)

    def _close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock, self.pending = None, None


__all__ = ["BACKEND", "PROBE_LENGTH", "ROUTES", "TO_ENDPOINT", "WeightReceiver", "check_fit", "flat_weights", "flatten",
           "load_flat_weights", "load_worker_model", "probe_ids", "probe_logprobs", "sent_names", "sent_parameters"]
