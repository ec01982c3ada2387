"""MLflowTracker's delivery settings, grouped: how and when logged records reach the server.

The flat arguments of 0.1 (``send_every_s``, ``flush_timeout_s``, ``hold_until_checkpoint``) are refused with
the new key named (:data:`RENAMED_KEYS`).

Example::

    MLflowTracker(experiment_name="gpt", delivery=Delivery(send_every_s=0.5, hold_until_checkpoint=False))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_mlopt.renamed import refuse_renamed

RENAMED_KEYS: Mapping[str, str] = {
    "send_every_s": "delivery.send_every_s",
    "flush_timeout_s": "delivery.flush_timeout_s",
    "hold_until_checkpoint": "delivery.hold_until_checkpoint",
}


def refuse_flat_keys(given: Mapping[str, Any]) -> None:
    """TypeError naming the new key of each flat 0.1 argument of MLflowTracker in ``given``."""
    refuse_renamed("MLflowTracker", given, RENAMED_KEYS, {"delivery": "Delivery"})


@dataclass(frozen=True)
class Delivery:
    """How records go from the outbox to the server: the sender's pace, the wait at the end, held steps.

    Example::

        MLflowTracker(delivery=Delivery(flush_timeout_s=120))
    """

    send_every_s: float = 2.0
    """Seconds between the sender's passes."""
    flush_timeout_s: float = 60.0
    """At the end of a successful fit, how long to wait for the server to take what is left (a failed or
    preempted launch waits at most 5 s: its grace belongs to the checkpoint)."""
    hold_until_checkpoint: bool = True
    """With FaultTolerantCheckpoint, send step rows once a checkpoint after them commits (each step once, the
    surviving value). False: send them as they come (live charts; a step redone after a kill appears twice)."""

    def __post_init__(self) -> None:
        for name, value in (("send_every_s", self.send_every_s), ("flush_timeout_s", self.flush_timeout_s)):
            if value <= 0:
                raise ValueError(f"delivery.{name} must be > 0, got {value}")
