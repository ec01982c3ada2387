"""The GPU step-time clock: device-synchronised wall time of steps ``warmup`` to the last, from inside a run.

    --trainer.callbacks+=span.SyncedSpan --trainer.callbacks.warmup=10 --trainer.callbacks.out=/tmp/span.json

Two device synchronisations in a whole run: at the start of step ``warmup`` and after the last step's
``on_train_batch_end`` hooks (every callback of the run ran by then; the end-of-training save does not count).
Between them the loop runs as the user's would: a synchronisation anywhere inside shows as time. The
checklist's bare-Trainer arms, its plain loops and its CLI arms all stamp at these two points.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch


def synchronize() -> None:
    """Wait for the device (a no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class SyncedSpan(pl.Callback):
    """Writes ``{"step_s": mean seconds per step after warmup}`` to ``out`` (rank zero) when training ends.

    Args:
        warmup: steps left out (compilation, allocator warm-up, NCCL set-up).
        out: the JSON file; None keeps the figure in ``step_s`` only.
    """

    def __init__(self, warmup: int = 10, out: str | None = None) -> None:
        self.warmup = warmup
        self.out = Path(out) if out else None
        self.started = self.ended = 0.0
        self.steps = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup and not self.started:
            synchronize()
            self.started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= trainer.max_steps and not self.ended:
            synchronize()
            self.ended = time.perf_counter()
            self.steps = trainer.global_step - self.warmup

    @property
    def step_s(self) -> float:
        """Mean seconds per timed step."""
        return (self.ended - self.started) / max(self.steps, 1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.out is not None and trainer.is_global_zero:
            self.out.write_text(json.dumps({"step_s": self.step_s, "steps": self.steps}))
