"""Checkpoint storage: the commit protocol, manifests and verification, retention, async writes."""

from lightning_mlopt.checkpoint.async_writer import AsyncWriter
from lightning_mlopt.checkpoint.manifest import Manifest, verify
from lightning_mlopt.checkpoint.retention import RetentionPolicy
from lightning_mlopt.checkpoint.store import STATE_NAME, CheckpointEntry, CheckpointStore
from lightning_mlopt.exceptions import CheckpointInvalidError

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
