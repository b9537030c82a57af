"""Tiny training runs reproduce their recorded goldens (tests/golden.py; re-record only on purpose)."""

import pytest

from golden import CASES, TWO_PROCESS, check  # tests/ is on sys.path under pytest

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
