"""A callback that times every training step from inside the run: the parity benchmark's clock.

    --trainer.callbacks+=step_clock.StepClock --trainer.callbacks.out=/tmp/step_times.json

Rank zero writes the wall seconds from each training batch's start to the next one's: one whole step, the
loop's work between batches included. The hand-written loop takes the same time stamp at the same point
(after the batch is fetched, before the step). Timing inside the run leaves start-up out of the figure, so a
single job gives the step time; the benchmark compares means over the steady steps.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


class StepClock(pl.Callback):
    """Rank zero writes ``{"step_s": [...]}`` to ``out``: the seconds between consecutive batch starts."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.step_s: list[float] = []
        self._last: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.step_s.append(now - self._last)
        self._last = now

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.out.write_text(json.dumps({"step_s": self.step_s}))
