"""The sbatch script on a real SLURM cluster (one node, private): a whole-job USR1, a requeue of a running
job (SIGTERM from SLURM), and a time limit each end in a save, exit 75, a requeue and a resumed run.

SLURM holds a requeued job until the old instance's job credential expires (``cred_expire``, 120 s by
default); the test cluster sets 10 s.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_mlopt.checkpoint import CheckpointStore
from tests.conftest import CONFIGS, REPO_PYTHONPATH, run_tool_here
from tests.support.slurm_cluster import SlurmCluster, missing_requirement

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = missing_requirement()
    if reason:
        pytest.skip(reason)
    started = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        started.start()
        yield started
    finally:
        started.stop()


def _write_script(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *extra: str,
    time_limit: str = "00:10:00",
    signal_seconds: int = 120,
) -> Path:
    generated = run_tool_here(  # the script is only written: no process needed
        "slurm",
        [
            "--config",
            str(CONFIGS / "gpt.yaml"),
            "--trainer.accelerator=cpu",
            "--trainer.strategy=ddp",
            "--nodes",
            "1",
            "--gpus_per_node",
            "0",
            "--cpu_workers",
            "2",
            "--cpus_per_task",
            "1",
            "--time",
            time_limit,
            "--signal_seconds",
            str(signal_seconds),
            "--sbatch_option=--comment=lightning_mlopt-tests",
            "--trainer.max_steps=40",
            "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.enable_progress_bar=false",
            "--trainer.logger=false",
            "--data.init_args.num_sequences=4096",
            "--checkpoint.every_n_steps=5",
            f"--run_dir={tmp_path / 'run'}",
            *extra,
        ],
        tmp_path,
        monkeypatch,
    )
    assert generated.returncode == 0, generated.stderr
    script = tmp_path / "run" / "job.sbatch"
    assert "#SBATCH --comment=lightning_mlopt-tests" in script.read_text().splitlines()
    assert "srun --cpus-per-task=1 " in script.read_text()
    return script


def _submit(cluster: SlurmCluster, script: Path) -> str:
    env_path = {"PYTHONPATH": REPO_PYTHONPATH, "PYTHONUNBUFFERED": "1"}
    cluster.env.update(env_path)  # sbatch exports the submitting environment to the job
    submitted = cluster.run("sbatch", "--parsable", str(script))
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0]


def _wait_for(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _requeued_then_finished(cluster: SlurmCluster, job_id: str, run_dir: Path) -> str:
    """Wait for the requeue and for the requeued job (held cred_expire seconds) to finish; return its log."""
    _wait_for(lambda: int(cluster.job(job_id).get("Restarts", "0")) >= 1, 120, "the requeue")
    # SLURM holds the requeued job until the old instance's credential expires (cred_expire, 10 s here). Releasing
    # it earlier by hand (scontrol update StartTime=now) made the new instance fail: "Job credential revoked".
    _wait_for(lambda: cluster.job(job_id).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), 240, "the end")
    job = cluster.job(job_id)
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", f"{job}\n{log[-3000:]}"
    return log


def _first_checkpoint(run_dir: Path) -> None:
    _wait_for(lambda: bool(list((run_dir / "checkpoints").glob("step-*"))), 180, "the first checkpoint")


def test_usr1_to_the_whole_job_saves_requeues_and_resumes(cluster, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    job_id = _submit(cluster, _write_script(tmp_path, monkeypatch))
    _first_checkpoint(run_dir)
    time.sleep(1)
    # --full: the batch shell gets it too (it used to die of it, ending the job FAILED without a requeue).
    cluster.run("scancel", "--signal=USR1", "--full", job_id, check=True)
    log = _requeued_then_finished(cluster, job_id, run_dir)
    assert "batch shell: SIGUSR1 received; passing it to the job step" in log
    assert "Exited with exit code 75" in log and f"requeueing job {job_id}" in log
    assert "(restart 1)" in log and "saved by signal)" in log.split("(restart 1)")[1]
    final = CheckpointStore(run_dir / "checkpoints").newest_valid()
    assert final is not None and final.step == 40 and final.manifest.final


def test_a_requeue_of_the_running_job_saves_on_slurms_sigterm_and_resumes(cluster, tmp_path, monkeypatch):
    # What preemption with PreemptMode=REQUEUE does: SLURM sends SIGTERM to every process of the job, waits
    # KillWait seconds, then kills what is left, and queues the job again.
    run_dir = tmp_path / "run"
    job_id = _submit(cluster, _write_script(tmp_path, monkeypatch))
    _first_checkpoint(run_dir)
    time.sleep(1)
    cluster.run("scontrol", "requeue", job_id, check=True)
    log = _requeued_then_finished(cluster, job_id, run_dir)
    assert "Preemption signal: saved step" in log
    resumed = log.split("(restart 1)")[1]
    assert "Auto-resuming from" in resumed and "saved by signal)" in resumed
    final = CheckpointStore(run_dir / "checkpoints").newest_valid()
    assert final is not None and final.step == 40 and final.manifest.final


def test_the_time_limit_signal_saves_and_requeues(cluster, tmp_path, monkeypatch):
    # --signal=USR1@100 on a 2-minute limit: SLURM sends USR1 20 to 80 s into the job (its timer is coarse). Not
    # earlier: a signal in start-up ends the job with 75 at once and saves nothing (there is nothing to save), and
    # a loaded 2-core machine took over 5 s to reach the first step (CI, with USR1@115).
    run_dir = tmp_path / "run"
    script = _write_script(
        tmp_path,
        monkeypatch,
        "--trainer.max_steps=100000",
        "--trainer.callbacks+=tests.support.faults.Pace",
        f"--trainer.callbacks.out_dir={tmp_path / 'pace'}",
        "--trainer.callbacks.seconds_per_step=0.2",
        time_limit="00:02:00",
        signal_seconds=100,
    )
    job_id = _submit(cluster, script)
    try:
        _wait_for(lambda: int(cluster.job(job_id).get("Restarts", "0")) >= 1, 200, "the time-limit requeue")
        log = (run_dir / f"slurm-{job_id}.out").read_text()
        assert "Exited with exit code 75" in log and f"requeueing job {job_id}" in log
        saved = CheckpointStore(run_dir / "checkpoints").newest_valid()
        # SLURM's coarse timer may still signal a loaded machine's job in start-up (seen on CI at USR1@100): then
        # every rank exits 75 at once with nothing to save, and the requeue is the same. Saving on USR1 in training
        # is test_usr1_to_the_whole_job_saves_requeues_and_resumes's claim.
        in_start_up = "before the first training step: nothing to save; exiting with status 75" in log
        assert in_start_up or (saved is not None and saved.manifest.reason == "signal"), log[-3000:]
    finally:
        cluster.run("scancel", job_id)
        os.environ.pop("SLURM_CONF", None)


def test_a_sweep_as_a_job_array_runs_every_trial_and_the_results_are_read_back(cluster, tmp_path, monkeypatch):
    (tmp_path / "sweep.yaml").write_text(
        "method: grid\nmetric: {name: train/loss, goal: minimize}\nparameters:\n"
        "  model.init_args.lr: {values: [0.0001, 0.1]}\n"
    )
    sweep_args = [
        "sweep",
        "--config",
        str(CONFIGS / "quickstart.yaml"),
        "--sweep",
        str(tmp_path / "sweep.yaml"),
        "--sweep_dir=sweep",
        "--trainer.devices=auto",
        "--trainer.max_steps=3",
        "--trainer.max_epochs=1",
        "--trainer.limit_val_batches=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
    ]
    allocation = ["--nodes", "1", "--gpus_per_node", "0", "--cpu_workers", "2", "--max_parallel", "1"]
    # A cluster's set-up lines (module load, conda activate) run in each array task before its trial.
    setup = ["--setup", f"echo $SLURM_ARRAY_TASK_ID > {tmp_path}/setup-ran-$SLURM_ARRAY_TASK_ID"]
    emitted = run_tool_here("sweep", [*sweep_args[1:], "--slurm", *allocation, *setup], tmp_path, monkeypatch)
    assert emitted.returncode == 0, emitted.stderr
    job_id = _submit(cluster, tmp_path / "sweep" / "sweep.sbatch")
    _wait_for(lambda: not cluster.run("squeue", "-h", "-j", job_id).stdout.strip(), 300, "the array to finish")
    assert sorted(path.name for path in tmp_path.glob("setup-ran-*")) == ["setup-ran-0", "setup-ran-1"]
    table = run_tool_here("sweep", [*sweep_args[1:], "--results"], tmp_path, monkeypatch)
    assert table.returncode == 0, table.stderr
    rows = table.stdout[table.stdout.index("rank  trial") :].splitlines()[1:3]
    assert [row.split()[0] for row in rows] == ["1", "2"] and all(row.split()[-1] == "done" for row in rows), rows


def test_an_allocation_that_does_not_match_the_run_is_refused_before_training(cluster, tmp_path, monkeypatch):
    script = _write_script(tmp_path, monkeypatch)
    cluster.env.update({"PYTHONPATH": REPO_PYTHONPATH})
    submitted = cluster.run("sbatch", "--parsable", "--ntasks-per-node=1", str(script))  # overrides the script's 2
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    _wait_for(lambda: cluster.job(job_id).get("JobState") in ("FAILED", "COMPLETED"), 120, "the job to end")
    assert cluster.job(job_id)["ExitCode"] == "2:0"
    log = (tmp_path / "run" / f"slurm-{job_id}.out").read_text()
    assert "SLURM allocated 1 tasks but the run needs 1 x 2 = 2" in log
    assert not (tmp_path / "run" / "checkpoints").exists()
