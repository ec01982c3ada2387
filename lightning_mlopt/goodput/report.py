"""Goodput from a ledger: where every second from a run's first start to its end went, over all its launches.

Reads ``goodput.jsonl`` (written by :class:`~lightning_mlopt.goodput.ledger.GoodputLedger`) and
splits the wall-clock time into productive step time and badput by category. The categories follow
``ml-goodput-measurement``'s ``BadputType`` names, so figures compare:

============================  ==========================================
ours                          ml-goodput-measurement
============================  ==========================================
productive step time          goodput (``GoodputType.TOTAL``)
start-up                      ``PROGRAM_STARTUP`` + ``TRAINING_PREP``
checkpoint save (blocking)    ``UNPRODUCTIVE_CHECKPOINT_SAVE_TIME``
checkpoint restore            ``UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME``
data stall                    ``DATA_LOADING_SYNC``
wasted progress               ``WASTED_PROGRESS_FROM_DISRUPTION``
between launches              ``INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION``
other                         ``OTHER``
============================  ==========================================

Survival: a step of a launch survives if every later launch resumed from that step or a later one (the
smallest resume step of the later launches); for the last launch, every step survives if it ended well (exit 0,
or ``fit`` ended without an error), else only the steps up to its newest committed checkpoint. A lost step's whole
record (its data wait and checkpoint save included) is wasted progress.

Standard library only (matplotlib, optional, for the chart).

Example::

    >>> events = [
    ...     {"event": "launch", "time": 2.0, "process_start": 0.0},
    ...     {"event": "train_start", "time": 4.0, "step": 0, "restore_s": 0.5},
    ...     {"event": "step", "time": 5.0, "step": 1, "seconds": 1.0, "data_s": 0.25, "checkpoint_s": 0.0},
    ...     {"event": "end", "time": 6.0, "step": 1, "ok": True},
    ... ]
    >>> report = compute(events)
    >>> report.seconds["productive"], report.seconds["startup"], report.total_s
    (0.75, 3.5, 6.0)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# (key, what the report calls it, ml-goodput-measurement's name), in the report's order.
CATEGORIES = (
    ("productive", "productive step time", "goodput (TOTAL)"),
    ("startup", "start-up", "PROGRAM_STARTUP + TRAINING_PREP"),
    ("checkpoint_save", "checkpoint save (blocking)", "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME"),
    ("checkpoint_restore", "checkpoint restore", "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME"),
    ("data_stall", "data stall", "DATA_LOADING_SYNC"),
    ("wasted", "wasted progress", "WASTED_PROGRESS_FROM_DISRUPTION"),
    ("between_launches", "between launches", "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION"),
    ("other", "other", "OTHER"),
)
KEYS = tuple(key for key, _, _ in CATEGORIES)


class LedgerError(ValueError):
    """A ledger that cannot be read: the message names the file and the line."""


@dataclass
class LaunchSummary:
    """One launch of the run: when, how it ended, its steps, and its seconds by category."""

    started: float  # UNIX time of the process start
    ended: float  # UNIX time of its last event
    status: int | None  # exit status; None: killed (no exit recorded)
    signal: str | None
    resumed_step: int | None  # the step it resumed from (0: from scratch); None: it never reached training
    steps_run: int
    steps_survived: int
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def how_it_ended(self) -> str:
        """``exit 0``, ``exit 75 (SIGTERM)``, ``killed (no exit recorded)``."""
        if self.status is None:
            return "killed (no exit recorded)"
        return f"exit {self.status}" + (f" ({self.signal})" if self.signal else "")


@dataclass
class GoodputReport:
    """The run's time by category (seconds), its launches and its step counts."""

    seconds: dict[str, float]
    total_s: float  # from the first launch's process start to the last event, measured apart from the categories
    launches: list[LaunchSummary]
    steps_run: int
    steps_survived: int
    final_step: int

    @property
    def goodput_percent(self) -> float:
        """Productive step time as a share of the wall-clock time."""
        return self.percent("productive")

    def percent(self, key: str) -> float:
        """Category ``key`` as a share of the wall-clock time, in percent."""
        return 100.0 * self.seconds[key] / self.total_s if self.total_s > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        """``goodput/percent``, ``goodput/total_s`` and ``goodput/<category>_s``, for the loggers."""
        figures = {"goodput/percent": self.goodput_percent, "goodput/total_s": self.total_s}
        return {**figures, **{f"goodput/{key}_s": self.seconds[key] for key in KEYS}}

    def as_dict(self) -> dict[str, Any]:
        """Everything, for ``--format json``."""
        return {
            "goodput_percent": self.goodput_percent,
            "total_s": self.total_s,
            "categories": [
                {"category": key, "name": name, "ml_goodput": ml_name, "seconds": self.seconds[key]}
                | {"percent": self.percent(key)}
                for key, name, ml_name in CATEGORIES
            ],
            "launches": [{**vars(launch), "how_it_ended": launch.how_it_ended} for launch in self.launches],
            "steps_run": self.steps_run,
            "steps_survived": self.steps_survived,
            "final_step": self.final_step,
        }


