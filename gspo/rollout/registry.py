"""The registry of generators: the ways completions can be sampled, by name, and what each can do.

Imports nothing of gspo: the config reads `generator_choices()` from here. The built-in generators are known by
name and imported where they live the first time one is used (`BUILTIN`), so naming "vllm" costs nothing until a
run samples with it, and nothing registers itself as a side effect of an import.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass


@dataclass(frozen=True)
class GeneratorBackend:
    """A registered way to sample completions, and what it can do (checked when a Sampler is built).

    `sample(sampler, prompt_ids, prompt_mask, *, eos, pad, max_new_tokens, temperature, top_p, top_k,
    min_p, repetition_penalty, greedy, seeded, with_logprobs, group_size) -> (completion ids (N, T),
    sampler log-probs (N, T) or None)`, where `sampler` is the model (or its copy) or, with `start`, the engine it
    returned; rows come in groups of `group_size` copies of a prompt. `unsupported(model)`: why it cannot run
    `model`, or None. `start(policy, tokenizer, sampling, rows=, seed=)`: an engine of its own for a run, with
    `push(policy) -> seconds` (load the policy's weights) and `start_s`; None: the run's sampler
    is the policy itself or a copy of it (`PolicySampler`).
    """

    sample: object
    unsupported: object
    seeded_rows: bool = True  # honours per-row seeds (SeededSampler)
    routing_record: bool = True  # its forwards can be recorded by gspo.plugs.moe.record_routing
    logprobs: bool = True  # returns the sampler's own log-probs (mu)
    start: object = None  # (policy, tokenizer, sampling, rows=, seed=) -> an engine; None: PolicySampler


# The built-in generators, in the order "auto" tries them: "module:attribute" of each one's GeneratorBackend
BUILTIN = {
    "gspo": "gspo.rollout.generation:NATIVE",  # gspo's own decode loop (gspo/rollout/decode.py)
    "hf": "gspo.rollout.generation:HF_GENERATE",  # HF `generate`
    "vllm": "gspo.rollout.vllm_engine:VLLM",  # a vLLM engine colocated in the process
}


class Generators(MutableMapping):
    """name -> GeneratorBackend, in registration order; an entry given as "module:attribute" is imported the
    first time it is read. A test may swap an entry (`monkeypatch.setitem`)."""

    def __init__(self, entries: dict):
        self._entries: dict[str, GeneratorBackend | str] = dict(entries)

    def __getitem__(self, name: str) -> GeneratorBackend:
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attribute = entry.partition(":")
            entry = self._entries[name] = getattr(importlib.import_module(module), attribute)
        return entry

    def __setitem__(self, name: str, backend: GeneratorBackend) -> None:
        self._entries[name] = backend

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


GENERATORS = Generators(BUILTIN)


def register_generator(name: str, backend: GeneratorBackend) -> GeneratorBackend:
    """Add `backend` under `name` (after the built-ins: "auto" tries it last); a ValueError if the name is taken."""
    if name in GENERATORS or name == "auto":
        raise ValueError(f"generator {name!r} is already registered")
    GENERATORS[name] = backend
    return backend


def generator_choices() -> tuple[str, ...]:
    """The values `generation_backend` accepts: "auto" (the first registered one that can run the model) and each
    name."""
    return ("auto", *GENERATORS)


def policy_backend(backend: str) -> str:
    """The backend that samples with the policy itself: `backend`, or "auto" where it names an engine (vllm)."""
    return "auto" if backend in GENERATORS and GENERATORS[backend].start is not None else backend


def pick_generator(model, backend: str) -> str:
    """The registered generator `backend` names, or for "auto" the first that can run `model`."""
    return choose_generator(model, backend)[0]


def choose_generator(model, backend: str) -> tuple[str, str]:
    """(the generator `pick_generator` takes, why: a line for the log saying which and, for "auto",
    why each one before it was passed over)."""
    if backend not in generator_choices():
        raise ValueError(f"backend must be one of {', '.join(map(repr, generator_choices()))}; got {backend!r}")
    if backend != "auto":
        reason = GENERATORS[backend].unsupported(model)
        if reason is not None:
            raise ValueError(f"backend={backend!r} cannot run this model: {reason}")
        return backend, f"sampler: {backend} (generation_backend={backend!r})"
    passed_over = []
    for name, b in GENERATORS.items():
        reason = b.unsupported(model)
        if reason is None:
            why = "; ".join(f"not {other}: {r}" for other, r in passed_over) or "the first that runs this model"
            return name, f"sampler: {name} (generation_backend='auto': {why})"
        passed_over.append((name, reason))
    raise ValueError("no registered generator can run this model: " + "; ".join(f"{n}: {r}" for n, r in passed_over))


__all__ = ["BUILTIN", "GENERATORS", "GeneratorBackend", "Generators", "choose_generator", "generator_choices",
           "pick_generator", "policy_backend", "register_generator"]
