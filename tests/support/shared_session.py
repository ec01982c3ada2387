"""Work done once per test session, however many pytest-xdist workers the session has.

A session-scoped fixture runs once per worker. What it builds on disk (the shared strategy runs: five 2-process
launches) is built by the first worker to ask, under a file lock, and read by the others.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder ``name``, shared by every worker of the session, after ``build(folder)`` ran in one of them.

    A build that raised leaves no mark: the next worker to ask builds again from an empty folder (and fails the
    same way, in its own tests), never on top of what the failed build left (a run would resume from it).

    Example::

        root = built_once(tmp_path_factory, "strategy_runs", lambda root: train(root, "ddp", "ddp", 20))
    """
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's basetemp is a folder of the session's
        base = base.parent
    root = base / name
    with FileLock(str(root) + ".lock"):
        if not (root / ".built").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            build(root)
            (root / ".built").touch()
    return root
