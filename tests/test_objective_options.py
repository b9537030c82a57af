"""An objective's own options (issue 48, item 5): declared by its loss's keyword-only parameters, set from a run's
config (`objective_options`, YAML and the command line), checked by name, type and the objective's own check, and
passed through `loss_options` and `policy_loss(options=...)` to the objective; the old keywords still work."""

import math
import warnings

import pytest
import torch

from gspo.algo.objectives import OBJECTIVES, LossInputs, objective_options, policy_loss, registered_objective
from gspo.config import ObjectiveSettings, TrainConfig, load_config, make_config, section
from gspo.step import loss_options

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z))


# Two sequences of one token, pi_old = 1 (log 0): seq 0 r = 1.5, A = +1; seq 1 r = 0.5, A = -1.
# SAPO's term -A f(r), f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos for A > 0, tau_neg for A < 0;
# seq_mean_token_mean over one token each: the mean of the two terms. d/dlogp = -A 4 sig (1 - sig) r / 2.
LOGP, ADV = [[math.log(1.5)], [math.log(0.5)]], [1.0, -1.0]


def sapo_loss(tau_pos: float, tau_neg: float) -> float:
    return (-sigmoid(tau_pos * 0.5) * 4 / tau_pos + sigmoid(tau_neg * -0.5) * 4 / tau_neg) / 2


def test_an_option_set_in_the_config_changes_the_loss_as_derived_by_hand():
    cfg = make_config(TrainConfig, {"objective": "sapo", "objective_options": {"sapo_tau_pos": 2}})
    kwargs = loss_options(section(cfg, ObjectiveSettings), norm_length=8, kl_in_reward=False)
    assert kwargs["options"] == {"sapo_tau_pos": 2.0, "sapo_tau_neg": 1.05}  # every option, the int read as a float
    logp = t(LOGP).requires_grad_()
    loss, _ = policy_loss(logp, torch.zeros(2, 1, dtype=D), t(ADV), torch.ones(2, 1, dtype=D), **kwargs)
    # tau_pos = 2: -sigmoid(1) * 2; tau_neg = 1.05 (its default): +sigmoid(-0.525) * 4 / 1.05
    assert loss.item() == pytest.approx((-2 * sigmoid(1.0) + 4 / 1.05 * sigmoid(-0.525)) / 2, rel=1e-12)
    assert loss.item() == pytest.approx(sapo_loss(2.0, 1.05), rel=1e-12)
    assert loss.item() != pytest.approx(sapo_loss(1.0, 1.05), rel=1e-3)  # the default's value differs
    loss.backward()
    s0, s1 = sigmoid(1.0), sigmoid(-0.525)
    assert torch.allclose(logp.grad, t([[-4 * s0 * (1 - s0) * 1.5 / 2], [4 * s1 * (1 - s1) * 0.5 / 2]]), rtol=1e-12)


