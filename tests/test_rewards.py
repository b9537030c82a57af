import math
import sys
import textwrap
import threading
import time

import pytest
import torch

from gspo.checkpoint import saved_config
from gspo.config import TrainConfig, make_config
from gspo.data.mixture import saved_tasks
from gspo.data.rewards import (
    RewardError,
    RewardModelReward,
    _extract_answer,
    answer_match,
    format_reward,
    get_reward_fn,
    last_number,
    make_regex_reward,
    reward_options,
    reward_spec,
    score_completions,
)

# ---- answer extraction and answer_match ----------------------------------------------------

def test_extract_answer():
    assert _extract_answer("so 3+4 = 7\n#### 7") == "7"
    assert _extract_answer("#### 1\nwait\n####  12 \nthe end") == "12"  # last marker, cut at newline
    assert _extract_answer("####\n5") == "5"  # whitespace (even a newline) after the marker is skipped
    assert _extract_answer("no marker: 7") is None
    assert _extract_answer("empty ####   ") is None


def test_answer_match_cases():
    completions = [
        "3 + 4 = 7\n#### 7",  # right
        "#### 8",  # wrong
        "the answer is 7",  # no marker
        "#### 932.0",  # numerically equal to "932"
        "#### 7\nno, actually\n#### 9",  # the last marker wins: 9
        "#### 1,000",  # thousands separator
        "#### abc ",  # exact string after stripping
        "#### 7",  # expected answer is None: no opinion
    ]
    answers = ["7", "7", "7", "932", "9", 1000, "abc", None]
    assert answer_match([""] * 8, completions, answer=answers) == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, None]
    # the earlier marker's 7 does not count once a later marker exists
    assert answer_match(["p"], ["#### 7\n#### 9"], answer=["7"]) == [0.0]
    # "nan"/"inf" never compare equal as numbers
    assert answer_match(["p"], ["#### inf"], answer=["infinity"]) == [0.0]


def test_answer_match_length_mismatch():
    with pytest.raises(ValueError, match="answer has 1 entries, expected 2"):
        answer_match(["a", "b"], ["#### 1", "#### 2"], answer=["1"])


# ---- format and regex rewards --------------------------------------------------------------

def test_format_reward():
    completions = [
        "work\n#### 42",
        "#### -3.5  \n",  # trailing whitespace is allowed
        "#### 1,234",
        "#### 42 then more text",  # does not END with the answer
        "#### forty-two",
        "42",
        "work\n#### 4\nmore\n#### 5",
    ]
    assert format_reward(["p"] * 7, completions) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert format_reward.__name__ == "format"


def test_make_regex_reward_full_match_semantics():
    fn = make_regex_reward(r"<think>.*</think>\s*\d+", "think_format")
    assert fn.__name__ == "think_format"
    # full match: a match in the middle is not enough; "." does not cross newlines without (?s)
    texts = ["<think>hm</think> 12", "x<think>hm</think> 12", "<think>a\nb</think>1", "<think></think>"]
    assert fn(["p"] * 4, texts) == [1.0, 0.0, 0.0, 0.0]
    dotall = make_regex_reward(r"(?s)<think>.*</think>\s*\d+", "think_dotall")
    assert dotall(["p"], ["<think>a\nb</think>1"]) == [1.0]
    with pytest.raises(ValueError, match="pattern"):
        make_regex_reward("(", "broken")
    with pytest.raises(ValueError, match="name"):
        make_regex_reward("a", "")


# ---- score_completions ---------------------------------------------------------------------

def _const(name, values):
    def fn(prompts, completions, **_):
        return list(values)

    fn.__name__ = name
    return fn


def test_weighted_scoring_with_none():
    a = _const("a", [1.0, None, 0.5, None])
    b = _const("b", [2.0, 3.0, None, None])
    total, raw = score_completions([a, b], [0.5, 2.0], ["p"] * 4, ["c"] * 4, {})
    # sample 0: 0.5*1 + 2*2 = 4.5; sample 1: only b: 2*3 = 6; sample 2: only a: 0.5*0.5 = 0.25;
    # sample 3: nobody had an opinion: 0.0
    assert total.dtype == torch.float32
    assert total.tolist() == [4.5, 6.0, 0.25, 0.0]
    assert list(raw) == ["a", "b"]
    assert raw["a"][[0, 2]].tolist() == [1.0, 0.5] and raw["a"][[1, 3]].isnan().all()
    assert raw["b"][:2].tolist() == [2.0, 3.0] and raw["b"][2:].isnan().all()


