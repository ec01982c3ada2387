"""The torture harness itself keeps working: one short trial of a kill at a random instant in two cells, with the
checkpoints in a loopback S3 store (half the relaunches find their local tier gone): DDP on 2 processes, and one
process with 2 DataLoader workers, where the kill lands mid-epoch more often than not. Each relaunch ends bitwise
equal to an uninterrupted run, and the store's newest checkpoint is the final one. The other faults' trials run in
the benchmark script (an unwritable folder is also a test of its own in test_fault_tolerant_checkpoint)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.multiprocess
def test_the_torture_script_runs_its_trials_and_reports_the_cells(tmp_path):
    # The one-process cell: no DistributedSampler orders its data, and 2 DataLoader workers seed themselves from
    # the loader: a kill mid-epoch must resume at the same sample, with the same worker seeds. One harness run for
    # both cells: one store server, one reference per cell.
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "torture" / "torture.py"),
            "--trials=1",
            "--strategies=ddp,single-w2",
            "--faults=kill",
            "--store=s3",
            "--no-publish",
            f"--work={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    table = [line.strip("|").split("|") for line in result.stdout.splitlines() if line.startswith("| ")]
    header, rows = [cell.strip() for cell in table[0]], [[cell.strip() for cell in row] for row in table[1:]]
    assert header == ["fault", "ddp", "single-w2"] and rows == [["kill", "1/1", "1/1"]], result.stdout[-2000:]
    assert "No failures." in result.stdout and "Store: s3" in result.stdout
