"""Other projects' environments as gspo episodes: OpenEnv (openenv-core) in-process and served by its own server on
127.0.0.1, and verifiers environments (gspo/env/openenv.py, gspo/env/verifiers.py)."""

import os
import socket
import sys
import threading
import time

import pytest
import torch

from conftest import ROOT, SMALL, tiny_cfg
from gspo.config import sampler_sections
from gspo.models import load_model
from gspo.rollout.registry import GENERATORS, GeneratorBackend
from gspo.rollout.sampler import Sampler

pytest.importorskip("openai")
pytest.importorskip("openenv")

from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    text: str = ""


class GuessEnv(Environment):
    """Say 7: reward 1 and done; anything else: "again", reward 0, done after two tries."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.tries = 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.tries = 0
        return GuessObservation(text="say 7")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self.tries += 1
        hit = "7" in action.guess
        return GuessObservation(text="again", reward=1.0 if hit else 0.0, done=hit or self.tries >= 2)

    @property
    def state(self) -> State:
        return State(step_count=self.tries)


class MoveAction(Action):
    x: int
    y: int


class GridEnv(Environment):
    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        return GuessObservation(text="move")

    def step(self, action: MoveAction, timeout_s=None, **kwargs) -> GuessObservation:
        return GuessObservation(reward=float(action.x + action.y), done=True)

    @property
    def state(self) -> State:
        return State()


def says(tok, text_of_row):
    """A generator whose rows answer `text_of_row(context text)` then stop: a model the test writes."""
    def sample(sampler, prompt_ids, prompt_mask, *, pad, with_logprobs, **_):
        answers = [[tok.convert_tokens_to_ids(c) for c in text_of_row(tok.decode(row[m.bool()].tolist()))]
                   + [tok.eos_token_id] for row, m in zip(prompt_ids, prompt_mask)]
        width = max(map(len, answers))
        ids = torch.tensor([a + [pad] * (width - len(a)) for a in answers])  # (n, t)
        return ids, torch.full(ids.shape, -0.5)

    return GeneratorBackend(sample, lambda model: None)


def episodes_of(tmp_path, monkeypatch, environment, answer, prompts=("1=", "2="), **kw):
    model, tok = load_model("tiny-dense", seed=0, overrides=SMALL)
    monkeypatch.setitem(GENERATORS, "says", says(tok, answer))
    cfg = tiny_cfg(tmp_path, environment=environment, generation_backend="says", per_device_batch_size=len(prompts),
                   num_generations=2, reward_funcs=["environment"], **kw)
    sampler = Sampler(model, tok, *sampler_sections(cfg), seeded=False)
    try:
        return sampler.sample(list(prompts), 0, 0, [{"prompt": p} for p in prompts]), tok
    finally:
        sampler.close()


def guesses(context: str) -> str:
    """Row "1=" guesses 7 at once; row "2=" guesses 3, then 7 once told "again"."""
    return "7" if context.startswith("1=") or context.endswith("again") else "3"


def check_guesses(rollout, tok):
    eps = rollout.episodes
    assert [e["env_reward"] for e in eps] == [1.0, 1.0, 1.0, 1.0]
    assert [e["calls"] for e in eps] == [1, 1, 2, 2] and not any(e["truncated"] for e in eps)
    # the second row's episodes: 3, then the observation (read, not trained), then 7
    row = rollout.input_ids[2][rollout.attention_mask[2].bool()].tolist()
    assert tok.decode(row) == "2=\nsay 73<eos>\nagain7<eos>"  # the tiny template: contents, one per line
    T = rollout.completion_len
    trained = rollout.input_ids[2, -T:][rollout.completion_mask[2]].tolist()
    assert tok.decode(trained) == "3<eos>7<eos>" and rollout.completion_mask[0].sum() == 2


def test_an_openenv_environment_in_process_runs_as_episodes(tmp_path, monkeypatch):
    check_guesses(*episodes_of(tmp_path, monkeypatch, "openenv:test_environments:GuessEnv", guesses))


def test_an_openenv_environment_served_by_openenv_runs_as_episodes(tmp_path, monkeypatch):
    import uvicorn
    from openenv.core.env_server.http_server import create_app

    app = create_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=8)
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        check_guesses(*episodes_of(tmp_path, monkeypatch, f"openenv:{url}", guesses))
    finally:
        server.should_exit = True
        thread.join(10)


def test_an_openenv_action_with_fields_is_a_tool(tmp_path):
    from gspo.env.openenv import OpenEnvAgent

    agent = OpenEnvAgent("test_environments:GridEnv")
    assert agent.text_field is None and agent.tool["function"]["name"] == "MoveAction"
    assert agent.tool["function"]["parameters"]["required"] == ["x", "y"]
    assert set(agent.tool["function"]["parameters"]["properties"]) == {"x", "y"}
    assert OpenEnvAgent("test_environments:GuessEnv").text_field == "guess"
    with pytest.raises(ValueError, match="its /schema could not be read .* is openenv's server running there"):
        OpenEnvAgent("http://127.0.0.1:9")


sys.modules.setdefault("test_environments", sys.modules[__name__])


# ----------------------------------------------------------------------------------------------- verifiers
def test_verifiers_0_4_has_no_load_environment_at_its_top():
    """What issue 50 names (verifiers.load_environment) is not in the verifiers that installs: gspo's adapter is
    built against verifiers.v1."""
    verifiers = pytest.importorskip("verifiers")
    assert verifiers.__version__.startswith("0.4")
    with pytest.raises(AttributeError, match="module 'verifiers' has no attribute 'load_environment'"):
        verifiers.load_environment  # noqa: B018


def test_a_verifiers_single_turn_environment_scores_with_its_rewards(tmp_path, monkeypatch):
    pytest.importorskip("verifiers")
    rollout, _ = episodes_of(tmp_path, monkeypatch, "verifiers:vf_qa", lambda context: "7" if "3+4" in context
                             else "5", prompts=("3+4=", "1+1="))
    eps = rollout.episodes
    assert [e["env_reward"] for e in eps] == [1.0, 1.0, 0.0, 0.0] and [e["calls"] for e in eps] == [1] * 4
    assert [e["scores"] for e in eps] == [{"correct": 1.0}] * 2 + [{"correct": 0.0}] * 2
    assert not any(e["agent_error"] for e in eps)


@pytest.mark.slow  # verifiers starts the tool's MCP server as a process: ~20 s
def test_a_verifiers_tool_environment_runs_its_tools_and_scores(tmp_path, monkeypatch):
    pytest.importorskip("verifiers")
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def model(context: str) -> str:  # call the tool, then answer what it said
        return "7" if context.endswith("\n7") else "calc(3+4)"

    rollout, tok = episodes_of(tmp_path, monkeypatch, "verifiers:vf_calc", model, prompts=("3+4=",),
                               tool_call_style="text")
    eps = rollout.episodes
    assert [(e["calls"], e["tool_calls"], e["env_reward"]) for e in eps] == [(2, 1, 1.5)] * 2
    assert eps[0]["scores"] == {"correct": 1.0, "used_tool": 1.0}
    row = rollout.input_ids[0][rollout.attention_mask[0].bool()].tolist()
    T = rollout.completion_len
    assert tok.decode(row) == "3+4=calc(3+4)<eos>\n77<eos>"  # the tiny template; the tool's "7": an observation
    assert tok.decode(rollout.input_ids[0, -T:][rollout.completion_mask[0]].tolist()) == "calc(3+4)<eos>7<eos>"


def test_a_verifiers_environment_that_is_not_there_is_named(tmp_path):
    pytest.importorskip("verifiers")
    from gspo.env.verifiers import VerifiersAgent

    with pytest.raises(ValueError, match=r"verifiers environment 'no_such_taskset': ModuleNotFoundError: taskset "
                                         r"'no_such_taskset' not found"):
        VerifiersAgent("no_such_taskset")
