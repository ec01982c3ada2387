"""Experiment tracking: W&B and MLflow loggers that survive relaunches, run provenance, and the goodput ledger.

``ThroughputProgressBar`` lives with the callbacks (``lightning_mlopt.callbacks``); the name here stays for
configurations that spell it ``lightning_mlopt.tracking.ThroughputProgressBar``.
"""

from lightning_mlopt.callbacks.throughput_progress_bar import ThroughputProgressBar
from lightning_mlopt.tracking.goodput_ledger import GoodputLedger
from lightning_mlopt.tracking.mlflow_tracker import MLflowTracker
from lightning_mlopt.tracking.wandb_tracker import WandbTracker

__all__ = ["GoodputLedger", "MLflowTracker", "ThroughputProgressBar", "WandbTracker"]
