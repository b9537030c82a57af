"""The reward of configs/own_task_smollm2.yaml: a user's own function, named in the config as
`examples/own_task/capital_rewards.py:names_the_capital` (a file path and a function; a module on the import
path works too: `my_package.rewards:fn`).

It follows TRL's signature: the completions, and each data column it names (here `capital`) as a list aligned
with them. The prompts are chat messages, so each completion arrives as TRL's conversational format,
`[{"role": "assistant", "content": text}]`; a plain-text dataset would hand it the text.
"""

import re


def names_the_capital(completions, capital, **_):
    """1.0 where the answer names the row's `capital` (as whole words, in any case), else 0.0; None (no opinion)
    where the row has no capital."""
    rewards = []
    for completion, city in zip(completions, capital, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        if not city:
            rewards.append(None)
            continue
        rewards.append(float(re.search(rf"\b{re.escape(city)}\b", text, re.IGNORECASE) is not None))
    return rewards
