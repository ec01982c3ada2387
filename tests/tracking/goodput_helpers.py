"""A callback the goodput scenario names by class_path: the test's own clock, independent of the ledger.

At module level in an importable module so that every rank (a fresh process) can build it.
"""

from __future__ import annotations

import os
import time

import lightning.pytorch as pl
from typing_extensions import override


class StepClock(pl.Callback):
    """Rank zero appends ``<global step> <time.time()>`` at each batch's start; every rank can be held there.

    One ``os.write`` per line on an ``O_APPEND`` file, so a SIGKILL loses no line written before it.

    Args:
        out_file: the file the lines go to.
        hold_at: the global step (before the batch's update) at whose batch start every rank sleeps, so the
            test can kill the job right there; None: never.
        hold_s: how long to sleep there.
        pace_s: sleep after every batch (all ranks), so steps are long enough to measure.
    """

    def __init__(self, out_file: str, hold_at: int | None = None, hold_s: float = 120.0, pace_s: float = 0.0) -> None:
        self.out_file = out_file
        self.hold_at = hold_at
        self.hold_s = hold_s
        self.pace_s = pace_s

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[override]
        if trainer.is_global_zero:
            fd = os.open(self.out_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, f"{trainer.global_step} {time.time():.6f}\n".encode())
            finally:
                os.close(fd)
        if trainer.global_step == self.hold_at:
            time.sleep(self.hold_s)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        if self.pace_s:
            time.sleep(self.pace_s)
