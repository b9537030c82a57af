"""The sections of how completions are made: the sampler and its rollout channel (SamplingSettings), and
multi-turn episodes with their tools (EpisodeSettings), with their checks.

The names of the tool-call styles and built-in tools are written here, once: gspo/env keys its implementations
by them and checks at import that each has one (`check_implemented`).
"""

from __future__ import annotations

from dataclasses import dataclass

from gspo.config.machinery import check_choice, check_positive, checks, prefixed
from gspo.config.shared import MODEL_DTYPES

TOOL_CALL_STYLES = ("hermes", "text")
"""How a model writes a tool call (`tool_call_style`); gspo.env.tools parses each, gspo.env answers each."""
BUILTIN_TOOL_NAMES = ("python",)
"""Tools named in `tools:` by their name alone; gspo.env.tools.BUILTIN_TOOLS holds the maker of each."""


@dataclass
class SamplingSettings:
    """How completions are sampled, and by which sampler."""

    max_prompt_length: int = 512
    """Longest prompt in tokens; every prompt is checked before training (see truncate_prompts)."""
    truncate_prompts: str = "error"
    """A prompt over max_prompt_length: error, or left (keep its last tokens, as TRL does)."""
    max_completion_length: int = 64
    """Maximum new tokens per completion."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling; below 1 it truncates the sampler's distribution (no longer the one trained on)."""
    top_k: int = 0
    """Top-k sampling; 0 disables it (transformers would otherwise apply 50)."""
    min_p: float = 0.0
    """Min-p sampling: keep tokens >= min_p x the top token's probability; 0 disables it. Truncates."""
    repetition_penalty: float = 1.0
    """HF's repetition penalty; above 1 makes seen tokens less likely (reshapes sampling); 1: off."""
    seeded_sampling: bool = False
    """A seeded generator per completion (Gumbel-max): tokens independent of batch layout and ranks."""
    generation_backend: str = "auto"
    """Sampler: gspo (own KV-cached loop), hf (HF generate), vllm (colocated engine) or auto."""
    sampler_dtype: str | None = None
    """The sampler's parameter dtype (e.g. bfloat16), a stand-in for engine numerics; null: the policy's."""
    sampler_lag: int = 0
    """Sample with the policy of this many rollouts ago (gspo/hf), a stand-in for async training; 0: off."""
    vllm_gpu_memory_utilization: float = 0.3
    """vllm on CUDA: fraction of GPU memory the colocated engine may take (weights and KV cache)."""
    vllm_kv_cache_bytes: int | None = None
    """vllm: KV cache size in bytes; null: room for one rollout (CPU), from the memory fraction (CUDA)."""
    vllm_sleep: bool = True
    """vllm on CUDA: the engine frees its memory while the trainer updates and wakes for each rollout."""
    rollout_workers: int = 0
    """Sampling processes beside the trainer (gspo serve endpoints it starts, on loopback), each with its own copy
    and a share of the prompts; 0: none."""
    rollout_timeout_s: float = 300.0
    """Longest wait for a rollout worker's or endpoint's answer; a dead or silent one is named and the run stops."""
    max_staleness: int = 0
    """Workers or endpoints sample this many steps ahead: a rollout trains weights at most k updates newer."""
    rollout_address: str | None = None
    """Retired (with `gspo rollout-server`): sampling machines run `gspo serve`, listed in rollout_endpoints."""
    rollout_endpoints: list | None = None
    """URLs of OpenAI-compatible endpoints to sample from (`gspo serve` or `vllm serve`, e.g. http://10.0.0.5:8000/v1),
    token in and token out, their weights updated by the trainer (needs the run's secret); null: sample in the
    trainer's process or its rollout_workers (docs/distributed.md)."""
    rollout_endpoint_wait_s: float = 0.0
    """rollout_endpoints: seconds to wait for a lost endpoint to answer again at its URL (restarted: by Ray, systemd,
    a person), which is then re-joined, given the last weights pushed, and asked again what it lost; 0: a lost
    endpoint stops the run (launcher=ray: 300 unless set)."""
    rollout_weight_transfer: str = "gspo"
    """How vllm serve endpoints take the trainer's weights: gspo (gspo's vLLM backend: any device, any machine, the
    run's secret, tensors only) or nccl (vLLM's NCCL backend: the trainer's GPU and the server's in one NCCL group;
    the server started with --weight-transfer-config '{"backend": "nccl"}'). gspo serve endpoints: always gspo."""
    rollout_secret: str | None = None
    """The secret the trainer and its rollout endpoints prove to each other (rollout_endpoints); never saved or logged,
    refused as a command-line override (ps shows those). Else rollout_secret_file, else GSPO_ROLLOUT_SECRET."""
    rollout_secret_file: str | None = None
    """A file holding the run's secret (its first line), readable by its owner only (chmod 600)."""


