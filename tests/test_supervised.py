"""The supervised NLL of reference completions: one encoding for `gspo sft` and the RL run's sft_coef term."""

import math
from types import SimpleNamespace

import pytest
import torch

from gspo.algo.logprobs import completion_logprobs
from gspo.models import load_model
from gspo.plugs.supervised import (
    collate,
    encode_pairs,
    reference_chunks,
    reference_ids,
    require_references,
    sft_backward,
    sft_coef_at,
    sft_nll,
)
from gspo.rollout import pad_id
from gspo.tasks import build_char_tokenizer, get_task
from tests.test_trainer import SMALL


# ------------------------------------------------------------------------------- one encoding
def test_pad_id_is_the_pad_token_else_the_first_stop_token():
    assert pad_id(SimpleNamespace(pad_token_id=3, eos_token_id=7)) == 3
    no_pad = SimpleNamespace(pad_token_id=None, eos_token_id=7)
    assert pad_id(no_pad) == 7  # no model: the tokenizer's eos
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[9, 10]))
    assert pad_id(no_pad, model) == 9  # the model's first stop token wins over the tokenizer's
    with pytest.raises(ValueError, match="no eos token"):
        pad_id(SimpleNamespace(pad_token_id=None, eos_token_id=None))


def test_reference_ids_end_with_eos_and_add_no_special_tokens():
    tok = build_char_tokenizer()
    assert reference_ids(tok, "12") == [tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("2"),
                                        tok.eos_token_id]


def test_collate_right_pads_and_labels_only_the_answer():
    # (ids, answer start): [1, 2 | 3] and [| 4]
    ids, mask, labels = collate([([1, 2, 3], 2), ([4], 0)], pad=0)
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert labels.tolist() == [[-100, -100, 3], [4, -100, -100]]


def test_sft_and_the_rl_term_encode_a_reference_alike_and_agree_on_its_nll():
    """`gspo sft`'s pairs and the RL term's rollout-layout chunks hold the same prompt and reference tokens,
    and the model's `labels` loss on the one equals `sft_nll` on the other (different layouts: to rounding)."""
    tok = build_char_tokenizer()
    rows = get_task("add3").dataset("train", n=5, seed=0)
    pairs = encode_pairs(tok, rows, "solution", 512)
    (ref,) = reference_chunks(rows, tok, 1, "solution", max_prompt_length=512, device="cpu")
    P = ref.input_ids.shape[1] - ref.completion_len
    for i, (seq, start) in enumerate(pairs):
        assert seq[:start] == ref.input_ids[i, :P][ref.attention_mask[i, :P].bool()].tolist()
        assert seq[start:] == ref.input_ids[i, P:][ref.completion_mask[i]].tolist()
        assert seq[start:] == reference_ids(tok, rows[i]["solution"])
    model, _ = load_model("tiny-dense", overrides=SMALL)
    ids, mask, labels = collate(pairs, pad_id(tok))
    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        logp, _ = completion_logprobs(model, ref.input_ids, ref.attention_mask, ref.completion_len)
    assert sft_nll(logp, ref.completion_mask).item() == pytest.approx(hf.item(), rel=1e-5)
    with pytest.raises(ValueError, match="no text column 'worked'"):
        encode_pairs(tok, rows, "worked", 512)
    with pytest.raises(ValueError, match="max_length=4"):
        encode_pairs(tok, rows, "solution", 4)


# ------------------------------------------------------------------------------- the RL run's SFT term
def test_sft_nll_by_hand():
    # Reference token probabilities 1/2, 1/4 (row 0) and 1/8 (row 1); NLL = (ln 2 + ln 4 + ln 8) / 3 = 2 ln 2
    logp = torch.tensor([[0.5, 0.25, 1.0], [0.125, 1.0, 1.0]]).log()
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert sft_nll(logp, mask).item() == pytest.approx(2 * math.log(2))
    logp[1, 2] = -math.inf  # a masked slot never leaks in, not even as NaN
    assert sft_nll(logp, mask).item() == pytest.approx(2 * math.log(2))
    with pytest.raises(ValueError, match="no reference token"):
        sft_nll(logp, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="same shape"):
        sft_nll(logp, mask[:, :2])


