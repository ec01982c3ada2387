"""MLflowTracker: the outbox's survival rule, a plain Trainer on the local store, and a real `mlflow server` on
loopback that the run outlives: a 2-process job killed with SIGKILL twice, and a server stopped mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_mlopt.callbacks import FaultTolerantCheckpoint
from lightning_mlopt.checkpoint import CheckpointStore
from lightning_mlopt.tracking import MLflowTracker
from lightning_mlopt.tracking.outbox import Outbox
from tests.conftest import CONFIGS, failure_report, start_cli
from tests.helpers import ThirdPartyLM
from tests.mlflow_server import MLflowServer

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
                FaultTolerantCheckpoint(dirpath=str(tmp_path / "checkpoints"), every_n_steps=3, resume_final=True)
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


@pytest.fixture
def mlflow_server(tmp_path):
    with MLflowServer(tmp_path / "server") as server:
        yield server


def _fit_args(run_dir: Path, pace: Path, server: MLflowServer, devices: int, max_steps: int) -> list[str]:
    return [
        "fit",
        "--model=tests.helpers.ThirdPartyLM",
        *MLFLOW,
        f"--trainer.logger.init_args.tracking_uri={server.uri}",
        "--trainer.logger.init_args.experiment_name=kills",
        "--trainer.logger.init_args.system_metrics_every_s=0.5",
        "--trainer.logger.init_args.send_every_s=0.5",
        "--trainer.accelerator=cpu",
        f"--trainer.devices={devices}",
        *(["--trainer.strategy=ddp"] if devices > 1 else []),
        f"--trainer.max_steps={max_steps}",
        "--trainer.max_epochs=-1",
        "--trainer.limit_val_batches=0",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--checkpoint.every_n_steps=5",
        "--trainer.callbacks+=tests.helpers.Pace",
        f"--trainer.callbacks.out_dir={pace}",
        "--trainer.callbacks.seconds_per_step=0.2",
        "--trainer.callbacks+=tests.helpers.LogLaunch",
        f"--run_dir={run_dir}",
    ]


def _launch(args: list[str], cwd: Path, launch: int, log: Path) -> subprocess.Popen[bytes]:
    os.environ.pop("MLFLOW_RUN_ID", None)  # an in-process test's export must not pick the run
    with log.open("ab") as out:
        return start_cli(args, cwd, {"TEST_LAUNCH": str(launch)}, stdout=out, stderr=out)


def _wait_for(path: Path, job: subprocess.Popen[bytes], timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert job.poll() is None, f"the job ended (status {job.returncode}) before {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} within {timeout} s"
        time.sleep(0.05)


@pytest.mark.multiprocess
def test_two_sigkills_then_a_finished_launch_make_one_run_with_each_step_once(tmp_path, mlflow_server):
    run_dir, pace, log = tmp_path / "run", tmp_path / "pace", tmp_path / "launches.log"
    args = _fit_args(run_dir, pace, mlflow_server, devices=2, max_steps=16)
    starts = []
    # Launch 1 is killed after step 8 (resumes from 5), launch 2 after step 13 (resumes from 10).
    for launch, kill_after in ((1, 8), (2, 13)):
        starts.append(time.time())
        job = _launch(args, tmp_path, launch, log)
        _wait_for(pace / f"step-{kill_after}.rank0", job)
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        for marker in pace.glob("step-*"):
            marker.unlink()
    starts.append(time.time())
    # The third launch names its checkpoint (`ckpt_path` changes; the run, and its parameters, do not).
    final = _launch([*args, "--ckpt_path=last"], tmp_path, 3, log)
    assert final.wait(timeout=300) == 0, log.read_text()[-4000:]
    said = log.read_text()
    assert "INVALID_PARAMETER_VALUE" not in said and "refused" not in said and "differ from" not in said, said[-3000:]

    client = mlflow_server.client()
    (experiment,) = [e for e in client.search_experiments() if e.name == "kills"]
    (run,) = client.search_runs([experiment.experiment_id])  # one run for three launches of two processes
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"
    assert json.loads((run_dir / "mlflow" / "run.json").read_text())["run_id"] == run_id
    assert CheckpointStore(run_dir / "checkpoints").newest_valid().manifest.run_ids["mlflow"] == run_id
    # Each step's loss exactly once, from the launch whose computation survived: 0-4 the first (its 5-7 were
    # redone), 5-9 the second (its 10-12 redone), 10-15 the third.
    losses = client.get_metric_history(run_id, "train_loss")
    assert sorted(m.step for m in losses) == list(range(16))
    launches = {m.step: int(m.value) for m in client.get_metric_history(run_id, "launch")}
    assert launches == {s: 1 if s < 5 else 2 if s < 10 else 3 for s in range(16)}
    # The resolved config as parameters (logged once: MLflow refuses a second, different value) and as a file.
    params = run.data.params
    assert params["trainer.max_steps"] == "16" and params["model.init_args.n_embd"] == "32"
    assert "ckpt_path" not in params and "run_dir" not in params
    assert "config.yaml" in [a.path for a in client.list_artifacts(run_id)]
    # System metrics, tagged with the node, continued after the resumes.
    (cpu,) = [
        key for key in run.data.metrics if key.startswith("system/") and key.endswith("cpu_utilization_percentage")
    ]
    samples = client.get_metric_history(run_id, cpu)
    assert any(m.timestamp >= starts[2] * 1000 for m in samples)
    assert len({m.step for m in samples}) == len(samples)  # numbered across launches, never twice
    # One record per committed checkpoint: steps 5 (launch 1), 10 (launch 2), 15 and the final 16 (launch 3).
    records = sorted(a.path for a in client.list_artifacts(run_id, "checkpoints"))
    assert records == [f"checkpoints/step-{s}.json" for s in (10, 15, 16, 5)]
    assert run.data.tags["mlopt.checkpoint.step"] == "16"


def test_a_server_stopped_mid_run_never_stops_training_and_gets_the_metrics_when_back(tmp_path, mlflow_server):
    run_dir, pace, log = tmp_path / "run", tmp_path / "pace", tmp_path / "launch.log"
    args = _fit_args(run_dir, pace, mlflow_server, devices=1, max_steps=30)
    job = _launch(args, tmp_path, 1, log)
    _wait_for(pace / "step-6.rank0", job)
    mlflow_server.stop()  # down for the rest of training
    _wait_for(pace / "step-30.rank0", job)  # training went on without it
    mlflow_server.start()  # back while the finished run waits to flush (flush_timeout_s)
    assert job.wait(timeout=180) == 0, failure_report(
        subprocess.CompletedProcess([], job.returncode, "", log.read_text())
    )
    said = log.read_text()
    assert said.count("MLflow: cannot reach") == 1 and "answers again" in said, said[-3000:]
    client = mlflow_server.client()
    run_id = json.loads((run_dir / "mlflow" / "run.json").read_text())["run_id"]
    assert sorted(m.step for m in client.get_metric_history(run_id, "train_loss")) == list(range(30))
    assert client.get_run(run_id).info.status == "FINISHED"
