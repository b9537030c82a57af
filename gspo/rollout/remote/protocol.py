"""The rollout channel's messages (remote/wire.py carries them): what the trainer sends a rollout worker and
what a worker answers, each kind with its schema, and the Rollout's translation into one message and back, every
field checked against what the trainer asked for before it reaches training.

trainer -> worker: setup (the sections the worker's Sampler is built from, once), weights (one flat tensor per
dtype), sample (a share of a step's prompts), stop. worker -> trainer: ready or error (once its sampler is built;
error also for a request it failed), probe (the log-probs that check a weight broadcast), rollout.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields

import torch

from gspo.rollout.batch import Rollout
from gspo.rollout.remote.wire import DTYPES, Kind, Message, WireError

NULL = type(None)
PROBE_LENGTH = 16  # tokens of the probe sequence every weight broadcast is checked on
SAMPLED = ("input_ids", "attention_mask", "completion_mask", "prompts", "completions", "sampler_logprobs", "routing",
           "episodes")  # the Rollout fields a sampler fills; the rest are the trainer's

TO_WORKER = {
    "setup": Kind({"threads": (int,), "seeded": (bool,), "version": (int,), "records": (bool,), "device": (str,),
                   "vocab_size": (int,), "settings": (dict,)}, {"rng": (("uint8",), 1)}, optional=("rng",)),
    "weights": Kind({"version": (int,), "trained_only": (bool,)}, {name: ((name,), 1) for name in DTYPES},
                    optional=tuple(DTYPES)),  # one flat buffer per dtype the model has
    "sample": Kind({"prompts": (list,), "step": (int,), "first_row": (int,), "rows": (list, NULL)}),
    "stop": Kind(),
}
TO_TRAINER = {
    "ready": Kind(),
    "error": Kind({"text": (str,)}),
    "probe": Kind({"busy": (float,), "load_s": (float,)}, {"logprobs": (("float32",), 1)}),
    "rollout": Kind({"step": (int,), "version": (int,), "prompts": (list,), "completions": (list,),
                     "episodes": (list, NULL), "routing_layers": (list, NULL)},
                    {"input_ids": (("int64",), 2), "attention_mask": (("int64",), 2), "completion_mask": (("bool",), 2),
                     "sampler_logprobs": (("float32",), 2), "routing": (("int64",), 4), "rng": (("uint8",), 1)},
                    optional=("sampler_logprobs", "routing")),
}


def plain(value, what: str):
    """`value` if JSON carries it unchanged in meaning (str, int, finite-or-not float, bool, None, lists, str-keyed
    dicts); a ValueError naming `what` and the offending part otherwise."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v, f"{what}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        bad = next((k for k in value if not isinstance(k, str)), None)
        if bad is not None:
            raise ValueError(f"{what}: the key {bad!r} is not a string; the rollout channel carries JSON values only")
        return {k: plain(v, f"{what}[{k!r}]") for k, v in value.items()}
    raise ValueError(f"{what} is a {type(value).__name__}; the rollout channel carries JSON values only (str, "
                     "numbers, bools, null, lists, dicts)")


def rollout_message(rollout: Rollout, step: int, version: int) -> tuple[dict, dict]:
    """(fields, tensors) of a worker's rollout message, its random state included."""
    extra = [f.name for f in fields(rollout) if f.name not in SAMPLED and getattr(rollout, f.name) is not None]
    if extra:
        raise ValueError(f"a sampled rollout carries {', '.join(extra)}, which the trainer computes")
    routing = rollout.routing
    return ({"step": step, "version": version, "prompts": rollout.prompts, "completions": rollout.completions,
             "episodes": plain(rollout.episodes, "episodes"),
             "routing_layers": None if routing is None else list(routing.layers)},
            {"input_ids": rollout.input_ids, "attention_mask": rollout.attention_mask,
             "completion_mask": rollout.completion_mask, "sampler_logprobs": rollout.sampler_logprobs,
             "routing": None if routing is None else routing.indices, "rng": torch.get_rng_state()})


def _texts(values: list, n: int) -> bool:
    return len(values) == n and all(isinstance(v, str) for v in values)


