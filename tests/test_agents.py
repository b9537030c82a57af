"""Agent episodes (gspo/rollout/agents.py): an agent written against the `openai` client runs on the run's endpoint,
and what the endpoint sampled is what the trainer trains: same tokens, mu equal to the trainer's log-probs."""

import asyncio
import logging
import sys

import pytest
import torch

from conftest import SMALL, changed, final_weights, initial_weights, read_metrics, tiny_cfg
from gspo.algo.logprobs import completion_logprobs
from gspo.config import sampler_sections
from gspo.models import load_model
from gspo.rollout.registry import GENERATORS, GeneratorBackend
from gspo.rollout.sampler import Sampler

pytest.importorskip("openai")
pytest.importorskip("fastapi")

SEEN = {}  # what the agents below read back from the endpoint, by row prompt


async def two_calls(client, row):
    """Asks, then asks again in the same chat: the second call continues the first."""
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "so="}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
    last = second.model_dump()
    SEEN[row["prompt"]] = last
    SEEN.setdefault("sequences", []).append(last["prompt_token_ids"] + last["choices"][0]["token_ids"])
    return float(second.choices[0].message.content[:1].isdigit())


def sync_agent(client, row):
    """A plain function with a sync client; its reward in a dict: the distinct characters it got back."""
    reply = client.completions.create(model="policy", prompt=row["prompt"], max_tokens=3)
    return {"reward": float(len(set(reply.choices[0].text)))}


def forever(client, row):
    while True:
        client.completions.create(model="policy", prompt=row["prompt"], max_tokens=2)


async def sleepy(client, row):
    await client.completions.create(model="policy", prompt=row["prompt"], max_tokens=2)
    await asyncio.sleep(30)


def raises_on_odd(client, row):
    client.completions.create(model="policy", prompt=row["prompt"], max_tokens=2)
    if int(row["prompt"][0]) % 2:
        raise KeyError("the agent's own bug")
    return 1.0


def lonely(row):
    return 1.0


def always_one(prompts, completions, **_):
    return [1.0] * len(completions)


def sampler_for(tmp_path, agent, **kw):
    cfg = tiny_cfg(tmp_path, agent=f"test_agents:{agent}", **kw)
    model, tok = load_model("tiny-dense", seed=0, overrides=SMALL)
    return Sampler(model, tok, *sampler_sections(cfg), seeded=cfg.seeded_sampling), model, tok


def sampled(sampler, prompts: list[str], rows: list[dict] | None = None):
    """Step 0's rollout of `prompts` (their `rows`), the sampler closed after it (its endpoint stopped)."""
    try:
        return sampler.sample(prompts, 0, 0, rows)
    finally:
        sampler.close()


def test_agent_tokens_are_those_sampled_and_mu_is_the_trainer_s_log_prob(tmp_path):
    sampler, model, tok = sampler_for(tmp_path, "two_calls", per_device_batch_size=3, num_generations=2,
                                      seeded_sampling=True)
    rows = [{"prompt": p} for p in ("12+3=", "45+6=", "7+80=")]
    rollout = sampled(sampler, [r["prompt"] for r in rows], rows)
    calls = sampler.runner.endpoint.engine.calls  # generator calls made (the closed runner keeps its count)
    assert rollout.num_sequences == 6 and calls <= 4  # six episodes, two calls each: batched generator calls
    assert [(e["calls"], e["sequences"]) for e in rollout.episodes] == [(2, 1)] * 6 and rollout.position_ids is None
    T = rollout.completion_len
    rows_tokens = sorted(r[m.bool()].tolist() for r, m in zip(rollout.input_ids, rollout.attention_mask))
    assert rows_tokens == sorted(SEEN.pop("sequences"))  # each row: its last call's prompt and completion, exactly
    theirs, _ = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, T)  # (N, T)
    mask = rollout.completion_mask
    assert mask.sum() > 12 and (~mask & rollout.attention_mask[:, -T:].bool()).any()  # observations, untrained
    assert torch.allclose(rollout.sampler_logprobs[mask], theirs[mask], atol=1e-5)


