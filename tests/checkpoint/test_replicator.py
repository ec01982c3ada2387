"""The replicator's schedule and failure rules, against a remote tier that records, stalls or fails on cue.

The real store is exercised end to end in tests/callbacks/test_object_store_checkpoints.py; here the timing
rules are pinned: what is due, that copies never queue up, that a failure is an error or said once.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from lightning_mlopt.checkpoint.remote.replicator import Replicator
from lightning_mlopt.exceptions import ObjectStoreError


class RecordingRemote:
    """Records each upload; ``gate`` holds an upload until set; ``failing`` makes uploads fail."""

    url = "s3://bucket/run"

    def __init__(self) -> None:
        self.uploaded: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.failing = False

    def upload(self, path: Path) -> str:
        self.gate.wait(10)
        if self.failing:
            raise ObjectStoreError(f"{self.url}/{path.name}: upload failed: cannot reach http://127.0.0.1:9")
        self.uploaded.append(path.name)
        return f"{self.url}/{path.name}"


def test_due_by_steps_or_minutes_and_every_commit_without_a_rule(monkeypatch):
    assert Replicator(RecordingRemote()).is_due(1)  # type: ignore[arg-type]
    by_steps = Replicator(RecordingRemote(), every_n_steps=100)  # type: ignore[arg-type]
    assert not by_steps.is_due(50) and by_steps.is_due(100)
    by_steps.last_copied_step = 100
    assert not by_steps.is_due(150) and by_steps.is_due(200)
    by_time = Replicator(RecordingRemote(), every_n_minutes=1.0)  # type: ignore[arg-type]
    assert not by_time.is_due(7)
    later = time.monotonic() + 61
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert by_time.is_due(7)


def test_copies_never_queue_up_only_the_newest_waits_and_busy_steps_are_protected():
    remote = RecordingRemote()
    remote.gate.clear()  # the first upload stalls
    replicator = Replicator(remote)  # type: ignore[arg-type]
    replicator.offer(Path("step-000000002"), 2)
    time.sleep(0.05)
    replicator.offer(Path("step-000000004"), 4)
    replicator.offer(Path("step-000000006"), 6)  # replaces 4, which would be stale on arrival
    assert replicator.busy_steps() == {2, 6}
    assert not replicator.flush(timeout=0.1)
    remote.gate.set()
    assert replicator.flush(timeout=10)
    replicator.close()
    assert remote.uploaded == ["step-000000002", "step-000000006"]
    assert replicator.busy_steps() == set() and replicator.last_copied_step == 6


def test_a_copy_that_must_succeed_fails_the_save_once():
    remote = RecordingRemote()
    remote.failing = True
    replicator = Replicator(remote)  # type: ignore[arg-type]
    replicator.offer(Path("step-000000002"), 2)
    replicator.flush(timeout=10)
    assert replicator.failed
    error = replicator.take_error()
    assert error is not None and "step-000000002: upload failed" in str(error)
    assert replicator.take_error() is None and not replicator.failed
    replicator.close()


def test_a_failing_store_beside_a_local_tier_is_said_once_until_it_works_again(caplog):
    remote = RecordingRemote()
    remote.failing = True
    replicator = Replicator(remote, must_succeed=False)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="lightning_mlopt.checkpoint.remote.replicator"):
        for step in (2, 4, 6):
            replicator.offer(Path(f"step-{step:09d}"), step)
            replicator.flush(timeout=10)
        remote.failing = False
        replicator.offer(Path("step-000000008"), 8)
        replicator.flush(timeout=10)
    replicator.close()
    messages = [record.getMessage() for record in caplog.records]
    assert sum("copies are failing" in message for message in messages) == 1
    assert any("copies work again" in message and "step 8" in message for message in messages)
    assert not replicator.failed and remote.uploaded == ["step-000000008"]


def test_an_abandoned_copy_never_holds_the_exit():
    remote = RecordingRemote()
    remote.gate.clear()
    replicator = Replicator(remote)  # type: ignore[arg-type]
    replicator.offer(Path("step-000000002"), 2)
    time.sleep(0.05)  # the upload has started, and stalls
    started = time.monotonic()
    replicator.abandon()
    assert not replicator.flush(timeout=None)  # returns at once: nothing is waited for any more
    replicator.close()
    assert time.monotonic() - started < 1
    replicator.offer(Path("step-000000004"), 4)  # after close: ignored
    assert replicator.busy_steps() == {2}
    remote.gate.set()  # let the abandoned thread end, so the test leaves no thread behind
    deadline = time.monotonic() + 10
    while replicator.busy_steps() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert remote.uploaded == ["step-000000002"]


@pytest.fixture(autouse=True)
def _no_exit_registry(monkeypatch):
    """abandon() registers the thread with the process's exit path; keep the registry of this test run clean."""
    from lightning_mlopt.process import exit as process_exit

    monkeypatch.setattr(process_exit, "_ABANDONED", [])