def split_endpoint(url) -> tuple[str, str, int]:
    """(base URL without a trailing /v1, host, port) of a rollout endpoint's URL; a ValueError naming it."""
    from urllib.parse import urlsplit

    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"rollout_endpoints: {url!r} is not an http(s)://host:port URL")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"rollout_endpoints: {url!r} has no valid port") from None
    path = parts.path.rstrip("/")
    path = path[:-3] if path.endswith("/v1") else path
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{port}{path}", parts.hostname, port


WEIGHT_TRANSFERS = ("gspo", "nccl")  # rollout_weight_transfer's choices: gspo.rollout.endpoint.client.TRANSFERS
SECRET_ENV = "GSPO_ROLLOUT_SECRET"
MIN_SECRET_CHARS = 16


def rollout_secret(s: SamplingSettings) -> bytes | None:
    """The run's secret for rollout servers: rollout_secret, else the file rollout_secret_file, else the environment
    variable GSPO_ROLLOUT_SECRET; None where none is set. A ValueError naming the source if it is unreadable, too
    short, or a file that others may read."""
    import os
    import stat

    if s.rollout_secret is not None:
        text, where = s.rollout_secret, "rollout_secret"
    elif s.rollout_secret_file is not None:
        where = f"rollout_secret_file={s.rollout_secret_file}"
        try:
            mode = os.stat(s.rollout_secret_file).st_mode
            with open(s.rollout_secret_file, encoding="utf-8") as f:
                text = f.readline()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"config: {where}: cannot be read ({getattr(err, 'strerror', None) or err})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"config: {where}: others may read it (mode {stat.S_IMODE(mode):o}); chmod 600 it")
    elif os.environ.get(SECRET_ENV):
        text, where = os.environ[SECRET_ENV], SECRET_ENV
    else:
        return None
    if len(text.strip()) < MIN_SECRET_CHARS:
        raise ValueError(f"config: {where}: the run's secret must be at least {MIN_SECRET_CHARS} characters (e.g. the "
                         "output of: python -c 'import secrets; print(secrets.token_hex(32))')")
    return text.strip().encode()


def reshaping(s: SamplingSettings) -> list[str]:
    """The settings that reshape the sampler's distribution away from the policy's softmax, as `name=value`."""
    return [f"{k}={getattr(s, k)!r}" for k, off in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                                                   ("repetition_penalty", 1.0)) if getattr(s, k) != off]


