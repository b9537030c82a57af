"""The value model (gspo/plugs/critic.py): built from the policy, aligned with the log-probs' positions,
and able to fit a fixed rollout's returns (the critic alone; in the trainer: test_ppo.py)."""

import torch

from conftest import SMALL
from gspo.algo.advantages import gae
from gspo.algo.values import explained_variance, value_loss
from gspo.models import load_model
from gspo.plugs.critic import completion_values, terminal_rewards, value_model_from
from gspo.rollout import generate

PROMPTS = ["1+2+3=", "4+0+5=", "7+7+1="]


def rollout(G: int = 4):
    policy, tokenizer = load_model("tiny-dense", overrides=SMALL, seed=0)
    torch.manual_seed(0)
    return policy, generate(policy, tokenizer, PROMPTS, G, max_new_tokens=8, temperature=1.0)


def test_terminal_rewards_sit_on_each_last_token():
    mask = torch.tensor([[True, True, True], [True, False, False]])
    out = terminal_rewards(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[0.0, 0.0, 2.0], [-1.0, 0.0, 0.0]]
    episodes = torch.tensor([[True, False, True, False], [True, True, False, False]])  # observations are False
    assert terminal_rewards(torch.tensor([2.0, -1.0]), episodes).tolist() == [[0, 0, 2.0, 0], [0, -1.0, 0, 0]]


def test_values_start_at_zero_and_read_only_the_prefix():
    policy, r = rollout()
    critic = value_model_from(policy)
    values = completion_values(critic, r.input_ids, r.attention_mask, r.completion_len)
    assert values.shape == r.completion_mask.shape and not values.any()  # zero head
    torch.nn.init.normal_(critic.head.weight, std=1.0)
    with torch.no_grad():
        base = completion_values(critic, r.input_ids, r.attention_mask, r.completion_len)  # (N, T)
        changed = r.input_ids.clone()
        P = r.input_ids.shape[1] - r.completion_len
        changed[:, P + 2] = (changed[:, P + 2] + 1) % policy.config.vocab_size  # completion token 2
        after = completion_values(critic, changed, r.attention_mask, r.completion_len)
    assert torch.equal(after[:, :3], base[:, :3])  # the value at token 2 sees tokens before it only
    assert (after[:, 3:] - base[:, 3:]).abs().max() > 1e-4
    # the copy is the policy's decoder, not shared with it
    assert critic.decoder is not policy.get_decoder()
    assert all(torch.equal(a, b) for a, b in zip(critic.decoder.parameters(), policy.get_decoder().parameters()))


def test_the_critic_fits_a_fixed_rollouts_returns():
    policy, r = rollout()
    # a reward fixed per prompt (its 4 completions alike): every token's return is then a function of
    # what the critic sees (the prompt), so it can be fitted exactly
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4 + [0.5] * 4)  # (N,)
    mask = r.completion_mask
    _, returns = gae(terminal_rewards(rewards, mask), torch.zeros(mask.shape), mask, gamma=1.0, lam=1.0)
    assert torch.equal(returns[mask], rewards[:, None].expand_as(mask)[mask])  # the reward at every token
    critic = value_model_from(policy)
    optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    ev = []
    for _ in range(60):
        values = completion_values(critic, r.input_ids, r.attention_mask, r.completion_len)
        loss, _ = value_loss(values, values.detach(), returns, mask, clip=None)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ev.append(explained_variance(values, returns, mask))
    assert ev[0] < 0.05 and ev[-1] > 0.95, (ev[0], ev[-1])  # measured 0.0 -> 0.997
