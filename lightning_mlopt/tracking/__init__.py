"""Experiment tracking: W&B and MLflow loggers that survive relaunches, and run provenance.

``ThroughputProgressBar`` lives with the callbacks (``lightning_mlopt.callbacks``); the name here stays for
configurations that spell it ``lightning_mlopt.tracking.ThroughputProgressBar``.

The goodput ledger is in ``lightning_mlopt.goodput``. The classes are imported on first use (PEP 562), so
importing the package costs nothing until one is used.

Example::

    from lightning_mlopt.tracking import MLflowTracker   # imports the tracker (and Lightning) here
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_mlopt.callbacks.throughput_progress_bar import ThroughputProgressBar
    from lightning_mlopt.tracking.mlflow_settings import Delivery
    from lightning_mlopt.tracking.mlflow_tracker import MLflowTracker
    from lightning_mlopt.tracking.wandb_tracker import WandbTracker

_MODULES = {
    "Delivery": "lightning_mlopt.tracking.mlflow_settings",
    "MLflowTracker": "lightning_mlopt.tracking.mlflow_tracker",
    "ThroughputProgressBar": "lightning_mlopt.callbacks.throughput_progress_bar",
    "WandbTracker": "lightning_mlopt.tracking.wandb_tracker",
}

__all__ = ["Delivery", "MLflowTracker", "ThroughputProgressBar", "WandbTracker"]


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
