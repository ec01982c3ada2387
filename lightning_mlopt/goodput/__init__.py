"""Goodput: where each launch's wall-clock time went, over every launch of a run.

- ``ledger.py``: :class:`GoodputLedger`, the callback that appends each launch's events to
  ``<run_dir>/goodput.jsonl``; it listens to the checkpoint's events and the step's phases, so it sits above the
  callbacks and trackers it listens to.
- ``report.py``: reads the ledger and computes goodput and badput by category (standard library only).
- ``append_log.py``: the crash-safe append-only file the ledger writes.

The callback is imported on first use (PEP 562), so ``python -m lightning_mlopt goodput RUN_DIR`` (which reads
the ledger through ``report.py``) starts without importing Lightning.

Example::

    from lightning_mlopt.goodput import GoodputLedger
    trainer = Trainer(callbacks=[FaultTolerantCheckpoint(), GoodputLedger()])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_mlopt.goodput.ledger import GoodputLedger

__all__ = ["GoodputLedger"]


def __getattr__(name: str) -> Any:
    if name == "GoodputLedger":
        return importlib.import_module("lightning_mlopt.goodput.ledger").GoodputLedger
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