def test_scoring_passes_columns_and_defaults_weights_and_dedups_names():
    seen = {}

    def uses_columns(prompts, completions, answer, level, **_):
        seen.update(answer=answer, level=level)
        return [float(lv) for lv in level]

    dup = _const("uses_columns", [10.0, 20.0])
    columns = {"answer": ["1", "2"], "level": [1, 2]}
    total, raw = score_completions([uses_columns, dup, answer_match], None, ["p", "q"], ["#### 1", "#### 3"], columns)
    assert seen == {"answer": ["1", "2"], "level": [1, 2]}
    assert list(raw) == ["uses_columns", "uses_columns_2", "answer_match"]
    # weights default to 1: [1 + 10 + 1, 2 + 20 + 0]
    assert total.tolist() == [12.0, 22.0]


def test_score_completions_errors():
    prompts, completions = ["What is 2+2? " * 40, "q"], ["x" * 500, "y"]

    def boom(prompts, completions, **_):
        raise KeyError("missing column")

    with pytest.raises(RewardError, match="reward function 'boom' raised KeyError") as info:
        score_completions([boom], None, prompts, completions, {})
    msg = str(info.value)
    assert "What is 2+2?" in msg and "xxxx" in msg and "x" * 300 not in msg  # first sample, truncated

    with pytest.raises(ValueError, match=r"'short' returned 1 values, expected 2"):
        score_completions([_const("short", [1.0])], None, prompts, completions, {})
    with pytest.raises(ValueError, match=r"'as_tensor' must return a list of 2 values, got Tensor"):
        score_completions([_const_obj("as_tensor", torch.ones(2))], None, prompts, completions, {})
    with pytest.raises(ValueError, match=r"'nan_fn' returned non-finite nan at sample 1"):
        score_completions([_const("nan_fn", [0.0, math.nan])], None, prompts, completions, {})
    with pytest.raises(ValueError, match=r"'inf_fn' returned non-finite inf at sample 0"):
        score_completions([_const("inf_fn", [math.inf, 0.0])], None, prompts, completions, {})
    with pytest.raises(ValueError, match=r"'str_fn' returned str at sample 0"):
        score_completions([_const("str_fn", ["1", 0.0])], None, prompts, completions, {})
    with pytest.raises(ValueError, match="weights has 1 entries but there are 2 reward functions"):
        score_completions([_const("a", [1, 1]), _const("b", [1, 1])], [1.0], prompts, completions, {})
    with pytest.raises(ValueError, match="column 'answer' has 1 entries, expected 2"):
        score_completions([_const("a", [1, 1])], None, prompts, completions, {"answer": ["1"]})


def test_bad_reward_names_the_offending_sample_or_drops_it():
    prompts, completions = ["p0", "p1", "p2"], ["fine", "BAD", "fine too"]

    def picky(prompts, completions, **_):
        if "BAD" in completions:
            raise ValueError("cannot parse")
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match=r"'picky' raised ValueError: cannot parse on sample 1 \(prompt='p1', "
                                         r"completion='BAD'\); fix the function, or set drop_bad_rewards=true"):
        score_completions([picky], None, prompts, completions, {})
    total, raw = score_completions([picky, _const("half", [0.5, 0.5, math.inf])], None, prompts, completions, {},
                                   drop_bad=True)
    # sample 1: picky raised; sample 2: half returned inf -> both dropped (NaN); sample 0: 1.0 + 0.5
    assert total[0].item() == 1.5 and torch.isnan(total[1:]).all()
    assert raw["picky"].tolist()[0] == 1.0 and math.isnan(raw["picky"][1])

    def always(prompts, completions, **_):
        raise OSError("disk gone")

    with pytest.raises(RewardError, match=r"'always' raised OSError: disk gone on the batch of 3 samples, and on every "
                                         r"one of the 3 samples alone .*a bug in the function rather than bad samples"):
        score_completions([always], None, prompts, completions, {}, drop_bad=True)  # nothing left to keep

    def only_in_batches(prompts, completions, **_):
        if len(completions) > 1:
            raise MemoryError("batch too big")
        return [1.0]

    with pytest.raises(RewardError, match=r"raised MemoryError: batch too big on the batch of 3 samples, but on no "
                                         r"sample alone"):
        score_completions([only_in_batches], None, prompts, completions, {}, drop_bad=True)


