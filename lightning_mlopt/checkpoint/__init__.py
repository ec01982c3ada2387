"""Checkpoint storage: the commit protocol, manifests and verification, retention, async writes."""

from lightning_mlopt.checkpoint.async_writer import AsyncWriter
from lightning_mlopt.checkpoint.manifest import CheckpointInvalidError, Manifest, verify
from lightning_mlopt.checkpoint.retention import RetentionPolicy
from lightning_mlopt.checkpoint.store import STATE_NAME, CheckpointEntry, CheckpointStore

__all__ = [
    "STATE_NAME",
    "AsyncWriter",
    "CheckpointEntry",
    "CheckpointInvalidError",
    "CheckpointStore",
    "Manifest",
    "RetentionPolicy",
    "verify",
]
