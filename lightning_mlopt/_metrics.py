"""How our callbacks hand metrics to the Trainer's loggers, and when.

Callbacks log from hooks where ``LightningModule.log`` is not available (``on_before_optimizer_step`` on
another callback's schedule, ``on_train_end``) or not wanted (it would reduce across ranks, a collective).
Rank zero writes what every rank already agreed on; the other ranks write nothing.

Example::

    every = logging_period(self.log_every_n_steps, trainer)
    if trainer.global_step % every == 0:
        log_metrics(trainer, {"perf/samples_per_s": 512.0})
"""

from __future__ import annotations

from collections.abc import Mapping

import lightning.pytorch as pl

from lightning_mlopt._compat import lightning_row_step

DEFAULT_LOGGING_PERIOD = 50  # Lightning's own default for Trainer(log_every_n_steps=...)


def log_metrics(trainer: pl.Trainer, metrics: Mapping[str, float], step: int | None = None) -> None:
    """Log ``metrics`` to every logger, from rank zero only, in the row Lightning logs the current batch in.

    ``step`` (default: the step Lightning labels this batch's row with, one below ``global_step`` after the
    update) names another row: one label per batch for every logger's rows, ours and Lightning's, so a resumed
    run's rows neither skip nor repeat a step.
    """
    if not metrics or not trainer.is_global_zero or not trainer.loggers:
        return
    label = lightning_row_step(trainer) if step is None else step
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=label)


def logging_period(every: int | None, trainer: pl.Trainer) -> int:
    """A callback's logging period in optimizer steps: its own ``every``, else the trainer's, else 50."""
    return int(every or getattr(trainer, "log_every_n_steps", None) or DEFAULT_LOGGING_PERIOD)
