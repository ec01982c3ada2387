"""Multi-node with torchrun: two agents on 127.0.0.1 (c10d rendezvous), one worker each; a killed worker is
restarted by its agent, the other agent restarts its worker too, and the job resumes from the checkpoint."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_mlopt.checkpoint import CheckpointStore
from lightning_mlopt.distributed.elastic import RESTART_SAFE_ENV
from tests.conftest import CONFIGS, REPO_PYTHONPATH

TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun is not installed")
def test_two_torchrun_agents_train_and_an_elastic_restart_resumes_from_the_checkpoint(tmp_path):
    run_dir, pace = tmp_path / "run", tmp_path / "pace"
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH, "PYTHONUNBUFFERED": "1", **RESTART_SAFE_ENV}
    env.pop("MASTER_PORT", None)
    command = [
        TORCHRUN,
        "--nnodes=2",
        "--nproc-per-node=1",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=mlopt-test",
        "-m",
        "lightning_mlopt",
        "fit",
        "--config",
        str(CONFIGS / "quickstart.yaml"),
        "--trainer.num_nodes=2",
        "--trainer.devices=1",
        "--trainer.max_steps=8",
        "--trainer.max_epochs=-1",
        "--trainer.limit_val_batches=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        f"--run_dir={run_dir}",
        "--checkpoint.every_n_steps=2",
        "--trainer.callbacks+=tests.support.faults.Pace",
        f"--trainer.callbacks.out_dir={pace}",
        "--trainer.callbacks.seconds_per_step=0.5",
    ]
    logs = [tmp_path / f"agent{node}.log" for node in (0, 1)]
    agents = []
    for log in logs:
        with log.open("w") as handle:  # a file, not a pipe: a stuck worker must not block the test
            agents.append(
                subprocess.Popen(
                    command, cwd=tmp_path, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    try:
        # Once step 2 is committed, kill the rank-1 worker (not its agent), as a node's process crash would.
        deadline = time.monotonic() + 180
        marker = pace / "step-3.rank1"
        while not (marker.exists() and (run_dir / "checkpoints" / "step-000000002").exists()):
            assert time.monotonic() < deadline, "the job never reached step 3: " + logs[0].read_text()[-3000:]
            assert all(a.poll() is None for a in agents), "an agent ended early: " + logs[0].read_text()[-3000:]
            time.sleep(0.2)
        os.kill(int(marker.read_text()), signal.SIGKILL)
        codes = [agent.wait(timeout=240) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-9", "-f", str(run_dir)], check=False)
    output = "\n".join(log.read_text() for log in logs)
    assert codes == [0, 0], output[-5000:]
    assert "Auto-resuming from" in output
    final = CheckpointStore(run_dir / "checkpoints").newest_valid()
    assert final is not None and final.step == 8 and final.manifest.final and final.manifest.world_size == 2
    # Both ranks trained after the restart, from the checkpoint (not from step 0): step 8 was reached by each.
    assert (pace / "step-8.rank0").exists() and (pace / "step-8.rank1").exists()


@pytest.mark.multiprocess
def test_sigterm_to_one_nodes_launcher_ends_both_nodes_preempted_with_75(tmp_path):
    """The kubelet signals one pod: its workers save with everyone's, and every node's launcher exits 75 (not
    the 75 of a failed worker, which torchrun would restart, or which PyTorchJob v1 would take as permanent)."""
    run_dir, pace = tmp_path / "run", tmp_path / "pace"
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH, "PYTHONUNBUFFERED": "1"}
    env.pop("MASTER_PORT", None)
    command = [
        *[sys.executable, "-m", "lightning_mlopt", "launch", "--nnodes=2", "--nproc-per-node=1"],
        *["--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=mlopt-one"],
        *["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--trainer.num_nodes=2", "--trainer.devices=1"],
        *["--trainer.max_steps=200", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false"],
        *[f"--run_dir={run_dir}", "--checkpoint.every_n_steps=2", "--trainer.callbacks+=tests.support.faults.Pace"],
        *[f"--trainer.callbacks.out_dir={pace}", "--trainer.callbacks.seconds_per_step=0.2"],
    ]
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    launchers = []
    for log in logs:
        with log.open("w") as handle:
            launchers.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=handle, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "checkpoints" / "step-000000002").is_dir():
            assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
            assert all(a.poll() is None for a in launchers), logs[0].read_text()[-3000:]
            time.sleep(0.2)
        launchers[1].send_signal(signal.SIGTERM)  # one node's launcher only
        codes = [launcher.wait(timeout=90) for launcher in launchers]
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
        subprocess.run(["pkill", "-9", "-f", str(run_dir)], check=False)
    outputs = [log.read_text() for log in logs]
    assert codes == [75, 75], "\n".join(output[-2000:] for output in outputs)
    for output in outputs:
        said = [line for line in output.splitlines() if line.startswith("launch:")]
        assert len(said) == 1 and "preempted" in said[0] and "Traceback" not in output, output[-2000:]
    newest = CheckpointStore(run_dir / "checkpoints").newest_valid()
    assert newest is not None and newest.manifest.reason == "signal"
