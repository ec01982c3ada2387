"""What each rank tells the ``launch`` that started it: where its checkpoints are, and how it ended.

torchrun's agent forwards a preemption signal to its workers and, if they do not stop within its shutdown
timeout, kills them; either way it raises in its own process and the workers' exit statuses are gone. So the
ranks tell ``launch`` themselves: ``launch`` names a folder in :data:`REPORTS_ENV`, and each rank writes
``rank-<RANK>.json`` there (atomically) when its run starts and again as it exits. ``launch`` reads them to say
in one line whether the workers saved, and which committed checkpoint a relaunch resumes from.

Outside ``launch`` (the variable unset) nothing is written. Standard library only.

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
from pathlib import Path
from typing import Any

REPORTS_ENV = "LIGHTNING_MLOPT_LAUNCH_REPORTS"
"""The folder where the ranks of a ``launch`` write their reports (set by ``launch`` for its workers)."""

_report: dict[str, Any] = {}


def note(**fields: Any) -> None:
    """Add ``fields`` to this rank's report and write it (a no-op outside ``launch``)."""
    _report.update(fields)
    write()


def write(status: int | None = None) -> None:
    """Write this rank's report, with its exit status when it is exiting; never raises (a report is a courtesy)."""
    folder = os.environ.get(REPORTS_ENV)
    if not folder:
        return
    if status is not None:
        _report["status"] = status
    rank = os.environ.get("RANK", "0")
    path = Path(folder) / f"rank-{rank}.json"
    with contextlib.suppress(OSError):
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"rank": int(rank), **_report}))
        temporary.replace(path)


def read_reports(folder: str | Path) -> dict[int, dict[str, Any]]:
    """Every rank's report in ``folder``: global rank -> fields (``status`` once the rank exited)."""
    reports: dict[int, dict[str, Any]] = {}
    for path in sorted(Path(folder).glob("rank-*.json")):
        with contextlib.suppress(OSError, ValueError):
            report = json.loads(path.read_text())
            reports[int(report["rank"])] = report
    return reports
