"""Tiny training runs reproduce their recorded goldens (tests/golden.py; re-record only on purpose).

Never skipped: bitwise where the environment is the recording's, within golden.py's stated tolerance
elsewhere (rewards, counts and accuracies exact)."""

import copy

import pytest

from golden import CASES, TWO_PROCESS, check, compare, load_golden  # tests/ is on sys.path under pytest

SINGLE = [case for case in CASES if case not in TWO_PROCESS]


@pytest.mark.slow
@pytest.mark.parametrize("case", SINGLE)
def test_single_process_run_matches_its_golden(case):
    passed, message, _ = check(case)
    assert passed, f"{case}: {message}"


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(TWO_PROCESS))
def test_two_process_run_matches_its_golden(case):
    passed, message, _ = check(case)
    assert passed, f"{case}: {message}"


def test_the_comparison_is_exact_at_home_and_tolerant_but_strict_on_rewards_elsewhere():
    """compare() itself, on a recorded golden and hand-edited copies of it (fast: no run)."""
    golden = load_golden("dense_gspo")
    step = next(i for i, row in enumerate(golden["metrics"]) if "loss/policy" in row)
    loss = golden["metrics"][step]["loss/policy"]

    def edited(env: dict | None = None, **metrics) -> dict:
        rows = copy.deepcopy(golden["metrics"])
        rows[step].update(metrics)
        return {**golden, "env": env or golden["env"], "metrics": rows}

    other = {**golden["env"], "transformers": "0.0-elsewhere"}
    assert compare(golden, edited()) == (True, "identical")
    # at home: one ulp-sized change of the loss is a difference
    assert compare(golden, edited(**{"loss/policy": loss * (1 + 1e-6)}))[0] is False
    # elsewhere: the loss within rel 1e-3 passes, 1e-2 off fails, a reward that moved at all fails
    passed, message = compare(golden, edited(other, **{"loss/policy": loss * (1 + 5e-4)}))
    assert passed and message.startswith("within rel 0.001 / abs 1e-06"), message
    assert compare(golden, edited(other, **{"loss/policy": loss * 1.01 + 1e-5}))[0] is False
    reward = golden["metrics"][step]["reward/mean"]
    passed, message = compare(golden, edited(other, **{"reward/mean": reward + 1e-12}))
    assert not passed and "reward/mean" in message, message
