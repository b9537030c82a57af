"""The worker's side of the rollout channel: one process that samples for the trainer (a spawned rollout worker, or
`gspo rollout-server` started on its own), and what both sides share of a weight broadcast (docs/samplers.md).

A worker joins the trainer over gspo/rollout/remote/wire.py (both prove the run's secret), takes the sections its
Sampler is built from (SamplingSettings, EpisodeSettings, SamplerShape: JSON in the setup message), then answers
the trainer's messages (gspo/rollout/remote/protocol.py) in the order they were sent: weights (loaded, then checked
on a probe: the log-probs of a fixed sequence, which must match the trainer's) and prompts (sampled with the
trainer's own Sampler plug). So which weights sample which step is fixed by the order of the
trainer's calls, never by timing. A spawned worker ends when the trainer's connection closes.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from dataclasses import fields, replace

import torch

from gspo.rollout.remote.protocol import PROBE_LENGTH, TO_WORKER, plain, rollout_message, same_settings
from gspo.rollout.remote.wire import DTYPE_NAMES, DTYPES, Closed, WireError, connect, recv, send

START_TIMEOUT_S = 120.0  # the least time a worker is given to start and join the trainer
# what torchrun sets in its ranks' environment, which a spawned worker inherits and must not read as its own
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID")
# the sections a worker's Sampler is built from, as the setup message names them (gspo.rollout.sampler)
SECTIONS = ("sampling", "episodes", "shape")
# settings of the channel itself, which a rollout server's config need not share with the trainer's
SECRETS = ("rollout_secret", "rollout_secret_file")  # never sent: a worker has its own, or was handed it
PLUMBING = ("rollout_workers", "rollout_timeout_s", "max_staleness", "rollout_address", "rollout_endpoints", *SECRETS)
# the trainer's to decide (whether it needs mu: its corrections, its staleness): a server takes the trainer's
DECIDED_BY_TRAINER = ("keep_logprobs",)


def sent_parameters(model, trained_only: bool) -> list:
    """The parameters a weight broadcast carries, in order (tied ones once): all of them, or (`trained_only`, every
    broadcast after the first) those the optimizer changes: with LoRA the adapters, the frozen base went once."""
    return [p for p in model.parameters() if p.requires_grad or not trained_only]


def flat_weights(model, trained_only: bool = False) -> dict[torch.dtype, torch.Tensor]:
    """The parameters of `model` (`sent_parameters`) flattened into one CPU buffer per dtype (gloo sends from
    the wire). Under fsdp each parameter is gathered whole first, parameter by parameter: a collective, so every
    rank calls this at the same point (each then broadcasts to its own workers)."""
    by_dtype: dict[torch.dtype, list] = {}
    for p in sent_parameters(model, trained_only):
        whole = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()  # fsdp: a DTensor shard
        by_dtype.setdefault(p.dtype, []).append(whole.reshape(-1).cpu())
    return {dtype: torch.cat(parts) for dtype, parts in by_dtype.items()}


def on_device(rollout, device):
    """`rollout` with its tensors (and routing record) on `device` (a worker's rollout travels through the CPU)."""
    return replace(rollout, **{f.name: getattr(rollout, f.name).to(device) for f in fields(rollout)
                               if isinstance(getattr(rollout, f.name), torch.Tensor) or f.name == "routing"
                               and rollout.routing is not None})


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
                         f"has {own} (a rollout server must load the trainer's model, with the same LoRA settings)")


def probe_logprobs(model, vocab_size: int) -> torch.Tensor:
    """(L-1,) log-probs of a fixed random sequence under `model`: the weights' fingerprint after a broadcast."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (1, PROBE_LENGTH), generator=g)  # (1, L)
    with torch.no_grad():
        logits = model(input_ids=ids.to(next(model.parameters()).device)).logits.float()  # (1, L, V)
    return torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None].to(logits.device))[:, 0].cpu()


def load_worker_model(model_settings, lora_settings) -> tuple:
    """(device, model, tokenizer): the run's model loaded as its config names it, with the run's LoRA adapters,
    for a worker that cannot be handed a copy (a rollout server; a worker of an fsdp trainer, whose copy is
    sharded); its weights then come from the trainer's first broadcast."""
    from gspo.models import seeded_model
    from gspo.plugs.lora import attach_adapters

    device, model, tokenizer = seeded_model(model_settings)
    return device, attach_adapters(model, lora_settings), tokenizer


