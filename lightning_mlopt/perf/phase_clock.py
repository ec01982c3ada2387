"""PhaseClock: the seconds a process spends in each phase of its training steps."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from lightning_mlopt.process import phase


class PhaseClock:
    """Seconds this process spent in each phase since the last :meth:`take`, from the phase markers.

    On CPU the host clock times the phases. On CUDA a CUDA event is recorded at each phase change and nothing
    waits for the GPU until :meth:`take`, which synchronizes once on the newest event: the phases are then GPU
    time (a forward whose kernels are still queued is not "done" when the host moves on), and the host is never
    blocked between reads. Call :meth:`take` only as often as the numbers are needed (a logging step).

    Example::

        clock = PhaseClock(torch.device("cpu")).attach()
        ...                                     # training steps mark phases
        seconds = clock.take()                  # {"data": 0.8, "forward": 2.1, ...}
        clock.detach()
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._totals: dict[str, float] = defaultdict(float)
        self._since = time.perf_counter()
        self._events: list[tuple[str, Any]] = []  # CUDA: (phase that ended, event recorded at its end)
        self._start_event: Any = self._event() if self._cuda else None

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def attach(self) -> PhaseClock:
        """Start receiving the phase changes of this process, counting from now."""
        self.reset()
        phase.add_listener(self)
        return self

    def detach(self) -> None:
        """Stop receiving phase changes."""
        phase.remove_listener(self)

    def switch(self, ended: str) -> None:
        """Phase ``ended`` ends now (called by :func:`set_phase`)."""
        if self._cuda:
            self._events.append((ended, self._event()))
        else:
            now = time.perf_counter()
            self._totals[ended] += now - self._since
            self._since = now

    def reset(self) -> None:
        """Forget the time counted so far; counting restarts now."""
        self._totals = defaultdict(float)
        self._since = time.perf_counter()
        self._events = []
        if self._cuda:
            self._start_event = self._event()

    def take(self) -> dict[str, float]:
        """Seconds per phase since the last take (or reset), including the current phase up to now; resets."""
        self.switch(phase.current_phase())
        if self._cuda and self._events:
            self._events[-1][1].synchronize()  # the one host wait, on the reads the caller asked for
            previous = self._start_event
            for ended, event in self._events:
                self._totals[ended] += previous.elapsed_time(event) / 1e3
                previous = event
            self._start_event, self._events = previous, []
        totals = dict(self._totals)
        self._totals = defaultdict(float)
        return totals
