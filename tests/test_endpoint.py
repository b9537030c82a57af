"""gspo's OpenAI-compatible endpoint (gspo/rollout/endpoint): what the `openai` client sends and reads over HTTP on
127.0.0.1, the tokens it carries, and what it refuses."""

import json
import threading
from contextlib import contextmanager

import pytest
import torch

from conftest import SMALL, gspo_argv, gspo_env, gspo_serving, tiny_cfg
from gspo.algo.logprobs import completion_logprobs
from gspo.models import load_model
from gspo.rollout.registry import GENERATORS, GeneratorBackend

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from gspo.rollout.endpoint.engine import Engine, Job, Sample  # noqa: E402
from gspo.rollout.endpoint.responses import chat_reply  # noqa: E402
from gspo.rollout.endpoint.server import Endpoint, Server, make_app  # noqa: E402
from gspo.rollout.endpoint.sessions import SessionLimits  # noqa: E402

CALC = {"type": "function", "function": {"name": "calc", "description": "a+b of integers", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model("tiny-dense", overrides=SMALL)


@contextmanager
def serving(engine, tokenizer, *, secret=None, open_loopback=True, **endpoint):
    """An Endpoint on a free loopback port, its engine driven by a thread of its own: (server, client)."""
    ep = Endpoint(engine, tokenizer, model_name="tiny", **endpoint)
    server = Server(ep, "127.0.0.1", 0, secret=secret, open_loopback=open_loopback)
    stop = threading.Event()
    thread = threading.Thread(target=engine.serve, args=(stop, 0.02), daemon=True)
    thread.start()
    try:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key=(secret or b"-").decode(), max_retries=0)
    finally:
        stop.set()
        thread.join()
        server.close()


def scripted(answer):
    """A generator whose row answers are `answer(context ids) -> ids` (mu -0.25 each), padded: a model the test
    writes."""
    def sample(sampler, prompt_ids, prompt_mask, *, pad, with_logprobs, **_):
        answers = [answer(row[mask.bool()].tolist()) for row, mask in zip(prompt_ids, prompt_mask)]
        width = max(map(len, answers))
        ids = torch.tensor([a + [pad] * (width - len(a)) for a in answers])  # (n, t)
        return ids, torch.full(ids.shape, -0.25) if with_logprobs else None

    return GeneratorBackend(sample, lambda model: None)


def test_a_chat_completion_carries_the_tokens_it_sampled_and_their_mu(tiny):
    model, tok = tiny
    with serving(Engine(GENERATORS["gspo"], model, model, tok), tok) as (_, client):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "12+3="}], n=2,
                                           max_tokens=6, logprobs=True, seed=7)
    body = r.model_dump()
    rendered = tok.apply_chat_template([{"role": "user", "content": "12+3="}], add_generation_prompt=True,
                                       tokenize=False)
    assert body["prompt_token_ids"] == tok(rendered, add_special_tokens=False)["input_ids"]
    assert len(r.choices) == 2 and r.usage.completion_tokens == sum(len(c["token_ids"]) for c in body["choices"])
    for choice in body["choices"]:
        ids = choice["token_ids"]
        assert 1 <= len(ids) <= 6 and choice["message"]["content"] == tok.decode(ids, skip_special_tokens=True)
        assert [t["token"] for t in choice["logprobs"]["content"]] == [tok.decode([t]) for t in ids]
        # mu is the trainer's log-prob of each token, same weights, temperature 1
        full = torch.tensor([body["prompt_token_ids"] + ids])
        theirs = completion_logprobs(model, full, torch.ones_like(full), len(ids))[0][0]  # (t,)
        mu = torch.tensor([t["logprob"] for t in choice["logprobs"]["content"]])
        assert torch.allclose(mu, theirs, atol=1e-5), (mu, theirs)


