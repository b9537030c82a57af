"""Rollouts: the padded batch of sampled completions (batch.py), how they are sampled (sampling.py:
the generator registry, seeded rows, the trainer's Sampler plug) and gspo's own decode loop
(decode.py, a preallocated KV cache; the same tokens as HF `generate` for the same seed).

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
from gspo.rollout.sampling import (
    GENERATORS,
    GeneratorBackend,
    PolicySampler,
    Sampler,
    SeededSampler,
    generate,
    generator_choices,
    keeps_sampler_logprobs,
    pick_generator,
    policy_backend,
    register_generator,
    row_seeds,
)

__all__ = ["GENERATORS", "Sampler", "GeneratorBackend", "PolicySampler", "Rollout", "SeededSampler",
           "completion_mask_from_ids", "encode_prompts", "eos_ids", "generate", "generator_choices",
           "keeps_sampler_logprobs", "pad_id", "pick_generator", "policy_backend", "register_generator", "row_seeds"]
import gspo.rollout.vllm_engine  # noqa: F401  # isort: skip  (registers "vllm"; last: it imports gspo.rollout.sampling)
