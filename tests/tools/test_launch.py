"""``python -m lightning_mlopt launch``: the statuses a scheduler acts on, and never a traceback. The preemption
path (SIGTERM to the launcher alone: one line, exit 75, a relaunch bitwise equal) runs in tests/tools/test_k8s.py
as the manifest's PID 1, and in the torture script's ``sigterm-launcher`` fault for every strategy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lightning_mlopt.process.launch_report import REPORTS_ENV, note, read_reports, write
from lightning_mlopt.tools.launch import _torchrun_arguments
from tests.conftest import CONFIGS, REPO_PYTHONPATH


def _launch(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH, "PYTHONUNBUFFERED": "1"}
    env.pop("MASTER_PORT", None)
    command = [sys.executable, "-m", "lightning_mlopt", "launch", *args]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)


def test_torchrun_options_pass_through_with_our_signals_and_grace():
    options = _torchrun_arguments(["--nnodes=2", "--nproc-per-node=8", "--shutdown-timeout=45", "fit", "-c", "x.yaml"])
    assert options.nnodes == "2" and options.nproc_per_node == "8"
    assert options.module and options.training_script == "lightning_mlopt"
    assert options.training_script_args == ["fit", "-c", "x.yaml"]
    assert {"SIGTERM", "SIGUSR1", "SIGINT"} <= set(options.signals_to_handle.split(","))
    assert options.shutdown_timeout == 45 and options.preempted_exit_code == 75


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,says",
    [
        (["--nproc-per-node=1", "checkpoint", "list"], "launch runs a Trainer subcommand"),
        (["-m", "fit"], "drop -m/--module"),
        (["--preempted-exit-code=0", "fit"], "--preempted-exit-code must be in 1..255"),
        (["--preemption-notices=azure", "fit"], "unknown provider(s) ['azure']"),
    ],
)
def test_bad_launcher_arguments_exit_2_in_one_line(tmp_path, args, says):
    done = _launch(tmp_path, *args)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not done.stdout


@pytest.mark.multiprocess
def test_a_worker_failure_is_the_launchers_status_in_one_line(tmp_path):
    done = _launch(tmp_path, "--nproc-per-node=1", "fit", "--config", str(CONFIGS / "missing.yaml"))
    assert done.returncode == 2, done.stderr[-2000:]
    launcher = [line for line in done.stderr.splitlines() if line.startswith("launch:")]
    assert launcher == ["launch: worker rank 0 exited with status 2; its output is above (exit 2)."]
    assert "config file not found" in done.stderr and "Traceback" not in done.stderr


def test_ranks_report_to_the_launcher_only_under_launch(tmp_path, monkeypatch):
    monkeypatch.delenv(REPORTS_ENV, raising=False)
    note(checkpoints="nowhere")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(REPORTS_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    note(checkpoints="runs/a/checkpoints")
    assert read_reports(tmp_path)[3]["checkpoints"] == "runs/a/checkpoints"
    write(status=75)
    assert read_reports(tmp_path)[3]["status"] == 75
    # torchrun restarted the workers: rank 3's report of the first attempt is stale, rank 0's is the newest.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    write()
    assert list(read_reports(tmp_path)) == [0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGUSR1"])
def test_a_signal_to_the_launcher_alone_reaches_the_rank_not_its_loader_and_it_saves_and_exits_75(
    tmp_path, signal_name
):
    import signal
    import time

    from lightning_mlopt.checkpoint import CheckpointStore

    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH, "PYTHONUNBUFFERED": "1"}
    env.pop("MASTER_PORT", None)
    command = [
        *[sys.executable, "-m", "lightning_mlopt", "launch", "--nproc-per-node=1", "fit"],
        *["--config", str(CONFIGS / "quickstart.yaml"), f"--run_dir={run_dir}", "--trainer.max_steps=200"],
        *["--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--checkpoint.every_n_steps=2"],
        *["--trainer.callbacks+=tests.support.faults.Pace", f"--trainer.callbacks.out_dir={tmp_path / 'pace'}"],
        "--trainer.callbacks.seconds_per_step=0.1",
        "--data.init_args.num_workers=1",  # a DataLoader worker: the signal must reach the rank, not kill it
    ]
    log = tmp_path / "launch.log"
    with log.open("w") as handle:
        launcher = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=handle, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoints" / "step-000000002").is_dir():
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        # torchrun alone dies of SIGUSR1 (SLURM's --signal=USR1@N), and passes SIGTERM to the rank's whole process
        # group, where a DataLoader worker it kills makes the rank fail instead of saving.
        launcher.send_signal(getattr(signal, signal_name))
        code = launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    output = log.read_text()
    assert code == 75, output[-3000:]
    launcher_lines = [line for line in output.splitlines() if line.startswith("launch:")]
    assert len(launcher_lines) == 1 and f"preempted by {signal_name}: the workers saved" in launcher_lines[0], output[
        -2000:
    ]
    assert "Traceback" not in output
    newest = CheckpointStore(run_dir / "checkpoints").newest_valid()
    assert newest is not None and newest.manifest.reason == "signal"


def test_a_signal_inside_torchruns_metrics_wrapper_is_still_the_signal(monkeypatch):
    """The real wrapper, with the signal's exception raised where the handler runs: right after time.time()."""
    import signal
    from types import SimpleNamespace

    from torch.distributed.elastic.metrics import api as metrics_api
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from lightning_mlopt.tools.launch import signal_behind

    @metrics_api.prof
    def monitor_workers() -> None:
        pass

    def clock_then_signal() -> float:
        raise SignalException("Process 1 got signal: 10", sigval=signal.SIGUSR1)

    monkeypatch.setattr(metrics_api, "time", SimpleNamespace(time=clock_then_signal))
    with pytest.raises(UnboundLocalError) as caught:  # what torchrun's run() then raises
        monitor_workers()
    found = signal_behind(caught.value)
    assert isinstance(found, SignalException) and found.sigval == signal.SIGUSR1
    plain = RuntimeError("rendezvous timed out")
    assert signal_behind(plain) is plain
