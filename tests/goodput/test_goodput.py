"""The goodput ledger and ``python -m lightning_mlopt goodput``: exact figures from hand-made ledgers, the ledger's
events from the phase markers, bad input, and one requeued job (2 SIGKILLs, 1 SIGTERM) through the real CLI."""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_mlopt.checkpoint import CheckpointStore
from lightning_mlopt.checkpoint.manifest import Manifest
from lightning_mlopt.cli import main
from lightning_mlopt.goodput.append_log import AppendLog, append_line
from lightning_mlopt.goodput.ledger import GoodputLedger, process_start_time
from lightning_mlopt.goodput.report import KEYS, LedgerError, compute, read_ledger
from lightning_mlopt.process import launch_report
from lightning_mlopt.process.phase import set_phase
from lightning_mlopt.tools import goodput as tool
from tests.conftest import CONFIGS, run_cli, start_cli
from tests.support.cli_args import fit_args
from tests.support.preloaded import PreloadedJob


def _launch(start: float, process_start: float) -> dict:
    return {"event": "launch", "time": start, "process_start": process_start, "pid": 1, "world_size": 2}


def _step(time_: float, step: int, seconds: float, data: float = 0.0, saving: float = 0.0, other: float = 0.0) -> dict:
    return {
        "event": "step",
        "time": time_,
        "step": step,
        "seconds": seconds,
        "data_s": data,
        "checkpoint_s": saving,
        "other_s": other,
    }


def _requeued_ledger() -> list[dict]:
    """Killed at step 4 (step 2 committed), requeued by SIGTERM at step 4 (exit 75), finished at step 6."""
    return [
        _launch(10.0, 0.0),
        {"event": "train_start", "time": 20.0, "step": 0, "restore_s": 0.0, "resumed_from": None},
        _step(22.0, 1, 2.0, data=0.5),
        _step(24.0, 2, 2.0, saving=0.5),
        {"event": "commit", "time": 24.2, "step": 2, "final": False},
        _step(26.0, 3, 2.0),
        _step(28.0, 4, 2.0),  # killed here: steps 3 and 4 are lost
        _launch(35.0, 30.0),
        {"event": "train_start", "time": 40.0, "step": 2, "restore_s": 1.0, "resumed_from": "ckpt/step-2"},
        _step(42.0, 3, 2.0, other=0.5),
        {"event": "signal", "time": 43.9, "signal": "SIGTERM"},
        _step(44.0, 4, 2.0, saving=0.25),
        {"event": "commit", "time": 44.1, "step": 4, "final": False},
        {"event": "end", "time": 45.0, "step": 4, "ok": False, "checkpoint_s": 0.5, "error": "SystemExit"},
        {"event": "exit", "time": 46.0, "status": 75},
        _launch(50.0, 48.0),
        {"event": "train_start", "time": 52.0, "step": 4, "restore_s": 0.5, "resumed_from": "ckpt/step-4"},
        _step(53.0, 5, 1.0),
        _step(54.0, 6, 1.0, data=0.25),
        {"event": "commit", "time": 54.5, "step": 6, "final": True},
        {"event": "end", "time": 55.0, "step": 6, "ok": True, "checkpoint_s": 0.5},
        {"event": "exit", "time": 56.0, "status": 0},
    ]


def test_a_requeued_run_splits_into_exact_categories():
    report = compute(_requeued_ledger())
    assert report.total_s == 56.0
    assert report.seconds == {
        "productive": 8.0,  # 1.5 + 1.5 (launch 1's steps 1-2) + 1.5 + 1.75 + 1.0 + 0.75
        "startup": 32.5,  # 20 + (40 - 30 - 1) + (52 - 48 - 0.5)
        "checkpoint_save": 1.75,  # 0.5 + 0.25 + 0.5 (the signal save, after step 4) + 0.5 (the final save)
        "checkpoint_restore": 1.5,
        "data_stall": 0.75,
        "wasted": 4.0,  # launch 1's steps 3 and 4: launch 2 resumed from step 2
        "between_launches": 4.0,  # 28 -> 30 and 46 -> 48
        "other": 3.5,  # 0.5 validation + (46 - 44 - 0.5) + (56 - 54 - 0.5)
    }
    assert sum(report.seconds.values()) == pytest.approx(report.total_s)
    assert report.goodput_percent == pytest.approx(100 * 8 / 56)
    assert [launch.how_it_ended for launch in report.launches] == [
        "killed (no exit recorded)",
        "exit 75 (SIGTERM)",
        "exit 0",
    ]
    assert [(launch.steps_run, launch.steps_survived) for launch in report.launches] == [(4, 2), (2, 2), (2, 2)]
    assert (report.steps_run, report.steps_survived, report.final_step) == (8, 6, 6)
    metrics = report.metrics()
    assert metrics["goodput/percent"] == pytest.approx(100 * 8 / 56)
    assert metrics["goodput/wasted_s"] == 4.0 and set(metrics) == {
        "goodput/percent",
        "goodput/total_s",
        *(f"goodput/{key}_s" for key in KEYS),
    }