def test_seeded_requests_repeat_alone_or_batched_with_others(tiny):
    model, tok = tiny
    ask = dict(model="tiny", messages=[{"role": "user", "content": "7+8="}], max_tokens=8, seed=11)
    engine = Engine(GENERATORS["gspo"], model, model, tok, window_s=0.5)
    with serving(engine, tok) as (_, client):
        alone = client.chat.completions.create(**ask).model_dump()["choices"][0]["token_ids"]
        results = {}

        def call(key, **kw):
            results[key] = client.chat.completions.create(**{**ask, **kw}).model_dump()["choices"][0]["token_ids"]

        threads = [threading.Thread(target=call, args=(k,), kwargs=kw) for k, kw in
                   (("same", {}), ("other", {"seed": 12}), ("longer", {"messages": [{"role": "user",
                                                                                    "content": "123+456="}]}))]
        before = engine.calls
        [t.start() for t in threads]
        [t.join() for t in threads]
    assert results["same"] == alone and results["other"] != alone
    assert engine.calls - before == 1  # the three came within the window: one generator call


def test_token_ids_in_sample_the_same_as_the_text_they_stand_for(tiny):
    model, tok = tiny
    with serving(Engine(GENERATORS["gspo"], model, model, tok), tok) as (_, client):
        text = client.completions.create(model="tiny", prompt="45+5=", max_tokens=6, seed=3).model_dump()
        ids = client.completions.create(model="tiny", prompt=tok("45+5=")["input_ids"], max_tokens=6,
                                        seed=3).model_dump()
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ignored"}],
                                              max_tokens=6, seed=3,
                                              extra_body={"prompt_token_ids": tok("45+5=")["input_ids"]}).model_dump()
        two = client.completions.create(model="tiny", prompt=["1=", "2="], n=2, max_tokens=3, temperature=0)
    assert text["prompt_token_ids"] == ids["prompt_token_ids"] == chat["prompt_token_ids"] == tok("45+5=")["input_ids"]
    assert text["choices"][0]["token_ids"] == ids["choices"][0]["token_ids"] == chat["choices"][0]["token_ids"]
    assert [c.index for c in two.choices] == [0, 1, 2, 3] and two.choices[0].text == two.choices[1].text  # greedy


def test_stop_strings_cut_the_text_and_keep_the_token_that_completed_them(tiny):
    model, tok = tiny
    say = [tok.convert_tokens_to_ids(c) for c in "12;34"] + [tok.eos_token_id]
    engine = Engine(scripted(lambda context: say), model, model, tok)
    with serving(engine, tok) as (_, client):
        cut = client.completions.create(model="tiny", prompt="x", max_tokens=10, stop=[";", "4"]).model_dump()
        whole = client.completions.create(model="tiny", prompt="x", max_tokens=10).model_dump()
        short = client.completions.create(model="tiny", prompt="x", max_tokens=2).model_dump()
    assert (cut["choices"][0]["text"], cut["choices"][0]["token_ids"], cut["choices"][0]["finish_reason"]) == (
        "12", say[:3], "stop")
    assert (whole["choices"][0]["text"], whole["choices"][0]["token_ids"], whole["choices"][0]["finish_reason"]) == (
        "12;34", say, "stop")
    assert (short["choices"][0]["text"], short["choices"][0]["finish_reason"]) == ("12", "length")


def test_a_stream_says_what_the_whole_response_says(tiny):
    model, tok = tiny
    ask = dict(model="tiny", messages=[{"role": "user", "content": "9+9="}], max_tokens=8, seed=5, n=2)
    with serving(Engine(GENERATORS["gspo"], model, model, tok), tok) as (_, client):
        whole = client.chat.completions.create(**ask).model_dump()
        chunks = [c.model_dump() for c in client.chat.completions.create(
            **ask, stream=True, stream_options={"include_usage": True})]
        plain = [c.model_dump() for c in client.completions.create(model="tiny", prompt="9+9=", max_tokens=5, seed=5,
                                                                    stream=True)]
        plain_whole = client.completions.create(model="tiny", prompt="9+9=", max_tokens=5, seed=5).model_dump()
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"] and chunks[-1]["usage"] == whole["usage"]
    for k in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == k]
        assert "".join(c["delta"]["content"] or "" for c in mine) == whole["choices"][k]["message"]["content"]
        assert sum((c.get("token_ids") or [] for c in mine), []) == whole["choices"][k]["token_ids"]
        assert mine[-1]["finish_reason"] == whole["choices"][k]["finish_reason"]
    assert "".join(c["choices"][0]["text"] for c in plain) == plain_whole["choices"][0]["text"]


