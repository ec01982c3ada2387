"""Callbacks for any Lightning Trainer."""

from lightning_mlopt.callbacks.collective_sequence_check import CollectiveSequenceCheck
from lightning_mlopt.callbacks.compile_model import CompileModel
from lightning_mlopt.callbacks.fault_tolerant_checkpoint import FaultTolerantCheckpoint
from lightning_mlopt.callbacks.float8_training import Float8Training
from lightning_mlopt.callbacks.grad_norm_monitor import GradNormMonitor
from lightning_mlopt.callbacks.health_settings import Stragglers, Watchdog  # NCCLHealthCheck's
from lightning_mlopt.callbacks.nccl_health_check import NCCLHealthCheck
from lightning_mlopt.callbacks.performance_monitor import PerformanceMonitor
from lightning_mlopt.callbacks.phase_markers import PhaseMarkers
from lightning_mlopt.callbacks.replica_consistency_check import ReplicaConsistencyCheck
from lightning_mlopt.callbacks.throughput_progress_bar import ThroughputProgressBar
from lightning_mlopt.callbacks.uneven_inputs import UnevenInputs
from lightning_mlopt.checkpoint.settings import Keep, Preemption, Resume, SaveOn, Tiers  # FaultTolerantCheckpoint's
from lightning_mlopt.exceptions import (
    CheckpointWriteError,
    CollectivesDivergedError,
    HealthCheckError,
    NonFiniteGradientError,
    ReplicaMismatchError,
)

__all__ = [
    "CheckpointWriteError",
    "CollectiveSequenceCheck",
    "CollectivesDivergedError",
    "CompileModel",
    "FaultTolerantCheckpoint",
    "Float8Training",
    "GradNormMonitor",
    "HealthCheckError",
    "Keep",
    "NCCLHealthCheck",
    "NonFiniteGradientError",
    "PerformanceMonitor",
    "PhaseMarkers",
    "Preemption",
    "ReplicaConsistencyCheck",
    "ReplicaMismatchError",
    "Resume",
    "SaveOn",
    "Stragglers",
    "ThroughputProgressBar",
    "Tiers",
    "UnevenInputs",
    "Watchdog",
]
