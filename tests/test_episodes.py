"""Multi-turn episodes (gspo/rollout/episodes.py) and tool calling (gspo/env/): the layout and mask of a
scripted episode written out by hand, log-probs and GSPO's length normalisation over the model's tokens
only, no gradient through an environment's tokens, seeded episodes equal to their turns sampled one call at
a time, and every way a tool or an environment can go wrong."""

import time

import pytest
import torch

from conftest import SMALL
from gspo.algo.logprobs import completion_logprobs
from gspo.algo.objectives import policy_loss
from gspo.env import Toolbox, ToolEnvironment, Turn, parse_tool_calls
from gspo.models import load_model
from gspo.rollout.episodes import EpisodeLimits, sample_episodes
from gspo.rollout.sampling import GENERATORS, GeneratorBackend, SeededSampler

OPTIONS = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)


def scripted(turns: list[list[list[int]]]):
    """A generator backend that answers turn j of row i with turns[j][i] (its mu: -0.5 per token), whatever the
    context: a model whose answers the test writes."""
    calls = []

    def sample(sampler, prompt_ids, prompt_mask, *, max_new_tokens, with_logprobs, pad, **_):
        calls.append((prompt_ids.clone(), prompt_mask.clone(), max_new_tokens))
        answers = turns[len(calls) - 1]
        width = max(map(len, answers))
        ids = torch.tensor([a + [pad] * (width - len(a)) for a in answers])  # (n, t)
        return ids, torch.full(ids.shape, -0.5) if with_logprobs else None

    return GeneratorBackend(sample, lambda model: None), calls


class Echo:
    """Answers every turn with `observation` until the model says "9", then ends with reward 1."""

    def __init__(self, observation: str = "ab"):
        self.observation = observation

    def reset(self, row):
        return row["prompt"]

    def step(self, model_turn):
        if "9" in model_turn:
            return Turn(reward=1.0, done=True)
        return Turn(observation=self.observation, reward=0.25, info={"tool_calls": 1})


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model("tiny-dense", overrides=SMALL)


def test_an_episode_is_laid_out_with_the_model_s_tokens_masked_in(tiny):
    model, tok = tiny  # ids: '1' 5, '2' 6, '9' 13, 'a' 29, 'b' 30, '=' 17, eos 2, pad 0
    backend, calls = scripted([[[5, 6, 2], [13, 2]], [[13, 2]]])  # turn 1 of rows 0, 1; turn 2 of row 0
    rollout, episodes = sample_episodes(backend, model, model, tok, [Echo(), Echo()],
                                        [{"prompt": "1="}, {"prompt": "12="}], EpisodeLimits(max_turns=3),
                                        with_logprobs=True, **OPTIONS)
    # row 0: "12" EOS, then the observation "ab", then "9" EOS; row 1: "9" EOS at once
    assert rollout.input_ids.tolist() == [[0, 5, 17, 5, 6, 2, 29, 30, 13, 2], [5, 6, 17, 13, 2, 0, 0, 0, 0, 0]]
    assert rollout.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]]
    assert rollout.completion_mask.int().tolist() == [[1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0]]
    assert rollout.sampler_logprobs.tolist() == [[-0.5, -0.5, -0.5, 0, 0, -0.5, -0.5], [-0.5, -0.5, 0, 0, 0, 0, 0]]
    assert rollout.completions == ["12ab9", "9"] and rollout.prompts == ["1=", "12="]
    assert [(e.turns, e.reward, e.info, e.truncated) for e in episodes] == [(2, 1.25, {"tool_calls": 1}, False),
                                                                            (1, 1.0, {}, False)]
    # turn 2 continued row 0 alone, from its whole context: prompt, its turn, the observation
    assert calls[1][0].tolist() == [[5, 17, 5, 6, 2, 29, 30]] and calls[1][1].tolist() == [[1] * 7]


def test_limits_end_an_episode_as_truncated(tiny):
    model, tok = tiny
    never_ends = [[[5, 2]]] * 3
    backend, _ = scripted(never_ends)
    _, (episode,) = sample_episodes(backend, model, model, tok, [Echo()], [{"prompt": "1="}],
                                    EpisodeLimits(max_turns=3), **OPTIONS)
    assert episode.turns == 3 and episode.truncated and len(episode.tokens) == 3 * 2 + 2 * 2  # last obs: none
    backend, calls = scripted([[[5, 6, 7, 2]], [[5, 2]]])
    rollout, (episode,) = sample_episodes(backend, model, model, tok, [Echo("abcdef")], [{"prompt": "1="}],
                                          EpisodeLimits(max_turns=5, max_total_tokens=8), **OPTIONS)
    # 4 model tokens, then the 6-token observation cut to the 4 left: no room for another turn
    assert episode.truncated and episode.turns == 1 and len(calls) == 1
    assert rollout.completion_mask.int().tolist() == [[1, 1, 1, 1, 0, 0, 0, 0]]


