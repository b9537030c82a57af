"""The run's sampler, `build_sampler`: the Sampler plug in this process (gspo/rollout/sampler.py) or, with
rollout_endpoints or rollout_workers, EndpointSampler (gspo/rollout/endpoint/rollouts.py, imported only then).

This module held all of sampling before it was split by concern: the generator registry (registry.py), `generate`
and the built-in generators (generation.py), seeded rows, the policy's copies and memory sizing (policy.py), the
Sampler plug (sampler.py). Its former names still import from here.
"""

from __future__ import annotations

from gspo.rollout.generation import generate, sampling_options
from gspo.rollout.policy import (
    PolicySampler,
    SeededSampler,
    available_bytes,
    check_sampling_memory,
    out_of_memory,
    row_seeds,
    sampling_bytes,
)
from gspo.rollout.registry import (
    GENERATORS,
    GeneratorBackend,
    choose_generator,
    generator_choices,
    pick_generator,
    policy_backend,
    register_generator,
)
from gspo.rollout.sampler import Sampler, SamplerShape, keeps_sampler_logprobs, sampler_sections


def build_sampler(model, tokenizer, sampling, episodes, shape: SamplerShape, *, seeded: bool, load: tuple | None = None,
                  rank: int = 0, recorder=lambda model: None, records: bool = False, version: int = 0, rng=None,
                  topology=None):
    """The run's Sampler plug, from its SamplingSettings (the rollout channel's settings among them), EpisodeSettings
    and SamplerShape (`sampler_sections(cfg)` gives all three): `Sampler` in the trainer's process, or
    `EndpointSampler` (the same Sampler, its generator the endpoints) with rollout_endpoints (servers of their own,
    shared by the trainer's ranks) or rollout_workers > 0 (gspo serve endpoints it starts itself, each building the
    same Sampler from the same sections; under torchrun each trainer rank has workers of its own for its share of
    the batch). `load`: the run's (ModelSettings, LoraSettings), which a worker of an fsdp trainer loads the model
    by (the trainer holds a shard only); `version`: the steps the weights have taken (a resumed run's); `rng`: a
    resumed run's random states of the endpoints; `topology`: the run's (shared endpoints under torchrun: rank 0
    pushes the weights for all). `rank`: unused, kept for callers."""
    if sampling.rollout_endpoints or sampling.rollout_workers:
        from gspo.rollout.endpoint.rollouts import EndpointSampler

        return EndpointSampler(model, tokenizer, sampling, episodes, shape, seeded=seeded, version=version,
                               topology=topology, records=records, rng=rng, load=load)
    return Sampler(model, tokenizer, sampling, episodes, shape, seeded=seeded, recorder=recorder, records=records)


__all__ = ["GENERATORS", "GeneratorBackend", "PolicySampler", "Sampler", "SamplerShape", "SeededSampler",
           "available_bytes", "build_sampler", "check_sampling_memory", "choose_generator", "generate",
           "generator_choices", "keeps_sampler_logprobs", "out_of_memory", "pick_generator", "policy_backend",
           "register_generator", "row_seeds", "sampler_sections", "sampling_bytes", "sampling_options"]
