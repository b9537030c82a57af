"""Checks of a model's files and sizes before it is built, each failure one line naming the file or field.

`check_sizes` refuses sizes below 1 in a config (model_overrides, a config.json); `check_memory` refuses a
model whose weights alone (`parameter_bytes`, an estimate from its config) exceed the memory available;
`check_safetensors` refuses a weights file that is cut short or not safetensors at all, and
`mismatched_shapes` says which tensor of which file does not fit the config. Imports nothing of ours.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "head_dim", "moe_intermediate_size")
"""Config fields that size a tensor or a stack of layers: each must be >= 1 where it is set."""
SHOWN = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")  # what a memory refusal names
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")  # Qwen-MoE, Mixtral, DeepSeek


def check_sizes(values: dict, where: str) -> None:
    """ValueError naming every SIZE_FIELDS entry of `values` (a config as a mapping; its text_config too) below 1."""
    bad = [f"{k}={values[k]!r}" for k in SIZE_FIELDS if _number(values.get(k)) and values[k] < 1]
    if bad:
        raise ValueError(f"{where}: {', '.join(bad)} must be > 0")
    if isinstance(values.get("text_config"), dict):
        check_sizes(values["text_config"], f"{where} (text_config)")


def check_config_json(folder) -> None:
    """ValueError naming `folder`/config.json where it is not a JSON object or sets a size below 1 (`check_sizes`)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return
    try:
        values = json.loads(path.read_bytes())
    except (ValueError, OSError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"model {path}: not a JSON object ({_first_line(err)})") from None
    if not isinstance(values, dict):
        raise ValueError(f"model {path}: not a JSON object (a {type(values).__name__})")
    check_sizes(values, f"model {path}")


def parameter_bytes(config, dtype_bytes: float) -> int:
    """An estimate of the memory a model's weights take, from its (transformers) config: embeddings (twice when
    not tied), per layer the attention projections (q, k, v, o) and the gated MLP (gate, up, down) or, in sparse
    layers, the router and every expert. Biases, norms and shared experts are left out: a slight underestimate."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    V, H, L = (_int(config, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers"))
    I = _int(config, "intermediate_size")
    heads = _int(config, "num_attention_heads") or 1
    kv_heads = _int(config, "num_key_value_heads") or heads
    head_dim = _int(config, "head_dim") or H // heads
    embed = V * H * (1 if getattr(config, "tie_word_embeddings", True) else 2)
    attention = H * heads * head_dim * 2 + H * kv_heads * head_dim * 2  # q and o; k and v
    E = max([_int(config, k) for k in _EXPERTS] + [0])
    sparse = 0
    if E > 1:  # every decoder_sparse_step-th layer, less the dense ones named (Qwen-MoE, DeepSeek)
        dense = len(getattr(config, "mlp_only_layers", None) or ()) + _int(config, "first_k_dense_replace")
        sparse = max(0, L // max(1, _int(config, "decoder_sparse_step") or 1) - dense)
    width = _int(config, "moe_intermediate_size") or I
    mlp = (L - sparse) * 3 * H * I + sparse * (H * E + E * 3 * H * width)
    return int((embed + L * attention + mlp) * dtype_bytes)


def available_memory() -> int | None:
    """Bytes of memory free for new tensors on the CPU (available RAM plus free swap: psutil, else Linux's
    /proc/meminfo), or None where neither can be read (then nothing is refused)."""
    try:
        import psutil
    except ImportError:
        try:
            with open("/proc/meminfo", encoding="ascii") as f:
                fields = dict(line.split(":", 1) for line in f.read().splitlines())
            return sum(int(fields[key].split()[0]) * 1024 for key in ("MemAvailable", "SwapFree"))
        except (OSError, KeyError, ValueError):  # not Linux
            return None
    return psutil.virtual_memory().available + psutil.swap_memory().free


def check_memory(config, dtype_bytes: float, where: str, advice: str) -> None:
    """ValueError, before the model is built, where its weights alone (`parameter_bytes`) exceed the memory
    available, naming the fields that size them; nothing where the available memory cannot be read."""
    need, have = parameter_bytes(config, dtype_bytes), available_memory()
    if have is not None and need > have:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        fields = ", ".join(f"{k}={getattr(text, k)}" for k in SHOWN if getattr(text, k, None) is not None)
        raise ValueError(f"{where}: its weights alone need about {need / 2**30:.1f} GiB (estimated from {fields}), "
                         f"more than the {have / 2**30:.1f} GiB of memory available; {advice}")


def check_safetensors(folder) -> None:
    """ValueError naming the first *.safetensors file in `folder` that is not one or is cut short, read from its
    header: an 8-byte length, that many bytes of JSON, then the tensor data the JSON's data_offsets describe."""
    for path in sorted(Path(folder).glob("*.safetensors")):
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"model file {path}: not a safetensors file (only {size} bytes)")
            length = struct.unpack("<Q", head)[0]
            if length > size - 8:
                raise ValueError(f"model file {path}: not a safetensors file (its header would take {length} bytes "
                                 f"of its {size})")
            try:
                header = json.loads(f.read(length))
                end = max([t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"] + [0])
            except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
                raise ValueError(f"model file {path}: not a safetensors file ({_first_line(err)})") from None
        if 8 + length + end > size:
            raise ValueError(f"model file {path}: cut short ({size} of the {8 + length + end} bytes its header "
                             "describes); copy or download it again")


def mismatched_shapes(folder, mismatched) -> ValueError:
    """The error for transformers' `mismatched_keys` ((name, saved shape, config's shape), ...) of a load from
    `folder`: the file holding the first one (from the safetensors index, else the folder's one file)."""
    name, saved, wanted = sorted(mismatched, key=str)[0]
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    try:
        file = folder / json.loads(index.read_text())["weight_map"][name] if index.is_file() else files[0]
    except (ValueError, KeyError, IndexError, TypeError, OSError):
        file = folder
    more = f" (and {len(mismatched) - 1} more tensors)" if len(mismatched) > 1 else ""
    return ValueError(f"model file {file}: {name} has shape {tuple(saved)}, but {folder / 'config.json'} makes it "
                      f"{tuple(wanted)}{more}")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(config, key: str) -> int:
    value = getattr(config, key, None)
    return int(value) if _number(value) and math.isfinite(value) else 0


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