def read_ledger(path: str | Path) -> list[dict[str, Any]]:
    """The events of a ledger file, in order.

    The NUL padding a killed launch leaves after its last line is ignored, and a last line without its newline
    (a copy the kill cut short) is left out; any other line that is not a JSON object with ``event`` and
    ``time`` raises :class:`LedgerError` naming it.
    """
    text = Path(path).read_text(errors="replace").rstrip("\0")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    elif lines:
        lines.pop()  # cut short: never a whole event
    events = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
            float(event["time"]), str(event["event"])
        except (ValueError, TypeError, KeyError):
            raise LedgerError(f"{path}, line {number}: not a ledger event: {line[:80]!r}") from None
        events.append(event)
    if not any(event["event"] == "launch" for event in events):
        raise LedgerError(f"{path}: no launch recorded in it (is it a goodput ledger?)")
    return events


@dataclass
class _Launch:
    start: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)

    def first(self, kind: str) -> dict[str, Any] | None:
        return next((event for event in self.events if event["event"] == kind), None)

    def last(self, kind: str) -> dict[str, Any] | None:
        return next((event for event in reversed(self.events) if event["event"] == kind), None)

    @property
    def steps(self) -> list[dict[str, Any]]:
        return [event for event in self.events if event["event"] == "step"]

    @property
    def resumed_step(self) -> int | None:
        started = self.first("train_start")
        return int(started["step"]) if started is not None else None

    @property
    def status(self) -> int | None:
        exited = self.last("exit")
        return int(exited["status"]) if exited is not None else None

    @property
    def ended_well(self) -> bool:
        end = self.last("end")
        return self.status == 0 or (self.status is None and end is not None and bool(end.get("ok")))

    @property
    def ended(self) -> float:
        return max(float(event["time"]) for event in [self.start, *self.events])


def _split(events: list[dict[str, Any]]) -> list[_Launch]:
    launches: list[_Launch] = []
    for event in events:
        if event["event"] == "launch":
            launches.append(_Launch(event))
        elif launches:
            launches[-1].events.append(event)
    return launches


def _cutoffs(launches: list[_Launch]) -> list[float]:
    """The newest step of each launch that survives: every later launch resumed from it or a later one."""
    last = launches[-1]
    if last.ended_well:
        cutoff = float("inf")
    else:  # its newest committed checkpoint (or the one it resumed from) is what a relaunch would resume from
        commits = [int(event["step"]) for event in last.events if event["event"] == "commit"]
        cutoff = float(max([*commits, last.resumed_step or 0]))
    cutoffs = [cutoff]
    for later in reversed(launches[1:]):
        if later.resumed_step is not None:
            cutoff = min(cutoff, later.resumed_step)
        cutoffs.append(cutoff)
    return list(reversed(cutoffs))


