"""LoaderOnly: a LightningModule that takes its batches exactly as training would and does nothing with them.

``python -m lightning_mlopt profile`` fits it in place of the configured model to measure the loader-only
ceiling: the same datamodule (or the model's own dataloaders), batch size, workers and distributed sampler,
the same transfer to the device, and no compute.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from typing_extensions import override


class LoaderOnly(pl.LightningModule):
    """Wraps ``model`` for its dataloaders and ``tokens_per_sample``; each training step does nothing.

    Args:
        model: the run's LightningModule (built, never trained: its weights stay out of the strategy).

    Example::

        trainer.fit(LoaderOnly(model), datamodule=datamodule)  # samples/s of the input pipeline alone

    """

    wrapped: pl.LightningModule

    def __init__(self, model: pl.LightningModule) -> None:
        super().__init__()
        self.automatic_optimization = False  # no optimizer, no backward
        self.anchor = nn.Parameter(torch.zeros(1))  # DDP wraps only modules with a trainable parameter
        object.__setattr__(self, "wrapped", model)  # not a submodule: its weights are not moved or wrapped
        self.tokens_per_sample = getattr(model, "tokens_per_sample", None)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:
        return None

    @override
    def configure_optimizers(self) -> None:
        return None

    @override
    def train_dataloader(self) -> Any:
        return self.wrapped.train_dataloader()  # used only when no datamodule is configured
