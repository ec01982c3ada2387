"""Tests that measure time run with no other test beside them, under pytest-xdist's workers.

A test marked ``solo`` (its verdict depends on time: a data-wait fraction, an input- or compute-bound call)
takes a room lock exclusively; every other test takes it shared. A turnstile, held by a solo test while it
waits for the room, stops the other worker from starting test after test and starving it. Nothing is locked
without xdist (one process runs one test at a time anyway).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def room(solo: bool) -> Iterator[None]:
    """Hold the session's room: alone when ``solo``, else beside the other worker's non-solo tests.

    Example::

        with room(solo=item.get_closest_marker("solo") is not None):
            ...  # set up, run and tear down the test
    """
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        yield
        return
    base = Path(tempfile.gettempdir()) / f"lightning_mlopt-tests-{run}"
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.room", "a") as shared_room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not solo:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(shared_room, fcntl.LOCK_EX if solo else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(shared_room, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
