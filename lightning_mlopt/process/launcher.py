"""Which launcher started this rank, and waiting for it to go first: standard library only.

Lightning's launcher (rank zero on one machine) starts ranks 1..N-1 as its children and SIGKILLs itself as soon
as it sees a child exit non-zero, which would turn the job's status (rank zero's) into 137. So a child it
started leaves after it, on every exit path: the agreed exit (``exit.py``), the signal deadline
(``signals.py``) and the start-up deadline (``startup.py``), which run in other threads and import this lazily.

Example::

    from lightning_mlopt.process.launcher import LAUNCHER_WAIT_S, started_by_lightning_launcher

    if started_by_lightning_launcher():
        wait_for_parent_to_exit(LAUNCHER_WAIT_S)
"""

from __future__ import annotations

import os
import time

LAUNCHER_WAIT_S = 30.0
"""The most a launched rank waits for its launcher to exit before it exits anyway."""


def started_by_lightning_launcher() -> bool:
    """Ranks 1.. of a one-machine run that Lightning's own launcher started (not torchrun, not srun)."""
    env = os.environ
    return env.get("LOCAL_RANK", "0") != "0" and "TORCHELASTIC_RUN_ID" not in env and "SLURM_PROCID" not in env


def is_global_rank_zero() -> bool:
    """Whether this process is the job's rank zero, from its launcher's environment (before any Trainer exists).

    torchrun sets ``RANK``; srun ``SLURM_PROCID`` (read only inside an allocation with ``SLURM_NTASKS``: a stray
    value in a login shell must not silence a one-process run); Lightning's launcher ``LOCAL_RANK`` on one machine.
    """
    env = os.environ
    rank = env.get("RANK") or (env.get("SLURM_PROCID") if "SLURM_NTASKS" in env else None)
    return (rank or env.get("LOCAL_RANK", "0")) == "0"


_launcher_pid: int | None = None  # the parent this rank started with (remember_launcher)


def remember_launcher() -> None:
    """Record this process's parent as its launcher, at start-up (the entry point, for a launched rank).

    A rank whose launcher died is re-parented; without this record, waiting for "the parent" to exit would wait
    for the new one (init, a subreaper), which never does.
    """
    global _launcher_pid
    _launcher_pid = os.getppid()


def wait_for_parent_to_exit(limit_s: float) -> None:
    """Poll until this process's launcher has exited (it is re-parented), ``limit_s`` at most.

    The launcher is the parent :func:`remember_launcher` recorded (else the parent now): a rank whose launcher
    is already gone returns at once. Safe from any thread (the signal deadline's watcher, the start-up guard's
    own thread): it stops nothing.
    """
    parent = _launcher_pid if _launcher_pid is not None else os.getppid()
    deadline = time.monotonic() + limit_s
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.05)
