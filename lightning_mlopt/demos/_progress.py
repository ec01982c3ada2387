"""Whether a demo's per-step loss belongs on the progress bar."""

from __future__ import annotations

import lightning.pytorch as pl


def progress_bar_shown(module: pl.LightningModule) -> bool:
    """True when the module's Trainer draws a progress bar.

    Lightning turns every ``prog_bar=True`` metric into a Python number after each batch (``.item()``): on a GPU
    that is a host synchronization per step, which stalls the queueing of the next step's kernels. Only a bar
    reads those numbers between logging steps, so the demos put the loss there only when one is drawn.

    Example::

        self.log("train/loss", loss, prog_bar=progress_bar_shown(self))
    """
    trainer = module._trainer
    return trainer is not None and trainer.progress_bar_callback is not None
