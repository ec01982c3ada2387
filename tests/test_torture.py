"""The torture harness itself keeps working: one short trial of a kill at a random instant (DDP, checkpoints in a
loopback S3 store: the relaunch ends bitwise equal to an uninterrupted run, the store's newest checkpoint is the
final one; and one process with 2 DataLoader workers, where the kill lands mid-epoch more often than not).
The other faults' trials run in the benchmark script (an unwritable folder is also a test of its own
in test_fault_tolerant_checkpoint)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("strategy", "store"),
    [("ddp", "s3"), ("single-w2", "local")],
    ids=["ddp-2proc-s3", "one-process-2-workers"],
)
def test_the_torture_script_runs_its_trials_and_reports_the_cells(tmp_path, strategy, store):
    # The one-process cell: no DistributedSampler orders its data, and 2 DataLoader workers seed themselves from
    # the loader: a kill mid-epoch must resume at the same sample, with the same worker seeds.
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "torture" / "torture.py"),
            "--trials=1",
            f"--strategies={strategy}",
            "--faults=kill",
            f"--store={store}",
            "--no-publish",
            f"--work={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in result.stdout.splitlines()
        if line.startswith("| ") and "fault" not in line
    }
    assert rows == {"kill": "1/1"}
    assert "No failures." in result.stdout and ("Store: s3" in result.stdout) == (store == "s3")
