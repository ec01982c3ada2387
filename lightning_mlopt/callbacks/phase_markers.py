"""PhaseMarkers: marks the phases of every training batch (``distributed/phase.py``) from the Trainer's hooks."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from typing_extensions import override

from lightning_mlopt.process.phase import set_phase


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

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        set_phase("backward")

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        set_phase("optimizer")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        set_phase("data", trainer.global_step)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.training:  # validation inside fit: not part of any training step
            set_phase("validation")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.training:
            set_phase("data")
