"""The exit statuses of ``python -m lightning_mlopt``, named once (README: "Exit statuses").

Standard library only: the entry point's guards import it before torch.

Example::

    raise SystemExit(BAD_INPUT)
"""

from __future__ import annotations

SUCCESS = 0
FAILURE = 1  # anything else: a traceback says what
BAD_INPUT = 2  # the configuration or arguments are wrong; nothing was written
CHECKPOINT_WRITE = 74  # EX_IOERR: a checkpoint could not be written (full disk, read-only mount, ...)
REQUEUE = 75  # EX_TEMPFAIL, "try again": saved after a preemption signal; the sbatch script requeues on it
TIME_LIMIT = 124  # as timeout(1): start-up outlasted startup_timeout, or the hang watchdog fired
ORPHANED = FAILURE  # a launched rank whose launcher is gone (nobody collects its status)
