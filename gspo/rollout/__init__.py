"""Rollouts: the padded batch of sampled completions (batch.py) and how they are sampled: the registry of
generators (registry.py: gspo's own decode loop, HF `generate`, vLLM, each imported on first use), `generate` and
the built-in generators (generation.py; decode.py: gspo's loop, a preallocated KV cache, the same tokens as HF
`generate` for the same seed), seeded rows and the policy's copies (policy.py), the trainer's Sampler plug built
from its own sections (sampler.py) and the run's sampler, in this process or on endpoints (sampling.py:
`build_sampler`; endpoint/: the OpenAI-compatible endpoint, rollout endpoints and workers, the weights' wire).

Layout: `input_ids` (N, P+T) are left-padded prompts (width P) followed by right-padded
completions (width T), N = B*G, rows grouped by prompt. The completion mask covers each
completion up to and including its first EOS.
"""

from gspo.rollout.batch import (
    Rollout,
    completion_mask_from_ids,
    encode_prompts,
    eos_ids,
    pad_id,
)
from gspo.rollout.generation import generate
from gspo.rollout.policy import PolicySampler, SeededSampler, row_seeds
from gspo.rollout.registry import (
    GENERATORS,
    GeneratorBackend,
    generator_choices,
    pick_generator,
    policy_backend,
    register_generator,
)
from gspo.rollout.sampler import Sampler, SamplerShape, keeps_sampler_logprobs, sampler_sections
from gspo.rollout.sampling import build_sampler

__all__ = ["GENERATORS", "GeneratorBackend", "PolicySampler", "Rollout", "Sampler", "SamplerShape", "SeededSampler",
           "build_sampler", "completion_mask_from_ids", "encode_prompts", "eos_ids", "generate", "generator_choices",
           "keeps_sampler_logprobs", "pad_id", "pick_generator", "policy_backend", "register_generator", "row_seeds",
           "sampler_sections"]
