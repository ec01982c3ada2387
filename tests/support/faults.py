"""Faults delivered from inside a training run, as the world delivers them: callbacks a test adds by class path.

Example::

    run_cli(fit_args("--trainer.callbacks+=tests.support.faults.SegfaultAtStep",
                     "--trainer.callbacks.step=2", devices=1), cwd=tmp_path)
"""

from __future__ import annotations

import ctypes

import lightning.pytorch as pl
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
