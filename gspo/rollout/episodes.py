"""Multi-turn episodes as one Rollout: the model's turns and the environment's observations in one sequence,
the completion mask over the model's own tokens only (docs/samplers.md, "Episodes").

Every stage reads `completion_mask`, so no stage learns about environments: log-probs, pi_old, mu, ratios,
KL, entropy, corrections and routing replay count the model's tokens only, and GSPO's length-normalised
sequence ratio is the exp of the mean log-ratio over the model's tokens of the whole episode (|y_i| counts
the model's tokens; the observations are context, like the prompt). The attention mask covers every real
token, observations included, so a forward reads the episode exactly as the model did while sampling.

Each turn is a continuation: the episodes still running are sampled together from their whole context so far
(prompt, earlier turns, observations), one generator call per turn. With seeded sampling every row draws from
its own generator across all its turns (gspo's loop, HF generate; a vLLM engine seeds each turn's request with
the row's seed), so an episode's tokens do not depend on the other episodes of the batch.
"""

from __future__ import annotations

import re
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from gspo.rollout.batch import Rollout, completion_mask_from_ids, encode_prompts, eos_ids, pad_id


@dataclass(frozen=True)
class EpisodeLimits:
    """Per-episode limits; an episode that reaches one ends there, counted as truncated."""

    max_turns: int = 4  # model turns
    max_turn_tokens: int = 48  # new tokens per model turn
    max_total_tokens: int = 256  # the model's and the environment's tokens after the prompt

    @classmethod
    def of(cls, settings, max_turn_tokens: int) -> EpisodeLimits:
        """The limits an EpisodeSettings (gspo.config) sets, each turn at most `max_turn_tokens`
        (max_completion_length)."""
        return cls(max_turns=settings.max_turns, max_turn_tokens=max_turn_tokens,
                   max_total_tokens=settings.max_episode_tokens)

    def __post_init__(self):
        for name in ("max_turns", "max_turn_tokens", "max_total_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer; got {getattr(self, name)!r}")


