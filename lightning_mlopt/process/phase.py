"""Where each process is in a training step: the one place that knows a step's phases.

The phases are marked from the Trainer's hooks by ``callbacks/phase_markers.py`` (a callback base that
NCCLHealthCheck and PerformanceMonitor share) and by :func:`phase` around blocks such as a checkpoint save.
Two readers use them: the hang watchdog reports the phase a stuck process is in (:func:`current`), and
listeners such as ``perf/phase_clock.py`` add up the time spent in each phase (PerformanceMonitor's step-time
breakdown).

A step's phases, in order: ``data`` (blocked on the dataloader: from the fetch of a batch to its start, the
transfer to the device included), ``forward``, ``backward``, ``optimizer`` (the step, zeroing, the hooks around
it), ``loop`` (between batches, outside the dataloader: Lightning's loop, logging, learning-rate schedulers,
callbacks' batch-end hooks), and ``checkpoint`` wherever a save runs. Outside a step's phases: ``setup``,
``restore`` (FaultTolerantCheckpoint finding, verifying and loading the checkpoint a run resumes from),
``validation`` (inside fit), and ``monitor`` (PerformanceMonitor's own work), which step-time figures leave out.
The process also keeps the total time spent in each phase (:func:`totals`): the goodput ledger
(``goodput/ledger.py``) reads it where the next batch's ``data`` begins, the only change it listens for.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

from lightning_mlopt._compat import current_frames

PHASES = ("data", "forward", "backward", "optimizer", "loop", "checkpoint")


class PhaseListener(Protocol):
    """Told when a phase ends (e.g. a clock that adds up the time per phase)."""

    def switch(self, ended: str) -> None:
        """Phase ``ended`` ends now; :func:`current_phase` already names the phase entered."""


class _State:
    # Plain attributes, written by the training thread and read by the watchdog thread (each a single store).
    phase = "setup"
    step = 0
    since = time.monotonic()
    totals: dict[str, float] = {}  # seconds spent in each phase before the current stretch
    # Each listener with the phases whose entry it is told of (None: every change).
    listeners: tuple[tuple[PhaseListener, frozenset[str] | None], ...] = ()


def set_phase(phase: str, step: int | None = None) -> None:
    """Record that this process entered ``phase`` (``data``, ``forward``, ``backward``, ...).

    Marking the phase the process is already in changes nothing but the step: several callbacks mark the
    same hook, and the time in a phase runs from its first mark.
    """
    if step is not None:
        _State.step = step
    if phase == _State.phase:
        return
    ended, now = _State.phase, time.monotonic()
    _State.totals[ended] = _State.totals.get(ended, 0.0) + now - _State.since
    _State.phase = phase
    _State.since = now
    for listener, entering in _State.listeners:  # told after the change: it can see where the process went
        if entering is None or phase in entering:
            listener.switch(ended)


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


def add_listener(listener: PhaseListener, entering: Iterable[str] | None = None) -> None:
    """Tell ``listener`` about every phase change of this process from now on (``entering``: only into those).

    A listener costs a call at every change it is told of: one that needs only a step's boundary says so.
    """
    if all(known is not listener for known, _ in _State.listeners):
        _State.listeners = (*_State.listeners, (listener, None if entering is None else frozenset(entering)))


def remove_listener(listener: PhaseListener) -> None:
    """Stop telling ``listener``."""
    _State.listeners = tuple(known for known in _State.listeners if known[0] is not listener)


def totals() -> dict[str, float]:
    """Seconds this process spent in each phase so far (monotonic clock), the current one up to now.

    Example::

        >>> before = totals().get("checkpoint", 0.0)
        >>> with phase("checkpoint"):
        ...     time.sleep(0.01)
        >>> totals()["checkpoint"] - before >= 0.01
        True
    """
    spent = dict(_State.totals)
    spent[_State.phase] = spent.get(_State.phase, 0.0) + time.monotonic() - _State.since
    return spent


def current_phase() -> str:
    """The phase this process is in now."""
    return _State.phase
