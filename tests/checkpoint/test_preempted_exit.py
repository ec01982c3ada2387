"""PreemptedExit in-process with a fake saver, trainer and signal record: what it saves, says, reports, exits with."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from lightning_utilities.core.rank_zero import rank_zero_only

from lightning_mlopt.checkpoint import preempted_exit
from lightning_mlopt.checkpoint.preempted_exit import PreemptedExit
from lightning_mlopt.checkpoint.settings import Preemption
from lightning_mlopt.checkpoint.step_vote import Agreed
from lightning_mlopt.exceptions import CheckpointWriteError
from lightning_mlopt.process import launch_report
from lightning_mlopt.process.grace import GRACE_ENV

STEP = 12
CKPT_8, CKPT_10 = Path("/run/checkpoints/step-8"), Path("/run/checkpoints/step-10")


class _Signals:
    """Stands in for the process's ``preemption`` record: a SIGTERM with ``seconds_left`` of a ``grace_s`` grace."""

    def __init__(self, calls: list[Any], seconds_left: float | None = 20.0, grace_s: float | None = 30.0) -> None:
        self.calls = calls
        self._seconds_left, self.grace_s = seconds_left, grace_s

    def acknowledge(self) -> None:
        self.calls.append("acknowledge")

    def seconds_left(self) -> float | None:
        return self._seconds_left

    def describe(self) -> str:
        return "SIGTERM"

    def own_for_run(self, *args: Any) -> list[int]:
        self.calls.append(("own_for_run", *args))
        return []


class _Saver:
    """Stands in for CheckpointSaver: what a save costs, the write in flight, the remote copies, the commits."""

    def __init__(
        self, calls: list[Any], committed: list[tuple[int, Path]], save_s: float | None = 4.0, copies_land: bool = True
    ) -> None:
        self.calls, self.save_s, self.copies_land = calls, save_s, copies_land
        self.store = SimpleNamespace(committed=lambda: calls.append("committed") or list(committed))

    def expected_save_seconds(self) -> float | None:
        return self.save_s

    def in_flight_seconds_left(self) -> float:
        return 1.5

    def finish_in_flight_within(self, trainer: Any, seconds: float | None) -> bool:
        self.calls.append(("finish_in_flight_within", seconds))
        return True

    def abandon_in_flight(self) -> None:
        self.calls.append("abandon_in_flight")

    def finish_copies(self, trainer: Any, seconds: float | None = None) -> bool:
        self.calls.append(("finish_copies", seconds))
        return self.copies_land


@pytest.fixture
def calls() -> list[Any]:
    return []


@pytest.fixture
def signals(monkeypatch: pytest.MonkeyPatch, calls: list[Any]) -> _Signals:
    fake = _Signals(calls)
    monkeypatch.setattr(preempted_exit, "preemption", fake)
    return fake


