"""SLURM: the sbatch script is checked, then run with stand-in srun/scontrol: signal, save, requeue, resume."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_mlopt.checkpoint import CheckpointStore
from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.tools.slurm import check_task_count, time_limit_seconds
from tests.conftest import CONFIGS, run_cli, run_tool_here
from tests.support.slurm_cluster import missing_requirement
from tests.support.slurm_standins import slurm_environment


def test_time_limits_and_task_counts():
    assert time_limit_seconds("1-02:00:00") == 93600 and time_limit_seconds("30") == 1800
    assert time_limit_seconds("04:30:00") == 16200 and time_limit_seconds("10:30") == 630
    assert time_limit_seconds("2-12") == 216000
    with pytest.raises(BadInputError, match="not a SLURM time limit"):
        time_limit_seconds("4h")
    check_task_count({"devices": "auto", "num_nodes": 1}, nodes=2, gpus_per_node=8)
    check_task_count({"devices": 8, "num_nodes": 2}, nodes=2, gpus_per_node=8)
    with pytest.raises(BadInputError, match=r"trainer\.devices is 4 in the config but --gpus_per_node is 8"):
        check_task_count({"devices": 4}, nodes=2, gpus_per_node=8)
    with pytest.raises(BadInputError, match=r"trainer\.num_nodes is 4 in the config but --nodes is 2"):
        check_task_count({"devices": 8, "num_nodes": 4}, nodes=2, gpus_per_node=8)


def test_a_task_count_mismatch_is_an_error_and_writes_nothing(tmp_path, monkeypatch):
    result = run_tool_here(
        "slurm",
        ["--config", str(CONFIGS / "quickstart.yaml"), "--nodes", "2", "--gpus_per_node", "0", "--cpu_workers", "8"],
        tmp_path,
        monkeypatch,
    )
    assert result.returncode == 2
    assert "trainer.devices is 1 in the config but --cpu_workers is 8" in result.stderr
    assert not (tmp_path / "runs").exists()
    late = run_tool_here(
        "slurm",
        ["--config", str(CONFIGS / "gpt.yaml"), "--nodes", "1", "--gpus_per_node", "8", "--time", "00:01:30"],
        tmp_path,
        monkeypatch,
    )
    assert late.returncode == 2 and "leaves no time before the SIGUSR1" in late.stderr


def test_the_script_for_gpus_asks_for_them_and_names_its_pieces(tmp_path, monkeypatch):
    result = run_tool_here(
        "slurm",
        [
            "--config",
            str(CONFIGS / "gpt.yaml"),
            "--trainer.accelerator=gpu",
            "--nodes",
            "2",
            "--gpus_per_node",
            "8",
            "--time",
            "1-00:00:00",
            "--partition",
            "a100",
            "--account",
            "lab",
            "--cpus_per_task",
            "6",
            "--sbatch_option=--mem=64G",
            "--sbatch_option=--constraint=h100",
            "--output",
            "job.sbatch",
        ],
        tmp_path,
        monkeypatch,
    )
    assert result.returncode == 0, result.stderr
    script = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --mem=64G" in script.splitlines() and "#SBATCH --constraint=h100" in script.splitlines()
    assert "\nsrun --cpus-per-task=6 " in script, "srun does not inherit --cpus-per-task from sbatch (SLURM >= 22.05)"
    for shell_signal in ("TERM", "USR1", "USR2", "INT"):
        assert f"trap 'forward {shell_signal}' {shell_signal}" in script
    bad = run_tool_here(
        "slurm",
        ["--config", str(CONFIGS / "gpt.yaml"), "--nodes", "1", "--gpus_per_node", "8", "--sbatch_option=mem=1G"],
        tmp_path,
        monkeypatch,
    )
    assert bad.returncode == 2 and "--sbatch_option 'mem=1G': give one sbatch option" in bad.stderr
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=1-00:00:00",
        "#SBATCH --partition=a100",
        "#SBATCH --account=lab",
        "#SBATCH --signal=USR1@120",
        "#SBATCH --requeue",
    ]:
        assert line in script.splitlines()
    assert "--trainer.num_nodes=2 --trainer.devices=8" in script and 'scontrol requeue "$job"' in script


def test_a_gpu_request_for_a_cpu_config_is_refused_and_a_cpu_job_asks_for_none(tmp_path, monkeypatch):
    quickstart = ["--config", str(CONFIGS / "quickstart.yaml"), "--nodes", "1", "--output", "job.sbatch"]
    refused = run_tool_here("slurm", [*quickstart, "--gpus_per_node", "1"], tmp_path, monkeypatch)
    assert refused.returncode == 2
    assert "--gpus_per_node 1 asks SLURM for GPUs, but trainer.accelerator is cpu in the config" in refused.stderr
    assert (
        "--gpus_per_node 0 --cpu_workers 1" in refused.stderr and "--sbatch_option=--gpus-per-node=1" in refused.stderr
    )
    assert not (tmp_path / "job.sbatch").exists() and not (tmp_path / "runs").exists()
    missing = run_tool_here("slurm", quickstart, tmp_path, monkeypatch)
    assert missing.returncode == 2 and "needs --nodes N (nodes) and --gpus_per_node G" in missing.stderr

    cpu_job = run_tool_here("slurm", [*quickstart, "--gpus_per_node", "0", "--error_log"], tmp_path, monkeypatch)
    assert cpu_job.returncode == 0, cpu_job.stderr
    assert "(1 node(s) x 1 CPU task(s))" in cpu_job.stdout
    lines = (tmp_path / "job.sbatch").read_text().splitlines()
    assert "#SBATCH --ntasks-per-node=1" in lines and not any("--gpus-per-node" in line for line in lines)
    output = next(line for line in lines if line.startswith("#SBATCH --output="))
    assert any(line == output.replace("--output=", "--error=").replace(".out", ".err") for line in lines)
    # Where it runs is said at the top: this folder and this interpreter, by path.
    assert f"#   working directory  {tmp_path.resolve()}" in lines
    assert f"#   interpreter        {sys.executable} (the one that wrote this script)" in lines


def test_setup_lines_run_before_the_job_step_which_inherits_them_and_a_failing_one_stops_the_job(tmp_path, monkeypatch):
    # An interpreter that records what it was started with, standing in for the cluster's (here a container's,
    # given as a command: `apptainer exec image.sif python`).
    recorder = tmp_path / "python-on-the-cluster"
    recorder.write_text('#!/bin/sh\necho "$CUDA_HOME|$*" >> "$(dirname "$0")/started.log"\n')
    recorder.chmod(0o755)
    args = ["--config", str(CONFIGS / "quickstart.yaml"), *("--nodes", "1", "--gpus_per_node", "0")]
    args += ["--python", f"{recorder} exec image.sif", "--sbatch_option=--mem=128G", "--output", "job.sbatch"]
    setup = ["--setup", "export CUDA_HOME=/opt/cuda-12.4  # as `module load cuda/12.4` would", "--setup", "true"]
    written = run_tool_here("slurm", [*args, *setup], tmp_path, monkeypatch)
    assert written.returncode == 0, written.stderr
    assert subprocess.run(["bash", "-n", "job.sbatch"], cwd=tmp_path).returncode == 0
    ran = subprocess.run(
        ["bash", "job.sbatch"], cwd=tmp_path, env=slurm_environment(tmp_path, tasks_per_node=1), capture_output=True
    )
    assert ran.returncode == 0, ran.stderr
    (started,) = (tmp_path / "started.log").read_text().splitlines()
    exported, command = started.split("|")
    assert exported == "/opt/cuda-12.4", "the job step inherits what the set-up lines set"
    assert command.startswith("exec image.sif -m lightning_mlopt fit --config ") and "--mem" not in command

    failing = ["--setup", "module load cuda/99.9 2>/dev/null || false"]
    written = run_tool_here("slurm", [*args, *failing], tmp_path, monkeypatch)
    assert written.returncode == 0, written.stderr
    stopped = subprocess.run(
        ["bash", "job.sbatch"], cwd=tmp_path, env=slurm_environment(tmp_path, tasks_per_node=1), capture_output=True
    )
    assert stopped.returncode == 2
    assert b"error: the set-up line failed (exit 1): module load cuda/99.9" in stopped.stderr
    assert len((tmp_path / "started.log").read_text().splitlines()) == 1, "the job step never started"
    assert (tmp_path / "calls.log").read_text().count("srun ") == 1, "srun ran for the first script only"


@pytest.mark.multiprocess
@pytest.mark.skipif(missing_requirement() is None, reason="runs on a real SLURM cluster in test_slurm_cluster.py")
def test_the_generated_script_saves_on_the_signal_requeues_and_the_requeued_job_resumes(tmp_path):
    generated = run_cli(
        [
            "slurm",
            "--config",
            str(CONFIGS / "quickstart.yaml"),
            "--trainer.devices=auto",
            "--nodes",
            "1",
            "--gpus_per_node",
            "0",
            "--cpu_workers",
            "2",
            "--time",
            "00:10:00",
            "--output",
            "job.sbatch",
            "--trainer.max_steps=10",
            "--trainer.max_epochs=-1",
            "--trainer.limit_val_batches=1",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.enable_progress_bar=false",
            "--checkpoint.every_n_steps=2",
            "--trainer.callbacks+=tests.support.faults.Pace",
            f"--trainer.callbacks.out_dir={tmp_path / 'pace'}",
            "--trainer.callbacks.seconds_per_step=0.3",
        ],
        cwd=tmp_path,
    )
    assert generated.returncode == 0, generated.stderr
    run_dir = tmp_path / generated.stdout.split("Run directory: ")[1].split()[0]
    slurm_env = slurm_environment(tmp_path, tasks_per_node=2, job_name="quickstart")
    job_id = slurm_env["SLURM_JOB_ID"]

    def sbatch_runs(extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "job.sbatch"],
            cwd=tmp_path,
            env={**slurm_env, **extra},
            capture_output=True,
            text=True,
            timeout=300,
        )

    # A wrong allocation is refused before training.
    wrong = sbatch_runs({"SLURM_NTASKS": "3"})
    assert wrong.returncode == 2 and "SLURM allocated 3 tasks but the run needs 1 x 2 = 2" in wrong.stderr
    assert not (run_dir / "checkpoints").exists()

    interrupted = sbatch_runs({"STANDIN_SIGNAL_AFTER_GLOB": str(run_dir / "checkpoints" / "step-*")})
    assert interrupted.returncode == 75, interrupted.stdout[-2000:] + interrupted.stderr[-3000:]
    assert f"scontrol requeue {job_id}" in (tmp_path / "calls.log").read_text()
    saved = CheckpointStore(run_dir / "checkpoints").newest_valid()
    assert saved is not None and saved.manifest.reason == "signal" and 2 <= saved.step < 10
    assert saved.manifest.world_size == 2

    requeued = sbatch_runs({"SLURM_RESTART_COUNT": "1"})
    assert requeued.returncode == 0, requeued.stdout[-2000:] + requeued.stderr[-3000:]
    assert "Auto-resuming from" in requeued.stdout + requeued.stderr
    final = CheckpointStore(run_dir / "checkpoints").newest_valid()
    assert final is not None and final.step == 10 and final.manifest.final
    assert (tmp_path / "calls.log").read_text().count("scontrol requeue") == 1
    resumed_steps = sorted(int(p.name.split("-")[1].split(".")[0]) for p in (tmp_path / "pace").glob("*.rank0"))
    assert resumed_steps[-1] == 10
