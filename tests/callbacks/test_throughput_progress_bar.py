"""ThroughputProgressBar reads the metrics it shows only when it draws, at most every ``min_interval_s``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_mlopt.callbacks import ThroughputProgressBar


class CountedBar(ThroughputProgressBar):
    """Counts the metric reads of its draws, per training batch."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.read_at: list[int] = []
        self.batch = -1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.batch = batch_idx

    def get_metrics(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self.read_at.append(self.batch)
        return super().get_metrics(trainer, pl_module)


def _fit(bar: ThroughputProgressBar, batches: int = 8) -> None:
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, limit_train_batches=batches, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_model_summary=False, callbacks=[bar],
    )  # fmt: skip
    trainer.fit(BoringModel())


def test_the_bar_draws_its_metrics_at_the_first_and_last_batch_and_then_by_the_clock():
    slow = CountedBar(log_every_n_steps=0, min_interval_s=3600.0)  # drawn, as in a terminal
    _fit(slow)
    # The epoch's first batch, its last, and the epoch's end: never the six between (Lightning's bar: all 8).
    assert slow.read_at == [0, 7, 7]
    every = CountedBar(log_every_n_steps=0, min_interval_s=0.0)
    _fit(every)
    assert every.read_at[:8] == list(range(8))


def test_min_interval_must_not_be_negative():
    with pytest.raises(ValueError, match="min_interval_s must be >= 0, got -1"):
        ThroughputProgressBar(min_interval_s=-1)
