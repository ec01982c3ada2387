"""Process guards: preemption signals owned from the first second, the signal deadline for a rank stuck in a
collective, the start-up deadline, the parent watch, and stale build locks. Faults as the world delivers them:
real signals to real processes blocked in real gloo collectives, a real launcher killed mid-start-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_mlopt.process.signals import PreemptionSignals
from lightning_mlopt.strategies.deepspeed.build_locks import clear_stale_build_locks, find_build_locks
from tests.conftest import CONFIGS, REPO_PYTHONPATH, run_cli


def _python(code: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    full_env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def test_handlers_only_record_and_release_gives_the_signal_back():
    guard = PreemptionSignals()
    try:
        owned = guard.install(["SIGUSR2"], deadline_s=None)
        assert owned == [signal.SIGUSR2]
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)
        assert guard.received() == signal.SIGUSR2  # recorded, the process lives on
        guard.acknowledge()
    finally:
        guard.release()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    assert guard.received() is None


def test_a_signal_never_acted_on_is_delivered_again_on_release():
    # validate/test own no signals: a SIGTERM that came while the handlers were ours must still end them.
    child = _python(
        """
        import os, signal, time
        from lightning_mlopt.process.signals import PreemptionSignals
        guard = PreemptionSignals()
        guard.install(["SIGTERM"], deadline_s=None)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        print("alive after the signal", flush=True)
        guard.release()
        time.sleep(5)
        print("should not get here", flush=True)
        """
    )
    out, _ = child.communicate(timeout=30)
    assert "alive after the signal" in out and "should not get here" not in out
    assert child.returncode == -signal.SIGTERM


def test_our_handler_put_back_after_a_release_passes_the_signal_on():
    # Lightning's teardown restores the handlers it found when it registered its own: ours, given back meanwhile.
    child = _python(
        """
        import os, signal, time
        from lightning_mlopt.process.signals import PreemptionSignals
        guard = PreemptionSignals()
        guard.install(["SIGTERM"], deadline_s=None)
        captured = signal.getsignal(signal.SIGTERM)
        guard.release()
        signal.signal(signal.SIGTERM, captured)  # what Lightning's teardown does
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(3)
        print("still alive: the signal was swallowed", flush=True)
        """
    )
    out, err = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGTERM, (out, err)


@pytest.mark.slow
def test_a_grace_known_after_the_signal_moves_the_deadline_it_runs_on():
    # The entry point owns the signals from its first second; a grace read later (the config's) must shorten
    # the deadline of a signal already received, or the scheduler's kill comes first (137, no requeue).
    child = _python(
        """
        import os, signal, time
        from lightning_mlopt.process.signals import PreemptionSignals
        guard = PreemptionSignals()
        guard.install(["SIGTERM"], deadline_s=120, exit_code=75)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        guard.install(["SIGTERM"], deadline_s=120, exit_code=75, graces={"SIGTERM": 3.0})
        time.sleep(20)
        print("still alive", flush=True)
        """
    )
    started = time.monotonic()
    out, err = child.communicate(timeout=60)
    assert child.returncode == 75, (out, err)
    assert time.monotonic() - started < 12


def test_no_preemption_signals_in_the_config_gives_back_what_the_entry_point_took():
    guard = PreemptionSignals()
    try:
        guard.install(["SIGUSR2"], deadline_s=None)
        assert guard.own_for_run(None, [], deadline_s=None, exit_code=75, graces=None) == []
        assert guard.owned() == [] and signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    finally:
        guard.release()


@pytest.mark.slow
def test_a_signal_during_the_final_save_leaves_a_finished_run_finished(tmp_path):
    # The time limit lands while the last checkpoint is written: the run is saved and done, and ends with 0.
    child = _python(
        f"""
        import os, signal
        import lightning.pytorch as pl
        from lightning.pytorch.demos.boring_classes import BoringModel
        from lightning_mlopt.callbacks import FaultTolerantCheckpoint
        from lightning_mlopt.process.signals import preemption

        class SignalDuringTheFinalSave(pl.Callback):
            def on_save_checkpoint(self, trainer, pl_module, checkpoint):
                if trainer.global_step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)

        preemption.install()
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False, limit_val_batches=0,
            enable_model_summary=False, default_root_dir={str(tmp_path)!r},
            callbacks=[SignalDuringTheFinalSave(), FaultTolerantCheckpoint(dirpath={str(tmp_path / "ckpt")!r})],
        )
        trainer.fit(BoringModel())
        print("finished", flush=True)
        """
    )
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0 and "finished" in out, (child.returncode, err[-2000:])
    assert (tmp_path / "ckpt" / "step-000000003").is_dir()


_STUCK_IN_A_COLLECTIVE = """
import os, sys, time, datetime
import torch, torch.distributed as dist
from lightning_mlopt.process.signals import preemption
rank, deadlines = int(sys.argv[1]), [float(s) for s in sys.argv[4].split(",")]
preemption.install(["SIGTERM", "SIGUSR1"], deadline_s=deadlines[rank], exit_code=75)
timeout = datetime.timedelta(minutes=30)
dist.init_process_group("gloo", rank=rank, world_size=2, init_method=sys.argv[2], timeout=timeout)
open(sys.argv[3] + f".rank{rank}", "w").close()
if rank == 0:
    dist.barrier()  # blocks in C++: the Python handler never runs while the peer sleeps