def test_an_environment_that_raises_is_named_with_its_episode(tiny):
    model, tok = tiny

    class Broken(Echo):
        def step(self, model_turn):
            raise KeyError("score")

    backend, _ = scripted([[[5, 2]]])
    with pytest.raises(ValueError, match=r"environment 'test_episodes:Broken': step raised KeyError: 'score' "
                                         r"\(episode 0, turn 1\)"):
        sample_episodes(backend, model, model, tok, [Broken()], [{"prompt": "1="}], EpisodeLimits(), **OPTIONS)


def test_log_probs_and_gspo_s_ratio_count_the_model_s_tokens_only(tiny):
    model, tok = tiny
    gen = GENERATORS["gspo"]
    rollout, _ = sample_episodes(gen, model, model, tok, [Echo("ab"), Echo("b")], [{"prompt": "1="}, {"prompt": "2="}],
                                 EpisodeLimits(max_turns=3, max_turn_tokens=4), seeds=[11, 12], with_logprobs=True,
                                 **OPTIONS)
    mask = rollout.completion_mask
    assert (~mask & rollout.attention_mask[:, -mask.shape[1]:].bool()).any()  # observations inside the sequence
    # the trainer's forward over the whole episode gives mu back on the model's tokens (KV-cached decode vs one
    # forward: rounding only)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.completion_len)
    assert (logp - rollout.sampler_logprobs)[mask].abs().max() < 1e-5
    # GSPO eq. (7) with hand values: log-ratios 0.3, 0.1, 0.2 on model tokens, 5.0 on an observation token
    # between them: s = exp(mean(0.3, 0.1, 0.2)) = exp(0.2), the observation left out (exp(mean) over 3 tokens,
    # not exp(sum), not over 4)
    old = torch.zeros(1, 4)
    new = torch.tensor([[0.3, 0.1, 5.0, 0.2]], requires_grad=True)
    hole = torch.tensor([[True, True, False, True]])
    _, stats = policy_loss(new, old, torch.tensor([1.0]), hole, objective="gspo", clip_low=0.9, clip_high=10.0)
    assert stats["ratio/mean"].item() == pytest.approx(torch.tensor(0.2).exp().item(), rel=1e-6)


def test_an_observation_token_never_receives_gradient(tiny):
    model, tok = tiny
    backend, _ = scripted([[[5, 6, 2]], [[13, 2]]])
    rollout, _ = sample_episodes(backend, model, model, tok, [Echo()], [{"prompt": "1="}], EpisodeLimits(),
                                 **OPTIONS)
    logp, _ = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.completion_len)  # (1, T)
    logp.retain_grad()
    for objective in ("gspo", "grpo", "gspo_token"):
        logp.grad = None
        loss, _ = policy_loss(logp, logp.detach() - 0.01, torch.tensor([1.0]), rollout.completion_mask,
                              objective=objective, clip_low=0.5, clip_high=0.5)
        loss.backward(retain_graph=True)
        grad = logp.grad[0]  # (T,)
        assert grad.tolist()[3:5] == [0.0, 0.0], objective  # the observation "ab": exactly nothing
        assert (grad[rollout.completion_mask[0]] != 0).all(), objective  # every model token: something


def test_a_seeded_episode_is_its_turns_sampled_one_call_at_a_time(tiny):
    # Two episodes sampled together; then episode 1's turns again, alone, each a single call of the generator
    # on its context so far with its own generator stream continuing: the same tokens.
    model, tok = tiny
    gen, seeds = GENERATORS["gspo"], [21, 22]
    envs = [Echo("ab"), Echo("a")]
    rows = [{"prompt": "12+3="}, {"prompt": "4="}]
    limits = EpisodeLimits(max_turns=3, max_turn_tokens=5)
    _, episodes = sample_episodes(gen, model, model, tok, envs, rows, limits,
                                  seeds=seeds, **OPTIONS)
    alone, stream, context = [], SeededSampler(seeds[1:], 1.0, "cpu"), tok("4=")["input_ids"]
    for turn in range(episodes[1].turns):
        with torch.inference_mode():
            ids, _ = gen.sample(model, torch.tensor([context]), torch.ones(1, len(context), dtype=torch.long),
                                eos=[tok.eos_token_id], pad=tok.pad_token_id, max_new_tokens=5, seeded=stream,
                                with_logprobs=False, greedy=False, group_size=1, **OPTIONS)
        new = ids[0].tolist()
        new = new[: new.index(tok.eos_token_id) + 1] if tok.eos_token_id in new else new
        alone += new
        context += new
        if "9" in tok.decode(new, skip_special_tokens=True) or turn == episodes[1].turns - 1:
            break
        seen = tok("a", add_special_tokens=False)["input_ids"]
        alone += seen
        context += seen
    assert alone == episodes[1].tokens and episodes[1].turns >= 2  # more than one turn, so the claim has teeth


