"""The fast tier's guard: an unmarked test over budget fails, naming the marker; heavy-marked tests are exempt."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import cli_environment
from tests.support.fast_tier import FAST_TEST_LIMIT_S, limit_for, over_budget

ALONE = "not multiprocess and not slow"


def test_the_limit_is_strict_only_when_the_fast_tier_runs_alone():
    assert limit_for(ALONE) == FAST_TEST_LIMIT_S
    assert limit_for("") == limit_for("not slurm") == 3 * FAST_TEST_LIMIT_S  # heavy tests may run beside it


def test_an_unmarked_test_over_the_limit_is_told_which_marker_to_add():
    assert over_budget({"parametrize", "solo"}, 1.9, ALONE) is None
    assert over_budget({"parametrize", "solo"}, 2.1, ALONE) == (
        "an unmarked test took 2.1 s (the fast tier allows 2 s each): mark it @pytest.mark.slow, or make it cheaper"
    )
    assert over_budget(set(), 5.9, "") is None and over_budget(set(), 6.1, "") is not None
    for heavy in ("slow", "multiprocess", "slurm", "requires_cuda"):
        assert over_budget({heavy}, 600.0, ALONE) is None


@pytest.mark.slow
def test_the_hook_fails_a_slow_unmarked_test_in_a_real_pytest_run(tmp_path):
    # The real hook, in a pytest run of its own: its conftest takes the hook from the repository's.
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_makereport  # noqa: F401\n")
    sleepy = """
        import time

        import pytest

        def test_unmarked():
            time.sleep(2.3)

        @pytest.mark.slow
        def test_marked():
            time.sleep(2.3)
    """
    (tmp_path / "test_sleepy.py").write_text(textwrap.dedent(sleepy))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-o", "addopts=", "-o",
         "markers=slow: heavy", "-m", ALONE, str(tmp_path)],
        cwd=tmp_path, env=cli_environment(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-3000:]
    assert "1 failed, 1 deselected" in result.stdout, result.stdout[-3000:]
    assert "an unmarked test took 2.3 s (the fast tier allows 2 s each): mark it @pytest.mark.slow" in result.stdout
