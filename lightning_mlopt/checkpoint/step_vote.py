"""The checkpoint's per-step vote: what any rank saw (a signal, the save timer run out, a failed background write).

Every rank must act on these at the same step boundary, or a collective save deadlocks; so each rank's flags go
into the batch's one exchange (``distributed/step_exchange.py``) and every rank reads the same sums.

With short steps (the ranks' mean under ``LAG_BELOW_S``, on 2+ ranks) the vote is read one boundary late: the
sum started at the previous boundary and finished while this step trained, so no rank waits for the collective.
One more step before a signal is acted on is then under a second of a grace of tens of seconds; longer steps vote
in step.

Example::

    vote = StepVote(every_n_minutes=30, saver=saver, budget=exit_response.budget)
    vote.start(trainer, collectives_at_step_start=False)      # setup: provide this rank's flags
    agreed = vote.agree(trainer, last_save_step)               # each step boundary, on every rank
    if agreed.signalled: ...
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from lightning_mlopt.checkpoint.saver import CheckpointSaver
from lightning_mlopt.distributed.step_exchange import step_exchange
from lightning_mlopt.process.grace import SaveBudget
from lightning_mlopt.process.signals import preemption

KEY = "checkpoint.vote"
# The flags: signal, timer due, write failed, and after a signal: no time for a new save, no time for the save in
# flight; then the rank's last step in seconds (summed: the ranks' mean x world).
SLOTS = 6
# Below this mean step time the vote is read one batch late (no wait on the step's path: an all-reduce is ~0.5 ms
# on busy CPU cores, 3-5% of a short step).
LAG_BELOW_S = 1.0


class Agreed(NamedTuple):
    """What the ranks agreed on at a step boundary (identical on every rank)."""

    signalled: bool = False
    due_by_time: bool = False
    no_time: bool = False
    no_time_in_flight: bool = False


class StepVote:
    """A rank's flags, summed over the ranks at each step boundary.

    Args:
        every_n_minutes: the save timer (None: never by time).
        saver: the run's saver (whether a background write failed; raises the failure on every rank).
        budget: after a signal, what the time left allows.
        signals: whether any signal requests a save (else only the timer and failed writes are voted on).

    """

    def __init__(
        self,
        every_n_minutes: float | None,
        saver: CheckpointSaver,
        budget: Callable[[], SaveBudget],
        signals: bool = True,
    ) -> None:
        self.every_n_minutes = every_n_minutes
        self.saver = saver
        self.budget = budget
        self.needed = signals or every_n_minutes is not None or saver.async_save
        self.last_save_time = time.monotonic()
        self._lagged = False  # agreed at each boundary from the ranks' mean step time (identical on all)
        self._may_lag = True
        self._last_boundary: float | None = None
        # This rank's last step, boundary to boundary; "not short" until one is measured: another callback's
        # exchange may sample the flags before the first boundary's agree.
        self._step_s = LAG_BELOW_S
        self._save_step_at_vote = -1  # the last save when the vote now in the background was sampled

    def start(self, trainer: Any, collectives_at_step_start: bool) -> None:
        """Setup, every rank: each batch's exchange carries this rank's flags from now on."""
        if not self.needed:
            return
        step_exchange(trainer).provide(KEY, self._local_flags)
        # On CPU the vote shares training's gloo group: left in flight across a boundary it would delay a
        # strategy that gathers at the step's start (FSDP: 13% a step), so such a strategy votes in step there.
        self._may_lag = not (trainer.world_size > 1 and _on_gloo() and collectives_at_step_start)

    def stop(self, trainer: Any) -> None:
        """Teardown: the exchange no longer carries the flags."""
        step_exchange(trainer).withdraw(KEY)

    def saved(self) -> None:
        """A save was made: the timer starts again."""
        self.last_save_time = time.monotonic()

    def agree(self, trainer: Any, last_save_step: int) -> Agreed:
        """Every rank, at a step boundary: the sums of what the ranks saw. A failed write raises here, on all."""
        if not self.needed:
            return Agreed()
        now = time.monotonic()
        # The first boundary knows no step time: it says "not short", so voting starts in step.
        self._step_s = now - self._last_boundary if self._last_boundary is not None else LAG_BELOW_S
        self._last_boundary = now
        exchange = step_exchange(trainer)
        if self._lagged and not exchange.exchanged(trainer, KEY):
            total = exchange.read_previous(trainer, KEY) or [0.0] * SLOTS
            if self._save_step_at_vote != last_save_step:
                total[1] = 0.0  # "timer due" from before the save made since: that save reset the timer
            self._save_step_at_vote = last_save_step
        else:
            total = exchange.read(trainer, KEY)
        # Every rank reads the same sums, so every rank votes the same way at the next boundary.
        self._lagged = self._may_lag and trainer.world_size > 1 and total[5] / trainer.world_size < LAG_BELOW_S
        signalled, due, write_failed, no_time, no_time_in_flight = (value > 0 for value in total[:5])
        if write_failed:
            self.saver.wait(trainer)  # collective: every rank raises the same error
        return Agreed(signalled, due, no_time, no_time_in_flight)

    def _local_flags(self) -> torch.Tensor:
        """What this rank sees now: a signal received, the timer run out, a background write failed."""
        due = self.every_n_minutes is not None and (
            time.monotonic() - self.last_save_time >= 60.0 * self.every_n_minutes
        )
        signalled = preemption.received() is not None
        flags = [float(signalled), float(due), float(self.saver.failed), 0.0, 0.0, self._step_s]
        if signalled:  # the time left matters only after a signal: without one, any save fits
            budget = self.budget()
            flags[3:5] = [float(not budget.new_save_fits), float(not budget.in_flight_fits)]
        return torch.tensor(flags)  # host values for a host exchange: no copy to or from a GPU, every step


def _on_gloo() -> bool:
    """Whether training's own process group is gloo (CPU), the one the vote's sums then share."""
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and (torch.distributed.get_backend() == "gloo")
    )
