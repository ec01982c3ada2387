"""A ``fit`` that one of our processes starts: its environment, and the scheduler's signals passed on to it.

The starters are a sweep's trials and ``profile``'s measured runs.

Standard library only.

Example::

    code, signalled = run_forwarding_signals(command_line("fit", "--config", "c.yaml"), log, child_fit_env())
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from typing import IO, Any


def child_fit_env(**extra: str) -> dict[str, str]:
    """The environment of a ``fit`` this process starts (a sweep's trial, a ``profile`` measurement).

    Outside SLURM, ``MASTER_PORT`` is dropped so that each child's ranks pick a free port (a port left set
    by an earlier run, or by our own parent, would be taken); under ``srun`` SLURM's rules hold and it stays.

    Example::

        subprocess.run(command_line("fit", "--config", "c.yaml"), env=child_fit_env(WANDB_RUN_GROUP="s1"))
    """
    env = {**os.environ, **extra}
    if "SLURM_NTASKS" not in env:
        env.pop("MASTER_PORT", None)
    return env


_FORWARDED = (signal.SIGTERM, signal.SIGUSR1)


def run_forwarding_signals(command: Sequence[str], log: IO[bytes], env: dict[str, str]) -> tuple[int, bool]:
    """Run a trial, forwarding SIGTERM/SIGUSR1 sent to the sweep (preemption, a SLURM time limit) to it.

    The trial's FaultTolerantCheckpoint saves and exits 75, instead of the signal killing the sweep and
    orphaning the trial. Returns the trial's exit status and whether a signal came.
    """
    child = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, env=env)
    received: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        if child.poll() is None:
            child.send_signal(signum)

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {number: signal.signal(number, forward) for number in _FORWARDED} if in_main_thread else {}
    try:
        return child.wait(), bool(received)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