def test_defaults_are_unchanged_without_options():
    cfg = make_config(TrainConfig, {"objective": "sapo"})
    assert cfg.objective_options == {}
    kwargs = loss_options(section(cfg, ObjectiveSettings), norm_length=8, kl_in_reward=False)
    assert kwargs["options"] == {"sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05}
    assert loss_options(section(make_config(TrainConfig, {}), ObjectiveSettings), norm_length=8,
                        kl_in_reward=False)["options"] == {}  # gspo has none
    args = (t(LOGP), torch.zeros(2, 1, dtype=D), t(ADV), torch.ones(2, 1, dtype=D))
    plain, _ = policy_loss(*args, objective="sapo")
    assert plain.item() == pytest.approx(sapo_loss(1.0, 1.05), rel=1e-12)
    assert policy_loss(*args, **kwargs)[0].item() == plain.item()  # bitwise
    tokens = t([[-1.0, -3.0], [-2.0, -5.0]]), t([[-1.1, -3.0], [-2.0, -4.8]]), t([1.0, -1.0]), torch.ones(2, 2)
    defaults = policy_loss(*tokens, objective="kl_cov", options=dict(OBJECTIVES["kl_cov"].options))[0]
    assert policy_loss(*tokens, objective="kl_cov")[0].item() == defaults.item()


@pytest.mark.parametrize("values, message", [
    ({"objective": "sapo", "objective_options": {"sapo_tau": 1.2}},
     "config: objective_options: 'sapo_tau' is not an option of objective 'sapo' (its options: sapo_tau_pos, "
     "sapo_tau_neg); did you mean 'sapo_tau_pos'?"),
    ({"objective": "grpo", "objective_options": {"sapo_tau_pos": 1.2}},
     "config: objective_options: 'sapo_tau_pos' is not an option of objective 'grpo' (it has none); it is an "
     "option of sapo"),
    ({"objective": "sapo", "objective_options": {"kl_cov_ratio": 0.1}},
     "'kl_cov_ratio' is not an option of objective 'sapo' (its options: sapo_tau_pos, sapo_tau_neg); it is an "
     "option of kl_cov"),
    ({"objective": "sapo", "objective_options": {"sapo_tau_neg": 0}},
     "config: objective_options: sapo: sapo_tau_pos/sapo_tau_neg: must be > 0, got 1.0, 0.0"),
    ({"objective": "kl_cov", "objective_options": {"kl_cov_ratio": 1.5}},
     "config: objective_options: kl_cov: kl_cov_ratio must be in (0, 1] and kl_cov_coef >= 0; got 1.5, 1.0"),
    ({"objective": "sapo", "objective_options": {"sapo_tau_pos": "high"}},
     "config: objective_options: sapo's sapo_tau_pos='high' has the wrong type: expected float"),
    ({"objective": "sapo", "objective_options": {"sapo_tau_pos": True}},
     "config: objective_options: sapo's sapo_tau_pos=True has the wrong type: expected float"),
    ({"objective": "sapo", "objective_options": {"sapo_tau_pos": float("inf")}},
     "config: objective_options: sapo's sapo_tau_pos=inf must be a finite number"),
    ({"objective": "sapo", "objective_options": [1.2]}, "config: objective_options=[1.2] has the wrong type"),
])
def test_bad_options_are_refused_by_name_when_the_config_is_built(values, message):
    with pytest.raises(ValueError) as err:
        make_config(TrainConfig, values)
    assert message in str(err.value)


def test_options_from_yaml_and_the_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("objective: kl_cov\nobjective_options:\n  kl_cov_ratio: 0.5\n")
    cfg = load_config(TrainConfig, path, ["objective_options={kl_cov_ratio: 0.25, kl_cov_coef: 2}"])
    assert cfg.objective_options == {"kl_cov_ratio": 0.25, "kl_cov_coef": 2}  # the override replaces the mapping
    assert load_config(TrainConfig, path).objective_options == {"kl_cov_ratio": 0.5}
    with pytest.raises(ValueError, match="'kl_cov_ration' is not an option of objective 'kl_cov'.*'kl_cov_ratio'"):
        load_config(TrainConfig, path, ["objective_options={kl_cov_ration: 0.25}"])


def test_policy_loss_refuses_bad_options():
    args = (t(LOGP), torch.zeros(2, 1, dtype=D), t(ADV), torch.ones(2, 1, dtype=D))
    with pytest.raises(ValueError, match="options: 'tau' is not an option of objective 'sapo'"):
        policy_loss(*args, objective="sapo", options={"tau": 2.0})
    with pytest.raises(ValueError, match="options: sapo: sapo_tau_pos/sapo_tau_neg: must be > 0"):
        policy_loss(*args, objective="sapo", options={"sapo_tau_pos": -1.0})
    with pytest.raises(ValueError, match="options: expected a mapping of option names to values, got list"):
        policy_loss(*args, objective="sapo", options=[("sapo_tau_pos", 2.0)])
    assert objective_options("sapo", {"sapo_tau_pos": 2}) == {"sapo_tau_pos": 2.0, "sapo_tau_neg": 1.05}


def test_the_old_keywords_still_work_with_a_deprecation_warning():
    args = (t(LOGP), torch.zeros(2, 1, dtype=D), t(ADV), torch.ones(2, 1, dtype=D))
    with pytest.warns(DeprecationWarning, match=r"policy_loss\(sapo_tau_pos=2.0\): objective options as keywords "
                                                r"are deprecated; pass them as options=\{'sapo_tau_pos': 2.0\}"):
        old, _ = policy_loss(*args, objective="sapo", sapo_tau_pos=2.0)
    assert old.item() == policy_loss(*args, objective="sapo", options={"sapo_tau_pos": 2.0})[0].item()
    assert old.item() == pytest.approx(sapo_loss(2.0, 1.05), rel=1e-12)
    with pytest.warns(DeprecationWarning):  # as before, an option of another objective is ignored
        grpo, _ = policy_loss(*args, objective="grpo", kl_cov_ratio=0.5)
    assert grpo.item() == policy_loss(*args, objective="grpo")[0].item()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new way warns nothing
        policy_loss(*args, objective="sapo", options={"sapo_tau_neg": 1.5})
    with pytest.raises(TypeError, match="unexpected keyword argument 'tau_pos'"):
        policy_loss(*args, objective="sapo", tau_pos=2.0)
    with pytest.raises(ValueError, match="'sapo_tau_pos' given twice, in options and as a keyword"):
        policy_loss(*args, objective="sapo", options={"sapo_tau_pos": 1.0}, sapo_tau_pos=2.0)


def scaled(x: LossInputs, *, scale: float = 1.0, note: str = "on"):
    """A probe: its loss is `scale` exactly (no gradient), so a run's `loss/policy` shows the option it got."""
    return scale + 0.0 * (x.logp * x.maskf).sum(), {"ratio/mean": x.log_ratio.exp()[x.mask].mean()}


def check_scaled(*, scale: float, note: str) -> None:
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")


def test_a_registered_objective_declares_options_that_a_run_passes_to_it(tmp_path):
    from conftest import tiny_cfg
    from gspo.tracking import read_jsonl
    from gspo.trainer import train

    with registered_objective("scaled", scaled, default_clip=(None, None), default_aggregation="token_mean",
                              check_options=check_scaled) as spec:
        assert dict(spec.options) == {"scale": 1.0, "note": "on"}
        with pytest.raises(ValueError, match="config: objective_options: scaled: scale must be > 0, got -2.0"):
            make_config(TrainConfig, {"objective": "scaled", "objective_options": {"scale": -2}})
        with pytest.raises(ValueError, match="scaled's note=3 has the wrong type: expected str"):
            make_config(TrainConfig, {"objective": "scaled", "objective_options": {"note": 3}})
        train(tiny_cfg(tmp_path, objective="scaled", objective_options={"scale": 3.0}, max_steps=1, eval_steps=0))
    lines = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss/policy" in m]
    assert [m["loss/policy"] for m in lines] == [3.0]  # the option reached every minibatch's loss
    assert "scaled" not in OBJECTIVES


def test_an_option_without_a_default_or_with_a_bad_default_is_refused_at_registration():
    def needs(x: LossInputs, *, scale: float):
        return x.logp.sum(), {}

    with pytest.raises(ValueError, match="objective 'needs': option 'scale' needs a default"):
        with registered_objective("needs", needs, default_clip=(None, None), default_aggregation="token_mean"):
            pass
    with pytest.raises(ValueError, match="scale must be > 0"):
        with registered_objective("bad_default", lambda x, *, scale=0.0, note="": (x.logp.sum(), {}),
                                  default_clip=(None, None), default_aggregation="token_mean",
                                  check_options=check_scaled):
            pass
    assert "needs" not in OBJECTIVES and "bad_default" not in OBJECTIVES