def test_hf_generate_samples_the_episodes_gspo_s_loop_does_and_packing_reads_them_alike(tiny):
    # Seeded, HF generate and gspo's loop draw the same tokens turn after turn; the padding-free forward
    # (packed rows: observations are real tokens, so each row stays contiguous) gives the padded one's log-probs.
    model, tok = tiny
    rows, limits = [{"prompt": "12+3="}, {"prompt": "4="}, {"prompt": "99="}], EpisodeLimits(max_turns=3,
                                                                                           max_turn_tokens=4)
    runs = {name: sample_episodes(GENERATORS[name], model, model, tok, [Echo("ab") for _ in rows], rows, limits,
                                  seeds=[5, 6, 7], **OPTIONS)[0] for name in ("gspo", "hf")}
    assert torch.equal(runs["gspo"].input_ids, runs["hf"].input_ids)
    assert torch.equal(runs["gspo"].completion_mask, runs["hf"].completion_mask)
    rollout = runs["gspo"]
    assert max(e["turns"] for e in rollout.episodes) >= 2
    with torch.no_grad():
        padded, _ = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.completion_len)
        packed, _ = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.completion_len,
                                        packed=True)
    mask = rollout.completion_mask
    assert (padded - packed)[mask].abs().max() < 1e-5


def test_the_record_of_an_episode_holds_its_transcript_and_final_turn(tiny):
    model, tok = tiny
    backend, _ = scripted([[[5, 6, 2]], [[13, 2]]])
    rollout, _ = sample_episodes(backend, model, model, tok, [Echo("ab")], [{"prompt": "1="}], EpisodeLimits(),
                                 **OPTIONS)
    (record,) = rollout.episodes
    assert record["segments"] == [["model", "12"], ["env", "ab"], ["model", "9"]] and record["final_turn"] == "9"
    assert (record["turns"], record["observation_tokens"], record["tokens"]) == (2, 2, 7)


def test_rollout_routing_replay_keeps_the_experts_each_token_was_first_read_with():
    # R3 over episodes: each call's experts kept for the positions it read first (the decode steps of the model's
    # tokens, the next prefill of an observation): those a full forward chooses (same weights, causal); replayed in
    # one forward they give back mu, and after the routers moved they are still the ones used
    from conftest import SMALL_MOE, perturb_routers
    from gspo.plugs.moe import record_routing
    from gspo.plugs.routing import minibatch_logprobs_and_routing

    torch.manual_seed(0)
    model, tok = load_model("tiny-moe", overrides=SMALL_MOE)
    torch.manual_seed(1)
    rows = [{"prompt": p} for p in ("1+2=", "12+3=", "7=")]
    rollout, episodes = sample_episodes(GENERATORS["gspo"], model, model, tok, [Echo("=") for _ in rows], rows,
                                        EpisodeLimits(max_turns=3, max_turn_tokens=4), with_logprobs=True,
                                        recorder=lambda: record_routing(model), **OPTIONS)
    assert any(e.turns > 1 for e in episodes)  # observations in between
    record, real = rollout.routing.indices, rollout.attention_mask.bool()  # (R, N, P+T, k), (N, P+T)
    assert record.shape[:3] == (2, 3, rollout.input_ids.shape[1]) and record.shape[3] == 2
    last = real.shape[1] - 1 - real.flip(-1).int().argmax(-1)  # (N,) each episode's last token: never read
    read = real.clone()
    read[torch.arange(3), last] = False
    assert (record[:, read] >= 0).all() and (record[:, ~read] == -1).all()
    with record_routing(model) as free, torch.no_grad():
        model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask)
    assert torch.equal(free.record().indices[:, read], record[:, read])
    with torch.no_grad():
        old, _ = minibatch_logprobs_and_routing(model, rollout, [torch.arange(3)], {"temperature": 1.0}, replay=True)
    cmask = rollout.completion_mask
    torch.testing.assert_close(old[cmask], rollout.sampler_logprobs[cmask], rtol=0, atol=1e-5)
    perturb_routers(model)  # the policy moved: its own choices differ, the replayed ones are the sampler's
    with torch.no_grad():
        _, replayed = minibatch_logprobs_and_routing(model, rollout, [torch.arange(3)], {}, replay=True, record=True)
        _, moved = minibatch_logprobs_and_routing(model, rollout, [torch.arange(3)], {}, record=True)
    assert torch.equal(replayed.indices[:, read], record[:, read])
    assert not torch.equal(moved.indices[:, read], record[:, read])


