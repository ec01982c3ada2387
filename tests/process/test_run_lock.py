"""One live job per run directory: the lock's logic in-process, then real launches into one run directory (a second
job refused at once, a killed job's lock taken over, a requeue that waits for its earlier attempt, ranks that
started on their own all refused together)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_mlopt.exceptions import RunDirBusy
from lightning_mlopt.process.run_lock import ALIVE, FREE, UNSURE, RunLock, _Holder, judge, release_held
from lightning_mlopt.run_dir import RUN_LOCK_NAME
from tests.conftest import CONFIGS, REPO_PYTHONPATH, cli_environment

HOST = socket.gethostname()


@pytest.fixture(autouse=True)
def _no_job_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests run as no job (a SLURM allocation running the suite would make every launch one job)."""
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _write_record(run_dir: Path, host: str, pid: int, job: str | None = None, age_s: float = 0.0) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"host": host, "pid": pid, "job": job, "since": "2026-01-02T03:04:05", "token": "t"}
    (run_dir / RUN_LOCK_NAME).write_text(json.dumps(record))
    then = time.time() - age_s
    os.utime(run_dir / RUN_LOCK_NAME, (then, then))


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _holder(host: str) -> _Holder:
    return _Holder(host, 1, None, "2026-01-02T03:04:05", "t")


# ---------------------------------------------------------------------------------------------- in-process


def test_judge_tells_alive_from_dead_on_this_host_and_another():
    assert judge(False, None, 0, 0, False) == ALIVE  # the flock is held: whoever it is lives
    assert judge(True, None, 0, 0, False) == FREE
    assert judge(True, _holder(HOST), 0, 0, False) == FREE  # on this host its flock would still be held
    # No flock on this filesystem: a local holder lives while its pid does and its heartbeat is fresh.
    assert judge(None, _holder(HOST), 1, 0, False, pid_alive=lambda pid: True) == ALIVE
    assert judge(None, _holder(HOST), 1, 0, False, pid_alive=lambda pid: False) == FREE
    # Another host: flock may not reach across hosts, so the heartbeat decides.
    other = _holder("another-node")
    assert judge(True, other, 5, 0, True) == ALIVE  # it moved while we watched
    assert judge(True, other, 5, 3, False) == UNSURE  # fresh, not yet seen to move: look again
    assert judge(True, other, 61, 0, False, stale_after_s=60) == FREE  # stale by this host's clock
    assert judge(True, other, -300, 60, False, stale_after_s=60) == FREE  # stood still while we watched: skew-proof


def test_a_second_holder_is_refused_naming_the_first_and_a_clean_release_frees_it(tmp_path):
    first, second = RunLock(tmp_path), RunLock(tmp_path)
    first.acquire()
    try:
        started = time.monotonic()
        with pytest.raises(RunDirBusy) as refused:
            second.acquire(wait_s=30)  # another job (no job id): refused at once, whatever the wait
        assert time.monotonic() - started < 1
        message = str(refused.value)
        assert f"host {HOST}, pid {os.getpid()}, since " in message and " UTC)" in message
        assert "wait for that job to end, stop it, or launch this one with another --run_dir" in message
        assert "\n" not in message
    finally:
        first.release()
    assert (tmp_path / RUN_LOCK_NAME).read_text() == ""  # emptied: the next holder finds nobody to take over
    second.acquire()
    assert second.took_over is None
    second.release()


