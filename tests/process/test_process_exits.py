"""How a 2-process job ends when one rank fails or is stuck: with the status that names it, not the launcher's 137.

Lightning's launcher (rank zero, whose status is the job's) SIGKILLs itself as soon as it sees a child exit
non-zero; a child that leaves first turns any status into 137. These run the real CLI on 2 CPU processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, REPO_PYTHONPATH

_TWO_RANKS = ("--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.accelerator=cpu")


def _fit(run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "lightning_mlopt",
        "fit",
        "--config",
        str(CONFIGS / "quickstart.yaml"),
        *_TWO_RANKS,
        "--trainer.max_steps=20",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.logger=false",
        f"--run_dir={run_dir}",
        *extra,
    ]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the ranks Lightning's launcher started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.multiprocess
def test_a_failure_on_one_rank_ends_the_job_with_status_1_and_its_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH, "PYTHONUNBUFFERED": "1"}
    failing = ("--trainer.callbacks+=tests.support.faults.RaiseOnRank", "--trainer.callbacks.rank=1")
    started = time.monotonic()
    result = subprocess.run(
        _fit(tmp_path / "run", *failing, "--trainer.callbacks.step=2"),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])  # not 137 (launcher), not -6 (gloo)
    assert "RuntimeError: injected failure on rank 1 at step 2" in result.stderr
    assert time.monotonic() - started < 120


@pytest.mark.multiprocess
def test_a_launched_rank_at_its_signal_deadline_lets_the_launching_rank_exit_first(tmp_path):
    # Rank 1 is stuck outside a collective, rank 0 inside one. The scheduler's SIGTERM reaches rank 1 a second
    # before rank 0, so rank 1 reaches its deadline first; leaving then would make the launcher kill itself (137,
    # no requeue). It waits for rank 0's own deadline exit, and the job ends 75.
    env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH, "PYTHONUNBUFFERED": "1"}
    hang = ("--trainer.callbacks+=tests.support.faults.HangOnRank", "--trainer.callbacks.rank=1")
    job = subprocess.Popen(
        _fit(tmp_path / "run", *hang, "--trainer.callbacks.step=2", "--checkpoint.preemption.deadline_s=3"),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "hanging-rank1").exists() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.2)
        assert (tmp_path / "hanging-rank1").exists(), job.communicate(timeout=30)[1][-3000:]
        (rank1,) = _children(job.pid)
        time.sleep(1)  # rank 0 waits in the next step's all-reduce
        os.kill(rank1, signal.SIGTERM)
        time.sleep(1)
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 75, (job.returncode, stderr[-3000:])
    assert stderr.count("did not reach a step boundary") == 2, stderr[-3000:]  # each rank said where it waited
    deadline = time.monotonic() + 10
    while not _gone(rank1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(rank1)
