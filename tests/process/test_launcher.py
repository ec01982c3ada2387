"""Waiting for the launcher: a rank whose launcher is already gone does not wait for whoever adopted it."""

from __future__ import annotations

import os
import time
from pathlib import Path

from lightning_mlopt.process import launcher

LIMIT_S = 0.6


def _orphan_waits(result: Path, remember: bool) -> float:
    """Seconds a rank spends in ``wait_for_parent_to_exit(LIMIT_S)`` once its launcher has died."""
    ready_read, ready_write = os.pipe()
    middle = os.fork()
    if middle == 0:  # the launcher: starts the rank, then dies (killed, out of memory) once the rank is up
        if os.fork() == 0:  # the rank
            try:
                parent = os.getppid()
                if remember:
                    launcher.remember_launcher()  # what the entry point does for a launched rank
                os.write(ready_write, b"1")  # only now may the launcher die: else the rank may start adopted
                while os.getppid() == parent:  # until it is adopted
                    time.sleep(0.005)
                started = time.monotonic()
                launcher.wait_for_parent_to_exit(LIMIT_S)
                staged = result.with_suffix(".partial")  # renamed whole: the reader never sees a half-written file
                staged.write_text(f"{time.monotonic() - started:.3f}")
                os.replace(staged, result)
            finally:
                os._exit(0)
        os.read(ready_read, 1)
        os._exit(0)
    os.close(ready_write)
    os.waitpid(middle, 0)
    os.close(ready_read)
    deadline = time.monotonic() + 10
    while not result.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return float(result.read_text())


def test_a_rank_whose_launcher_died_returns_at_once_and_without_the_record_waits_the_whole_limit(tmp_path):
    assert _orphan_waits(tmp_path / "remembered", remember=True) < 0.1
    # Without the record, "the parent" is the process that adopted it, which never exits: the full limit (30 s in
    # a real exit, after which the ranks of a job whose launcher was killed had outlived it).
    assert _orphan_waits(tmp_path / "forgotten", remember=False) >= LIMIT_S - 0.05