# ----------------------------------------------------------------------------------------------- tools
def add(a: int, b: int) -> int:
    """a + b"""
    return a + b


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: arithmetic, e.g. 12*34
    """
    if not set(expression) <= set("0123456789+-*() "):
        raise ValueError("only digits and + - * ( )")
    return str(eval(expression))  # noqa: S307  (the characters are checked above)


def slow(x: int) -> int:
    time.sleep(30)  # far past the 0.3 s limit: a call that waited for it could not pass the test's 15 s bound
    return x


def huge() -> str:
    return "x" * 5000


def test_tool_calls_are_parsed_in_both_styles():
    (call,) = parse_tool_calls('ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": "2"}}</tool_call>')
    assert (call.name, call.arguments, call.error) == ("add", {"a": 1, "b": "2"}, None)
    bad, not_object = parse_tool_calls('<tool_call>{"name": add}</tool_call><tool_call>[1]</tool_call>')
    assert bad.error.startswith("the call is not JSON") and not_object.error.startswith("a call is a JSON object")
    calls = parse_tool_calls('calc((1+2)*34)\nthen\n  add({"a": 1, "b": 2})', style="text")
    assert [(c.name, c.arguments) for c in calls] == [("calc", {None: "(1+2)*34"}), ("add", {"a": 1, "b": 2})]
    assert parse_tool_calls("no call here") == [] and parse_tool_calls("x = calc(1) + 2", style="text") == []
    with pytest.raises(ValueError, match="style must be one of"):
        parse_tool_calls("x", style="xml")


def test_every_tool_failure_is_an_observation_with_its_kind():
    box = Toolbox([add, calc, slow, huge], timeout_s=0.3, max_output_chars=100)
    ok = box.run('<tool_call>{"name": "add", "arguments": {"a": "40", "b": 2}}</tool_call>')
    assert [(r.text, r.error) for r in ok] == [("42", None)]  # "40" coerced to int by the type hint
    cases = {
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>': ("bad arguments", "needs argument 'b'"),
        '<tool_call>{"name": "add", "arguments": {"a": "x", "b": 1}}</tool_call>': ("bad arguments", "must be int"),
        '<tool_call>{"name": "sub", "arguments": {}}</tool_call>': ("unknown tool", "no tool named 'sub'"),
        '<tool_call>{"name": "calc", "arguments": {"expression": "os"}}</tool_call>': ("raised", "ValueError"),
        '<tool_call>{"name": "calc" </tool_call>': ("malformed", "not JSON"),
    }
    for turn, (kind, words) in cases.items():
        (result,) = box.run(turn)
        assert result.error == kind and words in result.text, (turn, result)
    t0 = time.perf_counter()
    (hung,) = box.run('<tool_call>{"name": "slow", "arguments": {"x": 1}}</tool_call>')
    # the mechanism: timed out, at the limit, not when the tool returned (30 s; a 15 s bound holds on a loaded runner)
    assert hung.error == "timed out" and time.perf_counter() - t0 < 15 and "within 0.3 s" in hung.text
    (cut,) = box.run('<tool_call>{"name": "huge"}</tool_call>')
    assert cut.error is None and cut.truncated and cut.text == "x" * 100 + " ... (cut)"


def test_a_tool_environment_answers_calls_and_ends_without_one():
    env = ToolEnvironment([calc], style="text")
    assert env.reset({"prompt": "12345*678="}) == "12345*678="
    turn = env.step("calc(12345*678)")
    assert (turn.observation, turn.done, turn.info) == (["\nresult: ", "8369910", "\n"], False,
                                                        {"tool_calls": 1, "tool_errors": 0})  # [markup, data, ...]
    assert env.step("calc(import os)").info == {"tool_calls": 1, "tool_errors": 1}
    assert env.step("8369910").done
    hermes = ToolEnvironment([add]).step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    assert hermes.observation == ["\n<tool_response>\n", "5", "\n</tool_response>\n"]
    with pytest.raises(ValueError, match="a named Python function"):
        Toolbox([lambda x: x])


def test_the_python_tool_runs_model_written_code_in_the_sandbox(tmp_path):
    from conftest import tiny_cfg
    from gspo.env import environment_factory, python_tool, tool_schema

    python = python_tool("os", timeout_s=1.0)
    assert python("print(12345 * 678)") == "8369910\n"
    raised = python("print('before')\n1 / 0")
    assert raised.startswith("before\nTraceback (most recent call last):\n  File \"solution.py\", line 2")
    assert raised.endswith("ZeroDivisionError: division by zero")
    assert python("while True: pass") == "(stopped: timeout)"
    (tmp_path / "secret").write_text("the trainer's file")
    read = python(f"print(open({str(tmp_path / 'secret')!r}).read())")  # a host file: outside its view
    assert "the trainer's file" not in read and read.startswith("Traceback") and "Error" in read
    assert tool_schema(python)["function"]["parameters"]["properties"]["code"]["type"] == "string"
    # named by its name alone; the model's code failing is its result, not a tool error
    cfg = tiny_cfg(tmp_path, environment="tools", tools=["python"], tool_timeout_s=2.0)
    env = environment_factory(cfg, cfg.sandbox)()
    env.reset({"prompt": "?"})
    turn = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(2 ** 10)"}}</tool_call>')
    assert (turn.observation, turn.info) == (["\n<tool_response>\n", "1024\n", "\n</tool_response>\n"],
                                             {"tool_calls": 1, "tool_errors": 0})
    with pytest.raises(ValueError, match=r"tools: 'pythn' is not \"module:function\" .* or a built-in tool \(python\)"):
        tiny_cfg(tmp_path, environment="tools", tools=["pythn"])


# ----------------------------------------------------------------------------------------------- chat messages
# a role-aware template in the tiny vocabulary: "user: 1=;\n", an assistant turn closed by ";\n", then "assistant: "
ROLES = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }};\n{% endfor %}"
         "{% if add_generation_prompt %}assistant: {% endif %}")


def test_tool_messages_are_rendered_by_the_chat_template(tiny):
    from gspo.data.rows import MESSAGES, render_prompts
    from gspo.rollout.episodes import chat_observation

    model, tok = tiny
    tok = __import__("copy").deepcopy(tok)
    tok.chat_template = ROLES
    row = render_prompts([{"prompt": [{"role": "user", "content": "1="}]}], tok)[0]
    assert row["prompt"] == "user: 1=;\nassistant: " and MESSAGES in row
    env = ToolEnvironment([calc], style="text")
    assert env.reset(row) == row["prompt"] and env.chat  # a chat row: the tool answers in messages
    assert env.step("calc(2*3)").messages == [{"role": "tool", "name": "calc", "content": "6"}]
    # the template's end of an assistant turn (";\n": its stop token is not part of it), the tool message, the
    # next assistant turn opened
    assert chat_observation(tok, [{"role": "tool", "content": "6"}]) == ";\ntool: 6;\nassistant: "
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    backend, _ = scripted([[ids("calc(2*3)") + [2]], [ids("6") + [2]]])
    rollout, (episode,) = sample_episodes(backend, model, model, tok, [env], [row], EpisodeLimits(max_turns=3),
                                          **OPTIONS)
    assert episode.tokens == ids("calc(2*3)") + [2] + ids(";\ntool: 6;\nassistant: ") + ids("6") + [2]
    assert rollout.completion_mask[0].tolist() == [True] * 10 + [False] * 22 + [True] * 2
    assert rollout.episodes[0]["segments"] == [["model", "calc(2*3)"], ["env", ";\ntool: 6;\nassistant: "],
                                               ["model", "6"]]
    # the same environment with a text prompt answers in text
    env = ToolEnvironment([calc], style="text")
    env.reset({"prompt": "1="})
    assert env.step("calc(2*3)").observation == ["\nresult: ", "6", "\n"]


def test_chat_messages_that_cannot_be_rendered_are_named(tiny):
    from gspo.rollout.episodes import chat_observation

    _, tok = tiny
    plain = __import__("copy").deepcopy(tok)
    plain.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        chat_observation(plain, [{"role": "tool", "content": "6"}])
    with pytest.raises(ValueError, match="must be a non-empty list of {role, content} string pairs"):
        chat_observation(tok, [{"role": "tool", "content": 6}])
    plain.chat_template = "{{ messages | length }}"  # re-renders everything once a message follows
    with pytest.raises(ValueError, match="renders a conversation differently once messages follow"):
        chat_observation(plain, [{"role": "tool", "content": "6"}])

    class Both(Echo):
        def step(self, model_turn):
            return Turn(observation="x", messages=[{"role": "tool", "content": "6"}])

    backend, _ = scripted([[[5, 2]]])
    with pytest.raises(ValueError, match=r"Both': step raised ValueError: a Turn has an observation or messages"):
        sample_episodes(backend, tiny[0], tiny[0], tok, [Both()], [{"prompt": "1="}], EpisodeLimits(), **OPTIONS)


def test_tool_schemas_come_from_docstrings_or_type_hints():
    from gspo.config import EpisodeSettings
    from gspo.env import chat_template_kwargs, tool_schema

    assert tool_schema(add) == {"type": "function", "function": {
        "name": "add", "description": "a + b", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]}}}
    documented = tool_schema(calc)["function"]  # Google style: transformers' get_json_schema
    assert documented["parameters"]["properties"]["expression"] == {"type": "string",
                                                                     "description": "arithmetic, e.g. 12*34"}
    settings = EpisodeSettings(environment="tools", tools=["test_episodes:add"])
    assert chat_template_kwargs({"enable_thinking": False}, settings) == {"enable_thinking": False,
                                                                          "tools": [tool_schema(add)]}
    assert chat_template_kwargs({"tools": []}, settings) == {"tools": []}  # given: kept
    assert chat_template_kwargs(None, EpisodeSettings()) is None


# ----------------------------------------------------------------------------------------------- training
class Countdown:
    """Three model turns: after each of the first two the environment says "=" and pays 0.25 if the turn
    started with a digit; the third ends the episode with 1.0 on the same condition."""

    def reset(self, row):
        self.turn = 0
        return row["prompt"]

    def step(self, model_turn):
        self.turn += 1
        paid = float(model_turn[:1].isdigit())
        if self.turn < 3:
            return Turn(observation="=", reward=0.25 * paid)
        return Turn(reward=paid, done=True)


EPISODES = dict(environment="test_episodes:Countdown", reward_funcs=["environment"], max_turns=3,
                max_episode_tokens=64, max_completion_length=6, seeded_sampling=True, learning_rate=1e-2)


@pytest.mark.slow
def test_a_run_trains_on_episodes_and_logs_them(tmp_path):
    from conftest import final_weights, initial_weights, read_metrics, tiny_cfg
    from gspo.trainer import train

    cfg = tiny_cfg(tmp_path, max_steps=2, eval_num_prompts=2, eval_k=2, **EPISODES)
    train(cfg)
    run = tmp_path / "run"
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [0, 1, 2]  # the loop below checks every step, and there are steps
    for m in metrics[1:]:
        assert 1 <= m["episode/turns_mean"] <= 3 and 0 < m["episode/observation_token_frac"] < 1
        assert m["episode/tool_calls"] == 0 and 0 <= m["episode/truncated_frac"] <= 1
        # the reward is the environment's: the sum of its step rewards (reward/mean over the same episodes)
        assert m["reward/mean"] == pytest.approx(m["episode/env_reward_mean"], abs=1e-6)
    assert "eval/accuracy" in metrics[-1] and "eval/tool_call_rate" in metrics[-1]
    samples = [line for line in (run / "samples.jsonl").read_text().splitlines()]
    first = __import__("json").loads(samples[0])
    roles = [role for role, _ in first["transcript"]]
    assert roles[0] == "model" and ("env" in roles) == (first["turns"] > 1)
    assert "".join(text for _, text in first["transcript"]) == first["completion"]
    before, after = initial_weights(cfg), final_weights(run)
    assert any(not torch.equal(before[k], after[k]) for k in before)


class ChatCountdown(Countdown):
    """Countdown answering in chat messages (the tiny tokenizer's template writes each on a line of its own)."""

    def step(self, model_turn):
        turn = super().step(model_turn)
        return Turn(messages=[{"role": "tool", "content": "="}], reward=turn.reward) if not turn.done else turn


@pytest.mark.slow
def test_a_run_on_chat_prompts_renders_the_environment_s_messages(tmp_path):
    import json

    from conftest import read_metrics, tiny_cfg
    from gspo.trainer import train

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{a}+{a}="}], "answer": str(2 * a)})
                            + "\n" for a in range(10, 30)))
    train(tiny_cfg(tmp_path, max_steps=1, eval_num_prompts=2, eval_k=1, dataset=str(data),
                   **{**EPISODES, "environment": "test_episodes:ChatCountdown"}))
    (metrics,) = [m for m in read_metrics(tmp_path / "run") if "episode/turns_mean" in m]
    assert metrics["episode/observation_token_frac"] > 0
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["turns"] > 1 and all(text == "\n=" for role, text in sample["transcript"] if role == "env")