def _sleeps_on(marker: str, seconds: float):
    def sleepy(prompts, completions, **_):
        if any(marker in c for c in completions):
            time.sleep(seconds)
        return [1.0] * len(completions)

    return sleepy


def test_a_reward_that_hangs_is_abandoned_after_the_timeout():
    prompts, completions = ["p0", "p1", "p2", "p3"], ["ok", "HANG", "ok", "HANG too"]
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"'sleepy' did not return within reward_timeout_s=0.2 s on sample 0 "):
        score_completions([_sleeps_on("HANG", 30)], None, ["p"], ["HANG"], {}, timeout_s=0.2)
    one = time.monotonic() - start  # one sample: a timeout for the batch, one for its probe
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"'sleepy' did not return within reward_timeout_s=0.2 s on sample 0 "):
        score_completions([_sleeps_on("HANG", 30)], None, prompts, [f"HANG {i}" for i in range(4)], {}, timeout_s=0.2)
    # four that hang: still one timeout for the batch and one for the per-sample probes (run at once), as long as
    # one sample's, measured just before on the same machine (a timeout per probe: 2.5x that, 5 timeouts)
    assert time.monotonic() - start < 1.8 * one, (time.monotonic() - start, one)
    with pytest.raises(RewardError, match=r"'sleepy' did not return within reward_timeout_s=0.2 s on sample 1 "
                                         r"\(prompt='p1', completion='HANG'\)"):
        score_completions([_sleeps_on("HANG", 30)], None, prompts, completions, {}, timeout_s=0.2)
    total, raw = score_completions([_sleeps_on("HANG", 30)], None, prompts, completions, {}, timeout_s=0.2,
                                   drop_bad=True)
    assert total[[0, 2]].tolist() == [1.0, 1.0] and total[[1, 3]].isnan().all()  # the hanging samples dropped
    # slow on the batch, fast on every sample: raise the limit, says the error
    with pytest.raises(RewardError, match=r"did not return within .* on the batch of 4 samples, but on no sample "
                                         r"alone; raise reward_timeout_s"):
        score_completions([_slow_batches], None, prompts, completions, {}, timeout_s=0.3, drop_bad=True)
    # with a limit or without, the call runs in this thread, the main one (rewards that use signals work)
    seen = []
    for timeout in (0, 5):
        score_completions([lambda p, c, **_: seen.append(threading.current_thread()) or [0.0] * 4], None, prompts,
                          completions, {}, timeout_s=timeout)
    assert seen == [threading.main_thread()] * 2


@pytest.mark.parametrize("thread_ran", [False, True])
def test_a_stop_signal_inside_the_deadline_watchdog_start_comes_through_as_itself(monkeypatch, thread_ran):
    # SIGTERM's handler (StopSignals, abandonable) raises wherever the main thread is, Thread.start()'s wait for the
    # new thread included: before that thread ran, or after. The clean-up neither fails ("cannot join thread before
    # it is started", which hid the stop from a Ray-launched rank) nor leaves the deadline signal's handler behind.
    import signal

    from gspo.data.reward_timeout import DEADLINE_SIGNAL
    from gspo.runtime import StepAbandoned

    real_start = threading.Thread.start

    def start(thread):
        if thread.name != "gspo-reward-deadline":
            return real_start(thread)
        if thread_ran:
            real_start(thread)
        raise StepAbandoned(signal.SIGTERM)

    monkeypatch.setattr(threading.Thread, "start", start)
    calls = []
    with pytest.raises(StepAbandoned):
        score_completions([lambda p, c, **_: calls.append(c) or [0.0]], None, ["p"], ["c"], {}, timeout_s=5)
    assert calls == [] and signal.getsignal(DEADLINE_SIGNAL) == signal.SIG_DFL


