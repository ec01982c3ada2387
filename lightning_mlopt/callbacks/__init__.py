"""Callbacks for any Lightning Trainer."""

from lightning_mlopt.callbacks.fault_tolerant_checkpoint import CheckpointWriteError, FaultTolerantCheckpoint
from lightning_mlopt.callbacks.grad_norm_monitor import GradNormMonitor, NonFiniteGradientError
from lightning_mlopt.callbacks.nccl_health_check import HealthCheckError, NCCLHealthCheck

__all__ = [
    "CheckpointWriteError",
    "FaultTolerantCheckpoint",
    "GradNormMonitor",
    "HealthCheckError",
    "NCCLHealthCheck",
    "NonFiniteGradientError",
]
