"""NCCLHealthCheck through the real CLI on 2 CPU processes: hangs, restarts, skew, stragglers, bandwidth."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_mlopt.callbacks import NCCLHealthCheck, Watchdog
from lightning_mlopt.callbacks.nccl_health_check import _missing_ranks
from lightning_mlopt.checkpoint import CheckpointStore
from lightning_mlopt.distributed.bandwidth import bus_bandwidth
from lightning_mlopt.distributed.elastic import RESTART_SAFE_ENV as TORCHRUN_RESTART_ENV
from lightning_mlopt.distributed.fingerprint import fingerprint_mismatches
from tests.conftest import CONFIGS, REPO_PYTHONPATH, run_cli

BASE = [
    "fit",
    "--config",
    str(CONFIGS / "gpt.yaml"),
    "--trainer.strategy=ddp",
    "--trainer.accelerator=cpu",
    "--trainer.limit_val_batches=0",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.logger=false",
]
HEALTH = ["--trainer.callbacks+=lightning_mlopt.callbacks.NCCLHealthCheck"]


def _sleepy(**init_args: object) -> list[str]:
    args = ["--model=tests.support.models.SleepyGPT"]
    return args + [f"--model.init_args.{key}={value}" for key, value in init_args.items()]


@pytest.mark.multiprocess
def test_hang_is_detected_dumped_and_every_process_exits(tmp_path):
    run_dir = tmp_path / "run"
    start = time.monotonic()
    result = run_cli(
        [
            *BASE,
            "--trainer.devices=2",
            "--trainer.max_steps=10",
            f"--run_dir={run_dir}",
            *_sleepy(sleep_rank=1, sleep_step=3, sleep_seconds=300),
            *HEALTH,
            "--trainer.callbacks.watchdog.timeout=5",
        ],
        cwd=tmp_path,
        timeout=200,
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 124, result.stderr[-3000:]
    dump = (run_dir / "health" / "hang-rank1.txt").read_text()
    assert "nap_inside_training_step" in dump
    assert "last step 3, phase 'forward'" in dump
    assert (run_dir / "health" / "hang-rank0.txt").is_file(), "the waiting rank gives up too"
    # Startup (~10 s) + 3 steps + the 5 s limit + at most 10 s of detection latency.
    assert elapsed < 60, elapsed
    time.sleep(1)
    leftover = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert leftover == [], "no process of the job is left behind"


@pytest.mark.multiprocess
@pytest.mark.skipif(
    shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists(),
    reason="torchrun is not installed",
)
def test_torchrun_restarts_a_hung_job_and_it_resumes_to_completion(tmp_path):
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH, "PYTHONUNBUFFERED": "1", **TORCHRUN_RESTART_ENV}

    def job(run_dir: Path) -> tuple[int | None, str]:
        """Run the job with a time limit; on timeout kill all of it (torchrun and its workers)."""
        command = [
            torchrun,
            "--nproc-per-node=2",
            "--max-restarts=1",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0",
            "-m",
            "lightning_mlopt",
            *BASE,
            "--trainer.devices=2",
            "--trainer.max_steps=8",
            f"--run_dir={run_dir}",
            "--checkpoint.every_n_steps=2",
            *_sleepy(sleep_rank=1, sleep_step=5, sleep_seconds=300, only_first_attempt=True),
            *HEALTH,
            "--trainer.callbacks.watchdog.timeout=5",
        ]
        # Output to a file, not a pipe: a worker that outlives torchrun would hold a pipe open forever.
        log = run_dir.parent / f"{run_dir.name}.log"
        with log.open("w") as handle:
            process = subprocess.Popen(
                command, cwd=tmp_path, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                process.wait(timeout=150)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                # torchrun starts workers in sessions of their own: find them by their unique run directory.
                subprocess.run(["pkill", "-9", "-f", str(run_dir)], check=False)
                process.wait()
                return None, log.read_text()
        return process.returncode, log.read_text()

    # TORCHRUN_RESTART_ENV gives each attempt its own rendezvous store: with torchrun's default shared store,
    # restarted workers could read the dead attempt's gloo addresses and hang in init_process_group.
    run_dir = tmp_path / "run"
    status, output = job(run_dir)
    assert status == 0, output[-4000:]
    assert "HANG on rank 1" in output
    assert "Auto-resuming from" in output
    final = CheckpointStore(run_dir / "checkpoints").newest_valid()
    assert final is not None and final.step == 8 and final.manifest.final


@pytest.mark.multiprocess
def test_version_skew_and_a_straggler_are_reported_by_rank(tmp_path):
    result = run_cli(
        [
            *BASE,
            "--trainer.devices=2",
            "--trainer.max_steps=4",
            f"--run_dir={tmp_path / 'run'}",
            "--trainer.callbacks+=tests.support.faults.FakeVersionOnRank",
            "--trainer.callbacks.value=2.0.0",
            "--trainer.callbacks+=tests.support.faults.SlowRank",
            # Two ranks: the median is their mean, so rank 1 is 1.5x it only when rank 0's own forward takes under
            # a quarter of rank 1's; a full second keeps that true on a loaded CI machine.
            "--trainer.callbacks.seconds=1.0",
            *HEALTH,
            "--trainer.callbacks.stragglers.every_n_steps=2",
            "--trainer.callbacks.probe_mb=1",
        ],
        cwd=tmp_path,
        preloaded=True,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "fingerprint MISMATCH" in output
    assert "'2.0.0' on rank 1" in output and "on rank 0" in output
    assert re.search(r"straggler\(s\) at step [24]: rank 1 ", output), output[-3000:]
    assert "busbw" in output and "NCCLHealthCheck pre-flight" in output


@pytest.mark.multiprocess
def test_a_rank_missing_at_the_barrier_is_named(tmp_path):
    result = run_cli(
        [
            *BASE,
            "--trainer.devices=2",
            "--trainer.max_steps=2",
            f"--run_dir={tmp_path / 'run'}",
            "--trainer.callbacks+=tests.support.faults.LateToSetup",
            "--trainer.callbacks.seconds=12",
            *HEALTH,
            "--trainer.callbacks.barrier_timeout=3",
        ],
        cwd=tmp_path,
        timeout=200,
        preloaded=True,
    )
    assert result.returncode != 0
    assert "pre-flight barrier: not every rank arrived within 3 s. Missing: rank 1" in result.stderr


def test_bandwidth_arithmetic_matches_nccl_tests():
    assert bus_bandwidth(1_000_000_000, 0.5, 4) == (2.0, 3.0)  # busbw = algbw * 2 * 3 / 4
    assert bus_bandwidth(2_000_000_000, 1.0, 2) == (2.0, 2.0)  # n = 2: factor 1
    algbw, busbw = bus_bandwidth(8_000_000_000, 0.1, 8)
    assert algbw == pytest.approx(80.0) and busbw == pytest.approx(140.0)  # factor 7/4
    with pytest.raises(ValueError):
        bus_bandwidth(1, 0, 2)


def test_fingerprint_mismatch_lines_name_ranks_and_hosts():
    fingerprints = [
        {"host": "a", "torch": "2.6", "nccl": "2.21"},
        {"host": "a", "torch": "2.6", "nccl": "2.21"},
        {"host": "b", "torch": "2.5", "nccl": "2.21"},
    ]
    assert fingerprint_mismatches(fingerprints) == ["torch: '2.6' on ranks 0 (a), 1 (a); '2.5' on rank 2 (b)"]
    assert fingerprint_mismatches(fingerprints[:2]) == []


def test_missing_ranks_parsing_and_validation():
    assert _missing_ranks("[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 3000 ms", 4, 0) == [1, 3]
    assert _missing_ranks("Rank 2 failed to pass monitoredBarrier", 4, 0) == [2]
    with pytest.raises(ValueError, match=r"watchdog\.timeout must be > 0"):
        NCCLHealthCheck(watchdog=Watchdog(timeout=0))
    with pytest.raises(TypeError, match=r"hang_timeout is now watchdog\.timeout"):
        NCCLHealthCheck(hang_timeout=5)
    with pytest.raises(TypeError, match=r"straggler_factor is now stragglers\.factor"):
        NCCLHealthCheck(straggler_factor=2.0)
    with pytest.raises(ValueError, match="on_mismatch must be warn or error"):
        NCCLHealthCheck(on_mismatch="ignore")  # type: ignore[arg-type]


def test_a_restartable_torchrun_job_on_the_shared_store_is_warned_about():
    from lightning_mlopt.distributed.elastic import restart_store_warning

    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in restart_store_warning(shared)
    assert restart_store_warning({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # own store
    assert restart_store_warning({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None  # never restarted
    assert restart_store_warning({}) is None  # not under torchrun