def test_tool_calls_are_parsed_back_into_tool_calls(tiny):
    model, tok = tiny
    say = [tok.convert_tokens_to_ids(c) for c in "calc(1+2)"] + [tok.eos_token_id]
    with serving(Engine(scripted(lambda context: say), model, model, tok), tok, tool_style="text") as (_, client):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+2="}],
                                           tools=[CALC])
        plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+2="}],
                                               tools=[CALC], tool_choice="none")
        streamed = [c.model_dump() for c in client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "1+2="}], tools=[CALC], stream=True)]
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("calc", {"expression": "1+2"})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content == "calc(1+2)"
    deltas = [c["choices"][0]["delta"] for c in streamed if c["choices"]]
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if d.get("tool_calls")] == ["calc"]
    # hermes, as Qwen-style templates write calls; a malformed call stays text, an unknown tool too
    text = ('thinking <tool_call>{"name": "calc", "arguments": {"expression": "2+2"}}</tool_call>'
            '<tool_call>{"name": "calc", </tool_call><tool_call>{"name": "rm", "arguments": {}}</tool_call>')
    message, reason = chat_reply(Sample([], [], "stop", text), [CALC], "hermes")
    assert reason == "tool_calls" and len(message["tool_calls"]) == 1
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"expression": "2+2"}
    assert message["content"] == ('thinking <tool_call>{"name": "calc", </tool_call><tool_call>{"name": "rm", '
                                  '"arguments": {}}</tool_call>')