class FixedLogits(torch.nn.Module):
    """Every position predicts softmax(bias): a model whose NLL is known in closed form."""

    def __init__(self, bias: torch.Tensor):
        super().__init__()
        self.bias = torch.nn.Parameter(bias.clone())

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        return SimpleNamespace(logits=self.bias.expand(*input_ids.shape, -1))  # (n, L, V)


def test_sft_term_equals_the_nll_by_hand_and_is_zero_at_coef_zero():
    tok = build_char_tokenizer()
    V, one, eos = len(tok), tok.convert_tokens_to_ids("1"), tok.eos_token_id
    bias = torch.zeros(V)
    bias[one] = math.log(3)  # p("1") = 3 / (V + 2), every other token 1 / (V + 2)
    rows = [{"prompt": "1+10=", "solution": "11"}, {"prompt": "2+2=", "solution": "1"}, {"prompt": "3+3="}]
    (ref,) = reference_chunks(rows, tok, 1, "solution", max_prompt_length=32, device="cpu")
    # Targets: "1", "1", <eos> and "1", <eos> (the row without a solution is skipped):
    # NLL = (3 ln((V + 2) / 3) + 2 ln(V + 2)) / 5
    expected = (3 * math.log((V + 2) / 3) + 2 * math.log(V + 2)) / 5
    model = FixedLogits(bias)
    term, nll = sft_backward(model, ref, 0.5)
    assert nll.item() == pytest.approx(expected, rel=1e-6) and term.item() == pytest.approx(0.5 * expected, rel=1e-6)
    # d NLL / d bias = softmax(bias) - (frequency of each token among the targets): 3/5 "1", 2/5 <eos>
    p = torch.softmax(bias, 0)
    freq = torch.zeros(V)
    freq[one], freq[eos] = 0.6, 0.4
    assert torch.allclose(model.bias.grad, 0.5 * (p - freq), atol=1e-7)
    zero_model = FixedLogits(bias)
    term, nll = sft_backward(zero_model, ref, 0.0)
    assert term.item() == 0.0 and nll.item() == pytest.approx(expected, rel=1e-6)
    assert torch.count_nonzero(zero_model.bias.grad) == 0
    # Parts: part j has references j, j + M, ...; with fewer references than parts, reference j mod n.
    parts = reference_chunks(rows, tok, 3, "solution", max_prompt_length=32, device="cpu")
    assert [part.completions for part in parts] == [["11"], ["1"], ["11"]]
    assert parts[1].completion_mask.tolist() == [[True, True]]  # trimmed to its own length: "1" + <eos>
    assert reference_chunks(rows[2:], tok, 2, "solution", max_prompt_length=32, device="cpu") is None
    with pytest.raises(ValueError, match="no training row has a text column 'solution'"):
        require_references([rows[2:]], "solution")


def test_sft_coef_schedules_by_hand():
    assert [sft_coef_at(s, 4, 0.5, "constant") for s in (1, 2, 3, 4)] == [0.5] * 4
    assert [sft_coef_at(s, 4, 0.5, "linear") for s in (1, 2, 3, 4)] == [0.5, 0.375, 0.25, 0.125]
    # cosine: 0.5 * (1 + cos(pi * (s - 1) / 4)) / 2 -> 0.5, 0.4268, 0.25, 0.0732
    assert [sft_coef_at(s, 4, 0.5, "cosine") for s in (1, 2, 3, 4)] == pytest.approx([0.5, 0.426777, 0.25, 0.073223],
                                                                                     abs=1e-6)
    assert all(sft_coef_at(s, 4, 0.0, kind) == 0.0 for s in (1, 4) for kind in ("constant", "linear", "cosine"))