def test_a_merged_sequence_is_byte_for_byte_what_was_sampled_under_a_merging_tokenizer(tmp_path, monkeypatch):
    """The tokenizer merges "12" into one token; the scripted model writes "1" "2" apart, then stops."""
    model, tok = load_model("tiny-dense", seed=0, overrides=SMALL)
    tok.add_tokens(["12"])
    one, two, eos = tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("2"), tok.eos_token_id
    assert tok("12", add_special_tokens=False)["input_ids"] != [one, two]

    def sample(sampler, prompt_ids, prompt_mask, *, pad, with_logprobs, **_):
        ids = torch.tensor([[one, two, eos]] * prompt_ids.shape[0])  # (n, 3)
        return ids, torch.full(ids.shape, -0.75)

    monkeypatch.setitem(GENERATORS, "scripted", GeneratorBackend(sample, lambda m: None))
    cfg = tiny_cfg(tmp_path, agent="test_agents:two_calls", generation_backend="scripted", per_device_batch_size=1,
                   num_generations=2)
    sampler = Sampler(model, tok, *sampler_sections(cfg), seeded=False)
    rollout = sampled(sampler, ["9="], [{"prompt": "9="}])
    last = SEEN["9="]
    first_prompt = tok.apply_chat_template([{"role": "user", "content": "9="}], add_generation_prompt=True,
                                           tokenize=False)
    p = tok(first_prompt, add_special_tokens=False)["input_ids"]
    shown = last["prompt_token_ids"][len(p) + 3:]  # the observation: the template's text after the reply
    real = rollout.input_ids[0][rollout.attention_mask[0].bool()].tolist()
    assert real == p + [one, two, eos] + shown + [one, two, eos]
    assert rollout.completion_mask[0].tolist() == [True] * 3 + [False] * len(shown) + [True] * 3
    assert rollout.sampler_logprobs[0].tolist() == [-0.75] * 3 + [0.0] * len(shown) + [-0.75] * 3


def test_limits_end_an_episode_as_truncated_never_the_run(tmp_path, caplog):
    sampler, _, _ = sampler_for(tmp_path, "forever", per_device_batch_size=1, num_generations=2, agent_max_calls=3)
    rollout = sampled(sampler, ["1="])
    assert [(e["calls"], e["truncated"], e["agent_error"]) for e in rollout.episodes] == [(3, True, False)] * 2
    sampler, _, _ = sampler_for(tmp_path, "sleepy", per_device_batch_size=1, num_generations=2, agent_timeout_s=1.0)
    rollout = sampled(sampler, ["1="])
    assert [(e["calls"], e["truncated"], e["agent_error"]) for e in rollout.episodes] == [(1, True, False)] * 2
    sampler, _, _ = sampler_for(tmp_path, "forever", per_device_batch_size=1, num_generations=2,
                                max_episode_tokens=5, agent_max_calls=50)
    rollout = sampled(sampler, ["1="])
    assert all(e["truncated"] for e in rollout.episodes) and rollout.completion_mask.sum(-1).max() <= 5


def test_an_agent_that_raises_is_named_with_its_row_and_scores_zero(tmp_path, caplog):
    cfg = tiny_cfg(tmp_path, agent="test_agents:raises_on_odd", reward_funcs=["test_agents:always_one"],
                   max_steps=1, per_device_batch_size=2, num_generations=2, eval_num_prompts=0)
    from gspo.trainer import train

    with caplog.at_level(logging.WARNING, logger="gspo.rollout.agents"):
        train(cfg)
    (m,) = read_metrics(tmp_path / "run")
    lines = [r.getMessage() for r in caplog.records if "raised KeyError" in r.getMessage()]
    assert lines and all("agent 'test_agents:raises_on_odd' raised KeyError: \"the agent's own bug\" (episode" in l
                         and "row {'prompt': '" in l for l in lines)
    assert m["episode/agent_errors"] == len(lines) / 4 and m["reward/mean"] == 1 - len(lines) / 4


def test_a_run_trains_a_sync_agent_and_says_what_its_episodes_did(tmp_path):
    from gspo.trainer import train

    cfg = tiny_cfg(tmp_path, agent="test_agents:sync_agent", reward_funcs=["environment"], max_steps=2,
                   eval_num_prompts=0)
    before = initial_weights(cfg)
    train(cfg)
    metrics = read_metrics(tmp_path / "run")
    assert all(m["reward/environment"] == m["reward/mean"] and 1 <= m["reward/mean"] <= 3 and m["reward/std"] > 0
               for m in metrics)
    assert all(m["episode/calls_mean"] == 1 and m["episode/agent_errors"] == 0 for m in metrics)
    assert changed(before, final_weights(tmp_path / "run"))


