"""The reward of configs/letters_smollm2.yaml: each answer scored by the scorer of the reasoning-gym generator that
wrote its question (the data's `task` column: reasoning_gym.get_score_answer_fn), on the completion's last integer
(the prompt asks for just the number; a 135M model often answers in a sentence: "The letter "h" appears 3 times.").
"""

import re

_INTEGER = re.compile(r"-?\d+")


def scored_by_generator(completions, answer, task, **_):
    """The generator's score (1.0 right, 0.0 wrong for letter_counting) of the completion's last integer; 0.0 where
    the completion has no integer."""
    from reasoning_gym import get_score_answer_fn  # lazily: the example's own dependency

    scorers = {name: get_score_answer_fn(name) for name in set(task)}  # one per generator in the batch
    rewards = []
    for completion, expected, name in zip(completions, answer, task, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        found = _INTEGER.findall(text)
        score = scorers[name]
        rewards.append(float(score(found[-1], {"answer": expected, "metadata": {}})) if found else 0.0)
    return rewards
