"""NCCLHealthCheck's settings for its two in-training concerns: the hang watchdog and the straggler check.

The pre-flight checks keep their flat keys (``barrier_timeout``, ``probe_mb``, ...); the watchdog and the
straggler check are groups, each checking its own values. The flat keys of 0.1 (``hang_timeout``, ...) are
refused with the new key named (:data:`RENAMED_KEYS`).

Example::

    NCCLHealthCheck(watchdog=Watchdog(timeout=900, adaptive_multiple=10), stragglers=Stragglers(factor=2.0))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_mlopt.process import exit_codes
from lightning_mlopt.renamed import refuse_renamed

RENAMED_KEYS: Mapping[str, str] = {
    "hang_timeout": "watchdog.timeout",
    "adaptive_multiple": "watchdog.adaptive_multiple",
    "hang_exit_code": "watchdog.exit_code",
    "dump_dir": "watchdog.dump_dir",
    "straggler_every_n_steps": "stragglers.every_n_steps",
    "straggler_factor": "stragglers.factor",
}


def refuse_flat_keys(given: Mapping[str, Any]) -> None:
    """TypeError naming the new key of each flat 0.1 argument of NCCLHealthCheck in ``given``."""
    refuse_renamed("NCCLHealthCheck", given, RENAMED_KEYS, {"watchdog": "Watchdog", "stragglers": "Stragglers"})


@dataclass(frozen=True)
class Watchdog:
    """The hang watchdog: a thread per rank that ends the process when no step finishes in time.

    Example::

        NCCLHealthCheck(watchdog=Watchdog(timeout=900))
    """

    timeout: float | None = 1800.0
    """Seconds without a finished step before the watchdog fires (None: no watchdog)."""
    adaptive_multiple: float | None = None
    """Raise the limit to this multiple of the longest step seen on any rank, when that is larger."""
    exit_code: int = exit_codes.TIME_LIMIT
    """Exit status after a hang (124, as timeout(1))."""
    dump_dir: str | None = None
    """Folder for the stack dumps; None: ``<trainer.default_root_dir>/health``."""

    def __post_init__(self) -> None:
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"watchdog.timeout must be > 0 or null, got {self.timeout}")
        if self.adaptive_multiple is not None and self.adaptive_multiple <= 1:
            raise ValueError(f"watchdog.adaptive_multiple must be > 1, got {self.adaptive_multiple}")
        if not 1 <= self.exit_code <= 255:
            raise ValueError(f"watchdog.exit_code must be in 1..255, got {self.exit_code}")


@dataclass(frozen=True)
class Stragglers:
    """The straggler check: each rank's mean forward time, compared in one small collective.

    Example::

        NCCLHealthCheck(stragglers=Stragglers(every_n_steps=50, factor=2.0))
    """

    every_n_steps: int | None = 100
    """How often to compare the ranks' forward times (None: never)."""
    factor: float = 1.5
    """A rank this many times slower than the median is a straggler."""

    def __post_init__(self) -> None:
        if self.every_n_steps is not None and self.every_n_steps < 1:
            raise ValueError(f"stragglers.every_n_steps must be >= 1 or null, got {self.every_n_steps}")
        if self.factor <= 0:
            raise ValueError(f"stragglers.factor must be > 0, got {self.factor}")
