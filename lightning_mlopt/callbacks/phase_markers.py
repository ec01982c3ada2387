"""PhaseMarkers: marks the phases of every training batch (``process/phase.py``) from the Trainer's hooks."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from typing_extensions import override

from lightning_mlopt._compat import mark_dataloader_fetches
from lightning_mlopt.process.phase import set_phase


def _fetching() -> None:
    set_phase("data")


class PhaseMarkers(Callback):
    """Marks the phases of every training batch from the Trainer's hooks; subclasses call ``super()``.

    Example::

        class MyMonitor(PhaseMarkers):
            def on_train_batch_end(self, trainer, pl_module, *args):
                super().on_train_batch_end(trainer, pl_module, *args)
                ...
    """

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        set_phase("forward", trainer.global_step)
        # "data" starts where the loop asks the dataloader for the next batch, not where this batch ends: the
        # loop's own work between batches (logging, schedulers, other callbacks' hooks) is no input stall.
        # Lightning sets the fetcher's hook as each epoch's loop starts, so it is (re)placed here.
        mark_dataloader_fetches(trainer, _fetching)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        set_phase("backward")

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        set_phase("optimizer")

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        set_phase("data")  # what follows is the epoch's first fetch (a new iterator: workers start here)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        set_phase("loop", trainer.global_step)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.training:  # validation inside fit: not part of any training step
            set_phase("validation")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.training:
            set_phase("loop")