@pytest.mark.slow
def test_ppo_s_critic_trains_on_episodes(tmp_path, monkeypatch):
    # gae over episodes: values and advantages on the model's tokens only (the recursion skips observations:
    # tests/test_advantages.py), the critic fitted on them, the policy moved
    from conftest import final_weights, initial_weights, read_metrics, tiny_cfg
    from gspo.plugs import baselines
    from gspo.trainer import train

    critics, fitted = [], []  # the critic built (and its first weights); each critic step's minibatch and mask
    built, fit, loss = baselines.value_model_from, baselines.CriticBaseline.update, baselines.value_loss

    def value_model_from(policy):
        critic = built(policy)
        critics.append((critic, {k: v.clone() for k, v in critic.state_dict().items()}))
        return critic

    def update(self, mb, part, step):
        fitted.append({"mb": mb})
        return fit(self, mb, part, step)

    def value_loss(values, old_values, returns, mask, clip):
        fitted[-1]["mask"] = mask.clone()
        return loss(values, old_values, returns, mask, clip)

    monkeypatch.setattr(baselines, "value_model_from", value_model_from)
    monkeypatch.setattr(baselines.CriticBaseline, "update", update)
    monkeypatch.setattr(baselines, "value_loss", value_loss)
    cfg = tiny_cfg(tmp_path, max_steps=2, eval_num_prompts=0, advantage_estimator="gae", objective="grpo",
                   **EPISODES)
    train(cfg)
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2]  # no evaluation: no step-0 line
    assert all(torch.isfinite(torch.tensor(m["value/explained_var"])) and m["episode/turns_mean"] >= 1
               for m in metrics)
    before, after = initial_weights(cfg), final_weights(tmp_path / "run")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # the critic itself was fitted: most of its tensors moved
    ((critic, first),) = critics
    moved = [k for k, v in critic.state_dict().items() if not torch.equal(v, first[k])]
    assert len(moved) > len(first) // 2, moved
    # and only on the model's tokens: an observation (inside the completion, attended, not the model's) has no
    # value target; there are observations in these episodes
    assert len(fitted) == 2 * cfg.num_minibatches
    observations = 0
    for f in fitted:
        mb = f["mb"]
        attended = mb.attention_mask[:, -mb.completion_len:].bool()  # (n, t) every token after the prompt
        observation = attended & ~mb.completion_mask  # (n, t)
        observations += int(observation.sum())
        assert not (f["mask"] & observation).any() and torch.equal(f["mask"], mb.completion_mask)
    assert observations > 0