@pytest.mark.parametrize("body, status, says", [
    ({"messages": [{"role": "user", "content": "1"}], "frequency_penalty": 0.5}, 400, "frequency_penalty is not "),
    ({"messages": [{"role": "user", "content": "1"}], "temprature": 0.5}, 400, "unknown field 'temprature'"),
    ({"messages": [{"role": "user", "content": "1"}], "tools": [CALC], "tool_choice": "required"}, 400,
     "only auto and none"),
    ({"messages": [{"role": "user", "content": "1"}], "logprobs": True, "top_logprobs": 3}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "1"}], "n": 0}, 400, "n must be an integer in [1, 64]"),
    ({"messages": [{"role": "wizard", "content": "1"}]}, 400, "messages[0] must be an object with a role"),
    ({"messages": [], "prompt_token_ids": [1, 99999]}, 400, "token id 99999 is outside the vocabulary"),
    ({"messages": []}, 400, "messages must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "1"}], "max_tokens": 4000}, 400, "exceed the model's context (512"),
])
def test_bad_requests_are_refused_by_name(tiny, body, status, says):
    import httpx

    model, tok = tiny
    with serving(Engine(GENERATORS["gspo"], model, model, tok), tok) as (server, _):
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", **body})
        raw = httpx.post(server.url + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == status and says in r.json()["error"]["message"], r.json()
    assert raw.status_code == 400 and raw.json()["error"]["message"] == "the request body is not JSON"


def test_only_the_run_s_secret_opens_the_endpoint(tiny):
    import httpx
    from fastapi.testclient import TestClient

    model, tok = tiny
    engine = Engine(GENERATORS["gspo"], model, model, tok)
    ask = {"model": "tiny", "prompt": "1", "max_tokens": 1}
    with serving(engine, tok, secret=b"s3cret", open_loopback=False) as (server, client):
        assert client.completions.create(**ask).choices  # the client sends api_key as its bearer token
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(server.url + "/v1/completions", json=ask, headers=headers)
            assert r.status_code == 401 and "run's secret" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/sessions/nope/v1/models", headers={"Authorization": "Bearer s3cret"}
                         ).status_code == 200
        r = httpx.post(server.url + "/sessions/nope/v1/completions", json=ask,
                       headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 404 and "no open session" in r.json()["error"]["message"]
    # a client from another address needs the secret even where loopback is open (TestClient: host "testclient")
    app = make_app(Endpoint(engine, tok), secret=b"s3cret", open_loopback=True)
    assert TestClient(app).get("/v1/models").status_code == 401
    assert TestClient(app).get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert TestClient(make_app(Endpoint(engine, tok), secret=None)).get("/v1/models").status_code == 401
    with pytest.raises(ValueError, match="serving on 0.0.0.0 .not loopback. needs the run's secret"):
        Server(Endpoint(engine, tok), "0.0.0.0", 0)


def test_a_session_continues_with_the_tokens_sampled_not_their_text_retokenized():
    """The tokenizer merges "12" into one token; the model sampled "1" and "2" apart. The second call's prompt holds
    the sampled tokens, and the session's sequence is exactly what was sampled and observed, in order."""
    model, tok = load_model("tiny-dense", overrides=SMALL)
    tok.add_tokens(["12"])
    one, two, eos = tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("2"), tok.eos_token_id
    assert tok("12", add_special_tokens=False)["input_ids"] != [one, two]  # decode/encode does not round-trip
    engine = Engine(scripted(lambda context: [one, two, eos]), model, model, tok)
    with serving(engine, tok) as (server, _):
        s = server.endpoint.sessions.open(SessionLimits(max_calls=3, max_tokens=100))
        client = openai.OpenAI(base_url=f"{server.url}/sessions/{s.id}/v1", api_key="-", max_retries=0)
        messages = [{"role": "user", "content": "a"}]
        first = client.chat.completions.create(model="tiny", messages=messages).model_dump()
        messages += [first["choices"][0]["message"], {"role": "user", "content": "b"}]
        second = client.chat.completions.create(model="tiny", messages=messages).model_dump()
        messages += [second["choices"][0]["message"], {"role": "user", "content": "c"}]
        client.chat.completions.create(model="tiny", messages=messages)
        with pytest.raises(openai.ConflictError, match="max_calls reached"):
            client.chat.completions.create(model="tiny", messages=messages)
    assert first["choices"][0]["message"]["content"] == "12" and first["choices"][0]["token_ids"] == [one, two, eos]
    start = first["prompt_token_ids"] + [one, two, eos]
    assert second["prompt_token_ids"][:len(start)] == start
    (sequence,) = s.sequences
    observed = second["prompt_token_ids"][len(start):]
    assert sequence.prompt_ids == first["prompt_token_ids"]
    assert sequence.tokens[:len(start) - len(sequence.prompt_ids) + len(observed) + 3] == \
        [one, two, eos] + observed + [one, two, eos]
    assert sequence.model[:3 + len(observed) + 3] == [True] * 3 + [False] * len(observed) + [True] * 3
    assert s.over == "max_calls" and len(s.calls) == 3



def test_gspo_serve_answers_any_openai_client_until_stopped(tmp_path):
    cfg = tiny_cfg(tmp_path, max_completion_length=5)
    with gspo_serving(cfg) as server:  # and stops when told (the helper checks its thread ended)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny-dense"]
        r = client.chat.completions.create(model="tiny-dense", messages=[{"role": "user", "content": "1+1="}])
        assert 1 <= len(r.model_dump()["choices"][0]["token_ids"]) <= 5  # max_completion_length: the default


@pytest.mark.slow
def test_the_gspo_serve_command_prints_its_address_and_stops_on_sigterm(tmp_path):
    import signal
    import subprocess

    process = subprocess.Popen(gspo_argv("serve", "model=tiny-dense", "--port", "0"), cwd=tmp_path, env=gspo_env(),
                               stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "gspo serve:" not in line:
            line = process.stderr.readline()
            assert line or process.poll() is None, "gspo serve exited before listening"
        url = line.split(" at ")[1].split(" ")[0]
        assert url.startswith("http://127.0.0.1:") and "loopback clients only" in line
        client = openai.OpenAI(base_url=url, api_key="-", max_retries=0)
        assert client.completions.create(model="tiny-dense", prompt="1+1=", max_tokens=3).choices[0].text is not None
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        process.kill()


def test_tools_reach_the_chat_template_and_a_top_p_request_samples(tiny):
    """A template that writes the tools' names: the request's tools are in the prompt the model read."""
    model, tok = tiny
    template = ("{% if tools %}tools: {% for t in tools %}{{ t['function']['name'] }}{% endfor %};\n{% endif %}"
                "{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    original, tok.chat_template = tok.chat_template, template
    try:
        with serving(Engine(GENERATORS["gspo"], model, model, tok), tok) as (_, client):
            ask = dict(model="tiny", messages=[{"role": "user", "content": "1+2="}], max_tokens=4)
            with_tools = client.chat.completions.create(**ask, tools=[CALC]).model_dump()
            without = client.chat.completions.create(**ask, tools=[CALC], tool_choice="none").model_dump()
            nucleus = client.chat.completions.create(**ask, temperature=0.7, top_p=0.5, n=3).model_dump()
    finally:
        tok.chat_template = original
    assert tok.decode(with_tools["prompt_token_ids"]) == "tools: calc;\n1+2=\n"
    assert tok.decode(without["prompt_token_ids"]) == "1+2=\n"  # tool_choice none: no tools offered
    assert len(nucleus["choices"]) == 3 and all(1 <= len(c["token_ids"]) <= 4 for c in nucleus["choices"])


def test_a_missing_extra_is_named_with_how_to_install_it():
    from gspo.rollout.endpoint.server import need

    with pytest.raises(ValueError, match=r"no_such_module_50 is not installed: the endpoint needs the serve extra "
                                         r"\(pip install 'gspo\[serve\]'\)"):
        need("serve", "fastapi", "no_such_module_50")


def test_the_engine_samples_under_the_autocast_it_is_given_on_its_own_thread(tiny):
    # autocast is per thread: a trainer's `with autocast()` does not reach the engine's serving thread (a rollout
    # worker's, an agent's), so the engine takes the trainer's autocast and enters it around every generator call
    from gspo.plugs.precision import forward_precision

    model, tok = tiny
    seen = []

    def spy(sampler, prompt_ids, prompt_mask, *, pad, with_logprobs, **_):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                     torch.is_inference_mode_enabled()))
        ids = torch.full((prompt_ids.shape[0], 1), 7)  # (n, 1)
        return ids, torch.zeros(ids.shape) if with_logprobs else None

    for autocast in (forward_precision(True, "cpu"), forward_precision(False, "cpu")):
        engine = Engine(GeneratorBackend(spy, lambda model: None), model, model, tok, autocast=autocast)
        stop = threading.Event()
        thread = threading.Thread(target=engine.serve, args=(stop, 0.02), daemon=True)
        thread.start()
        try:
            engine.submit(Job([5, 6], max_tokens=1)).result(timeout=30)
        finally:
            stop.set()
            thread.join()
    # bf16: outside inference mode, so autocast caches its casts of the (trainable, float32) weights
    assert seen == [(True, torch.bfloat16, False), (False, torch.bfloat16, True)]


def test_a_closed_engine_fails_waiting_requests_at_once_and_takes_no_more(tiny):
    model, tok = tiny
    engine = Engine(GENERATORS["gspo"], model, model, tok)
    waiting = engine.submit(Job([5, 6], max_tokens=2))
    engine.close("the run stopped")
    with pytest.raises(RuntimeError, match="the run stopped"):
        waiting.result(timeout=1)
    with pytest.raises(ValueError, match="the endpoint takes no more requests: the run stopped"):
        engine.submit(Job([5, 6], max_tokens=2))
