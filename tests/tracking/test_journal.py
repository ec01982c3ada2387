"""The tracker journal: what a killed launch logged reaches the run, however many launches are killed in a row."""

from __future__ import annotations

from lightning_mlopt.tracking.journal import Journal


def _steps(rows: list[dict]) -> list[int]:
    return [row["trainer/global_step"] for row in rows]


def test_rows_of_two_launches_killed_in_a_row_reach_the_third(tmp_path):
    path = tmp_path / "journal-run.jsonl"
    first = Journal(path, "launch-1")
    for step in range(3):
        first.record({"loss": 1.0 - step / 10}, step)  # then SIGKILL: never closed
    second = Journal(path, "launch-2")
    rows, _ = second.unsynced(before_step=2)  # resumed at step 2: logs steps 2.. itself
    assert _steps(rows) == [0, 1]
    for step in (2, 3):
        second.record({"loss": 0.5}, step)  # then SIGKILL again, before its tracker flushed anything
    third = Journal(path, "launch-3")
    rows, _ = third.unsynced(before_step=3)
    assert _steps(rows) == [0, 1, 2], "the rows launch 2 replayed are lost with launch 2"
    assert rows[0]["loss"] == 1.0
    fourth = Journal(path, "launch-4")
    third.close("exit")
    assert fourth.unsynced(before_step=None) == ([], []), "a closed launch's rows are never replayed again"


def test_a_closed_launch_hands_nothing_on(tmp_path):
    path = tmp_path / "journal-run.jsonl"
    first = Journal(path, "launch-1")
    first.record({"loss": 1.0}, 0)
    first.record_artifact(tmp_path / "step-000000001")
    first.close("exit")
    assert Journal(path, "launch-2").unsynced(before_step=None) == ([], [])
