"""The skips CI accepts (tests/skips_allowed.txt, enforced by tests/conftest.py where CI is set)."""

from types import SimpleNamespace

from conftest import SKIPS_ALLOWED, allowed_skips, unlisted_skips


def test_every_allowed_skip_says_why():
    lines = [line for line in SKIPS_ALLOWED.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert lines and all("  # " in line and line.split("  # ", 1)[1].strip() for line in lines)
    assert len(allowed_skips()) == len(lines)


def test_a_skip_is_unlisted_unless_a_pattern_matches_its_reason(tmp_path):
    allowlist = tmp_path / "allowed.txt"
    allowlist.write_text("# a comment\n\nvllm is not installed  # why\n")
    reports = [SimpleNamespace(nodeid="a.py::t1", longrepr=("a.py", 3, "Skipped: vllm is not installed (...)")),
               SimpleNamespace(nodeid="b.py::t2", longrepr=("b.py", 9, "Skipped: no memory cgroup here"))]
    assert unlisted_skips(reports, allowed_skips(allowlist)) == ["b.py::t2: Skipped: no memory cgroup here"]
    assert unlisted_skips(reports[:1], allowed_skips(allowlist)) == []
