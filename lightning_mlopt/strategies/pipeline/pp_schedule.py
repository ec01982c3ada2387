"""Pipeline schedules by YAML name: what each asks of the split, its theoretical bubble, and the measured one.

A schedule streams ``m`` micro-batches through ``p`` pipeline ranks. Before the first micro-batch reaches the
last rank, and after the last one leaves the first, ranks wait: the *bubble*. With equal forward and backward
times per stage and free communication it is ``(p - 1) / (m + p - 1)`` of the step for GPipe and 1F1B (which
differ in memory: 1F1B keeps at most ``p`` micro-batches' activations alive, GPipe all ``m``), and
``(p - 1) / (v * m + p - 1)`` when each rank holds ``v`` stages taken in turn (interleaved 1F1B, looped BFS).
The seeds' rule: ``m >= 4 p``; a bubble over 20% asks for more micro-batches, interleaving or another split.

:class:`BubbleClock` measures it: the time each of this rank's stages spends computing (forward, backward),
taken from the whole step's wall time, is the time it waited.

Example::

    schedule = SCHEDULES["1f1b"]
    schedule.theoretical_bubble(ranks=2, microbatches=4)   # 0.2
    clock = BubbleClock(stages)
    with clock.step():
        pipeline_schedule.step(inputs)
    clock.bubble()                                         # this rank's idle share of that step
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps
from typing import Any

from lightning_mlopt.exceptions import BadInputError

MICROBATCHES_PER_RANK = 4
"""Fewer micro-batches than this many per pipeline rank earn a warning: the bubble is then over 20%."""


@dataclass(frozen=True)
class ScheduleKind:
    """One schedule of ``torch.distributed.pipelining`` as YAML names it.

    Args:
        name: the YAML name (``gpipe``).
        torch_name: the name ``get_schedule_class`` knows (``GPipe``).
        stages_per_rank: how many stages each rank holds by default; ``multi_stage``: whether more than one
            is allowed (and whether the schedule takes a list of stages).
        microbatches_at_least_stages: the schedule refuses fewer micro-batches than stages (1F1B).
        description: one line for the docs and the error that lists them.

    """

    name: str
    torch_name: str
    stages_per_rank: int
    multi_stage: bool
    microbatches_at_least_stages: bool
    description: str

    def theoretical_bubble(self, ranks: int, microbatches: int, stages_per_rank: int = 1) -> float:
        """The idle share of a step with equal stage times and free communication (see the module docstring)."""
        v = stages_per_rank if self.multi_stage else 1
        return (ranks - 1) / (v * microbatches + ranks - 1)

    def few_microbatches(self, ranks: int, microbatches: int, stages_per_rank: int = 1) -> str | None:
        """A warning when fewer than :data:`MICROBATCHES_PER_RANK` per pipeline rank leave a bubble over 20%."""
        enough = MICROBATCHES_PER_RANK * ranks
        if microbatches >= enough:
            return None
        bubble = self.theoretical_bubble(ranks, microbatches, stages_per_rank)
        return (
            f"pipeline: {microbatches} micro-batches for {ranks} pipeline ranks leave a bubble of {bubble:.0%} in "
            f"theory; {enough} or more keep it under 20%"
        )

    def check_microbatches(self, microbatches: int, ranks: int, stages: int) -> None:
        """Refuse micro-batch counts torch's schedule would refuse mid-step: 1F1B's one per stage, the rounds.

        Raises:
            BadInputError: the count and the fix, in one line.

        """
        if self.microbatches_at_least_stages and microbatches < stages:
            raise BadInputError(
                f"microbatches={microbatches}: {self.name} needs at least one per stage ({stages}); "
                "raise microbatches or use gpipe"
            )
        rounds = max(1, microbatches // ranks)  # torch's interleaved schedules run them in rounds of this many
        if self.multi_stage and microbatches % rounds:
            raise BadInputError(
                f"microbatches={microbatches}: {self.name} runs them in rounds of {rounds}, which must divide "
                f"them; choose a multiple of {ranks}"
            )

    def schedule_class(self) -> type[Any]:
        """Torch's class for it."""
        from torch.distributed.pipelining.schedules import get_schedule_class

        return get_schedule_class(self.torch_name)