def test_a_stop_signal_right_after_the_gil_watchdog_is_armed_still_disarms_it(monkeypatch):
    # faulthandler's C watchdog ends the process at its deadline: armed and left so by a stop signal's exception
    # (raised as the arming call returns), it would kill the run while it saves its checkpoint.
    import faulthandler
    import signal

    from gspo.data import reward_timeout
    from gspo.runtime import StepAbandoned

    calls = []

    def arm(*args, **kwargs):
        calls.append("armed")
        raise StepAbandoned(signal.SIGTERM)

    monkeypatch.setattr(faulthandler, "dump_traceback_later", arm)
    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", lambda: calls.append("disarmed"))
    with pytest.raises(StepAbandoned):
        with reward_timeout.gil_watchdog(5.0):
            calls.append("body")
    assert calls == ["armed", "disarmed"]


def _slow_batches(prompts, completions, **_):
    time.sleep(0.6 if len(completions) > 1 else 0)
    return [0.5] * len(completions)


@pytest.mark.parametrize("error, shown", [(SystemExit(0), "SystemExit: 0"), (SystemExit(7), "SystemExit: 7"),
                                          (KeyboardInterrupt(), "KeyboardInterrupt"),
                                          (GeneratorExit(), "GeneratorExit")])
def test_exiting_from_a_reward_is_an_error_never_a_dropped_sample(error, shown):
    def leaves(prompts, completions, **_):
        raise error

    for drop_bad in (False, True):
        with pytest.raises(RewardError, match=rf"'leaves' raised {shown} on the batch of 2 samples: a reward function "
                                             r"must return its values, not exit or interrupt the run"):
            score_completions([leaves], None, ["p", "q"], ["a", "b"], {}, drop_bad=drop_bad, timeout_s=5)


def test_rewards_get_copies_of_their_inputs():
    prompts, completions, columns = ["p", "q"], ["a", "b"], {"answer": [["1"], ["2"]]}

    def vandal(prompts, completions, answer, **_):
        prompts[0], completions[:] = "X", []
        answer[0].append("X")
        return [1.0, 1.0]

    for timeout in (0, 5):
        score_completions([vandal], None, prompts, completions, columns, timeout_s=timeout)
        assert (prompts, completions, columns) == (["p", "q"], ["a", "b"], {"answer": [["1"], ["2"]]})


def _const_obj(name, obj):
    def fn(prompts, completions, **_):
        return obj

    fn.__name__ = name
    return fn


# ---- get_reward_fn -------------------------------------------------------------------------

