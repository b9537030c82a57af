"""The trainer's Sampler plug, built from its own sections: SamplingSettings, EpisodeSettings and `SamplerShape`, the
few values it shares with the rest of the run (never the whole config: gspo.config's `sampler_sections` is the one
place that reads those out of a TrainConfig). A rollout worker (a gspo serve endpoint the trainer starts:
gspo/rollout/endpoint/spawned.py) is handed the same three and samples with this same plug; on rollout endpoints the
trainer's own plug samples with the endpoints as its generator."""

from __future__ import annotations

import dataclasses

from gspo.config import SamplerShape, keeps_sampler_logprobs, sampler_sections  # noqa: F401  (re-exported)
from gspo.rollout.batch import Rollout, key_name, step_of
from gspo.rollout.generation import generate, sampling_options
from gspo.rollout.policy import LOWER_HINT, PolicySampler, check_sampling_memory, out_of_memory, row_seeds
from gspo.rollout.registry import GENERATORS, choose_generator


class Sampler:
    """The sampling plug of the trainer: G completions per prompt from the policy being trained.

    Built once, from the policy's current weights; `sample(prompts, step, first_row)` returns this
    rank's `Rollout` with the sampler's own log-probs (mu) when `with_logprobs`, the experts it
    used when `recorder` is given (called with the model that samples), and per-row seeds (global
    row numbers from `first_row`) when `seeded`. `sync(policy)` after the updates loads the new
    weights into the sampler (an engine, a copy; nothing when the sampler is the policy itself)
    and returns `time/sync_s`.
    """

    def __init__(self, model, tokenizer, sampling, episodes, shape: SamplerShape, *, seeded: bool,
                 recorder=lambda model: None, records: bool = False, engine: tuple | None = None):
        """Built from the run's SamplingSettings and EpisodeSettings (gspo.config: with an environment every sequence
        is a multi-turn episode, its chat messages rendered with the shape's chat_template_kwargs, its python tool in
        the shape's `sandbox`) and the values it shares with the run (`shape`); never the whole config. `engine`:
        (name, GeneratorBackend, handle) of an engine started elsewhere (rollout endpoints: gspo/rollout/endpoint/
        client.py), which samples instead of the one generation_backend names."""
        from gspo.env import chat_template_kwargs, environment_factory
        from gspo.rollout.agents import agent_of
        from gspo.rollout.episodes import EpisodeLimits

        agent = agent_of(episodes)  # an agent, or an OpenEnv / verifiers environment's: episodes on the endpoint
        self.agent, self.agent_name = agent if agent is not None else (None, None)
        self.make_env = environment_factory(episodes, shape.sandbox)  # None: single-turn (or agents)
        self.episode_settings, self.runner = episodes, None  # the agents' endpoint, started on first use
        self.template_kwargs = chat_template_kwargs(shape.chat_template_kwargs, episodes)
        self.limits = EpisodeLimits.of(episodes, sampling.max_completion_length)
        self.model, self.tokenizer, self.seeded, self.recorder = model, tokenizer, seeded, recorder
        self.options = sampling_options(sampling)
        self.group_size, self.seed = shape.num_generations, shape.seed
        if engine is None:
            self.name, self.reason = choose_generator(model, sampling.generation_backend)  # reason: a line for the log
            backend, handle = GENERATORS[self.name], None
        else:
            self.name, backend, handle = engine
            self.reason = f"sampler: {self.name}"
        self.backend = backend
        # an engine's mu always differs a little (rollout endpoints: their shape says so, rollout_endpoints set)
        with_logprobs = shape.keep_logprobs or backend.start is not None
        needs = {"seeded_rows": seeded, "routing_record": records, "logprobs": with_logprobs}
        missing = [what for what, needed in needs.items() if needed and not getattr(backend, what)]
        if missing:
            raise ValueError(f"generation_backend={self.name!r} cannot provide {', '.join(missing)}, which this run "
                             "needs (seeded_sampling or torchrun, routing_replay=rollout, the sampler's log-probs)")
        if self.agent is not None and records:
            raise ValueError("routing_replay=rollout records the sampler's experts per call; agent episodes do not "
                             "keep them yet: use routing_replay=old_policy or none with an agent")
        self.with_logprobs, self.synced, self.records = with_logprobs, False, records
        B, G = shape.per_device_batch_size, shape.num_generations
        # an engine holds whole episodes: room for the prompt and max_episode_tokens after it
        engine = sampling if self.make_env is None and self.agent is None else dataclasses.replace(
            sampling, max_completion_length=max(sampling.max_completion_length, episodes.max_episode_tokens))
        self.sampler = (handle if handle is not None
                        else backend.start(model, tokenizer, engine, rows=B * G, seed=shape.seed) if backend.start
                        else PolicySampler(model, tokenizer, sampling))
        if isinstance(self.sampler, PolicySampler):  # an engine sizes its own memory (vllm_gpu_memory_utilization)
            check_sampling_memory(self.sampler.model, B, G, sampling.max_completion_length)

    def request(self, prompts: list[str], step, first_row: int, rows: list | None = None) -> None:
        """Remember the prompts of rollout `step` (a step, or (step, round): gspo.rollout.batch.step_of) and their
        data rows, which start episodes; `receive(step)` samples them (in this process nothing runs ahead)."""
        self.asked = (prompts, step, first_row, rows)

    def receive(self, step, wait: bool = True) -> Rollout | None:
        """Rollout `step`, sampled now from the prompts `request` gave (None without `wait`)."""
        prompts, asked, first_row, rows = self.asked
        assert asked == step, (asked, step)
        return self.sample(prompts, step, first_row, rows) if wait else None

    def rng_after(self, step) -> None:
        """Nothing: this sampler draws from the trainer's random state, which the checkpoint holds."""

    def version_of(self, step) -> None:
        """None: sampled in this process from the weights the step trains (or sampler_lag's copy, a fixed lag)."""

    def sample(self, prompts: list[str], step, first_row: int, rows: list | None = None) -> Rollout:
        """Rollout `step` of `prompts` (a step, or (step, round)); seeded rows are numbered from `first_row` within
        the step."""
        G = self.group_size
        sampler = self.sampler.model if isinstance(self.sampler, PolicySampler) else self.sampler
        seeds = row_seeds(self.seed, step_of(step), first_row, len(prompts) * G) if self.seeded else None
        try:
            rows = rows if rows is not None else [{"prompt": p} for p in prompts]  # prompts alone: rows of them
            if self.make_env is not None:  # one episode per sequence, G per row, each with its own environment
                return self.episodes(sampler, [row for row in rows for _ in range(G)], seeds)
            if self.agent is not None:  # one agent episode per sequence, through the run's endpoint
                return self.agent_episodes([row for row in rows for _ in range(G)], seeds)
            return generate(self.model, self.tokenizer, prompts, G, **self.options, with_logprobs=self.with_logprobs,
                            routing_recorder=self.recorder(sampler), row_seeds=seeds, backend=self.backend,
                            sampler=sampler)
        except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError
            if not out_of_memory(err):
                raise
            text = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise ValueError(f"{key_name(step)}: sampling {len(prompts) * G} sequences (per_device_batch_size="
                             f"{len(prompts)} x num_generations={G}) ran out of memory ({text}); "
                             f"{LOWER_HINT}") from None

    def episodes(self, sampler, rows: list, seeds: list[int] | None) -> Rollout:
        """Multi-turn episodes of `rows` (one per sequence) sampled by `sampler` (gspo/rollout/episodes.py)."""
        from gspo.rollout.episodes import sample_episodes

        options = {k: v for k, v in self.options.items() if k not in ("max_new_tokens", "max_prompt_length",
                                                                      "truncate_prompts")}
        rollout, _ = sample_episodes(self.backend, sampler, self.model, self.tokenizer,
                                     [self.make_env() for _ in rows], rows, self.limits,
                                     max_prompt_length=self.options["max_prompt_length"],
                                     truncate_prompts=self.options["truncate_prompts"], seeds=seeds,
                                     with_logprobs=self.with_logprobs, chat_template_kwargs=self.template_kwargs,
                                     recorder=(lambda: self.recorder(sampler)) if self.records else None, **options)
        return rollout

    def agent_episodes(self, rows: list, seeds: list[int] | None) -> Rollout:
        """Agent episodes of `rows` (one per sequence) on the run's endpoint (gspo/rollout/agents.py)."""
        from gspo.plugs.precision import current_autocast
        from gspo.rollout.agents import AgentRunner, agent_rollout, session_limits
        from gspo.rollout.endpoint.engine import engine_of

        if self.runner is None:
            e = self.episode_settings
            device = next(self.model.parameters()).device  # the engine samples under the trainer's autocast
            engine = engine_of(self, autocast=current_autocast(device))
            self.runner = AgentRunner(self.agent, self.agent_name, engine, self.tokenizer,
                                      template_kwargs=self.template_kwargs, tool_style=e.tool_call_style,
                                      limits=session_limits(e), concurrency=e.agent_concurrency,
                                      max_tokens=self.options["max_new_tokens"])
        # mu always: the endpoint recorded it with every call (mismatch/* then says how far it is from pi_old)
        return agent_rollout(self.runner.run(rows, seeds), rows, self.tokenizer, self.model, True)

    def sync(self, policy) -> dict:
        """Load the updated policy into the sampler; {"time/sync_s": seconds}, and on the first call
        `time/sampler_start_s` (the engine's start-up, or making the copy; 0 for the policy itself)."""
        stats = {"time/sync_s": self.sampler.push(policy)}
        if not self.synced:
            stats["time/sampler_start_s"], self.synced = self.sampler.start_s, True
        return stats

    def close(self) -> None:
        """Shut down an engine this Sampler started (vllm: one per process at a time); nothing otherwise."""
        if self.runner is not None:
            self.runner.close()
        close = getattr(self.sampler, "close", None)
        if close is not None:
            close()


__all__ = ["Sampler", "SamplerShape", "keeps_sampler_logprobs", "sampler_sections"]
