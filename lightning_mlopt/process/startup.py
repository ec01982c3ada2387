"""A deadline for start-up, and an end for a rank whose launcher is gone.

Start-up (imports, the process-group rendezvous, DeepSpeed's op builds, wrapping, resuming) runs before any
step, so no step-based watchdog covers it, and the process group's own timeout is 30 minutes. A rank whose
peer died there, or that waits on a lock nobody will release, would sit that long or forever. The guard
ends it at ``timeout_s`` with a short message naming where the main thread waits, and exit status 124 (as
timeout(1)); the first training or evaluation batch disarms it.

A rank started by a launcher (Lightning's for ranks 1..N-1 on one machine, torchrun) also watches its parent:
when the launcher is gone (killed, or it crashed), nobody will collect this process's result, and its peers
are gone or going, so it exits instead of lingering for the process group's timeout.

Only the standard library is imported here: this module loads before torch.

Example::

    from lightning_mlopt.process.startup import startup_guard

    startup_guard.arm(900)          # the entry point, before importing torch
    ...
    startup_guard.disarm()          # the first batch ran
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from lightning_mlopt.process import exit_codes

DEFAULT_STARTUP_TIMEOUT_S = 900.0
STARTUP_TIMEOUT_EXIT_CODE = exit_codes.TIME_LIMIT
ORPHAN_EXIT_CODE = exit_codes.ORPHANED


class StartupGuard:
    """One daemon thread per process: the start-up deadline and, for launched ranks, the parent watch.

    Args:
        poll_s: how often the thread looks (a second: the deadline is minutes, parent loss is not urgent to
            the millisecond).

    """

    def __init__(self, poll_s: float = 1.0) -> None:
        self.poll_s = poll_s
        self._deadline: float | None = None
        self._timeout_s = 0.0
        self._parent: int | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._last_words: list[Callable[[str], object]] = []

    def arm(self, timeout_s: float | None) -> None:
        """Start (or restart) the start-up clock: ``timeout_s`` from now; None or 0 turns it off."""
        self._timeout_s = float(timeout_s or 0)
        self._deadline = time.monotonic() + self._timeout_s if self._timeout_s > 0 else None
        self._ensure_thread()

    def disarm(self) -> None:
        """Start-up is over: the first batch ran."""
        self._deadline = None

    @property
    def armed(self) -> bool:
        """True while the start-up clock runs."""
        return self._deadline is not None

    def watch_parent(self) -> None:
        """End this process when its parent (the launcher) is gone."""
        self._parent = os.getppid()
        self._ensure_thread()

    def add_last_words(self, write: Callable[[str], object]) -> None:
        """Call ``write(reason)`` before this rank ends because its launcher is gone.

        The hang watchdog registers its stack dump here: when every rank's watchdog fires at once and the
        launching rank exits first, the rank that hung would otherwise end as an orphan before its own watchdog
        wrote the dump that names the culprit.
        """
        self._last_words.append(write)

    def remove_last_words(self, write: Callable[[str], object]) -> None:
        """Undo :meth:`add_last_words` (the watchdog stopped)."""
        if write in self._last_words:
            self._last_words.remove(write)

    def stop(self) -> None:
        """Stop the thread (tests); the process-wide guard otherwise lives as long as the process."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._stop.clear()

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="startup-guard", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self._exit(
                    STARTUP_TIMEOUT_EXIT_CODE,
                    f"start-up did not finish within {self._timeout_s:.0f} s (startup_timeout); the first step never "
                    "ran. Usual causes: a rank that died or never started (the others wait for it in the "
                    "process-group rendezvous or a collective), or a lock left by a killed process. Exiting with "
                    f"status {STARTUP_TIMEOUT_EXIT_CODE}.",
                )
            if self._parent is not None and os.getppid() != self._parent:
                self._say_last_words(f"the process that launched this rank (pid {self._parent}) is gone")
                self._exit(
                    ORPHAN_EXIT_CODE,
                    f"the process that launched this rank (pid {self._parent}) is gone; its peers are gone or "
                    f"going, so this rank exits (status {ORPHAN_EXIT_CODE}) instead of waiting for them.",
                )

    def _say_last_words(self, reason: str) -> None:
        for write in list(self._last_words):
            try:
                write(reason)
            except Exception as error:  # an exit path: a failed dump must not keep the orphan alive
                sys.stderr.write(f"warning: could not write the last words before exiting: {error!r}\n")

    @staticmethod
    def _exit(code: int, message: str) -> None:
        from lightning_mlopt.process import phase  # stdlib-only module

        name, step, in_phase = phase.current()
        rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or os.environ.get("LOCAL_RANK") or "0"
        stack = phase.main_thread_stack()
        sys.stderr.write(
            f"error: rank {rank}: {message} Phase '{name}' (step {step}) for {in_phase:.0f} s. Main thread:\n{stack}"
        )
        sys.stderr.flush()
        if code != ORPHAN_EXIT_CODE:  # an orphan's launcher is gone already
            from lightning_mlopt.process.launcher import (
                LAUNCHER_WAIT_S,
                started_by_lightning_launcher,
                wait_for_parent_to_exit,
            )

            if started_by_lightning_launcher():  # leaving first, it would make the launcher SIGKILL itself (137)
                wait_for_parent_to_exit(LAUNCHER_WAIT_S)
        os._exit(code)


startup_guard = StartupGuard()
"""The process's one start-up guard."""
