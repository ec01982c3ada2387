"""Checkpoint storage: the commit protocol, manifests and verification, retention, async writes.

The names below load on first use (PEP 562), so that ``lightning_mlopt.checkpoint.preemption``, which the
entry point imports before anything slow, costs no torch import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_mlopt.checkpoint.async_writer import AsyncWriter
    from lightning_mlopt.checkpoint.manifest import Manifest, verify
    from lightning_mlopt.checkpoint.retention import RetentionPolicy
    from lightning_mlopt.checkpoint.store import STATE_NAME, CheckpointEntry, CheckpointStore
    from lightning_mlopt.exceptions import CheckpointInvalidError

_WHERE = {
    "AsyncWriter": "async_writer",
    "CheckpointInvalidError": "manifest",
    "Manifest": "manifest",
    "verify": "manifest",
    "RetentionPolicy": "retention",
    "STATE_NAME": "store",
    "CheckpointEntry": "store",
    "CheckpointStore": "store",
}

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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