def _worker_main(rank: int, host: str, port: int, secret: bytes, model, tokenizer, device: str | None = None,
                 load: tuple | None = None, start_timeout_s: float = START_TIMEOUT_S,
                 own_sections: tuple | None = None) -> None:
    """A rollout worker: join the trainer at host:port as `rank` (both prove `secret`), take the sections its sampler
    is built from, then sample on request and load broadcast weights, in the order asked, until told to stop.

    It samples with the trainer's own Sampler plug, built from the trainer's SamplingSettings, EpisodeSettings and
    SamplerShape: the policy copy itself, a low-precision copy of it (sampler_dtype) or an engine (vllm), as in the
    trainer's process. `device`: where it samples (a rollout server's own); None: the trainer's. `load`:
    (ModelSettings, LoraSettings) to load the model from (`load_worker_model`) when `model` is None.
    `own_sections`: a rollout server's (SamplingSettings, EpisodeSettings, SamplerShape), from its own config: the
    trainer's must equal them, so a server runs only code its own config names (an environment, tools); None: the
    trainer's (a spawned worker, the trainer's child).
    """
    for name in TORCHRUN_ENV:  # spawned by a torchrun rank: a process on its own, not one of its ranks
        os.environ.pop(name, None)
    sock = connect(host, port, secret, rank, start_timeout_s)
    try:
        _serve(sock, rank, model, tokenizer, device, load, own_sections)
    except Closed:
        if own_sections is not None:  # a rollout server says so; a spawned worker's trainer is gone: it ends
            raise
    except WireError as err:  # the trainer broke the protocol: say so to it (if it listens), then stop
        try:
            send(sock, "error", {"text": f"rollout worker {rank} refused a message: {err}"})
        except OSError:
            pass
        raise
    finally:
        sock.close()


def _sections(sock, settings: dict, own_sections: tuple | None) -> tuple:
    """The (SamplingSettings, EpisodeSettings, SamplerShape) this worker samples with: the trainer's `settings`, or
    a rollout server's own once the trainer's equal them (the channel's settings aside; whether mu is kept is the
    trainer's to say); else the server says how they differ, to the trainer and in a ValueError."""
    theirs = sections_of(settings)
    if own_sections is None:
        return theirs
    differ = same_settings(_flat(settings), _flat(sections_message(*own_sections)), PLUMBING + DECIDED_BY_TRAINER)
    if differ:
        text = (f"the trainer's sampling settings differ from this rollout server's config ({'; '.join(differ[:4])}): "
                "start the server with the trainer's config")
        send(sock, "error", {"text": text})
        raise ValueError(text)
    sampling, episodes, shape = own_sections
    return sampling, episodes, replace(shape, keep_logprobs=theirs[2].keep_logprobs)


def _flat(settings: dict) -> dict:
    """One mapping of every setting in a setup message's sections (their names do not repeat across sections)."""
    return {name: value for part in SECTIONS for name, value in settings[part].items()}


def _serve(sock, rank: int, model, tokenizer, device: str | None, load: tuple | None,
           own_sections: tuple | None) -> None:
    """`_worker_main` once connected: set up, then answer the trainer's requests until it says stop."""
    from gspo.plugs.moe import record_routing
    from gspo.rollout.sampler import Sampler

    setup = recv(sock, TO_WORKER)
    if setup.kind != "setup":
        raise WireError(f"a {setup.kind!r} message before the setup")
    options = setup.fields
    sampling, episodes, shape = _sections(sock, options["settings"], own_sections)
    try:
        torch.set_num_threads(options["threads"])
        if model is None:
            _, model, tokenizer = load_worker_model(*load)
        model = model.to(device or options["device"]).eval()  # one GPU: shared by the trainer and its workers
        # routing_replay=rollout: the experts this worker's sampler chose travel in the rollout (Rollout.routing)
        recorder = record_routing if options["records"] else lambda sampler: None
        sampler = Sampler(model, tokenizer, sampling, episodes, shape, seeded=options["seeded"], recorder=recorder,
                          records=options["records"])
        if "rng" in setup.tensors:  # resumed: where the checkpointed run's worker stood
            torch.set_rng_state(setup.tensors["rng"])
        elif not options["seeded"]:  # its own stream, reproducible for a given seed
            torch.manual_seed(shape.seed + 1000 * rank)
    except Exception:  # noqa: BLE001  (no engine, a model it cannot run): the trainer reports it and stops
        send(sock, "error", {"text": traceback.format_exc(limit=4)})
        return
    send(sock, "ready")
    _answer(sock, model, sampler, options)


