"""LoRA through PEFT (the `peft` extra): low-rank adapters trained on a frozen base.

    model = attach_adapters(model, section(cfg, LoraSettings))  # lora_r > 0 or a `peft:` block; else the model

Only the adapters require grad, so the optimizer, its state and a checkpoint hold only them; the
base with its adapters off is the reference policy (gspo/plugs/reference.py), so kl_coef > 0 keeps one
model in memory. MoE routers are never adapted: a LoRA delta on a router would change the experts
it picks behind the back of routing replay, whose hooks sit on the router module itself.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

DEFAULT_TARGETS = "all-linear"  # every linear layer but the output head (PEFT's shorthand, TRL's usual choice)
_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")


def lora_settings(lora) -> dict | None:
    """The `peft.LoraConfig` keywords of a run, or None for full fine-tuning.

    A `peft:` block is taken as written (any LoraConfig field; r is required); otherwise the lora_*
    fields, with lora_r = 0 meaning full fine-tuning. Setting both is an error, named.
    """
    block = lora.peft
    if block is None:
        if not lora.lora_r:
            return None
        return {"r": lora.lora_r, "lora_alpha": lora.lora_alpha, "lora_dropout": lora.lora_dropout,
                "target_modules": lora.lora_target_modules}
    defaults = {f.name: f.default for f in dataclasses.fields(lora) if f.name in _FIELDS}
    also = [name for name in _FIELDS if getattr(lora, name) != defaults[name]]
    if also:
        raise ValueError(f"config: give LoRA settings either as a `peft:` block or as {', '.join(_FIELDS)}, "
                         f"not both (set: peft and {', '.join(also)})")
    if "r" not in block:
        raise ValueError("config: the `peft:` block needs r (the LoRA rank), e.g. {r: 16, lora_alpha: 32}")
    settings = {"target_modules": DEFAULT_TARGETS, **block}
    for key in ("task_type", "peft_type"):
        settings.pop(key, None)  # always a causal-LM LoRA
    return settings


def check_lora(lora) -> None:
    """Config-time checks of a LoraSettings: consistent, peft installed, a setting PEFT refuses named (before
    loading). LoRA under fsdp is refused by gspo.config.train.check_train."""
    settings = lora_settings(lora)
    if settings is not None:
        _lora_config(settings)


def attach_adapters(model, lora):
    """`model` with LoRA adapters (a peft PeftModel), or `model` itself for full fine-tuning.

    "all-linear" is resolved here, to the nn.Linear layers (GPT-2's Conv1D too) but the output head:
    left to PEFT, on a transformers-5 MoE it also adapts the router's weight and the fused experts
    (its mapping of the v4 layer names). The experts can still be named in a `peft:` block's
    target_parameters; a setting that reaches a router is refused.
    """
    settings = lora_settings(lora)  # a LoraSettings (gspo.config)
    if settings is None:
        return model
    from peft import get_peft_model

    if settings["target_modules"] == DEFAULT_TARGETS:
        settings = {**settings, "target_modules": linear_layers(model)}
    cuda = sorted({str(p.device) for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):  # the adapters' random init leaves the run's random stream alone:
        peft_model = get_peft_model(model, _lora_config(settings))  # it samples as full fine-tuning would
    adapted = [name.removesuffix(".base_layer") for name, module in peft_model.named_modules()
               if "router" in type(module).__name__.lower() and name.endswith(".base_layer")]
    if adapted:
        raise ValueError(f"LoRA: the settings put an adapter on MoE router {adapted[0]!r}: routers stay frozen "
                         "(routing replay and the drift metric hook the router itself); leave them out of "
                         "target_modules / target_parameters")
    if not any(p.requires_grad for p in peft_model.parameters()):
        raise ValueError(f"LoRA: target_modules={settings['target_modules']!r} matched no layer of this "
                         f"{model.config.model_type} model; name its layers (e.g. q_proj, v_proj)")
    return peft_model


def linear_layers(model) -> list[str]:
    """Names of the model's linear layers (nn.Linear, transformers' Conv1D) but its output head."""
    head = model.get_output_embeddings()
    return sorted(name for name, module in model.named_modules()
                  if type(module).__name__ == "Conv1D" or isinstance(module, torch.nn.Linear) and module is not head)


def is_peft(model) -> bool:
    """True for a peft PeftModel (checked by its attribute, so peft need not be imported)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def plain_model(model):
    """The transformers model inside a PeftModel (its layers carry the adapters), or `model` itself."""
    return model.get_base_model() if is_peft(model) else model


def merged_state_dict(model) -> dict:
    """`model`'s weights under its plain model's names, each adapted layer's weight plus its adapters'
    delta (computed out of place: `model` and its adapters stay as they are). What an inference
    engine loads (gspo/rollout/vllm_engine.py). A model without adapters: its own state dict."""
    if not is_peft(model):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer

    base, deltas = model.get_base_model(), {}
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if type(module).__name__ == "ParamWrapper":  # target_parameters (fused MoE experts)
            raise ValueError(f"LoRA: merging adapters on parameters ({name}, target_parameters) is not supported "
                             "here; adapt modules (target_modules) only")
        active = [a for a in module.active_adapters if a in module.lora_A]
        if active:
            deltas[f"{name}.weight"] = sum(module.get_delta_weight(a) for a in active)
    state = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        state[key] = value + deltas[key] if key in deltas else value
    return state


def merged_model(model):
    """The base with the adapters folded into its weights, as a plain transformers model (in place:
    `model` is spent). The model itself where it has no adapters."""
    return model.merge_and_unload() if is_peft(model) else model


def load_adapter(path: str, load_base):
    """(model, tokenizer) from a PEFT adapter folder: its base (`load_base(name_or_path)` -> (model, tokenizer)),
    the adapter merged in; the folder's own tokenizer where it has one (gspo saves it beside the adapter)."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{path}: a LoRA adapter whose base model is not named (a gspo preset: random weights "
                         "from a seed); load the run's merged/ folder instead (lora_save_merged: true)")
    try:
        from peft import PeftModel
    except ImportError:
        raise ValueError(f"{path} is a LoRA adapter: loading it needs the peft extra, "
                         "pip install 'gspo[peft]'") from None
    model, tokenizer = load_base(base)
    if os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    return PeftModel.from_pretrained(model, path).merge_and_unload(), tokenizer


def _lora_config(settings: dict):
    try:
        from peft import LoraConfig
    except ImportError:
        raise ValueError("LoRA needs the peft extra: pip install 'gspo[peft]'") from None
    try:
        return LoraConfig(task_type="CAUSAL_LM", **settings)
    except (TypeError, ValueError) as err:
        raise ValueError(f"config: LoRA settings {settings} refused by peft.LoraConfig: {err}") from None
