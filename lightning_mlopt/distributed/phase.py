"""Which phase of a training step each process is in, for the hang watchdog's report."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from lightning_mlopt._compat import current_frames


class _State:
    # Plain attributes, written by the training thread and read by the watchdog thread (each a single store).
    phase = "setup"
    step = 0
    since = time.monotonic()


def set_phase(phase: str, step: int | None = None) -> None:
    """Record that this process entered ``phase`` (``data``, ``forward``, ``backward``, ...)."""
    _State.phase = phase
    _State.since = time.monotonic()
    if step is not None:
        _State.step = step


def current() -> tuple[str, int, float]:
    """(phase, step, seconds in that phase)."""
    return _State.phase, _State.step, time.monotonic() - _State.since


def main_thread_stack(frames: int = 8) -> str:
    """The main thread's innermost ``frames`` Python frames, read from any thread: where a stuck process waits."""
    main = current_frames().get(threading.main_thread().ident or -1)
    return "".join(traceback.format_stack(main)[-frames:]) if main is not None else ""


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a block (e.g. a checkpoint save) and restore the previous phase after it.

    Example::

        with phase("checkpoint"):
            save()
    """
    previous = _State.phase
    set_phase(name)
    try:
        yield
    finally:
        set_phase(previous)
