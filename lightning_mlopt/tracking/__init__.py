"""Experiment tracking: a W&B logger that survives relaunches, and run provenance.

``ThroughputProgressBar`` lives with the callbacks (``lightning_mlopt.callbacks``); the name here stays for
configurations that spell it ``lightning_mlopt.tracking.ThroughputProgressBar``.
"""

from lightning_mlopt.callbacks.throughput_progress_bar import ThroughputProgressBar
from lightning_mlopt.tracking.wandb_tracker import WandbTracker

__all__ = ["ThroughputProgressBar", "WandbTracker"]