@pytest.fixture
def report(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """This rank's launch report, written to ``tmp_path`` as ``launch`` would read it (a fresh one per test)."""
    monkeypatch.setattr(launch_report, "_report", {})
    monkeypatch.setenv(launch_report.REPORTS_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    return lambda: {k: v for k, v in launch_report.read_reports(tmp_path)[0].items() if k not in ("rank", "attempt")}


def _trainer(calls: list[Any], rank_zero: bool = True) -> Any:
    connector = SimpleNamespace(update_train_step_metrics=lambda: calls.append("log_step"))
    return SimpleNamespace(global_step=STEP, is_global_zero=rank_zero, _logger_connector=connector)


def _respond(response: PreemptedExit, trainer: Any, agreed: Agreed, save: Any) -> tuple[int, list[str]]:
    """Run ``respond``; the exit status and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit) as exit_:
        warnings.simplefilter("always")
        response.respond(trainer, agreed, save)
    return exit_.value.code, [str(w.message) for w in caught]  # type: ignore[return-value]


def test_with_time_left_it_logs_the_step_saves_and_exits_with_the_preemption_status(signals, calls, report):
    response = PreemptedExit(Preemption(exit_code=75), _Saver(calls, [(8, CKPT_8)]), remote_url=None)
    saved = Path("/run/checkpoints/step-12")
    status, said = _respond(response, _trainer(calls), Agreed(signalled=True), lambda: calls.append("save") or saved)
    assert status == 75
    assert said == ["Preemption signal: saved step 12; exiting with status 75."]
    assert calls == ["acknowledge", "log_step", "save"]  # acted on first; the row reaches loggers before the save
    assert response.exiting
    assert report() == {"preempted": True, "resume_from": str(saved), "resume_step": 12, "redo_steps": 0}


def test_the_exit_status_is_the_configured_one(signals, calls, report):
    response = PreemptedExit(Preemption(exit_code=99), _Saver(calls, []), remote_url=None)
    status, said = _respond(response, _trainer(calls), Agreed(signalled=True), lambda: None)
    assert status == 99
    assert said == ["Preemption signal: saved step 12; exiting with status 99."]


def test_no_time_commits_the_write_in_flight_within_the_budget_and_names_the_newest_commit(signals, calls, report):
    response = PreemptedExit(Preemption(), _Saver(calls, [(8, CKPT_8), (10, CKPT_10)]), remote_url=None)
    status, said = _respond(response, _trainer(calls), Agreed(signalled=True, no_time=True), _fail_if_saved)
    assert status == 75
    # 20 s left, less the 3 s margin of a 30 s grace.
    assert calls == ["acknowledge", ("finish_in_flight_within", 17.0), "committed"]
    assert said == [
        "Preemption (SIGTERM): no time to save step 12 (a save takes up to 4.0 s, 17.0 s left before the kill); "
        f"a relaunch resumes from {CKPT_10} (step 10; 2 step(s) redone). Exiting with status 75."
    ]
    assert report() == {"preempted": True, "resume_from": str(CKPT_10), "resume_step": 10, "redo_steps": 2}


def test_no_time_even_for_the_write_in_flight_abandons_it(signals, calls, report):
    response = PreemptedExit(Preemption(), _Saver(calls, [(10, CKPT_10)]), remote_url=None)
    agreed = Agreed(signalled=True, no_time=True, no_time_in_flight=True)
    status, _ = _respond(response, _trainer(calls), agreed, _fail_if_saved)
    assert status == 75
    assert calls == ["acknowledge", "abandon_in_flight", "committed"]


def test_no_time_and_nothing_committed_says_a_relaunch_starts_again(signals, calls, report):
    signals._seconds_left = -2.0  # already past the kill by the clock: said as 0
    response = PreemptedExit(Preemption(), _Saver(calls, [], save_s=None), remote_url=None)
    _, said = _respond(response, _trainer(calls), Agreed(signalled=True, no_time=True), _fail_if_saved)
    assert said == [
        "Preemption (SIGTERM): no time to save step 12 (a save takes up to 0.0 s, 0.0 s left before the kill); "
        "nothing is committed yet: a relaunch starts again (12 step(s) redone). Exiting with status 75."
    ]
    assert report() == {"preempted": True, "resume_from": None, "resume_step": 0, "redo_steps": 12}


def test_a_failed_save_exits_all_the_same_naming_the_newest_commit(signals, calls, report):
    def save() -> Path:
        raise CheckpointWriteError("No space left on device (errno 28) writing /run/checkpoints/step-12")

    response = PreemptedExit(Preemption(), _Saver(calls, [(8, CKPT_8), (10, CKPT_10)]), remote_url=None)
    status, said = _respond(response, _trainer(calls), Agreed(signalled=True), save)
    assert status == 75
    assert said == [
        "Preemption: the save of step 12 failed (No space left on device (errno 28) writing "
        f"/run/checkpoints/step-12); a relaunch resumes from {CKPT_10} (step 10). Exiting with status 75."
    ]
    assert report() == {"preempted": True, "resume_from": str(CKPT_10), "resume_step": 10, "redo_steps": 2}


def test_a_failed_save_with_nothing_committed_says_the_start(signals, calls, report):
    def save() -> Path:
        raise CheckpointWriteError("disk gone")

    response = PreemptedExit(Preemption(), _Saver(calls, []), remote_url=None)
    _, said = _respond(response, _trainer(calls), Agreed(signalled=True), save)
    assert said == [
        "Preemption: the save of step 12 failed (disk gone); a relaunch resumes from the start (step 0). "
        "Exiting with status 75."
    ]


def test_another_error_in_the_save_is_not_swallowed(signals, calls, report):
    def save() -> Path:
        raise ValueError("a bug, not a full disk")

    response = PreemptedExit(Preemption(), _Saver(calls, []), remote_url=None)
    with pytest.raises(ValueError, match="a bug, not a full disk"):
        response.respond(_trainer(calls), Agreed(signalled=True), save)
    assert not response.exiting


def test_a_rank_other_than_zero_neither_reads_the_commits_nor_reports_them_nor_warns(
    signals, calls, report, monkeypatch
):
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    response = PreemptedExit(Preemption(), _Saver(calls, [(10, CKPT_10)]), remote_url=None)
    status, said = _respond(response, _trainer(calls, rank_zero=False), Agreed(no_time=True), _fail_if_saved)
    assert status == 75
    assert said == []
    assert "committed" not in calls
    assert report() == {"preempted": True}


def test_a_remote_copy_that_does_not_land_in_the_time_left_is_said_and_the_local_one_named(signals, calls, report):
    saver = _Saver(calls, [(10, CKPT_10)], copies_land=False)
    response = PreemptedExit(Preemption(), saver, remote_url="s3://bucket/run")
    saved = Path("/run/checkpoints/step-12")
    _, said = _respond(response, _trainer(calls), Agreed(signalled=True), lambda: saved)
    assert ("finish_copies", 17.0) in calls
    assert said == [
        "Preemption signal: saved step 12; exiting with status 75.",
        f"Preemption: the copy to s3://bucket/run did not finish within the grace; {saved} is in the local tier, "
        "the object store keeps its previous checkpoint.",
    ]


def test_a_remote_copy_that_lands_is_not_mentioned_and_without_a_remote_none_is_awaited(signals, calls, report):
    saved = Path("/run/checkpoints/step-12")
    landed = PreemptedExit(Preemption(), _Saver(calls, []), remote_url="s3://bucket/run")
    _, said = _respond(landed, _trainer(calls), Agreed(signalled=True), lambda: saved)
    assert said == ["Preemption signal: saved step 12; exiting with status 75."]
    assert ("finish_copies", 17.0) in calls
    calls.clear()
    local = PreemptedExit(Preemption(), _Saver(calls, []), remote_url=None)
    _respond(local, _trainer(calls), Agreed(signalled=True), lambda: saved)
    assert not any(isinstance(call, tuple) and call[0] == "finish_copies" for call in calls)


def test_the_budget_is_the_time_left_less_the_grace_s_margin_with_the_saver_s_costs(signals, calls, report):
    budget = PreemptedExit(Preemption(), _Saver(calls, [], save_s=4.0), remote_url=None).budget()
    assert (budget.seconds_left, budget.save_s, budget.in_flight_s) == (17.0, 4.0, 1.5)
    signals.grace_s = 5.0  # a short grace still keeps at least 1 s
    assert PreemptedExit(Preemption(), _Saver(calls, []), remote_url=None).budget().seconds_left == 19.0


def test_a_cloud_notice_shorter_than_the_grace_shortens_the_budget(signals, calls, report, tmp_path):
    (tmp_path / launch_report.DEADLINE_NAME).write_text(str(time.time() + 10.0))
    budget = PreemptedExit(Preemption(), _Saver(calls, []), remote_url=None).budget()
    assert budget.seconds_left == pytest.approx(10.0 - 3.0, abs=0.5)
    (tmp_path / launch_report.DEADLINE_NAME).write_text(str(time.time() + 100.0))  # later than the grace: no effect
    assert PreemptedExit(Preemption(), _Saver(calls, []), remote_url=None).budget().seconds_left == 17.0


def test_an_unknown_grace_leaves_the_budget_unbounded(signals, calls, report):
    signals._seconds_left, signals.grace_s = None, None
    budget = PreemptedExit(Preemption(), _Saver(calls, [], save_s=4.0), remote_url=None).budget()
    assert budget.seconds_left is None
    assert budget.new_save_fits


def test_take_signals_passes_the_configured_grace_for_every_signal(signals, calls, monkeypatch):
    monkeypatch.setenv(GRACE_ENV, "SIGUSR1=120")  # overridden by the setting
    trainer = _trainer(calls)
    settings = Preemption(signals=["SIGUSR1"], exit_code=80, deadline_s=50.0, grace_s=30.0)
    PreemptedExit(settings, _Saver(calls, []), remote_url=None).take_signals(trainer)
    assert calls == [("own_for_run", trainer, ("SIGUSR1",), 50.0, 80, {"*": 30.0})]


def test_take_signals_without_a_grace_uses_what_the_launcher_announced_or_none(signals, calls, monkeypatch):
    trainer = _trainer(calls)
    response = PreemptedExit(Preemption(deadline_s=None), _Saver(calls, []), remote_url=None)
    monkeypatch.setenv(GRACE_ENV, "SIGUSR1=120,SIGTERM=30")
    response.take_signals(trainer)
    monkeypatch.delenv(GRACE_ENV)
    response.take_signals(trainer)
    signals_ = ("SIGTERM", "SIGUSR1")
    assert calls == [
        ("own_for_run", trainer, signals_, None, 75, {"SIGUSR1": 120.0, "SIGTERM": 30.0}),
        ("own_for_run", trainer, signals_, None, 75, {}),
    ]


def _fail_if_saved() -> Path:
    raise AssertionError("no time was agreed: nothing may be saved")
