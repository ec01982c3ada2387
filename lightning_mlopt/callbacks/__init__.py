"""Callbacks for any Lightning Trainer."""

from lightning_mlopt.callbacks.fault_tolerant_checkpoint import CheckpointWriteError, FaultTolerantCheckpoint

__all__ = ["CheckpointWriteError", "FaultTolerantCheckpoint"]