def test_a_last_launch_killed_loses_the_steps_after_its_newest_commit():
    events = _requeued_ledger()[:7]  # launch 1 only: killed after step 4, step 2 committed
    report = compute(events)
    assert report.seconds["wasted"] == 4.0
    assert report.seconds["productive"] == 3.0
    assert (report.steps_survived, report.final_step) == (2, 2)


def test_a_step_survives_only_if_every_later_launch_resumed_at_or_after_it():
    # Launch 2 resumed from step 4, but launch 3 fell back to step 2 (a damaged checkpoint): launch 1's steps 3-4
    # and launch 2's step 5 were all redone.
    events = [
        _launch(0.0, 0.0),
        {"event": "train_start", "time": 1.0, "step": 0, "restore_s": 0.0},
        *[_step(1.0 + n, n, 1.0) for n in range(1, 5)],
        _launch(6.0, 6.0),
        {"event": "train_start", "time": 7.0, "step": 4, "restore_s": 0.0},
        _step(8.0, 5, 1.0),
        _launch(9.0, 9.0),
        {"event": "train_start", "time": 10.0, "step": 2, "restore_s": 0.0},
        *[_step(10.0 + n - 2, n, 1.0) for n in range(3, 6)],
        {"event": "end", "time": 13.0, "step": 5, "ok": True},
    ]
    report = compute(events)
    assert [launch.steps_survived for launch in report.launches] == [2, 0, 3]
    assert report.seconds["wasted"] == 3.0
    assert report.final_step == 5
    assert sum(report.seconds.values()) == pytest.approx(report.total_s) == 13.0


def test_a_line_cut_short_by_a_kill_is_left_out_and_a_damaged_line_is_named(tmp_path):
    ledger = tmp_path / "goodput.jsonl"
    lines = [json.dumps(event) for event in _requeued_ledger()[:5]]
    ledger.write_text("\n".join(lines[:4]) + "\n" + lines[4][:20])  # no newline: the write the kill cut short
    assert len(read_ledger(ledger)) == 4
    ledger.write_text("\n".join([*lines[:2], "{not json", *lines[2:]]) + "\n")
    with pytest.raises(LedgerError, match="line 3"):
        read_ledger(ledger)


def test_the_next_launch_writes_over_a_line_cut_short_instead_of_onto_it(tmp_path):
    path = tmp_path / "goodput.jsonl"
    launch = b'{"event":"launch","time":1.0,"process_start":0.0}\n'
    path.write_bytes(launch + b'{"event":"step","ti' + b"\0" * 100)  # cut mid-copy, then the padding
    log = AppendLog(path)
    log.write(b'{"event":"launch","time":5.0,"process_start":4.0}\n')
    log.close()
    assert [event["time"] for event in read_ledger(path)] == [1.0, 5.0]
    append_line(path, '{"event":"exit","time":6.0}\n')  # after a close: the same rule
    assert [event["time"] for event in read_ledger(path)] == [1.0, 5.0, 6.0]


def test_a_writer_killed_before_closing_leaves_padding_that_the_next_launch_writes_over(tmp_path):
    path = tmp_path / "goodput.jsonl"
    first = AppendLog(path)
    first.write(b'{"event":"launch","time":1.0,"process_start":0.0}\n')
    # Killed here: no close, so the file keeps its reserved, NUL-filled megabyte.
    assert path.stat().st_size >= 1 << 20
    assert [event["time"] for event in read_ledger(path)] == [1.0]
    second = AppendLog(path)
    for n in range(20000):  # past the first reservation: the mapping moves on
        second.write(json.dumps({"event": "step", "time": 2.0 + n}).encode() + b"\n")
    second.close()
    first._map.close()  # the killed process's handles, released without its close (which would truncate)
    os.close(first._fd)
    events = read_ledger(path)
    assert len(events) == 20001 and events[-1]["time"] == 20001.0
    assert path.read_bytes().endswith(b"}\n")


