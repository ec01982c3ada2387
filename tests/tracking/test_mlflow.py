"""MLflowTracker: the outbox's survival rule, a plain Trainer on the local store, and a real `mlflow server` on
loopback that the run outlives (a server stopped mid-run). A 2-process job killed with SIGKILL twice and requeued
on SIGTERM, tracked on such a server, is tests/goodput/test_goodput.py's requeued job."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_mlopt.callbacks import FaultTolerantCheckpoint, Resume
from lightning_mlopt.checkpoint import CheckpointStore
from lightning_mlopt.tracking import MLflowTracker
from lightning_mlopt.tracking.outbox import Outbox
from tests.conftest import CONFIGS, failure_report, start_cli
from tests.support.mlflow_server import MLflowServer
from tests.support.models import ThirdPartyLM

MLFLOW = ["--config", str(CONFIGS / "trackers" / "mlflow.yaml")]

# ---------------------------------------------------------------------- the outbox


def _steps(records: list[dict]) -> list[tuple[int, int]]:
    return [(record["launch"], record["step"]) for record in records if record["kind"] == "metrics"]


def test_outbox_keeps_each_step_of_the_surviving_launch_across_kills(tmp_path):
    path = tmp_path / "outbox.jsonl"
    first = Outbox(path)
    first.resumed(0)
    first.add("params", params={"lr": "0.1"})
    for step in range(8):  # a batch ending at global step s+1 logs at step s
        first.add("metrics", step=step, time_ms=0, metrics={"loss": float(step)})
    first.release(5)  # the checkpoint of step 5 committed: steps 0..4 go
    assert _steps(first.sendable()) == [(1, s) for s in range(5)]
    assert next(r["kind"] for r in first.sendable()) == "params"  # not held
    first.mark_done([r["i"] for r in first.sendable()])
    # Killed mid-line: the next launch reads what was written whole and ends the cut line first.
    with path.open("a") as handle:
        handle.write('{"launch": 1, "kind": "metrics", "st')

    second = Outbox(path)
    assert second.launch == 2 and second.sendable() == [] and second.waiting() == 3  # steps 5..7: undecided
    second.resumed(5)  # the next launch starts from the checkpoint of step 5: the killed launch's 5..7 are lost
    assert second.sendable() == [] and len(second.dropped()) == 3
    for step in range(5, 9):
        second.add("metrics", step=step, time_ms=0, metrics={"loss": 100.0 + step})
    assert second.sendable() == []  # held: no checkpoint since step 5
    second.release(None)  # finished
    assert _steps(second.sendable()) == [(2, s) for s in range(5, 9)]

    third = Outbox(path)  # what a later reader sees: the same decisions, from the file alone
    assert sorted(set(_steps(third.sendable())) | {(1, s) for s in range(5)}) == [(1, s) for s in range(5)] + [
        (2, s) for s in range(5, 9)
    ]
    assert len(third.dropped()) == 3


def test_outbox_without_managed_checkpoints_lets_rows_go_at_once(tmp_path):
    outbox = Outbox(tmp_path / "outbox.jsonl")
    outbox.release_at_once()
    outbox.add("metrics", step=3, time_ms=0, metrics={"loss": 1.0})
    assert _steps(outbox.sendable()) == [(1, 3)]


def test_outbox_rewrites_a_file_of_done_records_and_keeps_what_matters(tmp_path, monkeypatch):
    import lightning_mlopt.tracking.outbox as outbox_module

    monkeypatch.setattr(outbox_module, "_COMPACT_AFTER", 5)
    path = tmp_path / "outbox.jsonl"
    first = Outbox(path)
    first.resumed(0)
    first.add("json", key=5, value={"step": 5})
    for step in range(10):
        first.add("metrics", step=step, time_ms=0, metrics={"loss": float(step)})
    first.release(8)
    first.mark_done([r["i"] for r in first.sendable()])  # 9 done; steps 8 and 9 wait
    lines_before = len(path.read_text().splitlines())

    second = Outbox(path)  # killed, relaunched: the file is rewritten without the done records
    assert len(path.read_text().splitlines()) < lines_before
    assert second.launch == 2 and second.count("metrics") == 10 and second.keys("json") == {5}
    assert second.waiting() == 2 and second.sendable() == []
    second.resumed(9)  # steps 8 (survives: below 9) and 9 (redone) of launch 1
    assert _steps(second.sendable()) == [(1, 8)] and len(second.dropped()) == 1
    assert Outbox(path).launch == 3


# ---------------------------------------------------------------------- a plain Trainer, the local store


@pytest.mark.slow
def test_plain_trainer_logs_to_a_local_store_and_a_relaunch_continues_the_run(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)

    def fit(max_steps: int) -> MLflowTracker:
        logger = MLflowTracker(experiment_name="plain", save_dir=str(tmp_path), system_metrics_every_s=0.2)
        trainer = pl.Trainer(
            max_steps=max_steps,
            max_epochs=-1,
            logger=logger,
            log_every_n_steps=1,
            limit_val_batches=0,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
            callbacks=[
                FaultTolerantCheckpoint(
                    dirpath=str(tmp_path / "checkpoints"), every_n_steps=3, resume=Resume(final=True)
                )
            ],
        )
        trainer.fit(ThirdPartyLM(num_sequences=64))
        return logger

    first = fit(4)
    assert os.environ.pop("MLFLOW_RUN_ID") == first.run_id  # exported for MLflow's own autologging
    second = fit(7)  # a relaunch with more steps resumes and logs into the same run
    assert second.run_id == first.run_id
    assert CheckpointStore(tmp_path / "checkpoints").newest_valid().manifest.run_ids == {"mlflow": first.run_id}
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["n_embd"] == "32"  # the model's hyperparameters, from both launches, once
    assert [m.step for m in client.get_metric_history(first.run_id, "train_loss")] == list(range(7))
    records = sorted(a.path for a in client.list_artifacts(first.run_id, "checkpoints"))
    assert records == [
        "checkpoints/step-3.json",
        "checkpoints/step-4.json",
        "checkpoints/step-6.json",
        "checkpoints/step-7.json",
    ]
    record = json.loads(
        Path(client.download_artifacts(first.run_id, "checkpoints/step-7.json", str(tmp_path))).read_text()
    )
    assert record["step"] == 7 and record["final"] is True and record["url"].startswith("file://")
    assert len(record["manifest_sha256"]) == 64
    system = [key for key in run.data.metrics if key.startswith("system/")]
    assert any(key.endswith("/cpu_utilization_percentage") for key in system), system


@pytest.mark.slow
def test_a_recorded_run_the_store_does_not_have_is_replaced_by_a_new_one_and_said(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    logger = MLflowTracker(save_dir=str(tmp_path), run_id="0123456789abcdef", system_metrics_every_s=None)
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    os.environ.pop("MLFLOW_RUN_ID", None)
    assert "run 0123456789abcdef is not on sqlite:///" in capsys.readouterr().err
    assert logger.run_id not in (None, "0123456789abcdef")
    client = logger.experiment
    assert [m.value for m in client.get_metric_history(logger.run_id, "loss")] == [1.0]


# ---------------------------------------------------------------------- a real server on loopback


def _fit_args(run_dir: Path, pace: Path, server: MLflowServer, max_steps: int) -> list[str]:
    return [
        "fit",
        "--model=tests.support.models.ThirdPartyLM",
        *MLFLOW,
        f"--trainer.logger.init_args.tracking_uri={server.uri}",
        "--trainer.logger.init_args.experiment_name=kills",
        "--trainer.logger.init_args.system_metrics_every_s=0.5",
        "--trainer.logger.init_args.delivery.send_every_s=0.5",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        f"--trainer.max_steps={max_steps}",
        "--trainer.max_epochs=-1",
        "--trainer.limit_val_batches=0",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--checkpoint.every_n_steps=5",
        "--trainer.callbacks+=tests.support.faults.Pace",
        f"--trainer.callbacks.out_dir={pace}",
        "--trainer.callbacks.seconds_per_step=0.2",
        "--trainer.callbacks+=tests.support.recorders.LogLaunch",
        f"--run_dir={run_dir}",
    ]


def _launch(args: list[str], cwd: Path) -> Any:
    """The fit, its one rank forked from the preloaded server: its subject is the tracker, not the launch."""
    os.environ.pop("MLFLOW_RUN_ID", None)  # an in-process test's export must not pick the run
    return start_cli(args, cwd, {"TEST_LAUNCH": "1"}, preloaded=True)


def _wait_for(path: Path, job: Any, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert job.poll() is None, f"the job ended (status {job.returncode}) before {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} within {timeout} s"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_server_stopped_mid_run_never_stops_training_and_gets_the_metrics_when_back(tmp_path, mlflow_server):
    run_dir, pace = tmp_path / "run", tmp_path / "pace"
    args = _fit_args(run_dir, pace, mlflow_server, max_steps=30)
    job = _launch(args, tmp_path)
    _wait_for(pace / "step-6.rank0", job)
    mlflow_server.stop()  # down for the rest of training
    _wait_for(pace / "step-30.rank0", job)  # training went on without it
    mlflow_server.start()  # back while the finished run waits to flush (delivery.flush_timeout_s)
    status = job.wait(timeout=180)
    said = job.stdout_text() + job.stderr_text()
    job.remove_outputs()
    assert status == 0, failure_report(subprocess.CompletedProcess([], status, "", said))
    assert said.count("MLflow: cannot reach") == 1 and "answers again" in said, said[-3000:]
    client = mlflow_server.client()
    run_id = json.loads((run_dir / "mlflow" / "run.json").read_text())["run_id"]
    assert sorted(m.step for m in client.get_metric_history(run_id, "train_loss")) == list(range(30))
    assert client.get_run(run_id).info.status == "FINISHED"
