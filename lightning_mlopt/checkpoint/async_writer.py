"""One background thread that writes checkpoints, at most one at a time, and reports its failures."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from lightning_mlopt.process.exit import abandon_at_exit


class AsyncWriter:
    """Run one write at a time on a background thread; a new write first waits for the previous one.

    A failure is kept and raised by the next ``wait()`` or ``submit()``, in the training thread, so a
    failed background write is reported rather than lost.

    Example::

        writer = AsyncWriter()
        writer.submit(lambda: torch.save(state, path))   # returns at once
        writer.wait()                                    # blocks until written; raises if it failed
        writer.close()
    """

    def __init__(self, name: str = "checkpoint-writer") -> None:
        self._name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_seconds: float | None = None  # how long the last finished write ran
        self.longest_seconds: float | None = None  # the longest write so far
        self._started = 0.0

    @property
    def busy(self) -> bool:
        """True while a write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def running_for(self) -> float:
        """Seconds the write in flight has been running; 0 when none is."""
        return time.perf_counter() - self._started if self.busy else 0.0

    @property
    def failed(self) -> bool:
        """True when a finished write failed and ``wait()`` has not raised its error yet (never blocks)."""
        return self._error is not None

    def submit(self, write: Callable[[], None]) -> None:
        """Wait for the write in flight (raising its error, if any), then start ``write`` in the background."""
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as error:
                self._error = error
            finally:
                self.last_seconds = time.perf_counter() - self._started
                self.longest_seconds = max(self.longest_seconds or 0.0, self.last_seconds)

        # Not a daemon: the interpreter waits for a write in progress rather than cutting it off.
        self._thread = threading.Thread(target=run, name=self._name, daemon=False)
        self._started = time.perf_counter()
        self._thread.start()

    def wait(self) -> None:
        """Block until no write is in flight; raise the error of a failed write once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def join(self, timeout: float | None) -> bool:
        """Wait at most ``timeout`` seconds (None: no limit) for the write in flight; whether it ended (no raise)."""
        if self._thread is not None:
            self._thread.join(None if timeout is None else max(timeout, 0.0))
        return not self.busy

    def abandon(self) -> None:
        """Stop waiting for the write in flight: it goes on until the process exits, and is never waited for.

        For a preempted process whose grace has no room for it: the write's staging folder is never committed.
        """
        if self._thread is not None:
            abandon_at_exit(self._thread)
        self._thread = None
        self._error = None

    def close(self) -> None:
        """Wait for the last write; errors are raised as in ``wait()``."""
        self.wait()
