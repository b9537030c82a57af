"""Modules that moved in issue 48's restructuring keep their old names, with a DeprecationWarning naming the
new one (gspo/__init__.py: MOVED), and the documented imports work."""

import importlib
import subprocess
import sys

import pytest

import gspo


def test_documented_imports_work_without_a_warning():
    code = ("import warnings; warnings.simplefilter('error')\n"
            "from gspo import GRPOTrainer, GSPOTrainer, Trainer, TrainConfig\n"
            "from gspo.config import TrainConfig, load_config, section, SamplingSettings\n"
            "from gspo.algo.objectives import policy_loss, register_objective\n"
            "from gspo.algo.advantages import group_advantages, register_estimator, gae\n"
            "from gspo.env import Turn\n"
            "from gspo.rollout import generate, Rollout\n"
            "from gspo.sandbox import describe_sandbox, run_sandboxed\n"
            "from gspo.trainer import train\n"
            "from gspo.run import build_run, Run\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("old", sorted(gspo.MOVED))
def test_an_old_module_name_is_the_new_module_with_a_warning(old):
    new = gspo.MOVED[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"^{old} moved to {new}: import that"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)  # one module object: state and monkeypatching are shared


def test_a_module_inside_a_moved_package_maps_too():
    sys.modules.pop("gspo.lab.stats", None)
    with pytest.warns(DeprecationWarning, match="gspo.lab.stats moved to gspo.apps.lab.stats"):
        from gspo.lab.stats import stat  # noqa: F401
    assert gspo.moved_to("gspo.lab.stats") == "gspo.apps.lab.stats"
    assert gspo.moved_to("gspo.labs") is None and gspo.moved_to("gspo.trainer") is None


def test_the_documented_old_imports_still_work():
    """docs of earlier releases: `from gspo.objectives import policy_loss`, `gspo.advantages.group_advantages`."""
    code = ("import warnings\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    from gspo.objectives import policy_loss, register_objective\n"
            "    from gspo.advantages import group_advantages\n"
            "    import gspo.algo.objectives as new\n"
            "assert policy_loss is new.policy_loss\n"
            "print(sorted({str(w.message).split(':')[0] for w in seen}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == ("['gspo.advantages moved to gspo.algo.advantages', "
                                   "'gspo.objectives moved to gspo.algo.objectives']")
