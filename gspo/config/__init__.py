"""Configs as plain dataclasses made of sections; YAML files and `key=value` overrides; validation.

    cfg = load_config(TrainConfig, "configs/demo.yaml", ["learning_rate=1e-5"])
    sampling = section(cfg, SamplingSettings)  # what the sampler is built from

The sections (gspo/config/shared.py, sampling.py, tasks.py, train.py) group the fields; TrainConfig and SFTConfig
keep flat names, so YAML keys, overrides, TRL's names and saved configs stay as they were. docs/configuration.md
explains every field at length.

The config is a leaf: it imports nothing of gspo but gspo.aliases, the pure math (gspo.algo) and modules that
import nothing of gspo outside their own package (a registry, the sandbox, the built-in tasks), so any module
may import it (tests/test_layout.py). Allowed values the runtime implements by name are written here once
(MODEL_DTYPES, TOOL_CALL_STYLES, BUILTIN_TOOL_NAMES, WEIGHTINGS); their implementers `check_implemented` at import.
"""

from gspo.config.machinery import (
    CHECKS,
    check_choice,
    check_implemented,
    check_positive,
    checks,
    coerce_fields,
    config_help,
    field_docs,
    load_config,
    make_config,
    own_names,
    prefixed,
    section,
    sections,
    to_dict,
    utf8_text,
    validate,
)
from gspo.config.sampling import BUILTIN_TOOL_NAMES, TOOL_CALL_STYLES, SamplerShape, split_endpoint
from gspo.config.sft import SFTConfig
from gspo.config.shared import (
    MODEL_DTYPES,
    DataSettings,
    EvalSettings,
    ModelSettings,
    OutputSettings,
    ProgressSettings,
    RewardSettings,
)
from gspo.config.tasks import TASK_KEYS, WEIGHTINGS, TaskSpec, parse_tasks
from gspo.config.train import (
    RAY_ENGINES,
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
    keeps_sampler_logprobs,
    renamed,
    rollout_secret,
    sampler_sections,
)

__all__ = ["AdvantageSettings", "BUILTIN_TOOL_NAMES", "BatchSettings", "CHECKS", "CheckpointSettings",
           "CorrectionSettings", "DataSettings", "DistributedSettings", "EpisodeSettings", "EvalSettings",
           "LoggingSettings", "LoraSettings", "MODEL_DTYPES", "ModelSettings", "ObjectiveSettings",
           "OptimizerSettings", "OutputSettings", "PrecisionSettings", "ProgressSettings", "RewardSettings",
           "RoutingSettings", "SFTConfig", "SFTTermSettings", "SamplerShape", "SamplingSettings", "TASK_KEYS",
           "RAY_ENGINES", "TOOL_CALL_STYLES", "TRAIN_SECTIONS", "TaskSettings", "TaskSpec", "TrainConfig", "WEIGHTINGS",
           "check_choice", "check_implemented", "check_positive", "checks", "coerce_fields", "config_help",
           "field_docs", "keeps_sampler_logprobs", "load_config", "make_config", "own_names", "parse_tasks",
           "prefixed", "renamed", "sampler_sections", "rollout_secret", "section", "sections", "split_endpoint",
           "to_dict", "utf8_text", "validate"]