@dataclass
class Episode:
    """One episode as it is built: the tokens after its prompt and which of them are the model's."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    model: list[bool] = field(default_factory=list)  # True: sampled by the model (trained); False: observation
    logprobs: list[float] = field(default_factory=list)  # mu of the model's tokens, 0.0 for observations
    turns: int = 0
    reward: float | None = None  # the sum of the environment's step rewards (None: it gave none)
    info: dict = field(default_factory=dict)  # the environment's counts, summed (tool_calls, tool_errors, ...)
    truncated: bool = False  # ended by a limit, not by the environment
    done: bool = False
    routing: list = field(default_factory=list)  # the sampler's experts, (R, l, k) per call: positions in order
    routed: int = 0  # positions (prompt + tokens) whose experts `routing` holds


def sample_episodes(generator, sampler, model, tokenizer, envs: list, rows: list[dict], limits: EpisodeLimits, *,
                    max_prompt_length: int = 512, truncate_prompts: str = "error", seeds: list[int] | None = None,
                    with_logprobs: bool = False, greedy: bool = False, chat_template_kwargs: dict | None = None,
                    recorder=None, **options) -> tuple[Rollout, list[Episode]]:
    """Run one episode per environment (N = len(envs); `rows[i]` starts `envs[i]`) into one padded Rollout.

    `generator`: a registered GeneratorBackend (gspo.rollout.registry.GENERATORS) and `sampler` what it samples
    with (the model, a copy); `options`: its sampling keywords (temperature, top_p, ...); `seeds`: one per
    episode (seeded sampling: each row's own generator across its turns, `SeededSampler`) or None; `greedy`:
    every turn greedy (evaluation); `chat_template_kwargs`: the template's keywords where an environment answers
    with chat messages (`chat_observation`); `recorder`: a no-argument callable making a fresh
    `gspo.plugs.moe.record_routing` block on the sampler, for rollout routing replay (R3): each position keeps the
    experts of the call that first read it (`_keep_experts`), in `Rollout.routing`.
    Returns the Rollout (completion columns: every token after the prompt; completion_mask: the model's;
    sampler_logprobs: mu, 0 on observations; episodes: `record`s) and the episodes (rewards, counts).
    """
    from gspo.rollout.policy import SeededSampler

    device = next(model.parameters()).device
    seeded = None if seeds is None else SeededSampler(seeds, options["temperature"], device)
    prompts = [_reset(env, row, i) for i, (env, row) in enumerate(zip(envs, rows))]
    ids, mask = encode_prompts(tokenizer, prompts, max_prompt_length, device, truncate_prompts)  # (N, P)
    episodes = [Episode(prompt_ids=row[m.bool()].tolist()) for row, m in zip(ids, mask)]
    layers = None  # the routers' layers, once a call recorded their experts
    eos, pad = eos_ids(tokenizer, model), pad_id(tokenizer, model)
    controls = control_tokens(tokenizer)
    for _ in range(limits.max_turns):
        active = [i for i, e in enumerate(episodes) if not e.done]
        if not active:
            break
        contexts = [episodes[i].prompt_ids + episodes[i].tokens for i in active]
        width = max(map(len, contexts))
        context_ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts], device=device)  # (n, L)
        context_mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts], device=device)  # (n, L)
        budget = max(limits.max_total_tokens - len(episodes[i].tokens) for i in active)
        was_training = model.training
        if isinstance(sampler, torch.nn.Module):  # an engine samples instead (the policy may train meanwhile)
            model.eval()
        recording = recorder() if recorder is not None else nullcontext()
        with torch.inference_mode(), recording as experts:  # what leaves it: Python lists, the experts copied
            turn_ids, turn_lp = generator.sample(
                sampler, context_ids, context_mask, eos=eos, pad=pad,
                max_new_tokens=min(limits.max_turn_tokens, budget), seeded=None if seeded is None else
                seeded.rows(active), with_logprobs=with_logprobs, greedy=greedy, group_size=1, **options)  # (n, t) x2
        if isinstance(sampler, torch.nn.Module):
            model.train(was_training)
        keep = completion_mask_from_ids(turn_ids, eos)  # (n, t) up to and including the first stop token
        call_record = experts.record() if experts is not None else None  # (R, n, L + t - 1, k) left-padded rows
        layers = None if call_record is None else call_record.layers
        for k, i in enumerate(active):
            episode = episodes[i]
            room = limits.max_total_tokens - len(episode.tokens)
            new = turn_ids[k][keep[k]].tolist()[:room]
            if call_record is not None:
                _keep_experts(episode, call_record.indices[:, k], width - len(contexts[k]), len(contexts[k]) + len(new))
            episode.tokens += new
            episode.model += [True] * len(new)
            episode.logprobs += turn_lp[k][keep[k]].tolist()[:room] if turn_lp is not None else [0.0] * len(new)
            episode.turns += 1
            if len(episode.tokens) >= limits.max_total_tokens:
                episode.truncated = episode.done = True
                continue
            stopped = bool(new) and new[-1] in eos  # the turn ended on a stop token (else a limit cut it)
            try:
                _answer(envs[i], episode, tokenizer.decode(new, skip_special_tokens=True), tokenizer, controls,
                        limits, last=episode.turns == limits.max_turns,
                        chat=(chat_template_kwargs or {}, tokenizer.decode(new[-1:]) if stopped else None))
            except Exception as err:  # an environment's bug: named, with the episode and its turn
                raise ValueError(f"environment {_name(envs[i])!r}: step raised {type(err).__name__}: "
                                 f"{str(err)[:200]} (episode {i}, turn {episode.turns})") from err
    return episode_rollout(episodes, prompts, ids, mask, tokenizer, pad, with_logprobs, layers), episodes


def _name(env) -> str:
    """An environment as its spec names it: "module:Class"."""
    return f"{type(env).__module__}:{type(env).__name__}"


def _reset(env, row: dict, i: int) -> str:
    """The prompt `env` starts episode `i` with, from data `row`; an environment's bug is one line naming it and
    the row (as step's are)."""
    where = f"(episode {i}, row {row!r:.80})"
    try:
        prompt = env.reset(row)
    except Exception as err:
        raise ValueError(f"environment {_name(env)!r}: reset raised {type(err).__name__}: {str(err)[:200]} "
                         f"{where}") from err
    if not isinstance(prompt, str):
        raise ValueError(f"environment {_name(env)!r}: reset returned {type(prompt).__name__}, not the prompt's "
                         f"text {where}")
    return prompt


def _keep_experts(episode: Episode, call: torch.Tensor, offset: int, end: int) -> None:
    """Keep the experts of one call's row `call` (R, L + t - 1, k; the row's context left-padded by `offset`) for
    the positions this call read first: from those earlier calls read up to position `end` - 1 of prompt and
    tokens (the turn's last token is read by the next call, or by none). So a model token's experts are those
    of the decode step that read it, an observation's those of the next call's prefill: each forward that
    gave mu of a token is replayed as the sampler ran it."""
    episode.routing.append(call[:, offset + episode.routed : offset + end - 1].clone())  # (R, l, k)
    episode.routed = max(episode.routed, end - 1)


def _answer(env, episode: Episode, text: str, tokenizer, controls: re.Pattern | None, limits: EpisodeLimits,
            last: bool, chat: tuple[dict, str | None]) -> None:
    """The environment's answer to the model's turn `text`, appended to `episode` (cut at the token limit; after
    the `last` turn allowed its reward still counts, its observation is left out: no turn would answer it).
    Its text is data (`controls`: `control_tokens`); `chat`: (chat_template_kwargs, the text of the stop token
    that ended the turn or None), for messages."""
    turn = env.step(text)
    if turn.messages is not None and turn.observation is not None:
        raise ValueError("a Turn has an observation or messages, not both")
    if turn.reward is not None:
        episode.reward = (episode.reward or 0.0) + float(turn.reward)
    for key, value in turn.info.items():
        episode.info[key] = episode.info.get(key, 0) + value
    if turn.done or not (turn.observation or turn.messages):
        episode.done = True
        return
    if last:
        episode.truncated = episode.done = True
        return
    shown = (_observation(turn.observation, controls) if turn.messages is None
             else chat_observation(tokenizer, turn.messages, *chat, controls=controls))
    seen = encode_data(tokenizer, shown, controls)
    room = limits.max_total_tokens - len(episode.tokens)
    if len(seen) >= room:  # no room left for the model to answer it
        seen, episode.truncated, episode.done = seen[:room], True, True
    episode.tokens += seen
    episode.model += [False] * len(seen)
    episode.logprobs += [0.0] * len(seen)


_TURN = "GSPO-MODEL-TURN-2f9c"  # stands for the model's turn when the template renders the text around it


def _observation(observation, controls: re.Pattern | None) -> str:
    """A Turn's observation as text for `encode_data`: text is data; a list alternates the environment's own
    markup, kept as written, and data: [markup, data, markup, ...]."""
    if isinstance(observation, str):
        return mark_data(observation, controls)
    if not isinstance(observation, list) or not all(isinstance(part, str) for part in observation):
        raise ValueError(f"a Turn's observation is text, or a list of texts [markup, data, markup, ...]; got "
                         f"{observation!r:.120}")
    return "".join(mark_data(part, controls) if k % 2 else part for k, part in enumerate(observation))


def chat_observation(tokenizer, messages: list[dict], template_kwargs: dict | None = None,
                     stop: str | None = None, *, controls: re.Pattern | None = None) -> str:
    """The text that follows a model's turn when `messages` (tool or user messages) answer it in a chat: what the
    tokenizer's chat template writes after an assistant message's content (its end-of-turn marker), then the
    messages, then the next assistant turn's opening (add_generation_prompt). `stop`: the text of the stop
    token the model ended its turn with, already in the episode: left out where the template's end-of-turn
    marker starts with it (ChatML's <|im_end|>); None (a turn cut by a limit): the whole marker is added.
    `controls` (`control_tokens`): the messages' texts are data, their control tokens' text marked for
    `encode_data`; the template's own markers are not.

    Found by rendering a stand-in conversation (a user message, an assistant message) with and without the
    messages: the template's own rendering, whatever its format (Qwen's tool messages as <tool_response> in a
    user turn, SmolLM2's "tool" role). A template that renders the earlier turns differently once the
    messages follow (it must extend them) is refused by name."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the environment answered with chat messages, but the tokenizer has no chat template")
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get(
            "content"), str) for m in messages):
        raise ValueError(f"chat messages must be a non-empty list of {{role, content}} string pairs; got "
                         f"{messages!r:.120}")
    messages = [{key: value if key == "role" or not isinstance(value, str) else mark_data(value, controls)
                 for key, value in m.items()} for m in messages]
    kwargs = dict(template_kwargs or {}, tokenize=False)
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _TURN}]
    before = tokenizer.apply_chat_template(base, **kwargs)
    after = tokenizer.apply_chat_template(base + list(messages), add_generation_prompt=True, **kwargs)
    if _TURN not in before or not after.startswith(before):
        raise ValueError("the chat template renders a conversation differently once messages follow the model's "
                         "turn, so they cannot be appended to the episode; answer with Turn(observation=text)")
    marker = before[before.rindex(_TURN) + len(_TURN):]  # (the template's end of an assistant turn)
    if stop and marker.startswith(stop):
        marker = marker[len(stop):]
    return marker + after[len(before):]


# Text from a tool, an environment or a model is data, never a chat's control tokens (DESIGN.md, "Trust"). Its
# control tokens' text is wrapped in these marks (noncharacters: never in text worth keeping, dropped from data)
# through the chat template's rendering, and spelled out in ordinary tokens by `encode_data`; text without any
# tokenizes as it always did. (transformers' apply_chat_template(sanitize_control_tokens=True) does the same.)
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"
_MARKED = re.compile(f"{_OPEN}([^{_OPEN}{_CLOSE}]*){_CLOSE}|[{_OPEN}{_CLOSE}]")  # a marked text, or a lone mark


def control_tokens(tokenizer) -> re.Pattern | None:
    """A pattern matching the text of the tokens that structure a chat: the tokenizer's special tokens and the
    added tokens its chat template writes (Qwen's <tool_response>, which is not marked special); whitespace and
    single characters aside (templates write those as text). None where there are none."""
    template = getattr(tokenizer, "chat_template", None) or ""
    template = " ".join(template.values()) if isinstance(template, dict) else template  # named templates
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    texts = {t.content for t in added if t.special or t.content in template}
    texts |= set(getattr(tokenizer, "all_special_tokens", ()))
    texts = sorted((t for t in texts if len(t) > 1 and not t.isspace()), key=len, reverse=True)  # longest first
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def mark_data(text: str, controls: re.Pattern | None) -> str:
    """Data `text` with its control tokens' text marked for `encode_data` (and any marks of its own dropped)."""
    if _OPEN in text or _CLOSE in text:
        text = text.replace(_OPEN, "").replace(_CLOSE, "")
    return text if controls is None else controls.sub(lambda m: _OPEN + m.group() + _CLOSE, text)


def encode_data(tokenizer, text: str, controls: re.Pattern | None) -> list[int]:
    """Token ids of `text` where a marked text (`mark_data`: a control token's, from data) is spelled out in ordinary
    tokens (its first character, then the rest as data) and the rest is read as the tokenizer reads it (the
    template's own markers stay its tokens); text without marks is tokenized in one call, as it always was."""
    ids = []
    for k, piece in enumerate(_MARKED.split(text)):  # [text, marked, text, ...]; a lone mark: None, a break
        if k % 2 == 0 and piece:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
        elif k % 2 and piece:
            ids += tokenizer(piece[:1], add_special_tokens=False)["input_ids"]
            ids += encode_data(tokenizer, mark_data(piece[1:], controls), controls)
    return ids


def episode_rollout(episodes: list[Episode], prompts: list[str], ids, mask, tokenizer, pad: int,
                    with_logprobs: bool, layers: tuple[int, ...] | None) -> Rollout:
    """The Rollout of built `episodes` after their prompts `ids`, `mask` (N, P; left-padded): tokens right-padded,
    the model's in the completion mask, mu where kept, the routing of `layers` (None: none), their records."""
    T = max(1, max(len(e.tokens) for e in episodes))

    def padded(values: list, fill, dtype) -> torch.Tensor:  # (N, T): each episode's, right-padded with `fill`
        return torch.tensor([v + [fill] * (T - len(v)) for v in values], dtype=dtype, device=ids.device)

    completion = padded([e.tokens for e in episodes], pad, torch.long)  # (N, T)
    real = padded([[1] * len(e.tokens) for e in episodes], 0, torch.long)  # (N, T)
    return Rollout(
        routing=None if layers is None else _routing(episodes, ids.shape[1], T, layers),
        input_ids=torch.cat([ids, completion], dim=1),  # (N, P+T)
        attention_mask=torch.cat([mask, real], dim=1),  # (N, P+T) observations included
        completion_mask=padded([e.model for e in episodes], False, torch.bool),  # (N, T) the model's tokens
        prompts=prompts,
        completions=[tokenizer.decode(e.tokens, skip_special_tokens=True) for e in episodes],  # whole transcripts
        sampler_logprobs=padded([e.logprobs for e in episodes], 0.0, torch.float32) if with_logprobs else None,
        episodes=[record(e, tokenizer) for e in episodes],
    )


def _routing(episodes: list[Episode], P: int, T: int, layers: tuple[int, ...]):
    """The episodes' kept experts as one RoutingRecord (R, N, P+T, k) on the Rollout's layout (prompts
    left-padded to P, tokens right-padded to T); -1 (route freely) where no call read a position: padding,
    each episode's last token, observations after its last turn."""
    from gspo.plugs.moe import RoutingRecord

    first = episodes[0].routing[0]  # (R, l, k)
    out = torch.full((first.shape[0], len(episodes), P + T, first.shape[-1]), -1, dtype=first.dtype,
                     device=first.device)  # (R, N, P+T, k)
    for n, e in enumerate(episodes):
        kept = torch.cat(e.routing, dim=1)  # (R, routed, k) positions 0 .. routed-1 of prompt and tokens
        prompt = len(e.prompt_ids)
        out[:, n, P - prompt : P] = kept[:, :prompt]
        out[:, n, P : P + kept.shape[1] - prompt] = kept[:, prompt:]
    return RoutingRecord(out, layers)


COUNTS = ("tool_calls", "tool_errors")  # the environments' counts every record holds (0 where one gave none)


def record(episode: Episode, tokenizer) -> dict:
    """What the trainer keeps of an episode (plain values): its counts, reward, and the transcript as segments
    ["model", text] / ["env", text] (samples.jsonl shows which parts were trained)."""
    segments, start = [], 0
    for end in range(1, len(episode.tokens) + 1):
        if end == len(episode.tokens) or episode.model[end] != episode.model[start]:
            text = tokenizer.decode(episode.tokens[start:end], skip_special_tokens=True)
            segments.append(["model" if episode.model[start] else "env", text])
            start = end
    observed = len(episode.model) - sum(episode.model)
    final = next((text for role, text in reversed(segments) if role == "model"), "")
    return {"turns": episode.turns, "truncated": episode.truncated, "env_reward": episode.reward,
            "observation_tokens": observed, "tokens": len(episode.tokens), "segments": segments, "final_turn": final,
            **{key: episode.info.get(key, 0) for key in COUNTS}}


__all__ = ["COUNTS", "Episode", "EpisodeLimits", "chat_observation", "control_tokens", "encode_data",
           "episode_rollout", "mark_data", "record", "sample_episodes"]