@checks(SamplingSettings)
def _check_sampling(s: SamplingSettings) -> None:
    from gspo.rollout.batch import TRUNCATIONS
    from gspo.rollout.registry import generator_choices

    check_positive(s, "max_prompt_length", "max_completion_length", "temperature", "repetition_penalty",
                   "vllm_kv_cache_bytes")
    check_positive(s, "top_k", "sampler_lag", allow_zero=True)
    if not 0 < s.top_p <= 1:
        raise ValueError(f"config: top_p={s.top_p!r} must be in (0, 1]")
    if not 0 <= s.min_p < 1:
        raise ValueError(f"config: min_p={s.min_p!r} must be in [0, 1)")
    if s.seeded_sampling and reshaping(s):
        raise ValueError(f"config: seeded_sampling draws from the full softmax; {', '.join(reshaping(s))} reshape it "
                         "(set top_p=1, top_k=0, min_p=0, repetition_penalty=1)")
    check_choice(s, "truncate_prompts", TRUNCATIONS)
    check_choice(s, "generation_backend", generator_choices())
    if s.sampler_dtype is not None:  # null: the policy's own dtype
        check_choice(s, "sampler_dtype", tuple(d for d in MODEL_DTYPES if d != "auto"))
    check_positive(s, "rollout_workers", "max_staleness", allow_zero=True)
    if s.max_staleness and not s.rollout_workers and not s.rollout_endpoints:
        raise ValueError(f"config: max_staleness={s.max_staleness} overlaps sampling with training in rollout worker "
                         "processes or endpoints; set rollout_workers: 1 or rollout_endpoints (sampler_lag simulates "
                         "staleness in one process)")
    if s.rollout_endpoints is not None:
        _check_endpoints(s)
    check_choice(s, "rollout_weight_transfer", WEIGHT_TRANSFERS)
    if s.rollout_weight_transfer != "gspo" and not s.rollout_endpoints:
        raise ValueError(f"config: rollout_weight_transfer={s.rollout_weight_transfer} is how vllm serve endpoints "
                         "take weights; set rollout_endpoints (rollout_workers and the in-process vllm engine take "
                         "them by gspo's)")
    check_positive(s, "rollout_timeout_s")
    check_positive(s, "rollout_endpoint_wait_s", allow_zero=True)
    if s.rollout_address is not None:
        raise ValueError(f"config: rollout_address={s.rollout_address!r} and gspo rollout-server are retired: on each "
                         "machine that samples start `gspo serve --config <this config> --host <address> --port "
                         "<port>` with the run's secret, and set rollout_endpoints: [http://<address>:<port>/v1, ...] "
                         "(docs/distributed.md)")
    if s.rollout_workers and s.sampler_lag:
        raise ValueError(f"config: sampler_lag={s.sampler_lag} simulates in one process the staleness that rollout "
                         "workers have for real; set max_staleness instead")
    if not 0 < s.vllm_gpu_memory_utilization <= 1:
        raise ValueError(f"config: vllm_gpu_memory_utilization={s.vllm_gpu_memory_utilization!r} must be in (0, 1]")


def _check_endpoints(s: SamplingSettings) -> None:
    if not isinstance(s.rollout_endpoints, list) or not s.rollout_endpoints:
        raise ValueError(f"config: rollout_endpoints={s.rollout_endpoints!r} must be a list of endpoint URLs")
    for url in s.rollout_endpoints:
        prefixed(split_endpoint, url)
    bases = [split_endpoint(url)[0] for url in s.rollout_endpoints]
    if len(set(bases)) < len(bases):
        raise ValueError(f"config: rollout_endpoints names an endpoint twice: {s.rollout_endpoints}")
    if s.rollout_workers:
        raise ValueError("config: rollout_endpoints samples from endpoints started on their own; rollout_workers "
                         "starts endpoints of the run's own: use one of them")
    if rollout_secret(s) is None:
        raise ValueError(f"config: rollout_endpoints: the trainer updates the endpoints' weights, which needs the "
                         f"run's secret; set {SECRET_ENV} (or rollout_secret_file) for the trainer and each gspo serve")
    own = [f"{k}={getattr(s, k)!r}" for k, default in (("generation_backend", "auto"), ("sampler_dtype", None),
                                                        ("sampler_lag", 0)) if getattr(s, k) != default]
    if own:
        raise ValueError(f"config: rollout_endpoints sample with the endpoints' own generator and weights; "
                         f"{', '.join(own)} choose the trainer's own sampler: remove them (set them on gspo serve)")


