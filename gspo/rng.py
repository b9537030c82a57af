"""Every random-number generator's state as exact JSON, for checkpoints and exact resume.

    state = capture_rng({"shuffle": shuffle})   # Python, NumPy, torch CPU (+ CUDA), named generators
    restore_rng(state, {"shuffle": shuffle})
    check_rng(state, {"shuffle": shuffle})      # the errors restore_rng would raise, no RNG changed
"""

from __future__ import annotations

import base64
import random

import numpy as np
import torch


def capture_rng(generators: dict[str, torch.Generator] | None = None) -> dict:
    """Every RNG state as JSON-able data: Python, NumPy, torch CPU, CUDA (if in use), named generators."""
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {"bit_generator": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": _b64(torch.get_rng_state()),
        "generators": {k: _b64(g.get_state()) for k, g in (generators or {}).items()},
    }
    # Only when CUDA is already initialised: asking would otherwise start a context on every GPU.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict, generators: dict[str, torch.Generator] | None = None) -> None:
    """Undo `capture_rng`: set every global RNG and each named generator to the captured state.

    The generator names must match the captured ones exactly. CUDA states are set for the GPUs
    present (none on a CPU-only machine, where a CUDA run cannot be resumed bit for bit anyway).
    """
    _set_states(state, generators or {}, random, np.random, torch.set_rng_state)
    if state.get("cuda") and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_unb64(s), i)


def check_rng(state: dict, generators: dict[str, torch.Generator] | None = None) -> None:
    """Raise what `restore_rng(state, generators)` would raise for a state it cannot set (CUDA's aside), setting
    throwaway generators of each kind only: no RNG in use changes."""
    spares = {name: torch.Generator(device=gen.device) for name, gen in (generators or {}).items()}
    _set_states(state, spares, random.Random(), np.random.RandomState(), torch.Generator().set_state)


def _set_states(state: dict, generators: dict, python, numpy, set_torch) -> None:
    """`state`'s Python, NumPy, torch CPU and named generators' states set on `python` (random or a Random),
    `numpy` (np.random or a RandomState), through `set_torch` and on `generators`."""
    saved = state.get("generators", {})
    if set(saved) != set(generators):
        raise ValueError(f"rng_generators: names {sorted(generators)} do not match the checkpoint's {sorted(saved)}")
    py = state["python"]
    python.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    npy = state["numpy"]
    numpy.set_state((npy["bit_generator"], np.asarray(npy["keys"], dtype=np.uint32), npy["pos"],
                     npy["has_gauss"], npy["cached_gaussian"]))
    set_torch(_unb64(state["torch"]))
    for name, gen in generators.items():
        gen.set_state(_unb64(saved[name]))


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
