"""open-r1's rewards run unchanged: math-verify in them keeps its own signal.alarm timeouts, because gspo calls
a reward on the main thread and stops it there when reward_timeout_s runs out (gspo.data.reward_timeout).

The rewards below are written here in open-r1's style (conversational completions, a `solution` column,
math-verify's parse/verify, regexes on <think>/<answer> tags, Kimi 1.5's length reward), not imported."""

import re
import signal
import threading
import time

import pytest

from gspo.config import EvalSettings, TrainConfig, make_config
from gspo.data.evaluation import TOTAL, success_rule
from gspo.data.reward_scoring import RewardError, reward_names, score_completions
from gspo.data.reward_timeout import DEADLINE_SIGNAL
from gspo.data.rewards import get_reward_fn

math_verify = pytest.importorskip("math_verify")
from math_verify import LatexExtractionConfig, LatexNormalizationConfig, parse, verify  # noqa: E402
from math_verify.errors import TimeoutException  # noqa: E402
from math_verify.utils import timeout as mv_timeout  # noqa: E402

# ------------------------------------------------------------------------------- the rewards, open-r1's style

ANSWER_CONFIG = [LatexExtractionConfig(
    normalization_config=LatexNormalizationConfig(nits=False, malformed_operators=False, basic_latex=True,
                                                  boxed="all", units=True),
    boxed_match_priority=0, try_extract_without_anchor=False)]


def _texts(completions):
    return [completion[0]["content"] for completion in completions]


def _correct(text: str, solution: str) -> bool | None:
    """math-verify's verdict on `text` against `solution`; None where the solution cannot be read."""
    gold = parse(solution, extraction_mode="first_match")  # signal.alarm inside: the main thread only
    if not gold:
        return None
    return verify(gold, parse(text, extraction_config=ANSWER_CONFIG, extraction_mode="first_match"))


def accuracy_reward(completions, solution, **kwargs):
    """1.0 where the completion's answer equals the solution (math-verify); None where the solution is unreadable."""
    verdicts = [_correct(text, sol) for text, sol in zip(_texts(completions), solution)]
    return [None if v is None else float(v) for v in verdicts]


def format_reward(completions, **kwargs):
    """1.0 where the whole completion is <think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>."""
    pattern = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL)
    return [float(pattern.match(text) is not None) for text in _texts(completions)]


def tag_count_reward(completions, **kwargs):
    """0.25 for each of the four tags written exactly once, newlines included."""
    tags = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
    return [sum(0.25 for tag in tags if text.count(tag) == 1) for text in _texts(completions)]


def len_reward(completions, solution, **kwargs):
    """Kimi 1.5's length reward: lam = 0.5 - (len - min) / (max - min) over the batch; lam where correct, min(0, lam)
    where wrong (an unreadable solution counts as correct); all 0 where every completion has one length."""
    texts = _texts(completions)
    lengths = [len(text) for text in texts]
    shortest, longest = min(lengths), max(lengths)
    if shortest == longest:
        return [0.0] * len(texts)
    rewards = []
    for text, sol, length in zip(texts, solution, lengths):
        lam = 0.5 - (length - shortest) / (longest - shortest)
        rewards.append(lam if _correct(text, sol) in (True, None) else min(0.0, lam))
    return rewards


COMPLETIONS = [
    "<think>\nhalf\n</think>\n<answer>\n$\\frac{1}{2}$\n</answer>",  # right (0.5), formatted: 54 characters
    "<think>\nguess\n</think>\n<answer>\n$3$\n</answer>",  # wrong, formatted: 45
    "So $\\boxed{4}$",  # right, no tags: 14
    "<think>\nhmm</think><answer>\n$7$\n</answer>",  # solution unreadable; two of the tags: 41
]
SOLUTIONS = ["$0.5$", "$4$", "$4$", "no number"]


def chat_batch():
    chat = [[{"role": "user", "content": f"question {i}"}] for i in range(4)]
    return [f"question {i}" for i in range(4)], chat