SCHEDULES: dict[str, ScheduleKind] = {
    kind.name: kind
    for kind in (
        ScheduleKind("gpipe", "GPipe", 1, False, False, "all forwards, then all backwards; m micro-batches alive"),
        ScheduleKind("1f1b", "1F1B", 1, False, True, "one forward, one backward; at most p micro-batches alive"),
        ScheduleKind("interleaved_1f1b", "Interleaved1F1B", 2, True, False, "1F1B over v stages per rank: bubble / v"),
        ScheduleKind("looped_bfs", "LoopedBFS", 2, True, False, "GPipe over v stages per rank, breadth first"),
    )
}
"""The schedules run and tested here on gloo (2 processes). torch's zero-bubble and DualPipeV schedules split
the backward in two and place stages in a "V"; they are not offered until tested."""


def schedule_named(name: str) -> ScheduleKind:
    """The schedule called ``name``.

    Raises:
        ValueError: an unknown name; the message lists the known ones.

    """
    kind = SCHEDULES.get(name.lower())
    if kind is None:
        known = ", ".join(f"{k.name} ({k.description})" for k in SCHEDULES.values())
        raise ValueError(f"schedule: unknown {name!r}; choose one of: {known}")
    return kind


class BubbleClock:
    """Times this rank's stage computations inside each pipeline step; the rest of the step is its bubble.

    The schedules call each stage's ``forward_one_chunk`` and ``backward_one_chunk`` (and
    ``backward_weight_one_chunk``) through the stage object, so wrapping those three on the instances times
    every micro-batch's compute; sends and receives, and waits for them, happen outside.

    Args:
        stages: this rank's ``PipelineStage`` objects.

    """

    _TIMED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, stages: Sequence[Any]) -> None:
        self._busy = 0.0
        self._wall = 0.0
        self._idle_total = 0.0  # since the last take(): what PerformanceMonitor sums per logging window
        self._wall_total = 0.0
        for stage in stages:
            for name in self._TIMED:
                method = getattr(stage, name, None)
                if callable(method):
                    setattr(stage, name, self._timed(method))

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._busy += time.perf_counter() - start

        return timed

    @contextmanager
    def step(self) -> Iterator[None]:
        """Time one pipeline step (``schedule.step``): its wall time and the compute inside it."""
        self._busy = 0.0
        start = time.perf_counter()
        try:
            yield
        finally:
            self._wall = time.perf_counter() - start
            self._wall_total += self._wall
            self._idle_total += max(0.0, self._wall - self._busy)

    def bubble(self) -> float:
        """The idle share of the last step timed on this rank, in [0, 1]."""
        if self._wall <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self._busy / self._wall))

    def take(self) -> tuple[float, float]:
        """Seconds idle and seconds in pipeline steps since the last call (PerformanceMonitor's windows)."""
        taken = (self._idle_total, self._wall_total)
        self._idle_total = self._wall_total = 0.0
        return taken


def bubble_advice(measured: float, theory: float, worst_rank: int, kind: ScheduleKind, ranks: int, m: int) -> str:
    """The warning for a bubble over 20% (``BUBBLE_WARNING``): what was measured, the theory, and the fixes.

    Example::

        >>> print(bubble_advice(0.35, 0.2, 1, SCHEDULES["1f1b"], ranks=2, m=4))  # doctest: +NORMALIZE_WHITESPACE
        pipeline bubble: ranks idle 35% of each step (rank 1 the most; 20% in theory for 1f1b with 2 pipeline
        ranks and 4 micro-batches): raise microbatches (8 or more), use interleaved_1f1b, or move layers away
        from the slowest stage
    """
    enough = MICROBATCHES_PER_RANK * ranks
    more = f" ({enough} or more)" if m < enough else ""
    return (
        f"pipeline bubble: ranks idle {measured:.0%} of each step (rank {worst_rank} the most; {theory:.0%} in "
        f"theory for {kind.name} with {ranks} pipeline ranks and {m} micro-batches): raise microbatches{more}, "
        "use interleaved_1f1b, or move layers away from the slowest stage"
    )
