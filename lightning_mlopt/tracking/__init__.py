"""Experiment tracking: a W&B logger that survives relaunches, provenance, secret redaction, a throughput bar."""

from lightning_mlopt.tracking.progress import ThroughputProgressBar
from lightning_mlopt.tracking.wandb_tracker import WandbTracker

__all__ = ["ThroughputProgressBar", "WandbTracker"]
