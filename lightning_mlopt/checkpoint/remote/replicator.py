"""Copies committed local checkpoints to the remote tier in the background, so saving blocks as a local disk does.

Two tiers: every save commits to a local folder first (node-local disk, tmpfs: fast to write, fast to resume
from), and the remote tier (an object store) receives a copy of a committed local checkpoint when one is due:
every commit, or every ``every_n_steps`` / ``every_n_minutes`` since the last copy. Copies never queue up: while
one uploads, only the newest checkpoint committed meanwhile waits (older ones would be stale on arrival).

``must_succeed``: the remote tier is where the user asked checkpoints to be (``dirpath: s3://...``); a failed
copy fails the save (the run stops with exit 74, earlier remote checkpoints intact). Otherwise (an explicit
``tiers.local_dirpath`` beside it) a failed copy is said once, training goes on with local saves, and the next due
copy tries again.

Example::

    replicator = Replicator(RemoteCheckpoints(ObjectStore.for_url("s3://ckpt/run")), every_n_steps=500)
    replicator.offer(Path("local/step-000000500"), step=500)   # rank zero, after each local commit
    replicator.flush(timeout=None)                             # at the end of training
    replicator.close()
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from lightning_mlopt.checkpoint.remote.checkpoints import RemoteCheckpoints
from lightning_mlopt.exceptions import ObjectStoreError, SupersededCopyError
from lightning_mlopt.process.exit import abandon_at_exit

log = logging.getLogger(__name__)


class Replicator:
    """Uploads committed local checkpoints to ``remote`` from a background thread, the newest first.

    The thread lives while there is something to copy (a run that ends on an exception leaves none behind).

    Args:
        remote: the remote tier.
        every_n_steps: copy when at least this many steps passed since the last copy (None: no step rule).
        every_n_minutes: copy when at least this many minutes passed since the last copy (None: no time rule).
            With neither rule, every commit is copied.
        must_succeed: a failed copy is an error of the save (True), or a warning said once (False).

    """

    def __init__(
        self,
        remote: RemoteCheckpoints,
        every_n_steps: int | None = None,
        every_n_minutes: float | None = None,
        must_succeed: bool = True,
    ) -> None:
        self.remote = remote
        self.every_n_steps = every_n_steps
        self.every_n_minutes = every_n_minutes
        self.must_succeed = must_succeed
        self.last_copied_step: int | None = None
        self.longest_seconds: float | None = None  # the longest copy so far: what a preempted rank budgets
        self._last_copy_time = time.monotonic()
        self._pending: tuple[Path, int] | None = None
        self._in_flight: int | None = None
        self._error: ObjectStoreError | None = None
        self._failing = False  # a copy failed and no copy has succeeded since (said once)
        self._closed = False
        self._abandoned = False
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def is_due(self, step: int) -> bool:
        """Whether a checkpoint committed at ``step`` should be copied now."""
        if self.every_n_steps is None and self.every_n_minutes is None:
            return True
        since = step - (self.last_copied_step if self.last_copied_step is not None else 0)
        by_steps = self.every_n_steps is not None and since >= self.every_n_steps
        by_time = (
            self.every_n_minutes is not None and time.monotonic() - self._last_copy_time >= 60 * self.every_n_minutes
        )
        return by_steps or by_time

    def offer(self, path: Path, step: int, force: bool = False) -> None:
        """A checkpoint was committed locally at ``path``: copy it if due (``force``: the final or a signal save)."""
        if not (force or self.is_due(step)):
            return
        with self._changed:
            if self._closed:
                return
            self._pending = (path, step)  # replaces an older one still waiting: it would be stale on arrival
            if self._thread is None:
                # Not a daemon: the interpreter waits for a copy in progress rather than cutting it off.
                self._thread = threading.Thread(target=self._run, name="checkpoint-replicator", daemon=False)
                self._thread.start()

    def busy_steps(self) -> set[int]:
        """Steps being copied or waiting to be: local retention must keep them until then."""
        with self._changed:
            return {step for step in (self._in_flight, self._pending and self._pending[1]) if step is not None}

    @property
    def failed(self) -> bool:
        """A copy that had to succeed failed, and ``take_error`` has not returned it yet (never blocks)."""
        return self._error is not None

    def take_error(self) -> ObjectStoreError | None:
        """The failure of a copy that had to succeed, once."""
        with self._changed:
            error, self._error = self._error, None
            return error

    def flush(self, timeout: float | None) -> bool:
        """Wait until nothing is copying or waiting, or ``timeout`` seconds (None: no limit); whether it is done."""
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        with self._changed:
            if self._abandoned:  # given up: nothing is waited for any more
                return self._pending is None and self._in_flight is None
            while self._pending is not None or self._in_flight is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def abandon(self) -> None:
        """Stop copying: a preempted process has no time left; the copy in flight never holds the exit."""
        with self._changed:
            self._pending = None
            self._closed = self._abandoned = True
            self._changed.notify_all()
        if self._thread is not None:
            abandon_at_exit(self._thread)

    def close(self) -> None:
        """Finish the copy in flight and the one waiting; no copy starts after it."""
        with self._changed:
            self._closed = True
            thread = self._thread
        if thread is not None and not self._abandoned:  # an abandoned copy never holds the exit
            thread.join()

    def _run(self) -> None:
        while True:
            with self._changed:
                if self._pending is None:  # nothing left: the thread ends; the next offer starts another
                    self._thread = None
                    return
                (path, step), self._pending = self._pending, None
                self._in_flight = step
            started = time.monotonic()
            try:
                url = self.remote.upload(path)
            except SupersededCopyError:
                # The step was saved again while it was copied: copy the newer save (unless a newer one waits).
                log.info("The checkpoint of step %d was saved again while it was copied: copying the newer save", step)
                with self._changed:
                    if self._pending is None and not self._abandoned:
                        self._pending = (path, step)
            except ObjectStoreError as error:
                self._failed_copy(step, error)
            except Exception as error:  # a local file gone or unreadable: the copy failed, the same way
                self._failed_copy(step, ObjectStoreError(f"{self.remote.url}: copying {path} failed: {error}"))
            else:
                self._copied(step, url, time.monotonic() - started)
            with self._changed:
                self._in_flight = None
                self._changed.notify_all()

    def _copied(self, step: int, url: str, seconds: float) -> None:
        if self._failing:
            log.warning("Remote checkpoint copies work again: %s (step %d)", url, step)
        self._failing = False
        self.last_copied_step, self._last_copy_time = step, time.monotonic()
        self.longest_seconds = max(self.longest_seconds or 0.0, seconds)
        log.info("Copied the checkpoint of step %d to %s in %.1f s", step, url, seconds)

    def _failed_copy(self, step: int, error: ObjectStoreError) -> None:
        if self.must_succeed:
            with self._changed:
                self._error = self._error or error
                self._pending = None  # later copies would fail alike; the run stops at its next step boundary
            return
        if not self._failing:  # said once, until a copy works again
            log.warning(
                "Remote checkpoint copies are failing (step %d): %s. Training goes on with local checkpoints; "
                "the next due copy tries again.",
                step,
                error,
            )
        self._failing = True
