"""Configs as plain dataclasses made of sections; YAML files and `key=value` overrides; validation.

    cfg = load_config(TrainConfig, "configs/demo.yaml", ["learning_rate=1e-5"])
    sampling = section(cfg, SamplingSettings)  # what the sampler is built from

The sections (gspo/config/shared.py, gspo/config/train.py) group the fields; TrainConfig and SFTConfig keep
flat names, so YAML keys, overrides, TRL's names and saved configs stay as they were. docs/configuration.md
explains every field at length.
"""

from gspo.config.machinery import (
    CHECKS,
    check_choice,
    check_positive,
    checks,
    coerce_fields,
    config_help,
    field_docs,
    load_config,
    make_config,
    prefixed,
    renamed,
    section,
    sections,
    to_dict,
    validate,
)
from gspo.config.sft import SFTConfig
from gspo.config.shared import (
    DataSettings,
    EvalSettings,
    ModelSettings,
    OutputSettings,
    ProgressSettings,
    RewardSettings,
)
from gspo.config.train import (
    TRAIN_SECTIONS,
    AdvantageSettings,
    BatchSettings,
    CheckpointSettings,
    CorrectionSettings,
    DistributedSettings,
    EpisodeSettings,
    LoggingSettings,
    LoraSettings,
    ObjectiveSettings,
    OptimizerSettings,
    PrecisionSettings,
    RoutingSettings,
    SamplingSettings,
    SFTTermSettings,
    TaskSettings,
    TrainConfig,
    rollout_secret,
    split_address,
)

__all__ = ["CHECKS", "TRAIN_SECTIONS", "AdvantageSettings", "BatchSettings", "CheckpointSettings",
           "CorrectionSettings", "DataSettings", "DistributedSettings", "EpisodeSettings", "EvalSettings",
           "LoggingSettings",
           "LoraSettings", "ModelSettings", "ObjectiveSettings", "OptimizerSettings", "OutputSettings",
           "PrecisionSettings", "ProgressSettings", "RewardSettings", "RoutingSettings", "SFTConfig",
           "SFTTermSettings", "SamplingSettings", "TaskSettings", "TrainConfig", "check_choice", "check_positive",
           "checks", "coerce_fields", "config_help", "field_docs", "load_config", "make_config", "prefixed",
           "renamed", "rollout_secret", "section", "sections", "split_address", "to_dict",
           "validate"]