@pytest.mark.slow
def test_a_worker_samples_the_episodes_the_trainer_s_process_would(tmp_path):
    from conftest import read_metrics, tiny_cfg
    from gspo.trainer import train

    for name, workers in (("here", 0), ("worker", 1)):
        train(tiny_cfg(tmp_path / name, max_steps=2, eval_num_prompts=0, rollout_workers=workers, **EPISODES))
    here, worker = (read_metrics(tmp_path / name / "run") for name in ("here", "worker"))
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "async/"))}  # noqa: E731
    assert [strip(r) for r in here] == [strip(r) for r in worker]
    assert all(r["episode/turns_mean"] >= 1 for r in worker)


def test_the_sampler_plug_runs_episodes_from_prompts_alone(tmp_path):
    from conftest import tiny_cfg
    from gspo.rollout import Sampler, sampler_sections

    model, tok = load_model("tiny-dense", overrides=SMALL)
    cfg = tiny_cfg(tmp_path, environment="test_episodes:Countdown", max_turns=3, seeded_sampling=True)
    sampler = Sampler(model, tok, *sampler_sections(cfg), seeded=True)
    rollout = sampler.sample(["1+2=", "3+4="], 1, 0)  # no rows: {"prompt": p}
    assert len(rollout.episodes) == 2 * cfg.num_generations and rollout.prompts[::4] == ["1+2=", "3+4="]
    assert all(e["turns"] == 3 or e["truncated"] for e in rollout.episodes)  # Countdown answers three turns