def test_get_reward_fn_builtins_and_user_module(tmp_path, monkeypatch):
    assert get_reward_fn("answer_match") is answer_match
    assert get_reward_fn("format") is format_reward
    (tmp_path / "my_rewards_mod.py").write_text(
        textwrap.dedent(
            """
            def length_penalty(prompts, completions, **_):
                return [-len(c) / 10 for c in completions]
            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards_mod", raising=False)
    fn = get_reward_fn("my_rewards_mod:length_penalty")
    assert fn(["p", "p"], ["abcde", ""]) == [-0.5, 0.0]
    total, raw = score_completions([fn, answer_match], [2.0, 1.0], ["p"], ["#### 4"], {"answer": ["4"]})
    assert list(raw) == ["length_penalty", "answer_match"]
    assert total.tolist() == [pytest.approx(2 * -0.6 + 1.0)]
    with pytest.raises(ValueError, match="no attribute 'missing'"):
        get_reward_fn("my_rewards_mod:missing")
    with pytest.raises(ValueError, match="not callable"):
        get_reward_fn("my_rewards_mod:NOT_CALLABLE")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        get_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ValueError, match=r"unknown reward .acc.*answer_match, code_tests, environment, format"):
        get_reward_fn("acc")


def test_reward_module_in_the_current_directory_imports_as_python_m_would(tmp_path, monkeypatch):
    # The `gspo` script's sys.path has its own folder, not the working directory (as `python -m` would):
    # `reward_funcs: [my_rewards:fn]` next to the config must still import, with its sibling modules.
    (tmp_path / "gspo_test_cwd_helper.py").write_text("SCALE = 0.5\n")
    (tmp_path / "gspo_test_cwd_rewards.py").write_text(textwrap.dedent("""
        from gspo_test_cwd_helper import SCALE
        def half_length(prompts, completions, **_):
            return [SCALE * len(c) for c in completions]
        """))
    here = {"", ".", str(tmp_path)}
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in here])  # restored afterwards
    monkeypatch.chdir(tmp_path)
    for name in ("gspo_test_cwd_rewards", "gspo_test_cwd_helper"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        fn = get_reward_fn("gspo_test_cwd_rewards:half_length")
        assert fn(["p", "p"], ["abcd", "ab"]) == [2.0, 1.0]
    finally:
        for name in ("gspo_test_cwd_rewards", "gspo_test_cwd_helper"):
            sys.modules.pop(name, None)
    with pytest.raises(ValueError, match="cannot import module 'gspo_test_cwd_absent'"):
        get_reward_fn("gspo_test_cwd_absent:f")


def test_reward_from_a_file_path(tmp_path, monkeypatch):
    folder = tmp_path / "rewards"
    folder.mkdir()
    (folder / "gspo_test_file_rewards.py").write_text(
        "def shout(prompts, completions, **_):\n    return [float(c.isupper()) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the file's folder joins it
    try:
        fn = get_reward_fn("rewards/gspo_test_file_rewards.py:shout")  # relative to the working directory
        assert fn(["p", "p"], ["ABC", "abc"]) == [1.0, 0.0]
        assert get_reward_fn(f"{folder}/gspo_test_file_rewards.py:shout") is fn  # the same file: the same module
    finally:
        sys.modules.pop("gspo_test_file_rewards", None)
    with pytest.raises(ValueError, match=r"reward 'rewards/none\.py:f': file rewards/none\.py not found"):
        get_reward_fn("rewards/none.py:f")
    with pytest.raises(ValueError, match="has no attribute 'whisper'"):
        get_reward_fn("rewards/gspo_test_file_rewards.py:whisper")
    sys.modules.pop("gspo_test_file_rewards", None)


# ---- RewardModelReward ---------------------------------------------------------------------

def _char_tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz0123456789 #+=?.\n"
    vocab = {"<eos>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per char
    # No pad token on purpose: RewardModelReward must fall back to eos.
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>"), len(vocab)


def _tiny_classifier(vocab_size, num_labels=1):
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, num_labels=num_labels,
    )
    return Qwen3ForSequenceClassification(cfg).eval()


def test_reward_model_reward_from_path(tmp_path):
    tokenizer, vocab_size = _char_tokenizer()
    model = _tiny_classifier(vocab_size)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    rm = RewardModelReward(str(tmp_path), batch_size=2)  # 3 texts of different lengths: padding in batch 1
    assert rm.__name__ == "reward_model"
    assert rm.tokenizer.pad_token == "<eos>" and rm.model.config.pad_token_id == 0
    prompts = ["what is 2+2? ", "q ", "what is 10+5? "]
    completions = ["#### 4", "a much longer answer #### 7", "15"]
    scores = rm(prompts, completions)
    assert len(scores) == 3 and all(isinstance(s, float) and math.isfinite(s) for s in scores)

    # Each score equals a direct, unpadded forward of the same model on the same text.
    for p, c, s in zip(prompts, completions, scores):
        ids = torch.tensor([tokenizer(p + c)["input_ids"]])  # (1, L)
        with torch.no_grad():
            expected = model(input_ids=ids).logits[0, 0].item()
        assert s == pytest.approx(expected, abs=1e-5)
    assert len({round(s, 6) for s in scores}) == 3  # different texts, different scores

    total, raw = score_completions([rm], None, prompts, completions, {})
    assert list(raw) == ["reward_model"]
    torch.testing.assert_close(total, torch.tensor(scores), atol=1e-6, rtol=0)


def test_reward_model_loads_in_the_configured_dtype_and_device(tmp_path):
    tokenizer, vocab_size = _char_tokenizer()
    model = _tiny_classifier(vocab_size)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    cfg = make_config(TrainConfig, {"task": "add3", "reward_funcs": [f"rm:{tmp_path}"],
                                    "reward_model_dtype": "bfloat16", "reward_model_device": "cpu"})
    rm = get_reward_fn(cfg.reward_funcs[0], **reward_options(cfg))
    assert {p.dtype for p in rm.model.parameters()} == {torch.bfloat16} and rm.device == torch.device("cpu")
    text = ["what is 2+2? #### 4"]
    ids = torch.tensor([tokenizer(text[0])["input_ids"]])  # (1, L)
    with torch.no_grad():
        expected = model.to(torch.bfloat16)(input_ids=ids).logits[0, 0].float().item()
    assert rm([""], text) == [expected]  # the bf16 model's own score, returned as a float
    assert get_reward_fn(f"rm:{tmp_path}").model.dtype == torch.float32  # the default stays float32
    with pytest.raises(ValueError, match="reward_model_dtype='int8' is not one of"):
        make_config(TrainConfig, {"task": "add3", "reward_model_dtype": "int8"})
    with pytest.raises(ValueError, match="reward_model_device='gpu' is not one of auto, cpu"):
        make_config(TrainConfig, {"task": "add3", "reward_model_device": "gpu"})
    with pytest.raises(ValueError, match="dtype must be one of"):
        RewardModelReward(str(tmp_path), dtype="half")


def test_reward_model_reward_rejects_bad_setup():
    tokenizer, vocab_size = _char_tokenizer()
    with pytest.raises(ValueError, match="num_labels == 1, got num_labels=2"):
        RewardModelReward(_tiny_classifier(vocab_size, num_labels=2), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="tokenizer is required"):
        RewardModelReward(_tiny_classifier(vocab_size))
    with pytest.raises(ValueError, match="batch_size"):
        RewardModelReward(_tiny_classifier(vocab_size), tokenizer=tokenizer, batch_size=0)


def test_reward_spec_is_the_import_path_get_reward_fn_reads_back():
    class Scorer:
        def __call__(self, prompts, completions, **_):
            return [0.0] * len(completions)

    assert reward_spec("answer_match") == "answer_match"
    assert reward_spec(answer_match) == "gspo.data.rewards:answer_match"
    assert get_reward_fn(reward_spec(answer_match)) is answer_match
    # an instance is named by its class, as an object no import path gives back (refused when read back alone)
    assert reward_spec(Scorer()) == f"object:{__name__}:{Scorer.__qualname__}(...)"
    cfg = make_config(TrainConfig, {"reward_funcs": ["format", answer_match],
                                    "tasks": [{"task": "add3", "reward_funcs": [answer_match]}]})
    saved = saved_config(cfg)
    assert saved["reward_funcs"] == ["format", "gspo.data.rewards:answer_match"]
    assert saved["tasks"] == saved_tasks(cfg.tasks) == [
        {"task": "add3", "reward_funcs": ["gspo.data.rewards:answer_match"]}]


# ---- TRL's reward signature and conversational format --------------------------------------

def test_trl_style_reward_functions_run_unchanged_on_text_and_chat_prompts():
    """Written against TRL's documented signature: keywords `prompts`, `completions`, `completion_ids` and
    every dataset column, `**kwargs` for the rest; with chat prompts, completions are lists of one
    assistant message."""
    calls = {}

    def reward_len(completions, **kwargs):  # TRL docs' first example: only completions, the rest in kwargs
        calls["len"] = sorted(kwargs)
        return [-abs(3 - len(c)) for c in completions]

    def format_reward_func(completions, **kwargs):  # the conversational form: c[0]["content"]
        return [float(c[0]["content"].startswith("#")) for c in completions]

    def with_ids(prompts, completions, completion_ids, ground_truth, **kwargs):
        calls["ids"] = completion_ids
        return [float(len(ids) == len(str(g))) for ids, g in zip(completion_ids, ground_truth)]

    def only_kwargs(**kwargs):
        calls["kw"] = sorted(kwargs)
        return [0.0] * len(kwargs["completions"])

    prompts, completions = ["1+1=", "2+2="], ["#2", "4"]
    columns, ids = {"ground_truth": ["#2", "44"]}, [[5, 6], [7]]
    total, raw = score_completions([reward_len, with_ids, only_kwargs], None, prompts, completions, columns,
                                   completion_ids=ids)
    assert raw["reward_len"].tolist() == [-1.0, -2.0] and raw["with_ids"].tolist() == [1.0, 0.0]
    assert calls["len"] == ["completion_ids", "ground_truth", "prompts"]
    assert calls["kw"] == ["completion_ids", "completions", "ground_truth", "prompts"] and calls["ids"] == ids
    chat = [[{"role": "user", "content": "1+1="}], [{"role": "user", "content": "2+2="}]]
    _, raw = score_completions([format_reward_func, only_kwargs, answer_match], None, prompts, completions,
                               {"answer": ["2", "4"]}, chat=chat)
    assert raw["format_reward_func"].tolist() == [1.0, 0.0]
    # the built-ins read text even in a chat batch (answer_match: no '####' here, so 0)
    assert raw["answer_match"].tolist() == [0.0, 0.0]
    assert calls["kw"] == ["answer", "completions", "prompts"]  # no completion_ids given: none handed on
    seen = {}
    score_completions([lambda p, c, **_: seen.update(p=p, c=c) or [0.0, 0.0]], None, prompts, completions, {},
                      chat=chat)
    assert seen == {"p": chat, "c": [[{"role": "assistant", "content": "#2"}], [{"role": "assistant", "content": "4"}]]}


def test_reward_call_arguments_that_clash_or_do_not_fit_are_named():
    with pytest.raises(ValueError, match=r"column\(s\) \['completions'\] clash with the reward call's own"):
        score_completions([answer_match], None, ["p"], ["c"], {"completions": ["x"]})
    with pytest.raises(ValueError, match="completion_ids has 1 entries, expected 2"):
        score_completions([answer_match], None, ["p", "q"], ["c", "d"], {"answer": ["1", "2"]}, completion_ids=[[1]])
    with pytest.raises(ValueError, match="chat has 1 entries, expected 2"):
        score_completions([answer_match], None, ["p", "q"], ["c", "d"], {"answer": ["1", "2"]}, chat=[[]])


# ---- math (math-verify) --------------------------------------------------------------------

def test_math_reward_reads_latex_boxed_fractions_sets_and_units():
    pytest.importorskip("math_verify")
    from gspo.data.rewards import math_reward

    cases = [("The answer is $\\boxed{\\frac{1}{2}}$", "1/2", 1.0),  # LaTeX in a box vs a plain fraction
             ("so it is 0.5", "1/2", 1.0),  # a decimal equals the fraction
             ("$\\frac{2}{4}$", "0.5", 1.0),  # unreduced
             ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),  # a LaTeX gold without $...$
             ("The length is $12\\text{ cm}$", "12", 1.0),  # units stripped
             ("The answer is $\\{1,2\\}$", "\\{2,1\\}", 1.0),  # sets, any order
             ("#### 932", "932", 1.0),
             ("\\boxed{3}", "4", 0.0), ("no answer here", "7", 0.0), ("it is 1/3", "0.5", 0.0)]
    got = math_reward(prompts=[""] * len(cases), completions=[c for c, _, _ in cases], answer=[a for _, a, _ in cases])
    assert got == [want for _, _, want in cases]
    assert math_reward([""], ["anything"], [None]) == [None]
    assert get_reward_fn("math") is math_reward and math_reward.__name__ == "math"
    # under reward_timeout_s on the main thread, as the trainer scores: math-verify's own timers on there too
    total, raw = score_completions([math_reward], None, ["q", "q"], ["$\\frac{1}{2}$", "2"], {"answer": ["0.5", "3"]},
                                   timeout_s=60)
    assert raw["math"].tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="cannot read the gold answer"):
        math_reward([""], ["1"], ["$$"])
    with pytest.raises(ValueError, match="answer has 1 entries, expected 2"):
        math_reward(["", ""], ["1", "2"], ["1"])


def test_math_reward_without_math_verify_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify now raises ImportError
    with pytest.raises(ValueError, match=r"math reward needs math-verify: pip install 'gspo\[math\]'"):
        get_reward_fn("math")


def test_last_number_reads_the_last_integer_of_a_worded_answer():
    completions = ["The sum is 12.", "12", "3+9 = 12, no wait, 13", "twelve", "-4 then 12", "x" + "9" * 5000, "12"]
    answers = ["12", 12, "12", "12", "12", "12", "n/a"]
    assert last_number([""] * 7, completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, None]
    assert last_number([""], ["it is -7"], answer=["-7"]) == [1.0]
    assert get_reward_fn("last_number") is last_number
