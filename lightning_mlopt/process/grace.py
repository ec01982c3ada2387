"""How long a preempted process has: the time from the scheduler's signal to its forced kill.

Each scheduler allows a fixed time and then kills: torchrun SIGKILLs its workers ``--shutdown-timeout`` seconds
(30 by default) after forwarding a SIGTERM; Kubernetes kills a pod ``terminationGracePeriodSeconds`` (30 by
default) after its SIGTERM; SLURM ends the job at its time limit, ``--signal`` seconds after the SIGUSR1; a spot
VM goes at the time its notice named. Whoever knows the figure passes it down in one environment variable,
:data:`GRACE_ENV` (``launch`` from torchrun's shutdown timeout, the sbatch script from ``--signal_seconds``, a
Kubernetes manifest through ``launch``), and ``checkpoint.preemption.grace_s`` overrides it.

A save that would not end before the kill is worse than none: it costs the rest of the grace and commits
nothing. Knowing the grace, a rank saves only when this run's earlier saves say it fits
(:class:`SaveBudget`), and its last-resort deadline (:mod:`lightning_mlopt.process.signals`) sits below it.

Standard library only.

Example::

    >>> grace_for(graces_from_environment({"LIGHTNING_MLOPT_PREEMPTION_GRACE_S": "30"}), "SIGTERM")
    30.0
    >>> signal_deadline_within(120.0, grace_s=30.0)
    28.5
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

GRACE_ENV = "LIGHTNING_MLOPT_PREEMPTION_GRACE_S"
"""Seconds from a preemption signal to the forced kill, set by whoever launches the ranks and knows it: one
figure for every signal (``30``), or one per signal (``SIGUSR1=120,SIGTERM=30``: SLURM's time-limit warning
leaves ``--signal`` seconds, its preemption SIGTERM only KillWait)."""

ANY_SIGNAL = "*"


def graces_from_environment(env: Mapping[str, str] | None = None) -> dict[str, float]:
    """The graces :data:`GRACE_ENV` announces: signal name (or ``*``) -> seconds; empty when nobody said.

    Example::

        >>> graces_from_environment({GRACE_ENV: "SIGUSR1=120,SIGTERM=30"})
        {'SIGUSR1': 120.0, 'SIGTERM': 30.0}
    """
    text = (os.environ if env is None else env).get(GRACE_ENV, "").strip()
    graces: dict[str, float] = {}
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        name, _, value = part.rpartition("=")
        try:
            seconds = float(value)
        except ValueError:
            return {}  # unusable: unknown, rather than a wrong figure
        if seconds > 0:
            graces[name.strip() or ANY_SIGNAL] = seconds
    return graces


def grace_for(graces: Mapping[str, float], signal_name: str) -> float | None:
    """The grace of ``signal_name``: its own, else the one for every signal, else None."""
    return graces.get(signal_name, graces.get(ANY_SIGNAL))


def safety_margin_s(grace_s: float) -> float:
    """What is kept back from a grace for leaving: flushing logs, exiting, the launcher's own wait (10 %, >= 1 s)."""
    return max(1.0, 0.1 * grace_s)


def signal_deadline_within(deadline_s: float | None, grace_s: float | None) -> float | None:
    """The last-resort deadline after a signal, moved below the grace when the grace is known.

    A process that cannot reach a step boundary (a rank stuck in a collective) exits with the requeue status at
    this deadline; past the grace it would be killed instead, and the scheduler would see a kill, not a
    preemption. It keeps half the safety margin: the step boundary's own decisions (:class:`SaveBudget`) keep
    all of it, so they come first.
    """
    if grace_s is None:
        return deadline_s
    within = max(grace_s - 0.5 * safety_margin_s(grace_s), 0.5 * grace_s)
    return within if deadline_s is None else min(deadline_s, within)


@dataclass(frozen=True)
class SaveBudget:
    """Whether a save fits in the time a preemption left, from how long this run's earlier saves took.

    Args:
        seconds_left: time until the forced kill, less the safety margin; None: unknown (always save).
        save_s: the expected time of one complete save (the longest this run has seen); None: no save yet.
        in_flight_s: the expected time until a background save in flight commits; 0 when none is.

    Example::

        >>> budget = SaveBudget(seconds_left=10.0, save_s=4.0, in_flight_s=3.0)
        >>> budget.new_save_fits, budget.in_flight_fits
        (True, True)
        >>> SaveBudget(seconds_left=5.0, save_s=4.0, in_flight_s=3.0).new_save_fits
        False

    """

    seconds_left: float | None
    save_s: float | None
    in_flight_s: float = 0.0

    @property
    def in_flight_fits(self) -> bool:
        """The background save in flight can commit before the kill."""
        return self.seconds_left is None or self.in_flight_s <= self.seconds_left

    @property
    def new_save_fits(self) -> bool:
        """After the save in flight, a new one can commit before the kill (unknown cost: try it)."""
        if self.seconds_left is None or self.save_s is None:
            return self.in_flight_fits
        return self.in_flight_s + self.save_s <= self.seconds_left