def test_bad_environment_settings_are_named(tmp_path):
    from conftest import tiny_cfg
    from gspo.rollout import Sampler, sampler_sections

    model, tok = load_model("tiny-dense", overrides=SMALL)
    with pytest.raises(ValueError, match=r"tool 'nowhere_mod:calc': cannot import module 'nowhere_mod'"):
        Sampler(model, tok, *sampler_sections(tiny_cfg(tmp_path, environment="tools", tools=["nowhere_mod:calc"])),
                seeded=False)
    with pytest.raises(ValueError, match=r"Echo has no step\(\) method"):
        Sampler(model, tok, *sampler_sections(tiny_cfg(tmp_path, environment="test_episodes:NoStep")), seeded=False)
    with pytest.raises(ValueError, match="set environment: tools"):
        tiny_cfg(tmp_path, tools=["test_episodes:calc"])


def NoStep():  # noqa: N802  (an environment factory, named like the class it pretends to be)
    class Echo:
        def reset(self, row):
            return row["prompt"]

    return Echo()


# ----------------------------------------------------------------------------------------------- the tool demo
def test_the_tool_demo_s_calculator_reward_and_demonstrations():
    from gspo.apps.demo_tools import calc, demonstration, final_answer
    from gspo.tasks import build_char_tokenizer

    assert [calc("1234+5678"), calc(" 90 - 8 "), calc("12*34")] == ["6912", "82", "408"]
    with pytest.raises(ValueError, match="expected a\\+b"):
        calc("1+2+3")
    # the final turn answers; a number only the observation shows does not count
    assert final_answer(["p"] * 3, ["x", "y", "z"], ["6912", "6912", "6912"],
                        final_turn=["6912", "", "it is 6913"]) == [1.0, 0.0, 0.0]
    assert final_answer(["p"], ["the sum: 6912"], [6912]) == [1.0]  # single-turn: the completion itself
    tok = build_char_tokenizer()
    ids, labels = demonstration(tok, {"prompt": "12+34=", "answer": "46"}, with_tool=True)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.replace("<bos>", "") == "12+34=calc(12+34)<eos>\nresult: 46\n46<eos>"
    trained = tok.decode([i for i, lab in zip(ids, labels) if lab != -100], skip_special_tokens=False)
    assert trained == "calc(12+34)<eos>46<eos>"  # the prompt and the tool's answer never trained
    ids, labels = demonstration(tok, {"prompt": "12+34=", "answer": "46"}, with_tool=False)
    assert tok.decode([i for i, lab in zip(ids, labels) if lab != -100], skip_special_tokens=False) == "46<eos>"