else:
    time.sleep(600)  # the peer never joins
print("unreachable", flush=True)
"""


def _signal_a_stuck_job(tmp_path: Path, deadlines: tuple[float, float]) -> tuple[list[int], list[str], float]:
    """Rank 0 waits in a barrier its peer never joins; SIGTERM both (as a scheduler does): (statuses, stderrs, s).

    ``deadlines``: each rank's seconds from the signal to its forced exit.
    """
    script = tmp_path / "stuck.py"
    script.write_text(_STUCK_IN_A_COLLECTIVE)
    marks = tmp_path / "ready"
    init = f"file://{tmp_path / 'rendezvous'}"
    env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH, "PYTHONUNBUFFERED": "1"}
    given = ",".join(str(d) for d in deadlines)
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), init, str(marks), given],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=rank == 0,
        )
        for rank in (0, 1)
    ]
    try:
        deadline = time.monotonic() + 120
        while not all(Path(f"{marks}.rank{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)  # rank 0 is inside the barrier now
        started = time.monotonic()
        for process in ranks:  # as a scheduler does: every process of the job
            process.send_signal(signal.SIGTERM)
        results = [process.communicate(timeout=60) for process in ranks]
        elapsed = time.monotonic() - started
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    return [process.returncode for process in ranks], [err for _, err in results], elapsed


@pytest.mark.multiprocess
def test_sigterm_to_a_job_stuck_in_a_collective_ends_it_at_the_deadline(tmp_path):
    # Rank 0's deadline comes first: it names where its main thread waits. Rank 1 leaves at its own deadline.
    statuses, errors, elapsed = _signal_a_stuck_job(tmp_path, deadlines=(3, 6))
    assert statuses == [75, 75], errors
    assert elapsed < 15, f"took {elapsed:.1f} s for a 3 s and a 6 s deadline"
    assert "received SIGTERM 3 s ago and did not reach a step boundary" in errors[0]
    assert "dist.barrier()" in errors[0], "the message shows where the main thread waits"
    assert "received SIGTERM 6 s ago" in errors[1]


@pytest.mark.multiprocess
def test_a_collective_broken_by_a_peer_leaving_after_the_signal_still_exits_for_requeue(tmp_path):
    # The peer reaches its deadline first and leaves; rank 0's barrier then fails. A job's status is rank
    # zero's: exiting 1 there would mark a preempted job failed instead of requeuing it.
    statuses, errors, elapsed = _signal_a_stuck_job(tmp_path, deadlines=(30, 1))
    assert statuses == [75, 75], errors
    assert elapsed < 15, f"took {elapsed:.1f} s: rank 0 waited for its own 30 s deadline"
    assert "received SIGTERM" in errors[0] and "then the main thread failed (RuntimeError" in errors[0], errors[0]
    assert "Exiting with status 75" in errors[0]
    assert "Traceback" not in errors[0], "one message, not the collective's traceback"


def _fit_command(run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "lightning_mlopt",
        "fit",
        "--config",
        str(CONFIGS / "quickstart.yaml"),
        "--trainer.max_steps=3",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.logger=false",
        f"--run_dir={run_dir}",
        *extra,
    ]


@pytest.mark.slow
def test_a_signal_during_start_up_ends_the_process_at_once_with_75_and_nothing_saved(tmp_path):
    # SLURM may send --signal=USR1@N while the process still imports torch and Lightning: it must not die of it
    # (exit 138 = killed by SIGUSR1), and with nothing trained there is nothing to save: it exits 75 at once (to be
    # requeued), in one line, instead of starting up for seconds or minutes to save step 1.
    env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH, "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    process = subprocess.Popen(
        _fit_command(tmp_path / "run"), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    time.sleep(0.8)  # inside the imports (they take seconds)
    process.send_signal(signal.SIGUSR1)
    _, stderr = process.communicate(timeout=240)
    took = time.monotonic() - started
    text = stderr.decode()
    assert process.returncode == 75, text[-3000:]
    assert text.splitlines() == [
        "preemption (SIGUSR1) before the first training step: nothing to save; exiting with status 75, a relaunch "
        "resumes from the newest committed checkpoint, if any"
    ]
    assert took < 5, took  # the imports alone take longer: it did not wait for them
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_start_up_deadline_ends_a_run_whose_peer_never_comes(tmp_path):
    # World size 2 on one machine, but rank 1 is never started: rank 0 waits in the rendezvous.
    env = {
        **os.environ,
        "PYTHONPATH": REPO_PYTHONPATH,
        "PYTHONUNBUFFERED": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29731",
        "WORLD_SIZE": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "NODE_RANK": "0",
    }
    started = time.monotonic()
    result = subprocess.run(
        _fit_command(tmp_path / "run", "--trainer.devices=2", "--trainer.strategy=ddp", "--startup_timeout=8"),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 124, result.stderr[-3000:]
    assert time.monotonic() - started < 60
    assert "start-up did not finish within 8 s" in result.stderr


@pytest.mark.multiprocess
def test_a_rank_whose_launcher_dies_in_deepspeed_start_up_exits(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH, "PYTHONUNBUFFERED": "1"}
    env.pop("MASTER_PORT", None)
    command = [
        sys.executable,
        "-m",
        "lightning_mlopt",
        "fit",
        "--model=tests.support.models.ThirdPartyLM",  # a user's model
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.strategy=zero2",
        "--trainer.max_steps=3",
        f"--run_dir={tmp_path / 'run'}",
    ]
    log = tmp_path / "job.log"
    with log.open("w") as output:
        launcher = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=output, stderr=subprocess.STDOUT)
    child = None
    try:
        deadline = time.monotonic() + 120
        # Wait until rank 1 is inside DeepSpeed's initialisation (it prints this line as it starts it).
        while "GLOBAL_RANK: 1" not in log.read_text() and time.monotonic() < deadline:
            assert launcher.poll() is None, log.read_text()[-2000:]
            time.sleep(0.05)
        pids = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
        child = int(pids[0]) if pids else None
        assert child is not None, "Lightning never started rank 1"
        launcher.kill()  # rank 0 dies in start-up (a node lost, an OOM kill)
        launcher.wait(30)
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(child), "rank 1 outlived its launcher by 30 s"
    finally:
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")


def test_stale_build_lock_is_removed_and_a_held_one_is_kept(tmp_path):
    root = tmp_path / "torch_extensions"
    stale = root / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    held = root / "py311_cpu" / "cpu_adam" / "lock"
    for lock in (stale, held):
        lock.parent.mkdir(parents=True)
    stale.touch()  # left by a process killed mid-build
    # A live builder holds its lock open, as torch's FileBaton does for the whole build.
    holder = _python(
        f"import os, time; fd = os.open({str(held)!r}, os.O_CREAT | os.O_EXCL); print('ok', flush=True); time.sleep(60)"
    )
    try:
        assert holder.stdout.readline().strip() == "ok"
        assert find_build_locks(root) == sorted([stale, held])
        assert clear_stale_build_locks([root]) == [stale]
        assert not stale.exists() and held.exists()
    finally:
        holder.kill()
        holder.wait()
    assert clear_stale_build_locks([root]) == [held], "once its holder is gone, it is stale too"


@pytest.mark.multiprocess
def test_a_stale_deepspeed_build_lock_does_not_hang_the_next_zero_launch(tmp_path):
    # The lock a SIGKILL during DeepSpeed's op build or load leaves: every later ZeRO launch waited on it
    # forever, silently, before any watchdog existed.
    import shutil

    from torch.utils.cpp_extension import get_default_build_root

    extensions = tmp_path / "torch_extensions"
    built = Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    op = extensions / "deepspeed_shm_comm"
    if (built / "deepspeed_shm_comm").is_dir():  # reuse this machine's build: a minute saved on 2 cores
        shutil.copytree(built / "deepspeed_shm_comm", op, copy_function=shutil.copy2)
    op.mkdir(parents=True, exist_ok=True)
    (op / "lock").touch()
    command = _fit_command(tmp_path / "run", "--trainer.devices=2", "--trainer.strategy=zero2", "--trainer.max_steps=2")
    # The lock is met where the strategy builds its engine: the ranks fork from the preloaded server.
    env = {"TORCH_EXTENSIONS_DIR": str(extensions)}
    result = run_cli(command[3:], cwd=tmp_path, timeout=400, env=env, preloaded=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Removed a stale build lock left by a killed process (no process held it): {op / 'lock'}" in result.stderr


@pytest.mark.slow
def test_a_native_crash_names_the_python_frames_it_happened_in(tmp_path):
    # A segmentation fault in an extension ends a run with status -11 and, without a dump, nothing else: the
    # entry point's fault handler prints every thread's Python stack first.
    env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH, "PYTHONUNBUFFERED": "1"}
    crash = ("--trainer.callbacks+=tests.support.faults.SegfaultAtStep", "--trainer.callbacks.step=2")
    result = subprocess.run(
        _fit_command(tmp_path / "run", *crash), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == -signal.SIGSEGV, result.stderr[-3000:]
    assert "Fatal Python error: Segmentation fault" in result.stderr
    assert "read_address_zero" in result.stderr and "on_train_batch_end" in result.stderr, result.stderr[-3000:]


def test_a_start_up_signal_that_a_peers_failure_reaches_first_still_exits_75_not_by_the_signal():
    # srun delivers SIGUSR1 to every task in start-up; the first to leave breaks its peer's rendezvous, whose
    # failure can reach the handlers' release before the peer's own watcher acts on the signal. Released then, the
    # signal was delivered again to the default handler: the task died of it and the job was not requeued.
    script = (
        "import signal\n"
        "from lightning_mlopt.process.signals import PreemptionSignals\n"
        "signals = PreemptionSignals()\n"
        "signals.install(['SIGUSR1'])\n"
        "signals.end_at_once_before_training()\n"
        "signals._record(signal.SIGUSR1)  # received; the watcher not woken yet\n"
        "signals.release()  # the failure's path (Lightning's on_exception)\n"
        "print('released without leaving')\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH}
    env.pop("RANK", None)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 75, result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith("preemption (SIGUSR1) before the first training step: nothing to save; exiting")