def _account(launch: _Launch, start: float, cutoff: float) -> tuple[dict[str, float], int, int]:
    """Seconds of ``launch`` by category from ``start`` to its last event; steps run and survived."""
    seconds = dict.fromkeys(KEYS, 0.0)
    ended = launch.ended
    started = launch.first("train_start")
    if started is None:  # it never reached training: all of it was start-up
        seconds["startup"] = ended - start
        return seconds, 0, 0
    restore = float(started.get("restore_s", 0.0))
    seconds["checkpoint_restore"] = restore
    seconds["startup"] = float(started["time"]) - start - restore
    cursor = float(started["time"])
    survived = 0
    steps = launch.steps
    for step in steps:
        duration = float(step["seconds"])
        if int(step["step"]) <= cutoff:
            survived += 1
            data, saving, other = (float(step.get(key, 0.0)) for key in ("data_s", "checkpoint_s", "other_s"))
            seconds["data_stall"] += data
            seconds["checkpoint_save"] += saving
            seconds["other"] += other
            seconds["productive"] += duration - data - saving - other
        else:
            seconds["wasted"] += duration
        cursor = float(step["time"])
    # After the last step: the final or signal save (its blocking part), then teardown and the exit ("other").
    # A killed launch's tail (a commit landing after its last step) is "other" too: no step finished in it.
    end = launch.last("end")
    tail_saving = float(end.get("checkpoint_s", 0.0)) if end is not None and float(end["time"]) >= cursor else 0.0
    seconds["checkpoint_save"] += tail_saving
    seconds["other"] += ended - cursor - tail_saving
    return seconds, len(steps), survived


def compute(events: list[dict[str, Any]]) -> GoodputReport:
    """The goodput report of a ledger's events (:func:`read_ledger`).

    Each launch's time runs from its process start to its last event; the time from one launch's last event to
    the next one's process start is "between launches". The total is measured apart, as the last event minus the
    first process start, so the categories summing to it checks that the records tile the run.
    """
    launches = _split(events)
    if not launches:
        raise LedgerError("no launch recorded in the ledger")
    seconds = dict.fromkeys(KEYS, 0.0)
    summaries = []
    previous_end: float | None = None
    for launch, cutoff in zip(launches, _cutoffs(launches), strict=True):
        process_start = float(launch.start.get("process_start", launch.start["time"]))
        # Launches never overlap; a start estimated before the previous end (clock resolution) starts at that end.
        start = process_start if previous_end is None else max(process_start, previous_end)
        between = 0.0 if previous_end is None else start - previous_end
        own, run, survived = _account(launch, start, cutoff)
        own["between_launches"] = between
        for key in KEYS:
            seconds[key] += own[key]
        signal = launch.last("signal")
        summaries.append(
            LaunchSummary(
                process_start,
                launch.ended,
                launch.status,
                str(signal["signal"]) if signal is not None else None,
                launch.resumed_step,
                run,
                survived,
                own,
            )
        )
        previous_end = launch.ended
    first_start = float(launches[0].start.get("process_start", launches[0].start["time"]))
    last_cutoff = _cutoffs(launches)[-1]
    return GoodputReport(
        seconds=seconds,
        total_s=launches[-1].ended - first_start,
        launches=summaries,
        steps_run=sum(launch.steps_run for launch in summaries),
        steps_survived=sum(launch.steps_survived for launch in summaries),
        final_step=_final_step(launches[-1], last_cutoff),
    )


def _final_step(launch: _Launch, cutoff: float) -> int:
    """The global step whose state the run keeps: where its last launch ended well, else its newest commit."""
    end = launch.last("end")
    if launch.ended_well and end is not None:
        return int(end["step"])
    steps = [int(step["step"]) for step in launch.steps]
    return int(min(cutoff, max([*steps, launch.resumed_step or 0])))
