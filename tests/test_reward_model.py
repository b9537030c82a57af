"""A tiny reward model trained in-process (conftest.train_tiny_reward_model) and used as `rm:<path>`.

The model is trained on add3 pairs (the worked solution vs the same text with another problem's
answer) with a Bradley-Terry loss; here it is loaded back the way a config's reward_funcs loads it.
"""

import math

import pytest
import torch

from conftest import answer_pairs, changed, train_tiny_reward_model
from gspo.data.rewards import answer_match, get_reward_fn, score_completions
from gspo.models import load_model

# Trained (300 steps), the model ranks 0.93-0.98 of held-out pairs correctly (seeds 0-5 measured); an
# untrained one 0.5-0.6 of them (its scores barely differ: which of a pair wins is near a coin flip).
RANKS_CORRECTLY = 0.85

# The task docstring's example, right and with the units digit wrong.
PROMPT = "347+585="
RIGHT = "7+5=12;4+8+1=13;3+5+1=9;#### 932"
WRONG = "7+5=12;4+8+1=13;3+5+1=9;#### 933"


def saved_weights(path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def test_answer_pairs_are_what_answer_match_separates():
    pairs = answer_pairs("test", 50, seed=3) + answer_pairs("test", 50, seed=3, one_digit=True)
    n = len(pairs)
    prompts = [p["prompt"] for p in pairs] * 2
    completions = [p["correct"] for p in pairs] + [p["wrong"] for p in pairs]
    assert answer_match(prompts, completions, answer=[p["answer"] for p in pairs] * 2) == [1.0] * n + [0.0] * n
    for p in pairs:  # the same text up to the answer after "#### "
        assert p["correct"].rpartition("#### ")[0] == p["wrong"].rpartition("#### ")[0]
    assert answer_pairs("test", 20, seed=3) == answer_pairs("test", 50, seed=3)[:20]  # seeded, prefix-stable


def test_reward_model_scores_depend_on_the_completion_and_reload_identically(tmp_path):
    stats = train_tiny_reward_model(tmp_path / "a", steps=5, seed=0)
    assert train_tiny_reward_model(tmp_path / "b", steps=5, seed=0) == stats  # seeded: same numbers...
    assert not changed(saved_weights(tmp_path / "a"), saved_weights(tmp_path / "b"))  # ...and same weights
    train_tiny_reward_model(tmp_path / "init", steps=0, seed=0)
    assert "score.weight" in changed(saved_weights(tmp_path / "init"), saved_weights(tmp_path / "a"))

    first, second = get_reward_fn(f"rm:{tmp_path / 'a'}"), get_reward_fn(f"rm:{tmp_path / 'a'}")
    # The tokenizer the tiny-dense policy writes its completions in.
    assert first.tokenizer.get_vocab() == load_model("tiny-dense", overrides={"num_hidden_layers": 1})[1].get_vocab()
    assert answer_match([PROMPT] * 2, [RIGHT, WRONG], answer=["932"] * 2) == [1.0, 0.0]
    scores = first([PROMPT, PROMPT], [RIGHT, WRONG])
    assert scores[0] != scores[1]  # one character of the completion differs, and so does the score
    assert second([PROMPT, PROMPT], [RIGHT, WRONG]) == scores  # a second load scores bit for bit the same
    # The model reads prompt + completion as one text: where the split falls does not matter.
    assert first(["", PROMPT + RIGHT[:6]], [PROMPT + RIGHT, RIGHT[6:]]) == pytest.approx([scores[0]] * 2, abs=1e-6)


@pytest.mark.slow
def test_a_trained_reward_model_ranks_right_answers_above_wrong_ones(tmp_path):
    from transformers import AutoModelForSequenceClassification

    trained = train_tiny_reward_model(tmp_path / "trained", seed=0)
    untrained = train_tiny_reward_model(tmp_path / "random", steps=0, seed=0)  # the same initial weights
    # Held out: the test split (training draws the train split), and not the helper's own eval seed.
    pairs = answer_pairs("test", 200, seed=1)
    n = len(pairs)
    prompts = [p["prompt"] for p in pairs] * 2
    completions = [p["correct"] for p in pairs] + [p["wrong"] for p in pairs]

    accuracy = {}
    for name in ("trained", "random"):
        rm = get_reward_fn(f"rm:{tmp_path / name}")
        total, raw = score_completions([rm], None, prompts, completions, {})  # (2n,)
        accuracy[name] = (total[:n] > total[n:]).float().mean().item()
        # score_completions gives each text's own forward: a model loaded with plain transformers, no padding.
        model = AutoModelForSequenceClassification.from_pretrained(tmp_path / name).eval()
        for i in (0, 1, n, n + 1):
            ids = rm.tokenizer(prompts[i] + completions[i], return_tensors="pt").input_ids  # (1, L)
            with torch.no_grad():
                direct = model(input_ids=ids).logits[0, 0].item()
            assert raw["reward_model"][i].item() == pytest.approx(direct, abs=1e-5)
            assert total[i].item() == raw["reward_model"][i].item()  # one function, weight 1

    assert accuracy["trained"] >= RANKS_CORRECTLY > accuracy["random"], accuracy
    # The helper's own held-out numbers agree. Untrained scores nearly tie, so the loss is about ln 2.
    assert trained["accuracy"] >= RANKS_CORRECTLY > untrained["accuracy"]
    assert untrained["eval_loss"] == pytest.approx(math.log(2), abs=0.01)
    assert trained["eval_loss"] < 0.3 and trained["train_loss"] < 0.3
