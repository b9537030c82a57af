"""Models shipped as GGUF files (llama.cpp's format), made plain transformers checkpoints once.

transformers reads a GGUF file with the `gguf` package, dequantising every tensor to float32, but
will not `save_pretrained` the result (its config keeps the GGUF quantization entry). gspo rebuilds
the model from that config without the entry, loads the dequantised weights into it, and saves
model and tokenizer (its chat template included) as a safetensors folder in a cache: `GSPO_CACHE`,
default ~/.cache/gspo, keyed by the file's real path, size and modification time. The first load of
a file converts it (~25 s for SmolLM2-135M on 2 CPU cores), later ones load the folder. Nothing is
downloaded: `model: path/to/x.gguf` in a config, or a model a pip package ships, by its name
(`model: smollm2`: gspo.models.PACKAGED). A file is checked before it is converted (`check_gguf`): an empty,
foreign, damaged or cut-short one is one line.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import shutil
import struct
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("GSPO_CACHE") or Path.home() / ".cache" / "gspo")


def is_gguf(name_or_path) -> bool:
    return isinstance(name_or_path, (str, os.PathLike)) and str(name_or_path).lower().endswith(".gguf")


def converted(path) -> Path:
    """The checkpoint folder made from GGUF file `path` (converted now if the cache lacks it)."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"model {str(path)!r}: no such GGUF file")
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
    try:
        _convert(path, partial)
        os.replace(partial, folder)  # complete or absent: a killed conversion leaves only the .partial folder
    except FileExistsError:
        pass  # another process converted it meanwhile
    except OSError as err:
        if not (folder / "config.json").is_file():
            raise ValueError(f"model {str(path)!r}: cannot write its conversion to {folder} ({err})") from err
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def _convert(path: Path, out: Path) -> None:
    try:
        import gguf  # transformers reads GGUF files with it
    except ImportError:
        gguf = None
    check_gguf(path, gguf and gguf.GGML_QUANT_SIZES)  # a damaged file is named so, with or without the package
    if gguf is None:
        raise ValueError(f"model {str(path)!r}: loading a GGUF file needs the gguf package: pip install gguf "
                         "(or pip install 'gspo[real]')")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"gguf: converting {path.name} to a transformers checkpoint in {out.parent} (once)", flush=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)  # dequantised to float32
    except (ValueError, KeyError, IndexError, struct.error) as err:  # what its readers raise on what they refuse
        raise ValueError(f"model {str(path)!r}: transformers cannot read it ({_first_line(err)})") from err
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the GGUF entry: save_pretrained refuses a "quantized" model
    plain = AutoModelForCausalLM.from_config(config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"model {str(path)!r}: its weights do not fit the architecture transformers reads from it "
                         f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count (GGUF v2 and v3, little-endian)
_WIDTHS = {0: 1, 1: 1, 7: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 10: 8, 11: 8, 12: 8}  # fixed-size metadata value types
_STRING, _ARRAY = 8, 9


class _CutShort(Exception):
    """The file ended inside its header."""


def check_gguf(path: Path, sizes: dict | None = None) -> None:
    """Refuse, in one line naming `path`, what is not a whole GGUF file (the layout: llama.cpp's docs/gguf.md):
    empty, another format, another version, more tensors or metadata than its size can hold, cut short in its
    header; with `sizes` (gguf.GGML_QUANT_SIZES: ggml type -> (block elements, block bytes)) also cut short in its
    tensor data. Reads the header and the tensor table only."""
    where, size = f"model {str(path)!r}", path.stat().st_size
    with open(path, "rb") as f:
        blob = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)) if size else memoryview(b"")
    if not size:
        raise ValueError(f"{where}: is empty")
    if bytes(blob[:4]) != b"GGUF"[: min(size, 4)]:
        raise ValueError(f"{where}: is not a GGUF file (it starts with {bytes(blob[:4])!r}, not b'GGUF')")
    if size < _HEADER.size:
        raise ValueError(f"{where}: is cut short ({size} bytes; a GGUF header alone takes {_HEADER.size})")
    _, version, tensors, entries = _HEADER.unpack_from(blob)
    if version not in (2, 3):
        raise ValueError(f"{where}: is GGUF version {version}; transformers reads versions 2 and 3")
    if tensors * 24 + entries * 13 > size - _HEADER.size:  # the smallest tensor entry and metadata entry
        raise ValueError(f"{where}: claims {tensors} tensors and {entries} metadata entries, more than its {size} "
                         "bytes can hold")
    try:
        table, start = _tensor_table(blob, entries, tensors)
    except _CutShort:
        raise ValueError(f"{where}: is cut short ({size} bytes, within its header); copy or download it again") \
            from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{where}: is damaged ({err})") from None
    if sizes:
        ends = [offset + elements // sizes[kind][0] * sizes[kind][1] for kind, elements, offset in table
                if kind in sizes]
        end = start + max(ends, default=0)
        if end > size:
            raise ValueError(f"{where}: is cut short ({size} bytes; its tensors end at byte {end}); copy or "
                             "download it again")


def _tensor_table(blob: memoryview, entries: int, tensors: int) -> tuple[list[tuple[int, int, int]], int]:
    """([(ggml type, elements, offset in the data section)] of every tensor, where the data section starts)."""
    pos, alignment = _HEADER.size, 32  # llama.cpp's default alignment

    def read(fmt: str):
        nonlocal pos
        if pos + struct.calcsize(fmt) > len(blob):
            raise _CutShort
        values = struct.unpack_from(fmt, blob, pos)
        pos += struct.calcsize(fmt)
        return values

    def skip_string() -> None:
        nonlocal pos
        (length,) = read("<Q")
        if pos + length > len(blob):
            raise _CutShort
        pos += length

    def skip_value(kind: int) -> None:
        nonlocal pos
        if kind == _STRING:
            skip_string()
        elif kind == _ARRAY:
            item, count = read("<IQ")
            if item in _WIDTHS:
                pos += _WIDTHS[item] * count
            else:
                for _ in range(count):
                    skip_value(item)
        elif kind in _WIDTHS:
            pos += _WIDTHS[kind]
        else:
            raise ValueError(f"metadata of unknown type {kind}")
        if pos > len(blob):
            raise _CutShort

    for _ in range(entries):
        (length,) = read("<Q")
        key = bytes(blob[pos: pos + length]).decode("utf-8")
        pos += length
        (kind,) = read("<I")
        if key == "general.alignment" and kind == 4:
            (alignment,) = read("<I")
        else:
            skip_value(kind)
    table = []
    for _ in range(tensors):
        skip_string()
        (dims,) = read("<I")
        shape = read(f"<{dims}Q") if dims <= 8 else None
        if shape is None:
            raise ValueError(f"a tensor of {dims} dimensions")
        kind, offset = read("<IQ")
        table.append((kind, math.prod(shape), offset))
    if not alignment:
        raise ValueError("general.alignment is 0")
    return table, (pos + alignment - 1) // alignment * alignment


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