def test_a_record_left_by_a_dead_pid_is_taken_over(tmp_path):
    pid = _dead_pid()
    _write_record(tmp_path, HOST, pid)
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        assert lock.took_over is not None and lock.took_over.pid == pid
        assert json.loads((tmp_path / RUN_LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_holder_on_another_host_is_taken_over_when_stale_and_refused_while_its_heartbeat_moves(tmp_path):
    _write_record(tmp_path / "stale", "another-node", 4242, age_s=120)
    lock = RunLock(tmp_path / "stale", stale_after_s=60)
    lock.acquire()
    assert lock.took_over is not None and lock.took_over.host == "another-node"
    lock.release()

    _write_record(tmp_path / "live", "another-node", 4242)
    stop = threading.Event()

    def beat() -> None:  # the remote holder's heartbeat
        while not stop.wait(0.05):
            os.utime(tmp_path / "live" / RUN_LOCK_NAME)

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        started = time.monotonic()
        with pytest.raises(RunDirBusy, match="host another-node, pid 4242"):
            RunLock(tmp_path / "live", stale_after_s=5, poll_s=0.05).acquire()
        assert time.monotonic() - started < 2  # refused once the heartbeat moved, not at the staleness limit
    finally:
        stop.set()
        beating.join()

    # A fresh record that never moves: a job that died a moment ago on another host, taken over once stale.
    _write_record(tmp_path / "just_dead", "another-node", 4242)
    started = time.monotonic()
    lock = RunLock(tmp_path / "just_dead", stale_after_s=0.5, poll_s=0.05)
    lock.acquire()
    assert 0.4 < time.monotonic() - started < 3 and lock.took_over is not None
    lock.release()


def test_a_requeue_waits_for_its_earlier_attempt_bounded_and_takes_it_when_it_ends(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    earlier = RunLock(tmp_path)
    earlier.acquire()
    started = time.monotonic()
    with pytest.raises(RunDirBusy, match=r"job 77, since .*\(waited \d+ s for it, an earlier attempt of this job"):
        RunLock(tmp_path, poll_s=0.05).acquire(wait_s=0.6)
    assert 0.6 <= time.monotonic() - started < 3

    ending = threading.Timer(0.5, earlier.release)  # the earlier attempt ends while the requeue waits
    ending.start()
    started = time.monotonic()
    requeue = RunLock(tmp_path, poll_s=0.05)
    try:
        requeue.acquire(wait_s=30)
        assert 0.4 < time.monotonic() - started < 5 and requeue.took_over is None
    finally:
        ending.join()
        requeue.release()

    monkeypatch.setenv("SLURM_JOB_ID", "78")  # another job's holder is never waited for
    holder = RunLock(tmp_path)
    holder.acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "79")
    started = time.monotonic()
    with pytest.raises(RunDirBusy, match="job 78"):
        RunLock(tmp_path, poll_s=0.05).acquire(wait_s=30)
    assert time.monotonic() - started < 1
    holder.release()


def test_the_heartbeat_moves_and_a_release_keeps_a_successors_record(tmp_path):
    lock = RunLock(tmp_path, heartbeat_s=0.05)
    lock.acquire()
    path = tmp_path / RUN_LOCK_NAME
    first = path.stat().st_mtime_ns
    deadline = time.monotonic() + 5
    while path.stat().st_mtime_ns == first and time.monotonic() < deadline:
        time.sleep(0.02)
    assert path.stat().st_mtime_ns != first
    # A filesystem without a cross-host flock let another host's job in: our release must not erase its record.
    taken = json.dumps({"host": "another-node", "pid": 1, "job": None, "since": "2026-01-02T03:04:05", "token": "x"})
    path.write_text(taken)
    release_held()
    assert path.read_text() == taken and not lock.held


def test_a_killed_holders_forked_child_does_not_keep_the_lock(tmp_path):
    # A DataLoader worker is a fork of rank zero: it must not hold a killed job's lock while it lingers.
    code = f"""
import os, signal, time
from pathlib import Path
from lightning_mlopt.process.run_lock import RunLock
RunLock(Path({str(tmp_path)!r})).acquire()
ready_read, ready_write = os.pipe()
if os.fork() == 0:  # the fork hooks ran before this line (a worker that is up, as a killed job's workers are)
    os.write(ready_write, b"1")
    time.sleep(60)
    os._exit(0)
os.read(ready_read, 1)
print("holding", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH}
    holder = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"holding"  # the child keeps the pipe
        assert holder.wait(timeout=60) == -signal.SIGKILL
        lock = RunLock(tmp_path)
        lock.acquire()  # the child still lives, holding nothing
        assert lock.took_over is not None and lock.took_over.pid == holder.pid
        lock.release()
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.stdout.close()
        holder.wait()


def test_every_rank_of_a_job_takes_the_same_path(monkeypatch):
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_mlopt.cli import run_dir_guard

    def trainer(nodes: int = 1) -> SimpleNamespace:
        strategy = DDPStrategy(cluster_environment=LightningEnvironment())
        return SimpleNamespace(world_size=2, num_nodes=nodes, strategy=strategy)

    monkeypatch.setenv(run_dir_guard.MODE_ENV, "")  # restored after the test, whatever the guard sets
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert run_dir_guard._agreed_at_setup(trainer()) is False  # Lightning's launcher will start rank 1 from here
    assert os.environ[run_dir_guard.MODE_ENV] == f"decided:{os.getpid()}"
    monkeypatch.setenv(run_dir_guard.MODE_ENV, f"decided:{os.getppid()}")  # what a launched rank inherits
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert run_dir_guard._agreed_at_setup(trainer()) is False
    monkeypatch.setenv(run_dir_guard.MODE_ENV, "decided:1")  # inherited from someone else: not its launcher's
    assert run_dir_guard._agreed_at_setup(trainer()) is True  # started on its own (LOCAL_RANK set by hand)
    monkeypatch.delenv(run_dir_guard.MODE_ENV)
    monkeypatch.delenv("LOCAL_RANK")
    assert run_dir_guard._agreed_at_setup(trainer(nodes=2)) is True  # other nodes' ranks wait in the rendezvous


# ---------------------------------------------------------------------------------------------- real launches


def _fit(run_dir: Path, release: Path, *extra: str) -> list[str]:
    """A short quickstart fit that holds at step 1 until ``release`` exists, logging with Lightning's default."""
    return [
        *[sys.executable, "-m", "lightning_mlopt", "fit", "--config", str(CONFIGS / "quickstart.yaml")],
        *["--trainer.max_steps=3", "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0"],
        *["--trainer.enable_progress_bar=false", "--checkpoint.every_n_steps=1", f"--run_dir={run_dir}"],
        *["--trainer.callbacks+=tests.support.faults.HoldAtStep", f"--trainer.callbacks.release={release}"],
        *extra,
    ]


def _start(command: list[str], cwd: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with log.open("w") as handle:
        return subprocess.Popen(
            command, cwd=cwd, env=cli_environment(env), stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait_for(path: Path, job: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)


def _snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file of a run (size, modification time); the logger's by name only: TensorBoard's writer thread flushes
    on its own clock, even while its run is held."""
    return {
        str(path.relative_to(run_dir)): (0, 0) if "lightning_logs" in path.parts else (st.st_size, st.st_mtime_ns)
        for path in sorted(run_dir.rglob("*"))
        if path.is_file() and path.name != RUN_LOCK_NAME and (st := path.stat())
    }


def _finish(job: subprocess.Popen, release: Path, log: Path) -> None:
    release.touch()
    assert job.wait(timeout=180) == 0, log.read_text()[-3000:]


def _kill(*jobs: subprocess.Popen) -> None:
    for job in jobs:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def _refused_once(output: str, holder_pid: int) -> None:
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output[-3000:]
    assert "is in use by a live job" in errors[0] and f"pid {holder_pid}, " in errors[0], errors[0]
    assert ", since " in errors[0] and " UTC)" in errors[0], errors[0]
    assert "another --run_dir" in errors[0] and "Traceback" not in output, output[-3000:]


def _assert_finished_intact(run_dir: Path) -> None:
    from lightning_mlopt.checkpoint import CheckpointStore

    newest = CheckpointStore(run_dir / "checkpoints").newest_valid()
    assert newest is not None and newest.step == 3 and newest.manifest.final
    assert (run_dir / "metrics.json").is_file()
    assert (run_dir / RUN_LOCK_NAME).read_text() == ""  # emptied by the holder as it ended


@pytest.mark.slow
def test_a_second_launch_into_a_live_run_is_refused_at_once_and_the_first_finishes_intact(tmp_path):
    run_dir, release = tmp_path / "run", tmp_path / "release"
    first = _start(_fit(run_dir, release), tmp_path, tmp_path / "first.log")
    try:
        _wait_for(Path(f"{release}.rank0"), first, tmp_path / "first.log")
        before = _snapshot(run_dir)
        started = time.monotonic()
        second = subprocess.run(
            _fit(run_dir, tmp_path / "never"), cwd=tmp_path, env=cli_environment(), capture_output=True, text=True
        )
        took = time.monotonic() - started
        assert second.returncode == 2, second.stderr[-3000:]
        _refused_once(second.stderr, first.pid)
        assert took < 60  # the CLI's own start-up and a lock test; never a start-up timeout
        assert _snapshot(run_dir) == before  # no log version, no config, no checkpoint, no ledger line
        _finish(first, release, tmp_path / "first.log")
    finally:
        _kill(first)
    _assert_finished_intact(run_dir)
    assert [path.name for path in (run_dir / "lightning_logs").iterdir()] == ["version_0"]


@pytest.mark.slow
def test_a_sigkilled_jobs_lock_is_taken_over_and_the_run_resumes(tmp_path):
    run_dir, release = tmp_path / "run", tmp_path / "release"
    # A DataLoader worker (a fork of the rank) outlives the kill for a while: it must not keep the lock.
    first = _start(_fit(run_dir, release, "--data.init_args.num_workers=1"), tmp_path, tmp_path / "first.log")
    try:
        _wait_for(Path(f"{release}.rank0"), first, tmp_path / "first.log")
        os.kill(first.pid, signal.SIGKILL)  # the rank alone, as the kernel's OOM killer does
        first.wait()
        release.touch()  # the relaunch must not hold at step 1 (the killed job may not have committed it)
        relaunch = subprocess.run(
            _fit(run_dir, release), cwd=tmp_path, env=cli_environment(), capture_output=True, text=True, timeout=300
        )
    finally:
        release.touch()
        with contextlib.suppress(ProcessLookupError):  # the rank and its orphaned worker, if still there
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    assert f"run_dir: took it over from a job that is gone (host {HOST}, pid {first.pid}, since" in relaunch.stdout
    _assert_finished_intact(run_dir)


@pytest.mark.slow
def test_a_requeue_waits_for_its_earlier_attempt_bounded(tmp_path):
    run_dir, release = tmp_path / "run", tmp_path / "release"
    job = {"SLURM_JOB_ID": "4242"}  # a requeue keeps its job id
    first = _start(_fit(run_dir, release), tmp_path, tmp_path / "first.log", env=job)
    requeue = None
    try:
        _wait_for(Path(f"{release}.rank0"), first, tmp_path / "first.log")
        impatient = subprocess.run(
            _fit(run_dir, release, "--run_dir_wait=3"), cwd=tmp_path, env=cli_environment(job), capture_output=True
        )
        stderr = impatient.stderr.decode()
        assert impatient.returncode == 2, stderr[-3000:]
        _refused_once(stderr, first.pid)
        assert "job 4242" in stderr and "(waited 3 s for it, an earlier attempt of this job" in stderr
        # A requeue with the default wait: it waits, and runs once the earlier attempt has ended.
        requeue = _start(_fit(run_dir, release), tmp_path, tmp_path / "requeue.log", env=job)
        deadline = time.monotonic() + 180
        while "waiting up to 150 s for it to end" not in (tmp_path / "requeue.log").read_text():
            assert requeue.poll() is None and time.monotonic() < deadline, (tmp_path / "requeue.log").read_text()
            time.sleep(0.2)
        _finish(first, release, tmp_path / "first.log")
        assert requeue.wait(timeout=180) == 0, (tmp_path / "requeue.log").read_text()[-3000:]
    finally:
        release.touch()
        _kill(first, *([requeue] if requeue else []))
    _assert_finished_intact(run_dir)  # the requeue found the run finished and trained nothing more


@pytest.mark.multiprocess
def test_a_second_two_process_job_is_refused_under_lightnings_launcher_and_under_launch(tmp_path):
    run_dir, release = tmp_path / "run", tmp_path / "release"
    ddp = ["--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.accelerator=cpu"]
    first = _start(_fit(run_dir, release, *ddp), tmp_path, tmp_path / "first.log")
    try:
        _wait_for(Path(f"{release}.rank1"), first, tmp_path / "first.log")
        _wait_for(Path(f"{release}.rank0"), first, tmp_path / "first.log")
        before = _snapshot(run_dir)
        # Lightning's launcher: rank zero refuses before it starts rank 1.
        started = time.monotonic()
        second = subprocess.run(
            _fit(run_dir, tmp_path / "never", *ddp), cwd=tmp_path, env=cli_environment(), capture_output=True, text=True
        )
        assert second.returncode == 2, second.stderr[-3000:]
        _refused_once(second.stderr, first.pid)
        assert time.monotonic() - started < 60
        # torchrun's agent (`launch`) starts both ranks at once: rank 1 waits in the rendezvous, and at setup both
        # learn rank zero's verdict and exit 2 together (a start-up timeout would be 900 s).
        fit = _fit(run_dir, tmp_path / "never", *ddp)[3:]  # after `python -m lightning_mlopt`
        launch = [sys.executable, "-m", "lightning_mlopt", "launch", "--nproc-per-node=2"]
        started = time.monotonic()
        third = subprocess.run(
            [*launch, f"--master-port={_free_port()}", *fit],
            cwd=tmp_path,
            env=cli_environment(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        output = third.stdout + third.stderr
        assert third.returncode == 2, output[-3000:]
        assert time.monotonic() - started < 120
        _refused_once(output, first.pid)  # rank zero says it, once
        said = [line for line in output.splitlines() if line.startswith("launch:")]
        assert len(said) == 1 and "exited with status 2" in said[0], output[-3000:]
        assert _snapshot(run_dir) == before
        _finish(first, release, tmp_path / "first.log")
    finally:
        _kill(first)
    _assert_finished_intact(run_dir)
