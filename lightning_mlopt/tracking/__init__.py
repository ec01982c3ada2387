"""Experiment tracking: W&B and MLflow loggers that survive relaunches, run provenance, and the goodput ledger.

``ThroughputProgressBar`` lives with the callbacks (``lightning_mlopt.callbacks``); the name here stays for
configurations that spell it ``lightning_mlopt.tracking.ThroughputProgressBar``.

The classes are imported on first use (PEP 562), so that a tool that reads only a file format of this package
(``python -m lightning_mlopt goodput RUN_DIR`` reads the ledger through ``tracking.goodput_report``) starts
without importing Lightning.

Example::

    from lightning_mlopt.tracking import MLflowTracker   # imports the tracker (and Lightning) here
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_mlopt.callbacks.throughput_progress_bar import ThroughputProgressBar
    from lightning_mlopt.tracking.goodput_ledger import GoodputLedger
    from lightning_mlopt.tracking.mlflow_tracker import MLflowTracker
    from lightning_mlopt.tracking.wandb_tracker import WandbTracker

_MODULES = {
    "GoodputLedger": "lightning_mlopt.tracking.goodput_ledger",
    "MLflowTracker": "lightning_mlopt.tracking.mlflow_tracker",
    "ThroughputProgressBar": "lightning_mlopt.callbacks.throughput_progress_bar",
    "WandbTracker": "lightning_mlopt.tracking.wandb_tracker",
}

__all__ = ["GoodputLedger", "MLflowTracker", "ThroughputProgressBar", "WandbTracker"]


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