def _answer(sock, model, sampler, options: dict) -> None:
    """Answer the trainer's weights and sample requests, in the order they come, until it says stop."""
    def fits(kind, header, specs):  # weights are checked against this model before a byte of them is read
        if kind == "weights":
            try:
                check_fit(model, {DTYPE_NAMES[dtype]: math.prod(shape) for _, dtype, shape in specs},
                          header["trained_only"])
            except ValueError as err:
                raise WireError(str(err)) from None

    version, busy = options["version"], 0.0  # busy: seconds spent sampling and loading weights
    while True:
        message = recv(sock, TO_WORKER, check=fits)
        kind, f, t0 = message.kind, message.fields, time.perf_counter()
        if kind == "stop":
            sampler.close()
            return
        try:
            if kind == "weights":
                version = f["version"]
                load_flat_weights(model, {DTYPES[name]: t for name, t in message.tensors.items()}, f["trained_only"])
                sampler.sync(model)  # a copy or an engine takes the new weights (an engine checks them itself)
                load_s = time.perf_counter() - t0
                busy += load_s
                reply = ("probe", {"busy": busy, "load_s": load_s},
                         {"logprobs": probe_logprobs(model, options["vocab_size"])})
            elif kind == "sample":
                prompts, rows = f["prompts"], f["rows"]
                if not all(isinstance(p, str) for p in prompts) or not all(isinstance(r, dict) for r in rows or ()):
                    raise WireError("a sample request whose prompts are not texts or whose rows are not mappings")
                rollout = sampler.sample(prompts, f["step"], f["first_row"], rows)
                busy += time.perf_counter() - t0
                reply = ("rollout", *rollout_message(on_device(rollout, "cpu"), f["step"], version))
            else:
                raise WireError(f"a second {kind!r} message")
        except WireError:
            raise
        except Exception:  # noqa: BLE001  reported to the trainer, which stops the run naming this worker
            reply = ("error", {"text": traceback.format_exc(limit=4)}, None)
        send(sock, *reply)


def sections_message(sampling, episodes, shape) -> dict:
    """The sections a worker's Sampler is built from, as the setup message carries them: {"sampling": {...},
    "episodes": {...}, "shape": {...}} of JSON values (the rollout channel carries nothing else; a value it cannot
    carry is a ValueError naming the setting). The secret is never sent: null."""
    return {part: {f.name: None if f.name in SECRETS else plain(getattr(section, f.name),
                                                                f"rollout workers: setting {f.name}")
                   for f in fields(section)}
            for part, section in zip(SECTIONS, (sampling, episodes, shape))}


def sections_of(settings: dict) -> tuple:
    """(SamplingSettings, EpisodeSettings, SamplerShape) rebuilt from a setup message's `settings`
    (`sections_message`); a WireError where they are not this version's sections."""
    from gspo.config import EpisodeSettings, SamplingSettings
    from gspo.rollout.sampler import SamplerShape

    classes = dict(zip(SECTIONS, (SamplingSettings, EpisodeSettings, SamplerShape)))
    if set(settings) != set(classes):
        raise WireError(f"setup settings of sections {sorted(settings)[:6]}, not this version's {list(SECTIONS)}")
    for part, cls in classes.items():
        names = {f.name for f in fields(cls)}
        if not isinstance(settings[part], dict) or set(settings[part]) != names:
            got = set(settings[part]) if isinstance(settings[part], dict) else set()
            raise WireError(f"setup settings {sorted(got ^ names)[:6]} of {part!r} are not this version's")
    return tuple(cls(**settings[part]) for part, cls in classes.items())


def serve_rollouts(cfg, address: str, rank: int, start_timeout_s: float = START_TIMEOUT_S) -> None:
    """`gspo rollout-server`: one rollout worker started on its own, here or on another machine. It joins the
    trainer waiting at `address` as worker `rank` (1 .. rollout_workers), both proving the run's secret
    (`rollout_secret(cfg)`), loads the run's model as `cfg` says (the trainer's config: the same architecture and
    sampling settings; the weights come from the trainer) and samples on its own device (cfg.device) until the
    trainer stops it. Every failure is a ValueError in one line."""
    from gspo.config import LoraSettings, ModelSettings, rollout_secret, section, split_address
    from gspo.rollout.sampler import sampler_sections

    if not 1 <= rank <= cfg.rollout_workers:
        raise ValueError(f"rollout-server: --rank {rank} must be in 1..rollout_workers={cfg.rollout_workers}")
    own = sampler_sections(cfg)  # what it samples with; the trainer's must be the same
    sections_message(*own)  # a setting the channel cannot carry: said before joining
    secret = rollout_secret(own[0])
    if secret is None:
        raise ValueError("rollout-server: the trainer asks for the run's secret; set GSPO_ROLLOUT_SECRET (or "
                         "rollout_secret_file in the config) to the trainer's")
    host, port = split_address(address)
    load = (section(cfg, ModelSettings), section(cfg, LoraSettings))
    try:
        _worker_main(rank, host, port, secret, None, None, device=cfg.device, load=load,
                     start_timeout_s=start_timeout_s, own_sections=own)
    except ValueError as err:  # the wire's, a config that differs from the trainer's, a model it cannot load
        raise ValueError(f"rollout-server: {err}") from err
    except OSError as err:  # the connection broke: the trainer ended without a stop, or its machine vanished
        raise ValueError(f"rollout-server: lost the trainer at {address} ({err})") from None


__all__ = ["START_TIMEOUT_S", "check_fit", "flat_weights", "load_flat_weights", "on_device", "probe_logprobs",
           "sections_message", "sections_of", "serve_rollouts"]