@dataclass
class EpisodeSettings:
    """Multi-turn episodes: an environment answers each model turn (tool calls, a game); only the model's
    tokens are trained (docs/samplers.md, "Episodes")."""

    environment: str | None = None
    """"module:Class" (or "file.py:Class"), called once per episode for an object with reset(row) and step(turn);
    "tools": the built-in tool environment over `tools`; "openenv:module:EnvClass" or "openenv:http://host:port": an
    OpenEnv environment; "verifiers:name" or "verifiers:module": a verifiers environment (the agents extra:
    docs/agents.md); null: single-turn completions."""
    tools: list | None = None
    """Tool functions, "module:function" each (type-hinted arguments), or python (model-written code in the code
    sandbox, as `sandbox` says); for environment: tools."""
    tool_call_style: str = "hermes"
    """How the model writes a call: hermes (<tool_call>{json}</tool_call>) or text (a line name(argument))."""
    tool_timeout_s: float = 5.0
    """Longest a tool call may run; a call that takes longer is an error the model reads (episode/tool_errors)."""
    tool_max_output_chars: int = 1000
    """A tool's result is cut to this many characters before the model reads it."""
    max_turns: int = 4
    """Model turns per episode (each at most max_completion_length tokens); more: the episode is truncated."""
    max_episode_tokens: int = 256
    """The model's and the environment's tokens after the prompt; more: the episode is truncated."""
    agent: str | None = None
    """"module:function" (or "file.py:function"): an agent, `[async] def agent(client, row)`, run once per episode
    with an OpenAI client on the run's endpoint; it returns the episode's reward (a number, or a dict with
    "reward"), or None to leave it to the reward functions (docs/agents.md). Not with `environment`."""
    agent_concurrency: int = 64
    """Agent episodes running at once (their calls are sampled together)."""
    agent_max_calls: int = 8
    """Calls to the endpoint per agent episode; one more ends the episode as truncated."""
    agent_timeout_s: float = 120.0
    """Wall-clock seconds an agent episode may run; longer: it is cancelled, truncated (never the run)."""


@checks(EpisodeSettings)
def _check_episodes(s: EpisodeSettings) -> None:
    check_choice(s, "tool_call_style", TOOL_CALL_STYLES)
    check_positive(s, "tool_timeout_s", "tool_max_output_chars", "max_turns", "max_episode_tokens",
                   "agent_concurrency", "agent_max_calls", "agent_timeout_s")
    if s.agent is not None and (not isinstance(s.agent, str) or ":" not in s.agent):
        raise ValueError(f"config: agent={s.agent!r}: expected \"module:function\" (or \"file.py:function\")")
    if s.agent is not None and s.environment is not None:
        raise ValueError("config: agent and environment both set; an agent runs its own episodes (its tools, its "
                         "environment): give one of them")
    bad = [t for t in s.tools or () if not isinstance(t, str) or (":" not in t and t not in BUILTIN_TOOL_NAMES)]
    if bad:
        raise ValueError(f"config: tools: {bad[0]!r} is not \"module:function\" (or \"file.py:function\") or a "
                         f"built-in tool ({', '.join(BUILTIN_TOOL_NAMES)})")
    if s.tools and s.environment != "tools":
        raise ValueError(f"config: tools={s.tools!r} are called by the built-in tool environment; set environment: "
                         "tools (or leave tools out: a custom environment runs its own)")
    if s.environment == "tools" and not s.tools:
        raise ValueError("config: environment: tools needs `tools`, a list of \"module:function\"")
    if s.environment is not None and s.environment != "tools" and ":" not in s.environment:
        raise ValueError(f"config: environment={s.environment!r}: expected \"module:Class\" (or \"file.py:Class\") "
                         "or tools")


@dataclass
class SamplerShape:
    """What the sampler shares with the rest of the run, outside its own sections (the names are the config's)."""

    num_generations: int
    """G: completions per prompt (rows come in groups of G)."""
    per_device_batch_size: int
    """B: prompts per rollout on this rank (an engine is sized for B * G rows)."""
    seed: int
    """The run's seed: per-row seeds (`row_seeds`), a worker's own random stream."""
    keep_logprobs: bool
    """Keep the sampler's log-probs (mu), as `keeps_sampler_logprobs` decides; an engine keeps them regardless."""
    chat_template_kwargs: dict | None = None
    """The template's keywords for episodes' chat messages (DataSettings)."""
    sandbox: str = "os"
    """Where the built-in python tool runs model-written code (RewardSettings)."""
    autocast: str | None = None
    """The policy forwards' autocast, "bf16" or "fp16" (PrecisionSettings), or None: a rollout worker samples under
    it, as the trainer's own sampler does."""