def test_an_agent_is_checked_before_the_run(tmp_path):
    with pytest.raises(ValueError, match="agent and environment both set"):
        tiny_cfg(tmp_path, agent="test_agents:two_calls", environment="tools", tools=["python"])
    with pytest.raises(ValueError, match="rollout_workers and rollout_endpoints are not supported with them"):
        tiny_cfg(tmp_path, agent="test_agents:two_calls", rollout_workers=1)
    with pytest.raises(ValueError, match=r"agent='two_calls': expected \"module:function\""):
        tiny_cfg(tmp_path, agent="two_calls")
    with pytest.raises(ValueError, match=r"an agent is called as agent\(client, row\); 'lonely' takes \(row\)"):
        sampler_for(tmp_path, "lonely")
    with pytest.raises(ValueError, match="module 'test_agents' has no attribute 'nope'"):
        sampler_for(tmp_path, "nope")


sys.modules.setdefault("test_agents", sys.modules[__name__])


async def with_a_sub_agent(client, row):
    """A main call, then a sub-agent's fresh chat (it does not continue the first), then the main chat again."""
    main = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=main, max_tokens=4)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "9*9="}], max_tokens=4)
    main += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and="}]
    last = await client.chat.completions.create(model="policy", messages=main, max_tokens=4)
    return float(len(set(last.choices[0].message.content)))


def test_rows_of_several_sequences_read_each_on_its_own():
    """Two sequences in one row, positions restarting: each token's log-prob is the one it has alone, on the padded,
    packed and naive paths."""
    from gspo.algo.logprobs import naive_completion_logprobs, position_ids_from_mask

    model, _ = load_model("tiny-dense", seed=0, overrides=SMALL)
    a, b = [5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]  # sequence 1: prompt 5 6, then 7 .. 10; sequence 2: all after
    P = 2
    ids = torch.tensor([[0, 0] + a[:P] + a[P:] + b + [0]])  # (1, 2 + 2 + 4 + 5 + 1): left pad, right pad
    mask = torch.tensor([[0, 0] + [1] * (len(a) + len(b)) + [0]])
    positions = position_ids_from_mask(mask)
    start = 2 + len(a)
    positions[0, start:start + len(b)] = torch.arange(len(b))
    T = ids.shape[1] - 4
    alone_a, _ = completion_logprobs(model, torch.tensor([a]), torch.ones(1, len(a), dtype=torch.long), len(a) - P)
    alone_b, _ = completion_logprobs(model, torch.tensor([b]), torch.ones(1, len(b), dtype=torch.long), len(b) - 1)
    for path in ("padded", "packed", "naive"):
        if path == "naive":
            got, _ = naive_completion_logprobs(model, ids, mask, T, position_ids=positions)
        else:
            got, _ = completion_logprobs(model, ids, mask, T, packed=path == "packed", position_ids=positions)
        assert torch.allclose(got[0, :4], alone_a[0], atol=1e-5), path  # 7 .. 10 read 5 6 .. only
        assert torch.allclose(got[0, 5:9], alone_b[0], atol=1e-5), path  # 12 .. 15 read 11 .. only
    plain, _ = completion_logprobs(model, ids, mask, T)
    assert not torch.allclose(plain[0, 5:9], alone_b[0], atol=1e-3)  # without positions they read sequence 1 too


def test_a_call_that_does_not_continue_is_another_sequence_of_the_episode(tmp_path):
    sampler, model, tok = sampler_for(tmp_path, "with_a_sub_agent", per_device_batch_size=2, num_generations=2)
    rollout = sampled(sampler, ["12=", "34="])
    assert [(e["calls"], e["sequences"]) for e in rollout.episodes] == [(3, 2)] * 4
    T = rollout.completion_len
    theirs, _ = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, T,
                                    position_ids=rollout.position_ids)  # (N, T)
    mask = rollout.completion_mask
    assert torch.allclose(rollout.sampler_logprobs[mask], theirs[mask], atol=1e-5)  # mu: as each call sampled it
    row = rollout.input_ids[0][rollout.attention_mask[0].bool()].tolist()
    assert "9*9=" in tok.decode(row)  # the sub-agent's prompt: in the row, read, never trained
    # and a run trains on such rows (the rows' sequences in one ratio per episode)
    from gspo.trainer import train

    cfg = tiny_cfg(tmp_path, agent="test_agents:with_a_sub_agent", reward_funcs=["environment"], max_steps=1,
                   eval_num_prompts=0, padding_free=True)
    before = initial_weights(cfg)
    train(cfg)
    (m,) = read_metrics(tmp_path / "run")
    assert m["episode/sequences_mean"] == 2 and m["episode/calls_mean"] == 3
    assert changed(before, final_weights(tmp_path / "run"))
