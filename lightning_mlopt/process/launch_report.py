"""What each rank tells the ``launch`` that started it: where its checkpoints are, and how it ended.

torchrun's agent forwards a preemption signal to its workers and, if they do not stop within its shutdown
timeout, kills them; either way it raises in its own process and the workers' exit statuses are gone. So the
ranks tell ``launch`` themselves: ``launch`` names a folder in :data:`REPORTS_ENV`, and each rank writes
``rank-<RANK>.json`` there (atomically) when its run starts and again as it exits. ``launch`` reads them to say
in one line whether the workers saved, and which committed checkpoint a relaunch resumes from.

Outside ``launch`` (the variable unset) nothing is written. Listeners in the process hear the exit status
wherever it is written (:func:`on_exit`: the goodput ledger records it). Standard library only.

Example::

    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> os.environ[REPORTS_ENV], os.environ["RANK"] = folder, "0"
    >>> note(checkpoints="runs/a/checkpoints"); write(status=75)
    >>> read_reports(folder)[0]["status"], read_reports(folder)[0]["checkpoints"]
    (75, 'runs/a/checkpoints')
    >>> del os.environ[REPORTS_ENV], os.environ["RANK"]
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPORTS_ENV = "LIGHTNING_MLOPT_LAUNCH_REPORTS"
"""The folder where the ranks of a ``launch`` write their reports (set by ``launch`` for its workers)."""
LAUNCHER_PID_ENV = "LIGHTNING_MLOPT_LAUNCHER_PID"
"""The process id of the ``launch`` that started the ranks (a preempted rank tells it to stop the others)."""
DEADLINE_NAME = "deadline"
"""A file in the reports folder: the UNIX time of the kill a cloud notice announced (written by ``launch``)."""

_report: dict[str, Any] = {}
_exit_listeners: list[Callable[[int], None]] = []


def on_exit(listener: Callable[[int], None]) -> None:
    """Call ``listener(status)`` when this rank writes its exit status (inside ``launch`` or not); once each."""
    if listener not in _exit_listeners:
        _exit_listeners.append(listener)


def note(**fields: Any) -> None:
    """Add ``fields`` to this rank's report and write it (a no-op outside ``launch``)."""
    _report.update(fields)
    write()


def write(status: int | None = None) -> None:
    """Write this rank's report, with its exit status when it is exiting; never raises (a report is a courtesy)."""
    if status is not None:
        for listener in list(_exit_listeners):
            with contextlib.suppress(Exception):  # a record of the exit must never change the exit
                listener(status)
    folder = os.environ.get(REPORTS_ENV)
    if not folder:
        return
    if status is not None:
        _report["status"] = status
    rank = os.environ.get("RANK", "0")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # a report from an earlier attempt is stale
    path = Path(folder) / f"rank-{rank}.json"
    with contextlib.suppress(OSError):
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"rank": int(rank), "attempt": attempt, **_report}))
        temporary.replace(path)


def tell_launcher_if_preempted() -> None:
    """A rank leaving preempted stops its ``launch`` too, as if the launcher had been signalled.

    Every rank agreed to stop, but only the launchers that got the signal know it was a preemption: the others
    would see workers fail with 75 (and torchrun would restart them, with ``--max-restarts``). A no-op outside
    ``launch`` or when this rank is not preempted.
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if _report.get("preempted") and launcher and os.environ.get(REPORTS_ENV) and int(launcher) == os.getppid():
        with contextlib.suppress(OSError):
            os.kill(int(launcher), signal.SIGTERM)


def announced_seconds_left() -> float | None:
    """Seconds until the kill a cloud notice announced to ``launch`` (it writes the deadline), or None."""
    folder = os.environ.get(REPORTS_ENV)
    if not folder:
        return None
    try:
        return float((Path(folder) / DEADLINE_NAME).read_text()) - time.time()
    except (OSError, ValueError):
        return None


def read_reports(folder: str | Path) -> dict[int, dict[str, Any]]:
    """The newest attempt's report of each rank in ``folder``: global rank -> fields (``status`` once it exited).

    torchrun restarts its workers as a new attempt; reports of earlier attempts are left out.
    """
    reports: dict[int, dict[str, Any]] = {}
    for path in sorted(Path(folder).glob("rank-*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError):
            report = json.loads(path.read_text())
            reports[int(report["rank"])] = report
    newest = max((report.get("attempt", 0) for report in reports.values()), default=0)
    return {rank: report for rank, report in reports.items() if report.get("attempt", 0) == newest}