def rollout_of(message: Message, sequences: int, vocab_size: int) -> tuple[Rollout, torch.Tensor]:
    """(the Rollout, the worker's random state) of a rollout message asked for `sequences` rows; a WireError naming
    what does not fit: a shape, a token id outside the vocabulary, texts that are not one per sequence."""
    from gspo.plugs.moe import RoutingRecord

    f, t = message.fields, message.tensors
    ids, attn, done, mu = t["input_ids"], t["attention_mask"], t["completion_mask"], t.get("sampler_logprobs")
    if ids.shape[0] != sequences:
        raise WireError(f"a rollout of {ids.shape[0]} sequences; it was asked for {sequences}")
    if attn.shape != ids.shape or done.shape[0] != sequences or done.shape[1] > ids.shape[1] or (
            mu is not None and mu.shape != done.shape):
        raise WireError(f"a rollout whose tensors do not fit each other: input_ids {tuple(ids.shape)}, attention_mask "
                        f"{tuple(attn.shape)}, completion_mask {tuple(done.shape)}")
    if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < vocab_size):
        raise WireError(f"a rollout with token ids {int(ids.min())}..{int(ids.max())}, outside the vocabulary "
                        f"(0..{vocab_size - 1})")
    if attn.numel() and not bool(((attn == 0) | (attn == 1)).all()):
        raise WireError("a rollout whose attention_mask holds values other than 0 and 1")
    if not (_texts(f["prompts"], sequences) and _texts(f["completions"], sequences)):
        raise WireError(f"a rollout whose prompts or completions are not {sequences} texts")
    episodes = f["episodes"]
    if episodes is not None and not (len(episodes) == sequences and all(isinstance(e, dict) for e in episodes)):
        raise WireError(f"a rollout whose episodes are not {sequences} records")
    routing, indices, layers = None, t.get("routing"), f["routing_layers"]
    if (indices is None) != (layers is None):
        raise WireError("a rollout with routing indices or routing layers, not both")
    if indices is not None:
        if (indices.shape[1:3] != ids.shape or len(layers) != indices.shape[0]
                or not all(type(x) is int for x in layers) or (indices.numel() and int(indices.min()) < -1)):
            raise WireError(f"a rollout whose routing record {tuple(indices.shape)} does not fit its input_ids "
                            f"{tuple(ids.shape)}")
        routing = RoutingRecord(indices, tuple(layers))
    if t["rng"].shape != torch.get_rng_state().shape:
        raise WireError(f"a rollout whose random state has {t['rng'].numel()} bytes, not "
                        f"{torch.get_rng_state().numel()}")
    return Rollout(input_ids=ids, attention_mask=attn, completion_mask=done, prompts=f["prompts"],
                   completions=f["completions"], sampler_logprobs=mu, routing=routing, episodes=episodes), t["rng"]


def probe_of(message: Message) -> tuple[torch.Tensor, float, float]:
    """(log-probs, seconds busy so far, seconds loading these weights) of a probe message; a WireError if they
    cannot be the probe's."""
    logprobs, busy, load_s = message.tensors["logprobs"], message.fields["busy"], message.fields["load_s"]
    if logprobs.shape != (PROBE_LENGTH - 1,):
        raise WireError(f"a probe of shape {tuple(logprobs.shape)}, expected ({PROBE_LENGTH - 1},)")
    if not (busy >= 0 and load_s >= 0):
        raise WireError(f"a probe with negative times (busy {busy}, load {load_s})")
    return logprobs, float(busy), float(load_s)


def same_settings(theirs: dict, ours: dict, ignored: tuple) -> list[str]:
    """`name: trainer X, here Y` for each sampling setting (not in `ignored`) the two dicts disagree on, JSON-wise."""
    a, b = json.loads(json.dumps(theirs)), json.loads(json.dumps(ours))
    def differ(x, y):
        return not (x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)))
    return [f"{k}: trainer {a.get(k)!r}, here {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if k not in ignored and differ(a.get(k), b.get(k))]


__all__ = ["PROBE_LENGTH", "TO_TRAINER", "TO_WORKER", "plain", "probe_of", "rollout_message", "rollout_of",
           "same_settings"]