def test_open_r1_rewards_score_on_the_main_thread_under_the_default_timeout():
    prompts, chat = chat_batch()
    assert [len(c) for c in COMPLETIONS] == [54, 45, 14, 41]
    fns = [accuracy_reward, format_reward, tag_count_reward, len_reward]
    total, raw = score_completions(fns, None, prompts, COMPLETIONS, {"solution": SOLUTIONS}, chat=chat,
                                   timeout_s=TrainConfig().reward_timeout_s)
    assert raw["accuracy_reward"][:3].tolist() == [1.0, 0.0, 1.0] and raw["accuracy_reward"][3].isnan()
    assert raw["format_reward"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert raw["tag_count_reward"].tolist() == [1.0, 1.0, 0.0, 0.5]  # the last: <think>\n and \n</answer> only
    # lam = 0.5 - (len - 14) / 40: 54 -> -0.5 (right), 45 -> -0.275 (wrong: min(0, lam)), 14 -> 0.5 (right),
    # 41 -> -0.175 (unreadable: as if right)
    assert raw["len_reward"].tolist() == pytest.approx([-0.5, -0.275, 0.5, -0.175], abs=1e-6)
    # weight 1 each; the None of accuracy is skipped in the sum
    assert total.tolist() == pytest.approx([2.5, 1.725, 1.5, 0.325], abs=1e-6)


def test_a_math_verify_reward_runs_on_the_main_thread_and_its_own_alarm_still_fires():
    seen = []

    def patient(completions, **_):  # math-verify's own timeout (signal.alarm, 1 s) inside gspo's (30 s)
        seen.append(threading.current_thread())
        try:
            mv_timeout(1)(time.sleep)(5)
            return [1.0] * len(completions)
        except TimeoutException:
            return [0.0] * len(completions)

    before = signal.getsignal(signal.SIGALRM)
    started = time.monotonic()
    _, raw = score_completions([patient], None, ["p"], ["c"], {}, timeout_s=30)
    assert raw["patient"].tolist() == [0.0] and 0.9 < time.monotonic() - started < 3  # its alarm, at 1 s
    assert seen == [threading.main_thread()]
    assert signal.getsignal(signal.SIGALRM) is before and signal.getsignal(DEADLINE_SIGNAL) == signal.SIG_DFL


def test_a_reward_past_its_time_is_stopped_on_the_main_thread_even_inside_a_math_verify_alarm():
    calls = []

    def stuck(completions, **_):  # hangs inside math-verify's alarm (5 s) on the batch, fast alone
        if len(completions) > 1:
            mv_timeout(5)(time.sleep)(1)
            calls.append("finished")  # never: the call is stopped, not left running in a thread
        return [1.0] * len(completions)

    started = time.monotonic()
    with pytest.raises(RewardError, match=r"'stuck' did not return within reward_timeout_s=0.3 s on the batch of 2 "
                                         r"samples, but on no sample alone; raise reward_timeout_s"):
        score_completions([stuck], None, ["p", "q"], ["a", "b"], {}, timeout_s=0.3)
    assert time.monotonic() - started < 2
    assert signal.alarm(0) == 0 and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL  # no alarm left armed
    time.sleep(1.2)
    assert calls == []


def _in_a_thread(fn):
    """`fn()` called from a thread that is not the main one: (its result, or the exception it raised)."""
    box = {}

    def run():
        try:
            box["out"] = fn()
        except Exception as err:
            box["out"] = err

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(60)
    return box["out"]


def test_off_the_main_thread_rewards_run_in_a_thread_of_their_own_and_signal_users_are_told_why_they_fail():
    prompts, chat = chat_batch()
    err = _in_a_thread(lambda: score_completions([accuracy_reward], None, prompts, COMPLETIONS,
                                                 {"solution": SOLUTIONS}, chat=chat, timeout_s=30))
    assert isinstance(err, RewardError)
    assert re.search(r"'accuracy_reward' raised ValueError: Math-Verify 'parse' function doesn't support threaded "
                     r"environment.* on sample 0 .*; it sets signal handlers \(math-verify's timeouts do\), which "
                     r"Python allows on the main thread only: score from the main thread", str(err)), str(err)
    # gspo's own math reward turns math-verify's alarms off there: reward_timeout_s alone bounds it
    out = _in_a_thread(lambda: score_completions([get_reward_fn("math")], None, ["q", "q"], ["$\\frac{1}{2}$", "2"],
                                                 {"answer": ["0.5", "3"]}, timeout_s=30))
    assert out[1]["math"].tolist() == [1.0, 0.0]
    # a hung call is abandoned in its thread (the old way), the error says so
    seen = []

    def hangs(prompts, completions, **_):
        seen.append(threading.current_thread().name)
        time.sleep(3)

    started = time.monotonic()
    err = _in_a_thread(lambda: score_completions([hangs], None, ["p"], ["c"], {}, timeout_s=0.2))
    assert re.search(r"'hangs' did not return within reward_timeout_s=0.2 s on sample 0 .* \(a call that timed out "
                     r"in a thread of its own is abandoned", str(err)), str(err)
    assert time.monotonic() - started < 2 and seen[0] == "gspo-reward-hangs"


def test_the_deadline_signal_taken_by_someone_else_means_a_thread_of_its_own():
    seen = []
    previous = signal.signal(DEADLINE_SIGNAL, lambda signum, frame: None)
    try:
        score_completions([lambda p, c, **_: seen.append(threading.current_thread()) or [0.0]], None, ["p"], ["c"],
                          {}, timeout_s=5)
    finally:
        signal.signal(DEADLINE_SIGNAL, previous)
    assert seen[0] is not threading.main_thread() and seen[0].name.startswith("gspo-reward-")


# ------------------------------------------------------------------------------- eval/accuracy by one reward

def test_success_is_decided_by_one_reward_the_first_by_default():
    names = reward_names([accuracy_reward, format_reward, tag_count_reward, len_reward])
    assert success_rule(EvalSettings(), names, None) == ("accuracy_reward", 1.0)
    assert success_rule(EvalSettings(eval_accuracy_reward="format_reward", eval_success_threshold=0.5), names,
                        None) == ("format_reward", 0.5)
    # the weighted total: full marks are 4, which the length reward (at most 0.5) never allows
    assert success_rule(EvalSettings(eval_accuracy_reward=TOTAL), names, None) == (TOTAL, 4.0)
    assert success_rule(EvalSettings(eval_accuracy_reward=TOTAL), names, [1.0, 0.5, 0.5, -1.0]) == (TOTAL, 2.0)
    with pytest.raises(ValueError, match=r"eval_accuracy_reward='accuracy' names none of the reward functions "
                                         r"evaluated \(accuracy_reward, format_reward, tag_count_reward, len_reward\)"):
        success_rule(EvalSettings(eval_accuracy_reward="accuracy"), names, None)
    assert reward_names([format_reward, accuracy_reward, format_reward]) == ["format_reward", "accuracy_reward",
                                                                            "format_reward_2"]
    with pytest.raises(ValueError, match=r"eval_accuracy_reward='  ' must be a reward function's name"):
        make_config(TrainConfig, {"eval_accuracy_reward": "  "})