def test_the_tool_demo_s_cold_start_says_each_phase_and_keeps_its_summary_for_resume(tmp_path):
    from gspo.apps.demo import COLD_START_FILE, saved_cold_start
    from gspo.apps.demo_tools import TOOL_SFT, cold_start

    said = []
    folder, summary = cold_start(tmp_path, 0, with_tool=False, steps=2, say=said.append)
    assert said[:2] == [f"cold start: loading tiny-dense (random init), writing {TOOL_SFT['examples']} "
                        "demonstrations", "cold start: SFT for 2 steps"]
    assert len(said) == 3 and said[2].startswith("cold start: done, 2 steps in ") and said[2].endswith(folder)
    assert summary["sft_steps"] == 2 and (tmp_path / "sft" / "model" / "config.json").is_file()
    assert saved_cold_start(tmp_path) == {**summary, "model_dir": folder}  # what --resume starts from
    assert (tmp_path / COLD_START_FILE).is_file() and saved_cold_start(tmp_path / "sft") is None


# ------------------------------------------------------------------------ configs/tools_env.yaml and its environment
def test_the_example_environment_runs_its_calculator_and_scores_the_answer(monkeypatch):
    from conftest import ROOT
    from gspo.config import EpisodeSettings
    from gspo.env import environment_factory

    monkeypatch.chdir(ROOT)  # the config names the class by a path relative to the repository's root
    make = environment_factory(EpisodeSettings(environment="examples/tools_env/calculator_env.py:CalculatorEnv"))
    env = make()
    assert env.reset({"prompt": "1234+5678=", "answer": "6912"}) == "1234+5678="
    turn = env.step("calc(1234+5678)")
    assert (turn.observation, turn.reward, turn.done) == (["\nresult: ", "6912", "\n"], 0.0, False)
    assert turn.info == {"tool_calls": 1, "tool_errors": 0}
    turn = env.step("calc(1+2+3)")  # the tool raises: an error the model reads, counted
    assert "expected a+b" in turn.observation[1] and turn.info == {"tool_calls": 1, "tool_errors": 1}
    turn = env.step("it is 6912")
    assert (turn.observation, turn.reward, turn.done) == (None, 1.0, True)
    env = make()  # one per episode
    env.reset({"prompt": "1+1=", "answer": 2})
    assert env.step("6912").reward == 0.0 and env.step("").reward == 0.0


def test_the_tools_env_config_trains_with_its_environment_s_reward(tmp_path, monkeypatch):
    import dataclasses

    from conftest import ROOT, TINY_RUN, read_metrics
    from gspo.config import EpisodeSettings, TrainConfig, load_config, section
    from gspo.env import environment_factory
    from gspo.tracking import read_jsonl
    from gspo.trainer import train

    monkeypatch.chdir(ROOT)
    cfg = load_config(TrainConfig, "configs/tools_env.yaml")
    assert (cfg.environment, cfg.reward_funcs) == ("examples/tools_env/calculator_env.py:CalculatorEnv",
                                                   ["environment"])
    train(dataclasses.replace(cfg, **{**TINY_RUN, "max_steps": 2, "per_device_batch_size": 4, "num_generations": 4,
                                      "log_samples_steps": 1, "log_samples_count": 16,
                                      "output_dir": str(tmp_path / "run")}))  # the tiny model in the cold start's place
    step = read_metrics(tmp_path / "run")[2]
    assert 0 <= step["reward/environment"] <= 1 and step["episode/turns_mean"] >= 1
    samples = read_jsonl(tmp_path / "run" / "samples.jsonl", null_as_nan=False)
    assert len(samples) == 32 and all(s["transcript"][0][0] == "model" for s in samples)
    make = environment_factory(section(cfg, EpisodeSettings))
    for s in samples:  # each episode's reward is its environment's, replayed on its model turns
        env = make()
        a, b = s["prompt"].rstrip("=").split("+")
        env.reset({"prompt": s["prompt"], "answer": str(int(a) + int(b))})
        rewards = [env.step(text).reward for role, text in s["transcript"] if role == "model"]
        assert s["rewards"]["environment"] == sum(rewards) == s["reward"], s