def _fill(folder: Path) -> None:
    """Write into ``folder`` until its file system says it is full (ENOSPC): a real full disk."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as error:
        assert error.errno == errno.ENOSPC, error
    finally:
        os.close(fd)


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_stops_the_ledger_once_and_never_training(tmpfs, tmp_path, monkeypatch):
    import lightning.pytorch as pl

    from lightning_mlopt.goodput import append_log as _append_log
    from tests.support.models import ThirdPartyLM

    disk = tmpfs("ledger", size="1m")
    # Reserve a page at a time (not 1 MiB), so that the ledger needs new blocks within a 40-step run.
    monkeypatch.setattr(_append_log, "_CHUNK", 4096)

    class FillTheDisk(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step == 3:
                _fill(disk)

    ledger = GoodputLedger(path=str(disk / "goodput.jsonl"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=40, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path / "run",
        callbacks=[ledger, FillTheDisk()],
    )  # fmt: skip
    with pytest.warns(UserWarning, match=r"goodput: cannot write .*No space left on device") as said:
        trainer.fit(ThirdPartyLM(num_sequences=64))
    assert trainer.global_step == 40  # training never stopped
    assert len([w for w in said if "goodput:" in str(w.message)]) == 1  # said once, not at every step
    # What was recorded before the disk filled is whole: no padding, every line an event, the report reads it.
    content = (disk / "goodput.jsonl").read_bytes()
    assert content.endswith(b"}\n") and b"\0" not in content
    steps = [event["step"] for event in read_ledger(disk / "goodput.jsonl") if event["event"] == "step"]
    assert steps == list(range(1, len(steps) + 1)) and 3 <= len(steps) < 40, steps
    assert compute(read_ledger(disk / "goodput.jsonl")).steps_run == len(steps)


class _Trainer(SimpleNamespace):
    """What the ledger reads of a Trainer, for driving its hooks without a fit."""

    # Hashed by identity, as a Trainer is: per-trainer state (``checkpoint_events(trainer)``) is keyed by it.
    __hash__ = object.__hash__


SLEEP_S, SLACK_S = 0.1, 0.05  # a phase's sleep; the most scheduling may add to it


def test_the_ledger_writes_one_line_per_step_from_the_phase_markers(tmp_path):
    trainer = _Trainer(
        is_global_zero=True,
        default_root_dir=str(tmp_path),
        world_size=1,
        global_step=0,
        callbacks=[],
        loggers=[],
        state=SimpleNamespace(status=SimpleNamespace(value="running")),
    )
    ledger = GoodputLedger(log_goodput=False)
    ledger.setup(trainer, None, "fit")  # type: ignore[arg-type]
    # Sleeps well apart from each other and from zero: on a loaded machine a phase takes its sleep plus whatever
    # scheduling adds (5 ms was seen on CI), so each is checked as at least its sleep and below the next size.
    set_phase("restore")
    time.sleep(0.02)
    set_phase("setup")
    ledger.on_train_start(trainer, None)  # type: ignore[arg-type]
    for step in range(1, 4):
        set_phase("data")
        time.sleep(SLEEP_S)
        set_phase("forward")
        time.sleep(0.01)
        trainer.global_step = step
        ledger.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]
        set_phase("checkpoint")
        time.sleep(SLEEP_S if step == 2 else 0.0)
        set_phase("loop")
        if step == 2:
            ledger._on_commit(Manifest(step=2, epoch=0, world_size=1, strategy="x", reason="every_n_steps"), tmp_path)
    set_phase("data")  # the next fetch closes step 3's record
    ledger.on_fit_end(trainer, None)  # type: ignore[arg-type]
    launch_report.write(status=0)  # the CLI's last word
    events = read_ledger(tmp_path / "goodput.jsonl")
    assert [event["event"] for event in events] == [
        "launch",
        "train_start",
        "step",
        "commit",  # committed in the background while step 2's record was still open
        "step",
        "step",
        "end",
        "exit",
    ]
    started, steps = events[1], [event for event in events if event["event"] == "step"]
    assert 0.02 <= started["restore_s"] < 0.02 + SLACK_S
    assert events[0]["process_start"] <= events[0]["time"]
    assert [step["step"] for step in steps] == [1, 2, 3]
    assert all(SLEEP_S <= step["data_s"] < SLEEP_S + SLACK_S for step in steps), steps
    assert SLEEP_S <= steps[1]["checkpoint_s"] < SLEEP_S + SLACK_S
    assert steps[0]["checkpoint_s"] < SLACK_S
    assert steps[1]["time"] - steps[0]["time"] == pytest.approx(steps[1]["seconds"], abs=1e-5)
    assert events[-1]["status"] == 0
    assert compute(events).steps_survived == 3


def test_process_start_includes_the_interpreter_start():
    psutil = pytest.importorskip("psutil")
    assert process_start_time() == pytest.approx(psutil.Process().create_time(), abs=1.5)


def test_constructor_validates(tmp_path):
    with pytest.raises(ValueError, match=r"path: .* folder"):
        GoodputLedger(path=str(tmp_path))


def test_a_folder_as_the_cli_ledger_path_is_bad_input_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--goodput.path=folder"])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert message.startswith("error: path: 'folder' is empty or a folder") and "usage" not in message
    assert [path.name for path in tmp_path.iterdir()] == ["folder"]


@pytest.mark.parametrize("damage", ["no folder", "no ledger", "unreadable line"])
def test_bad_input_says_why_in_one_line_and_writes_nothing(tmp_path, capsys, damage):
    run_dir = tmp_path / "run"
    if damage != "no folder":
        run_dir.mkdir()
    if damage == "unreadable line":
        (run_dir / "goodput.jsonl").write_text(json.dumps(_launch(0.0, 0.0)) + "\n{oops\n")
    before = sorted(tmp_path.rglob("*"))
    assert tool.main([str(run_dir)]) == 2
    message = capsys.readouterr().err
    assert message.startswith("error: ") and len(message.strip().splitlines()) == 1, message
    expected = {"no folder": "no such run directory", "no ledger": "no goodput.jsonl", "unreadable line": "line 2"}
    assert expected[damage] in message
    assert sorted(tmp_path.rglob("*")) == before


def test_the_report_as_text_json_and_chart(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "goodput.jsonl").write_text("".join(json.dumps(event) + "\n" for event in _requeued_ledger()))
    assert tool.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "Goodput of run: 14.3% of 56.0 s" in out
    assert "WASTED_PROGRESS_FROM_DISRUPTION" in out and "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION" in out
    assert "steps: 8 run, 6 survived; final global step 6" in out
    pytest.importorskip("matplotlib")
    assert (run_dir / "goodput.png").stat().st_size > 0
    assert tool.main([str(run_dir), "--format", "json", "--no-chart"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["goodput_percent"] == pytest.approx(100 * 8 / 56)
    assert [row["ml_goodput"] for row in report["categories"]][5] == "WASTED_PROGRESS_FROM_DISRUPTION"


# ------------------------------------------------------------------ one requeued job through the real CLI

MAX_STEPS = 20


def _command(
    run_dir: Path, clock: Path, tracking_uri: str, hold_at: int | None = None, hold_s: float = 120.0
) -> list[str]:
    return fit_args(
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.log_every_n_steps=1",
        # The run is tracked on a real `mlflow server` on loopback: one run for the four launches.
        *["--config", str(CONFIGS / "trackers" / "mlflow.yaml")],
        f"--trainer.logger.init_args.tracking_uri={tracking_uri}",
        "--trainer.logger.init_args.experiment_name=requeued",
        "--trainer.logger.init_args.system_metrics_every_s=0.5",
        "--trainer.logger.init_args.delivery.send_every_s=0.5",
        "--checkpoint.every_n_steps=4",
        # Saves are waited for (still committed on the writer's thread): a background write would slow the next
        # batch's fetch, which the ledger rightly counts in that step but the test's clock (at the batch's start,
        # after its fetch) cannot see.
        "--checkpoint.async_save=false",
        # A tiny GPT: the scenario measures the ledger and the tracker, not the model.
        "--model.init_args.n_layer=1",
        "--model.init_args.d_model=32",
        "--model.init_args.n_head=2",
        "--data.init_args.num_sequences=1024",
        "--trainer.callbacks+=tests.tracking.goodput_helpers.StepClock",
        f"--trainer.callbacks.out_file={clock}",
        f"--trainer.callbacks.hold_at={'null' if hold_at is None else hold_at}",
        f"--trainer.callbacks.hold_s={hold_s}",
        "--trainer.callbacks.pace_s=0.1",
        "--trainer.callbacks+=tests.support.recorders.LogLaunch",  # each step's row names the launch that computed it
        "--trainer.callbacks+=lightning_mlopt.callbacks.GradNormMonitor",  # callback rows beside Lightning's
        strategy="ddp",
        steps=MAX_STEPS,
        run_dir=run_dir,
        quiet=False,
    )


def _clock(path: Path) -> list[tuple[int, float]]:
    return [(int(step), float(at)) for step, at in (line.split() for line in path.read_text().splitlines())]


def _launch_until(command: list[str], clock: Path, step: int, cwd: Path, launch: int) -> PreloadedJob:
    """Start launch number ``launch`` of the job; return once rank zero started the batch at global step ``step``."""
    os.environ.pop("MLFLOW_RUN_ID", None)  # an in-process test's export must not pick the run
    env = {"TEST_LAUNCH": str(launch)}
    process = start_cli(command, cwd, env, preloaded=True)  # the ledger's subject is the run, not its imports
    deadline = time.monotonic() + 120
    while not (clock.is_file() and any(seen == step for seen, _ in _clock(clock))):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the job did not reach step {step}: {process.stderr_text()[-3000:]}")
        time.sleep(0.02)
    return process


def _time_lost(clock: Path, resumed_at: int, killed_at: int) -> float:
    """The test's own truth: from the start of the first batch after the checkpoint resumed from to the kill's
    batch start, the steps that finished and were lost."""
    times = dict(_clock(clock))
    return times[killed_at] - times[resumed_at]


@pytest.mark.multiprocess
def test_two_sigkills_and_a_sigterm_requeue_add_up_to_the_wall_clock_and_mlflow_keeps_each_step_once(
    tmp_path, capsys, mlflow_server
):
    # One requeued job, two trackers of what it did: the goodput ledger (time) and MLflow (each step's row).
    run_dir = tmp_path / "run"
    clocks = [tmp_path / f"clock-{n}.txt" for n in range(1, 5)]
    first_start = time.time()
    # Launch 1: killed at the start of the batch at step 7 (checkpoint 4 committed): steps 5-7 are lost.
    process = _launch_until(_command(run_dir, clocks[0], mlflow_server.uri, hold_at=7), clocks[0], 7, tmp_path, 1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)
    # Launch 2: resumes from 4, killed at the batch at step 14 (checkpoint 12 committed): steps 13-14 are lost.
    process = _launch_until(_command(run_dir, clocks[1], mlflow_server.uri, hold_at=14), clocks[1], 14, tmp_path, 2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)
    # Launch 3: SIGTERM to every process while the batch at step 15 runs: seen at its end (step 16) and agreed at
    # that boundary or, with steps this short, the next (the vote is summed in the background): 16 or 17 saved,
    # exit 75. The ledger's and the trackers' truths below follow the step it saved.
    command = _command(run_dir, clocks[2], mlflow_server.uri, hold_at=15, hold_s=2.0)
    process = _launch_until(command, clocks[2], 15, tmp_path, 3)
    os.killpg(process.pid, signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 75, stderr.decode()[-3000:]
    # Launch 4 names its checkpoint (`ckpt_path` changes; the run, and its MLflow parameters, do not), finishes.
    final_start = time.time()
    command = [*_command(run_dir, clocks[3], mlflow_server.uri), "--ckpt_path=last"]
    final = run_cli(command, cwd=tmp_path, env={"TEST_LAUNCH": "4"}, preloaded=True)
    assert final.returncode == 0, final.stderr[-3000:]
    wall_clock = time.time() - first_start
    # The launches' parameters differ only in the test's own clock callback (its file, where it holds): the
    # tracker keeps the first value and says so, and MLflow refuses nothing.
    said = (stderr.decode() + final.stdout + final.stderr).splitlines()
    noted = [line for line in said if any(word in line for word in ("INVALID_PARAMETER_VALUE", "refused", "differ"))]
    assert noted and all(
        line.endswith("keep their first value (MLflow cannot change a parameter): trainer.callbacks") for line in noted
    ), noted

    assert tool.main([str(run_dir), "--format", "json", "--no-chart"]) == 0
    report = json.loads(capsys.readouterr().out)
    seconds = {row["category"]: row["seconds"] for row in report["categories"]}
    total = report["total_s"]
    assert wall_clock - 3.0 < total <= wall_clock  # from the first process start to the last event
    assert sum(seconds.values()) == pytest.approx(total, rel=0.01)
    assert [launch["status"] for launch in report["launches"]] == [None, None, 75, 0]
    assert report["launches"][2]["signal"] == "SIGTERM"

    resumed = [_clock(clock)[0][0] for clock in clocks[1:]]  # each relaunch's first batch: where it resumed
    signal_step = resumed[2]
    assert resumed[:2] == [4, 12] and signal_step in (16, 17), resumed
    truth = _time_lost(clocks[0], resumed[0], 7) + _time_lost(clocks[1], resumed[1], 14)
    assert seconds["wasted"] == pytest.approx(truth, rel=0.02)
    assert seconds["productive"] > 0 and seconds["checkpoint_restore"] > 0 and seconds["between_launches"] > 0

    # The report and metrics.json agree on the step counts: every step kept once, to the final step.
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert report["final_step"] == metrics["global_step"] == MAX_STEPS
    assert report["steps_survived"] == MAX_STEPS
    assert [launch["steps_run"] for launch in report["launches"]] == [7, 10, signal_step - 12, MAX_STEPS - signal_step]
    assert report["steps_run"] == MAX_STEPS + 5  # steps 5-7 and 13-14 ran twice

    # MLflow: one run for four launches of two processes, each step's row once, from the launch whose
    # computation survived (a batch ending at global step s + 1 logs at step s): 0-3 the first launch (its 4-6
    # were redone), 4-11 the second (its 12-13 redone), 12 to the signal's save the third, the rest the fourth.
    client = mlflow_server.client()
    (experiment,) = [e for e in client.search_experiments() if e.name == "requeued"]
    (run,) = client.search_runs([experiment.experiment_id])
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"
    assert json.loads((run_dir / "mlflow" / "run.json").read_text())["run_id"] == run_id
    assert CheckpointStore(run_dir / "checkpoints").newest_valid().manifest.run_ids["mlflow"] == run_id
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == list(range(MAX_STEPS))
    launches = {m.step: int(m.value) for m in client.get_metric_history(run_id, "launch")}
    assert launches == {s: 1 if s < 4 else 2 if s < 12 else 3 if s < signal_step else 4 for s in range(MAX_STEPS)}
    # Our callbacks' rows carry the same labels: every grad_norm row once, none missing at a resume step;
    # PerformanceMonitor's (each launch's first batch is start-up, in no window) never twice.
    assert sorted(m.step for m in client.get_metric_history(run_id, "grad_norm/total")) == list(range(MAX_STEPS))
    perf = [m.step for m in client.get_metric_history(run_id, "perf/frac_forward")]
    assert perf and len(perf) == len(set(perf)) and set(perf) <= set(range(MAX_STEPS)), sorted(perf)
    # goodput/* went to the final launch's logger, over every launch so far.
    wasted = client.get_metric_history(run_id, "goodput/wasted_s")
    newest = max(wasted, key=lambda m: (m.step, m.timestamp))
    assert newest.value == pytest.approx(seconds["wasted"], rel=1e-6)
    # The resolved config as parameters (logged once: MLflow refuses a second, different value) and as a file.
    params = run.data.params
    assert params["trainer.max_steps"] == str(MAX_STEPS) and params["model.init_args.d_model"] == "32"
    assert "ckpt_path" not in params and "run_dir" not in params
    assert "config.yaml" in [a.path for a in client.list_artifacts(run_id)]
    # System metrics, tagged with the node, continued after the resumes, numbered across launches.
    (cpu,) = [
        key for key in run.data.metrics if key.startswith("system/") and key.endswith("cpu_utilization_percentage")
    ]
    samples = client.get_metric_history(run_id, cpu)
    assert any(m.timestamp >= final_start * 1000 for m in samples)
    assert len({m.step for m in samples}) == len(samples)
    # One record per committed checkpoint: 4 (launch 1), 8 and 12 (launch 2), 16 and the signal's save (16 or 17)
    # (launch 3), the final 20 (launch 4).
    records = {a.path for a in client.list_artifacts(run_id, "checkpoints")}
    assert records == {f"checkpoints/step-{s}.json" for s in (4, 8, 12, 16, signal_step, 20)}
    assert run.data.tags["mlopt.checkpoint.step"] == str(MAX_STEPS)
