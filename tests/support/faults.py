"""Faults delivered as the world delivers them: callbacks a test adds by class path, and kills from outside.

Example::

    run_cli(fit_args("--trainer.callbacks+=tests.support.faults.SegfaultAtStep",
                     "--trainer.callbacks.step=2", devices=1), cwd=tmp_path)
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
from typing_extensions import override


class SegfaultAtStep(pl.Callback):
    """Crashes this process with a real SIGSEGV (a read of address 0) at the end of optimizer step ``step``:
    what a faulty native extension does."""

    def __init__(self, step: int) -> None:
        self.step = step

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        if trainer.global_step == self.step:
            read_address_zero()


def read_address_zero() -> None:
    """Dereference a null pointer, as a native bug does (named so the crash report's frames can be checked)."""
    ctypes.string_at(0)


class RaiseOnRank(pl.Callback):
    """Raises ``RuntimeError`` on rank ``rank`` at the end of optimizer step ``step`` (a bug one rank hits)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")


class HangOnRank(pl.Callback):
    """Rank ``rank`` sleeps ``seconds`` at the end of optimizer step ``step``: its peers wait for it in the next
    step's collective (a rank stuck outside a collective, the others inside one)."""

    def __init__(self, rank: int, step: int, seconds: float = 600.0) -> None:
        self.rank, self.step, self.seconds = rank, step, seconds

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            import time

            open(f"hanging-rank{self.rank}", "w").close()  # in the working directory: the test waits for it
            time.sleep(self.seconds)


def kill_job_when(
    command: list[str], cwd: Path, env: dict[str, str], ready: Callable[[], bool], waiting_for: str
) -> None:
    """Start ``command`` in its own session; SIGKILL every process of it (ranks, workers) once ``ready()`` holds.

    A job that ends before that fails the test, naming ``waiting_for``; after 240 s it is killed all the same.
    """
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while not ready() and time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"the job ended (status {process.returncode}) before {waiting_for}")
            time.sleep(0.02)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
