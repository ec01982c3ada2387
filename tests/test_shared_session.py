"""tests/support/shared_session.py: a session's shared build runs once, and a failed one leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.shared_session import built_once


class _Factory:
    def __init__(self, base: Path) -> None:
        self.base = base

    def getbasetemp(self) -> Path:
        return self.base


def test_the_first_caller_builds_and_the_next_reads_what_it_built(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    calls: list[Path] = []

    def build(root: Path) -> None:
        calls.append(root)
        (root / "made").write_text("once")

    first = built_once(_Factory(tmp_path), "runs", build)  # type: ignore[arg-type]
    second = built_once(_Factory(tmp_path), "runs", build)  # type: ignore[arg-type]
    assert first == second == tmp_path / "runs" and calls == [first]
    assert (first / "made").read_text() == "once"


def test_workers_share_the_sessions_folder_and_a_failed_build_is_redone_from_empty(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    worker = _Factory(tmp_path / "popen-gw1")  # a worker's basetemp: a folder of the session's

    def fail(root: Path) -> None:
        (root / "partial").write_text("a run that would be resumed from")
        raise RuntimeError("the build failed")

    with pytest.raises(RuntimeError, match="the build failed"):
        built_once(worker, "runs", fail)  # type: ignore[arg-type]
    seen: list[list[str]] = []
    root = built_once(worker, "runs", lambda root: seen.append(sorted(p.name for p in root.iterdir())))  # type: ignore[arg-type]
    assert root == tmp_path / "runs" and seen == [[]]
