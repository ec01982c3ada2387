"""tests/support/solo.py: a test marked solo waits for the other worker's test and holds back its next one."""

from __future__ import annotations

import threading
import time
import uuid

from tests.support.solo import room


def test_a_solo_test_runs_alone_between_the_other_workers_tests(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", uuid.uuid4().hex)  # a session of its own
    events: list[str] = []
    started, solo_in = threading.Event(), threading.Event()

    def other_worker() -> None:
        with room(solo=False):
            started.set()
            time.sleep(0.3)
            events.append("other test ends")
        solo_in.wait(5)
        with room(solo=False):  # its next test waits for the solo one to end
            events.append("other worker's next test starts")

    thread = threading.Thread(target=other_worker)
    thread.start()
    assert started.wait(5)
    with room(solo=True):
        events.append("solo starts")
        solo_in.set()
        time.sleep(0.3)
        events.append("solo ends")
    thread.join(5)
    assert events == ["other test ends", "solo starts", "solo ends", "other worker's next test starts"]


def test_without_xdist_nothing_is_locked(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)
    with room(solo=True), room(solo=True):  # would deadlock if it locked
        pass
