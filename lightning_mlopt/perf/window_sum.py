"""WindowSum: every rank's measurement window summed over ranks, without a blocking collective of its own.

A closed window (a vector where only this rank's slots are non-zero) rides in the next exchange another
callback makes anyway (``distributed/step_exchange.py``: FaultTolerantCheckpoint's per-step vote in every
CLI run, GradNormMonitor's norms): no collective is added. When that exchange runs in the background (the
vote with short steps), the sum arrives at the exchange a batch later. A window that no exchange picked up within a
batch (the monitor alone in the Trainer) is summed in the background instead (:class:`BackgroundSum`) and
read a batch later. Either way the training step never waits for it; the sums arrive one or two batches
after the window closed, each with the step it was closed at. Every rank submits at the same batches, so
every rank takes the same path.

Example::

    sums = WindowSum(trainer)                 # at train start, on every rank
    sums.submit(vector, trainer.global_step)  # at a logging step
    for values, step in sums.arrived():       # at every batch end
        report(values, step)
    for values, step in sums.drain():         # at the end of training (waits)
        report(values, step)
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_mlopt.distributed.background_sum import BackgroundSum
from lightning_mlopt.distributed.step_exchange import step_exchange

_NAME = "perf.window"


class WindowSum:
    """Sums submitted windows over every rank by the cheapest path available; see the module docstring."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self._background = BackgroundSum()  # created by every rank now: creating its group is collective
        self._waiting: tuple[list[float], int, int] | None = None  # (values, step, batch submitted at)
        self._offered: list[int] = []  # steps of windows an exchange took whose sums have not arrived yet
        self._in_background: int | None = None  # step of the window being summed in the background
        self._arrived: list[tuple[list[float], int]] = []
        self._batch = 0
        step_exchange(trainer).provide(_NAME, self._offer, receive=self._receive)

    def _offer(self) -> torch.Tensor:
        if self._waiting is None:
            return torch.zeros(0, dtype=torch.float64)
        values, step, _ = self._waiting
        self._offered.append(step)  # taken: its sum arrives with the exchange (now, or a batch later)
        self._waiting = None
        return torch.tensor(values, dtype=torch.float64)

    def _receive(self, values: list[float]) -> None:
        self._arrived.append((values, self._offered.pop(0)))

    def submit(self, values: list[float], step: int) -> None:
        """Offer a closed window (closed at optimizer step ``step``) to the next exchange."""
        if self._waiting is not None:  # the previous one found no exchange: it goes to the background
            self._to_background()
        self._waiting = (values, step, self._batch)

    def arrived(self) -> list[tuple[list[float], int]]:
        """At a batch end: the sums that arrived, oldest first; moves a window no exchange took to the background."""
        self._batch += 1
        if self._in_background is not None:
            self._arrived.append((self._background.result(), self._in_background))  # done while the batch ran
            self._in_background = None
        if self._waiting is not None and self._waiting[2] < self._batch:  # a whole batch, and no exchange
            self._to_background()
        arrived, self._arrived = self._arrived, []
        return arrived

    def drain(self) -> list[tuple[list[float], int]]:
        """Every sum still due, waiting for them (the end of training)."""
        step_exchange(self._trainer).settle()  # a window in the exchange's background sum arrives now
        if self._waiting is not None:
            self._to_background()
        if self._in_background is not None:
            self._arrived.append((self._background.result(), self._in_background))
            self._in_background = None
        arrived, self._arrived = self._arrived, []
        return arrived

    def close(self) -> None:
        """Stop offering windows to the exchange."""
        step_exchange(self._trainer).withdraw(_NAME)

    def _to_background(self) -> None:
        assert self._waiting is not None
        if self._in_background is not None:  # one in flight at a time: finish the older one first
            self._arrived.append((self._background.result(), self._in_background))
        values, step, _ = self._waiting
        self._background.start(values)
        self._in_background, self._waiting = step, None
