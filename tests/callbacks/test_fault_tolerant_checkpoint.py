"""FaultTolerantCheckpoint through the real CLI and Trainer: kills, signals, damage, full disks, resume."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback

from lightning_mlopt.callbacks import CheckpointWriteError, FaultTolerantCheckpoint, Preemption, Resume
from lightning_mlopt.checkpoint import CheckpointStore, verify
from lightning_mlopt.cli import main
from tests.conftest import CONFIGS, REPO_PYTHONPATH, run_cli, start_cli
from tests.support.cli_args import fit_args
from tests.support.faults import kill_job_when

# 160 sequences / (16 per rank x 2 ranks) = 5 steps per epoch: 12 steps cross two epoch boundaries and
# leave checkpoints in the middle of epochs. Dropout makes the RNG state matter.
GPT_ARGS = [
    "--trainer.limit_val_batches=0",
    "--trainer.num_sanity_val_steps=0",
    "--model.init_args.dropout=0.1",
    "--data.init_args.num_sequences=160",
    "--checkpoint.every_n_steps=2",
]


def _command(run_dir: Path, strategy: str, devices: int = 2, extra: tuple[str, ...] = ()) -> list[str]:
    args = fit_args(
        *GPT_ARGS,
        "--trainer.callbacks+=tests.support.recorders.RecordEverything",
        f"--trainer.callbacks.out_dir={run_dir / 'record'}",
        *extra,
        strategy=strategy,
        devices=devices,
        steps=12,
        run_dir=run_dir,
    )
    return [sys.executable, "-m", "lightning_mlopt", *args]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH, "PYTHONUNBUFFERED": "1"}
    env.pop("MASTER_PORT", None)
    return env


def _run(command: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _run_forked(command: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``_run`` with the ranks forked from the preloaded server: for runs whose subject is what they commit."""
    return run_cli(command[3:], cwd, timeout=timeout, preloaded=True)  # after `python -m lightning_mlopt`


def _kill_job_during_background_write(command: list[str], cwd: Path, markers: Path) -> None:
    """Start the job (forked, preloaded); SIGKILL every process while the save of step 6 is written but not
    yet committed."""

    def both_ranks_in_flight() -> bool:
        return len(list(markers.glob("in-flight-rank*"))) >= 2

    kill_job_when(command[3:], cwd, both_ranks_in_flight, "its background write", preloaded=True)


@pytest.mark.multiprocess
# One sharded layout here: the commit protocol under test is the same code for DCP shards and ZeRO partitions,
# and the torture script's ``kill`` fault runs 20 trials per strategy, ZeRO included (benchmarks/results/).
# TP writes DCP shards too, but of DTensors split over the tensor dimension, with its own RNG and sampler:
# resuming it bitwise is its own claim; so is PP's (its stages' flattened optimizer states, its schedule's RNG use).
# FSDP with float8 linears and compiled blocks: a run with both features resumes to the same bits (float8's scales
# are computed each step, compiled graphs are rebuilt by the relaunch).
@pytest.mark.parametrize("strategy", ["fsdp", "tp", "pp", "fsdp+float8+compile"])
def test_kill_9_then_the_same_command_ends_bitwise_identical(tmp_path, strategy):
    """Killed during an async sharded save's background write (DDP killed at a random instant: the torture
    script's ``kill`` fault, one trial of which runs in tests/test_torture.py)."""
    strategy, _, features = strategy.partition("+")
    extra = tuple(f"--config={CONFIGS / 'features' / f'{name}.yaml'}" for name in features.split("+") if name)
    extra += ("--compile.backend=aot_eager",) if "compile" in features else ()
    reference_dir = tmp_path / "reference"
    reference = _run_forked(_command(reference_dir, strategy, extra=extra), tmp_path)
    assert reference.returncode == 0, reference.stderr[-4000:]
    said = reference.stdout + reference.stderr
    assert ("float8 (tensorwise" in said, "torch.compile (aot_eager)" in said) == (bool(features),) * 2, said[-3000:]
    expected = torch.load(reference_dir / "record" / "params.pt")

    run_dir = tmp_path / "interrupted"
    command = _command(run_dir, strategy, extra=extra)
    held = [
        "--trainer.callbacks+=tests.support.faults.InterfereWithBackgroundWrite",
        f"--trainer.callbacks.out_dir={run_dir / 'markers'}",
        "--trainer.callbacks.step=6",
        "--trainer.callbacks.hold_s=60",
    ]
    _kill_job_during_background_write(command + held, tmp_path, run_dir / "markers")
    # Every rank's files of step 6 were on disk, but not every rank had confirmed: nothing committed.
    committed = [step for step, _ in CheckpointStore(run_dir / "checkpoints").committed()]
    assert committed and committed[-1] < 6, committed
    assert not (run_dir / "record" / "params.pt").exists(), "the kill came after the run had finished"

    resumed = _run_forked(command, tmp_path)  # the identical command
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "Auto-resuming from" in resumed.stderr + resumed.stdout
    start = torch.load(run_dir / "record" / "start_params.pt")
    assert 0 < start["step"] < 12, "it resumed from a checkpoint, not from scratch"
    if strategy != "ddp":
        assert start["step"] == committed[-1], "the previous checkpoint is the one resume picks"
    actual = torch.load(run_dir / "record" / "params.pt")
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), f"{name} differs after kill and resume"
    final = CheckpointStore(run_dir / "checkpoints").newest_valid()
    assert final is not None and final.step == 12 and final.manifest.final

    # A run marked final does not train again: no step runs, no checkpoint is written. One layout is enough: the
    # launch ends before any Trainer or strategy exists (lightning_mlopt/cli/support.py: finished_run).
    if strategy != "fsdp" or features:
        return
    record_written = (run_dir / "record" / "rank0.json").stat().st_mtime_ns
    again = _run_forked(command, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "is marked final" in again.stderr + again.stdout
    assert (run_dir / "record" / "rank0.json").stat().st_mtime_ns == record_written
    assert CheckpointStore(run_dir / "checkpoints").newest_valid().manifest.created == final.manifest.created


@pytest.mark.multiprocess
def test_sigterm_saves_the_current_step_and_exits_non_zero(tmp_path):
    run_dir = tmp_path / "run"
    marks = tmp_path / "marks"
    command = _command(
        run_dir,
        "ddp",
        extra=(
            "--trainer.max_steps=1000",
            "--data.init_args.num_sequences=4096",
            "--checkpoint.every_n_steps=null",
            "--trainer.callbacks+=tests.support.faults.Pace",
            f"--trainer.callbacks.out_dir={marks}",
            "--trainer.callbacks.seconds_per_step=0.05",
        ),
    )
    process = subprocess.Popen(command, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not list(marks.glob("step-3.rank*")) and time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)  # to rank 0 only: the decision to stop is shared
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 75, stderr.decode()[-3000:]
    entry = CheckpointStore(run_dir / "checkpoints").newest_valid()
    assert entry is not None and entry.manifest.reason == "signal"
    reached = max(int(p.name.split("-")[1].split(".")[0]) for p in marks.glob("step-*.rank0"))
    assert entry.step == reached, "saved at the step boundary it stopped at"
    time.sleep(1)
    leftover = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert leftover == [], "no process of the job is left behind"


QUICK = [
    "--trainer.max_steps=6",
    "--trainer.limit_val_batches=0",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.enable_progress_bar=false",
    "--checkpoint.every_n_steps=2",
    "--checkpoint.async_save=false",
]


def _quickstart(tmp_path: Path, *extra: str) -> None:
    main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), f"--run_dir={tmp_path / 'run'}", *QUICK, *extra])


@pytest.mark.parametrize("damage", ["truncate", "delete"])
@pytest.mark.slow
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, monkeypatch, capsys, damage):
    monkeypatch.chdir(tmp_path)
    _quickstart(tmp_path, "--trainer.max_steps=4")
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    newest = store.committed()[-1][1] / "state.ckpt"
    if damage == "truncate":
        newest.write_bytes(newest.read_bytes()[:100])
    else:
        newest.unlink()
    capsys.readouterr()
    with pytest.warns(UserWarning, match=r"step-000000004 failed verification"):
        _quickstart(tmp_path)
    entries = store.entries()
    assert [e.step for e in entries if e.valid] == [2, 4, 6]  # step 4 was saved anew after the fallback
    assert store.newest_valid().manifest.final


@pytest.mark.slow
def test_full_disk_gives_a_clear_error_and_keeps_earlier_checkpoints(tmp_path, monkeypatch, capsys, tmpfs):
    monkeypatch.chdir(tmp_path)
    disk = tmpfs("disk", size="12m")  # room for two quickstart checkpoints, not for a third
    args = (f"--checkpoint.dirpath={disk / 'checkpoints'}", "--checkpoint.keep.last=10")
    _quickstart(tmp_path, "--trainer.max_steps=4", "--checkpoint.save_on.train_end=false", *args)
    checkpoints = disk / "checkpoints"
    before = [path for _, path in CheckpointStore(checkpoints).committed()]
    assert [p.name for p in before] == ["step-000000002", "step-000000004"]
    filler = disk / "filler"  # another job fills the disk
    with contextlib.suppress(OSError), filler.open("wb", buffering=0) as handle:
        while True:
            handle.write(b"\0" * 2**16)
    os.truncate(filler, filler.stat().st_size - 2**20)  # 1 MiB left: the start-up probe passes, a save does not
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        _quickstart(tmp_path, "--trainer.max_steps=8", *args)
    assert exit_info.value.code == 74
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("error: ") and "No space left on device" in message, message
    assert str(checkpoints) in message and "earlier checkpoints are intact" in message
    assert [path for _, path in CheckpointStore(checkpoints).committed()] == before
    for path in before:
        verify(path)  # still valid
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".staging")], "the failed save was removed"


@pytest.mark.slow
def test_unwritable_directory_gives_a_clear_error_before_training(tmp_path, monkeypatch, capsys, tmpfs):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("not a folder")
    for folder, cause in [
        (tmp_path / "a_file" / "checkpoints", "Not a directory (errno 20)"),
        (tmpfs("read_only", read_only=True) / "checkpoints", "Read-only file system (errno 30)"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            _quickstart(tmp_path, f"--checkpoint.dirpath={folder}")
        assert exit_info.value.code == 74
        message = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"cannot save checkpoints: {cause} writing {folder}" in message
        assert "stopped before training" in message


@pytest.mark.slow  # two fits of the ResNet demo in this process
def test_async_write_failure_is_reported_and_earlier_checkpoints_survive(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    callback = FaultTolerantCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_steps=2, async_save=True)
    import lightning.pytorch as pl

    from lightning_mlopt.demos import DigitsDataModule, ResNetClassifier

    def build(steps: int) -> pl.Trainer:
        return pl.Trainer(
            accelerator="cpu",
            max_steps=steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[callback],
            default_root_dir=str(tmp_path),
        )

    model = ResNetClassifier(depth=18, width=8, in_channels=1)
    build(2).fit(model, DigitsDataModule(batch_size=32))
    first = CheckpointStore(tmp_path / "ckpt").newest_valid()
    assert first is not None and first.step == 2

    real_save = torch.save

    def broken(obj, f, *args, **kwargs):
        if str(getattr(f, "name", f)).endswith("state.ckpt"):  # the background write of the full state
            raise OSError(5, "Input/output error")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", broken)
    callback.resume = Resume(auto=False)
    with pytest.raises(CheckpointWriteError, match=r"background checkpoint write failed: .*Input/output error"):
        build(6).fit(model, DigitsDataModule(batch_size=32))
    verify(first.path)


def test_constructor_validates():
    with pytest.raises(ValueError, match=r"every_n_steps must be >= 1"):
        FaultTolerantCheckpoint(every_n_steps=0)
    with pytest.raises(ValueError, match="unknown signal name"):
        FaultTolerantCheckpoint(preemption=Preemption(signals=("SIGNOPE",)))
    with pytest.raises(ValueError, match=r"exit_code must be in 1\.\.255"):
        FaultTolerantCheckpoint(preemption=Preemption(exit_code=0))
    with pytest.raises(TypeError, match=r"keep_last is now keep\.last \(e\.g\. keep=Keep\(last=\.\.\.\)"):
        FaultTolerantCheckpoint(keep_last=5)
    with pytest.raises(TypeError, match=r"signal_deadline_s is now preemption\.deadline_s"):
        FaultTolerantCheckpoint(signal_deadline_s=5)
    with pytest.raises(TypeError, match=r"unexpected argument 'keep_lasts'"):
        FaultTolerantCheckpoint(keep_lasts=5)


@pytest.mark.slow
def test_time_trigger_saves_when_minutes_have_passed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # 0.0001 minutes = 6 ms: every step is due; the decision goes through the same collective path.
    _quickstart(
        tmp_path,
        "--checkpoint.every_n_steps=null",
        "--checkpoint.every_n_minutes=0.0001",
        "--checkpoint.keep.last=10",
        "--checkpoint.save_on.train_end=false",
    )
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    reasons = {entry.step: entry.manifest.reason for entry in store.entries() if entry.valid}
    assert sorted(reasons) == [1, 2, 3, 4, 5, 6]
    assert set(reasons.values()) == {"every_n_minutes"}


def _signal_whole_job_after(
    command: list[str], cwd: Path, checkpoints: Path, signum: int, preloaded: bool = False
) -> tuple[int, float, str]:
    """Start the job in its own process group; after its first commit, signal every process of it at once
    (as SLURM and Kubernetes do); return (exit status, seconds from the signal to the exit, stderr).

    ``preloaded``: the ranks fork from the preloaded server (started as torchrun starts them), not Lightning's
    launcher."""
    if preloaded:
        process: Any = start_cli(command[3:], cwd, preloaded=True)
    else:
        process = subprocess.Popen(
            command, cwd=cwd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 240
        while not list(checkpoints.glob("step-*")) and time.monotonic() < deadline:
            assert process.poll() is None, process.communicate()[1].decode()[-3000:]
            time.sleep(0.05)
        time.sleep(random.Random(signum).uniform(0.2, 1.0))  # mid-step, most likely mid-collective
        started = time.monotonic()
        os.killpg(process.pid, signum)
        _, stderr = process.communicate(timeout=120)
        return process.returncode, time.monotonic() - started, stderr.decode()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["fsdp", "pp"])
def test_sigterm_to_every_process_of_a_sharded_job_saves_and_exits_75(tmp_path, strategy):
    # Lightning's own SIGTERM handler runs a broadcast inside the handler: with the signal landing mid-step on
    # both ranks, FSDP hung 3 times of 3. Ours only records; the save happens at the agreed step boundary.
    # Under PP the signal lands inside the schedule's point-to-point sends as often as in a collective.
    run_dir = tmp_path / "run"
    command = _command(
        run_dir,
        strategy,
        extra=("--trainer.max_steps=1000", "--data.init_args.num_sequences=4096", "--checkpoint.every_n_steps=3"),
    )
    # FSDP's job is launched for real (Lightning's launcher and its handlers); PP's ranks fork preloaded.
    checkpoints = run_dir / "checkpoints"
    status, seconds, stderr = _signal_whole_job_after(command, tmp_path, checkpoints, signal.SIGTERM, strategy == "pp")
    assert status == 75, stderr[-3000:]
    assert seconds < 30
    entry = CheckpointStore(run_dir / "checkpoints").newest_valid()
    assert entry is not None and entry.manifest.reason == "signal"
    resumed = _run_forked([*command, f"--trainer.max_steps={entry.step + 2}"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Auto-resuming from {entry.path}" in resumed.stderr + resumed.stdout


@pytest.mark.multiprocess
@pytest.mark.parametrize(("strategy", "size"), [("zero2", "4m"), ("fsdp", "4m"), ("pp", "4m")])
def test_a_disk_full_mid_write_ends_every_rank_with_the_cause(tmp_path, tmpfs, strategy, size):
    # The first save does not fit: it fails inside the strategy's own writer (DeepSpeed's, DCP's), on one
    # rank or both; every rank must agree and end with one line naming the disk, not hang or print pages.
    disk = tmpfs("disk", size=size)
    run_dir = tmp_path / "run"
    command = _command(
        run_dir, strategy, extra=(f"--checkpoint.dirpath={disk / 'checkpoints'}", "--checkpoint.async_save=false")
    )
    started = time.monotonic()
    # FSDP's run is launched for real (its status passes through Lightning's launcher); the others' ranks fork
    # from the preloaded server, where what is written and said is the same.
    result = (_run if strategy == "fsdp" else _run_forked)(command, tmp_path, timeout=180)
    assert result.returncode == 74, result.stderr[-3000:]
    assert time.monotonic() - started < 120
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors and all("No space left on device (errno 28) writing" in line for line in errors), errors
    assert all(f"{disk / 'checkpoints'}" in line and "earlier checkpoints are intact" in line for line in errors)
    assert "Traceback" not in result.stderr
    assert not [p for p in (disk / "checkpoints").iterdir() if p.name.startswith(".staging")]


@pytest.mark.multiprocess
def test_a_background_write_that_fails_on_rank_1_only_ends_every_rank_and_commits_nothing(tmp_path):
    # FSDP's async save of step 4: the operating system refuses rank 1's shard (a folder is in its place,
    # EISDIR) in the background thread, after rank 0 wrote its own. Both ranks must end with rank 1's cause.
    run_dir = tmp_path / "run"
    blocked = (
        "--trainer.callbacks+=tests.support.faults.InterfereWithBackgroundWrite",
        f"--trainer.callbacks.out_dir={run_dir / 'markers'}",
        "--trainer.callbacks.step=4",
        "--trainer.callbacks.block_rank=1",
    )
    result = _run(_command(run_dir, "fsdp", extra=blocked), tmp_path, timeout=180)
    assert result.returncode == 74, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2, result.stderr[-3000:]  # one line per rank
    assert all("background checkpoint write failed: rank 1: Is a directory (errno 21)" in line for line in errors)
    assert all("earlier checkpoints are intact" in line.lower() for line in errors), errors
    checkpoints = run_dir / "checkpoints"
    assert [step for step, _ in CheckpointStore(checkpoints).committed()] == [2]
    assert CheckpointStore(checkpoints).latest_name() == "step-000000002"
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".staging")]
    verify(checkpoints / "step-000000002")


@pytest.mark.slow
def test_a_run_whose_final_save_was_lost_is_marked_final_on_relaunch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # What a kill during the final save leaves: the periodic checkpoint at max_steps, not marked final.
    # Lightning skips the training loop of a run resumed at max_steps, so on_train_end never runs there.
    _quickstart(tmp_path, "--trainer.max_steps=4", "--checkpoint.save_on.train_end=false")
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    entry = store.newest_valid()
    assert entry is not None and entry.step == 4 and not entry.manifest.final
    _quickstart(tmp_path, "--trainer.max_steps=4")
    entry = store.newest_valid()
    assert entry is not None and entry.step == 4 and entry.manifest.final and entry.manifest.reason == "final"


@pytest.mark.multiprocess
def test_a_ddp_run_relaunched_under_zero2_trains_on_and_a_layout_none_reads_is_refused_once(tmp_path):
    run_dir = tmp_path / "run"

    def command(strategy: str, steps: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "lightning_mlopt",
            "fit",
            "--model=tests.support.models.ThirdPartyLM",  # a user's model, with its own dataloaders
            "--trainer.accelerator=cpu",
            "--trainer.devices=2",
            f"--trainer.strategy={strategy}",
            f"--trainer.max_steps={steps}",
            "--trainer.limit_val_batches=0",
            "--trainer.logger=false",
            "--checkpoint.resume.final=true",
            f"--run_dir={run_dir}",
        ]

    first = _run_forked(command("ddp", 2), tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    # DDP's one file loads into ZeRO's partitions as it is (at any world size): the run trains on.
    switched = _run_forked(command("zero2", 4), tmp_path)
    assert switched.returncode == 0, switched.stderr[-3000:]
    assert f"Auto-resuming from {run_dir / 'checkpoints' / 'step-000000002'}" in switched.stdout + switched.stderr
    newest = CheckpointStore(run_dir / "checkpoints").newest_valid()
    assert newest is not None and newest.step == 4 and newest.manifest.layout == "ZeRO partitions"

    # A checkpoint in a layout none of our strategies reads: refused in one line, said once for both ranks.
    manifest_path = newest.path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "layout": "the format of OwnFormat"}))
    before = sorted(str(p) for p in (run_dir / "checkpoints").rglob("*"))
    refused = _run_forked(command("ddp", 6), tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "(written by DeepSpeedStrategy on 2 processes: the format of OwnFormat)" in errors[0]
    assert "Traceback" not in refused.stderr
    assert sorted(str(p) for p in (run_dir / "checkpoints").rglob("*")) == before


def _signalled_quickstart(tmp_path: Path, grace_s: float, save_s: float) -> tuple[int, str]:
    """Saves that take ``save_s`` every 2 steps, a SIGTERM at step 5, ``grace_s`` from the signal to a kill."""
    with pytest.raises(SystemExit) as stopped, pytest.warns(UserWarning) as warned:
        _quickstart(
            tmp_path,
            f"--checkpoint.preemption.grace_s={grace_s}",
            "--trainer.callbacks+=tests.support.faults.SlowSaves",
            f"--trainer.callbacks.seconds={save_s}",
            "--trainer.callbacks+=tests.support.faults.SignalAtStep",
            "--trainer.callbacks.step=5",
        )
    return stopped.value.code, "\n".join(str(warning.message) for warning in warned)


@pytest.mark.slow
def test_a_grace_too_short_for_a_save_exits_75_at_once_naming_the_checkpoint_to_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    code, err = _signalled_quickstart(tmp_path, grace_s=2.5, save_s=2.0)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert code == 75, err[-2000:]
    # Saves take >= 2 s and the grace leaves 1.5 s: no save is started; steps 2 and 4 stay, 4 is resumed from.
    assert [step for step, _ in CheckpointStore(checkpoints).committed()] == [2, 4]
    assert "no time to save step 5" in err and "step-000000004 (step 4; 1 step(s) redone)" in err
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_a_grace_that_fits_the_save_saves_the_signalled_step(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = _signalled_quickstart(tmp_path, grace_s=20.0, save_s=0.5)
    assert code == 75, err[-2000:]
    newest = CheckpointStore(tmp_path / "run" / "checkpoints").newest_valid()
    assert newest is not None and newest.step == 5 and newest.manifest.reason == "signal"


@pytest.mark.slow
def test_a_background_save_that_cannot_finish_in_the_grace_is_abandoned_and_never_committed(tmp_path):
    command = [
        sys.executable,
        "-m",
        "lightning_mlopt",
        "fit",
        "--config",
        str(CONFIGS / "quickstart.yaml"),
        f"--run_dir={tmp_path / 'run'}",
        *QUICK,
        "--checkpoint.async_save=true",
        "--checkpoint.preemption.grace_s=2.5",  # 1.5 s left after the margin: the write in flight needs 3 s
        "--trainer.callbacks+=tests.support.faults.SlowWrite",
        "--trainer.callbacks.step=4",
        "--trainer.callbacks.seconds=3",
        "--trainer.callbacks+=tests.support.faults.SignalAtStep",
        "--trainer.callbacks.step=5",
    ]
    done = _run(command, tmp_path, timeout=120)
    assert done.returncode == 75, done.stderr[-3000:]
    assert [step for step, _ in CheckpointStore(tmp_path / "run" / "checkpoints").committed()] == [2]
    assert "step-000000002 (step 2; 3 step(s) redone)" in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_a_restart_from_an_older_checkpoint_sets_the_abandoned_branch_aside(tmp_path, monkeypatch, caplog):
    """A rollback past a loss spike: a later crash must resume this branch, and retention must keep its saves."""
    monkeypatch.chdir(tmp_path)
    _quickstart(tmp_path, "--trainer.max_steps=8", "--checkpoint.keep.last=2")  # keeps steps 6 and 8
    checkpoints = tmp_path / "run" / "checkpoints"
    store = CheckpointStore(checkpoints)
    assert [step for step, _ in store.committed()] == [6, 8]
    # A ckpt_path alone is a warm start: the run's own newest checkpoint wins, and this one is finished.
    older = f"--ckpt_path={checkpoints / 'step-000000006'}"
    _quickstart(tmp_path, older, "--trainer.max_steps=7")
    assert [step for step, _ in store.committed()] == [6, 8] and not (checkpoints / "rolled_back").exists()
    # Forced: from step 6, to step 7 (as if the new branch crashed there). Auto-resume chose the finished step 8
    # first: the explicit checkpoint wins, and its run is saved at its end all the same.
    _quickstart(tmp_path, older, "--trainer.max_steps=7", "--checkpoint.resume.ckpt_path=always")
    assert [step for step, _ in store.committed()] == [6, 7], "step 8 of the abandoned branch is out of the way"
    (rolled_back,) = (checkpoints / "rolled_back").iterdir()
    assert [p.name for p in rolled_back.iterdir()] == ["step-000000008"] and verify(rolled_back / "step-000000008")
    assert "Rolled back to step 6: the 1 newer checkpoints of this run were moved to" in caplog.text
    assert store.newest_valid().step == 7 and store.latest_name() == "step-000000007"


class _FailsAt(torch.optim.SGD):
    """SGD that updates the first parameter of step ``fails_at``, then raises (as an out-of-memory for its state)."""

    fails_at = 3

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        self.steps = getattr(self, "steps", 0) + 1
        group = self.param_groups[0]
        for index, parameter in enumerate(group["params"]):
            if self.steps == self.fails_at and index == 1:
                raise RuntimeError("out of memory (in the optimizer step)")
            parameter.data.add_(parameter.grad, alpha=-group["lr"])
        return loss


class _FailsAfterTheStep(Callback):
    """Raises in on_train_batch_end of step 3, after the optimizer's step returned (the state is whole)."""

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == 3:
            raise RuntimeError("out of memory (after the step)")


@pytest.mark.parametrize("raised_in", ["training_step", "optimizer step", "after the step"])
def test_an_exception_inside_the_optimizer_step_saves_no_half_updated_state(tmp_path, raised_in):
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if raised_in == "training_step" and batch_idx == 2:
                raise RuntimeError("out of memory (in the forward pass)")
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self) -> Any:
            return (
                _FailsAt(self.parameters(), lr=0.1) if raised_in == "optimizer step" else super().configure_optimizers()
            )

    callback = FaultTolerantCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_steps=100, async_save=False)
    raising = [_FailsAfterTheStep()] if raised_in == "after the step" else []
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=10, logger=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path, callbacks=[callback, *raising],
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.fit(Model())
    committed = CheckpointStore(tmp_path / "ckpt").committed()
    if raised_in == "training_step":  # before any update of step 3: the state of step 2 is whole
        assert [step for step, _ in committed] == [2] and verify(committed[0][1]).reason == "exception"
    elif raised_in == "after the step":  # step 3's update is complete: saved
        assert [step for step, _ in committed] == [3] and verify(committed[0][1]).reason == "exception"
    else:
        assert committed == [], "the weight was updated for step 3, the bias not: no checkpoint of that"


class _FillTheDiskThenSigterm(Callback):
    """At step 3's end: another job fills the checkpoint disk, then the scheduler sends SIGTERM."""

    def __init__(self, disk: Path) -> None:
        self.disk = disk

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == 3:
            with contextlib.suppress(OSError), (self.disk / "filler").open("wb", buffering=0) as handle:
                while True:
                    handle.write(b"\0" * 2**16)
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_a_preemption_whose_save_fails_still_exits_for_a_requeue_from_the_last_commit(tmp_path, tmpfs, recwarn):
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    disk = tmpfs("disk", size="2m")
    callback = FaultTolerantCheckpoint(dirpath=str(disk / "ckpt"), every_n_steps=2, async_save=False)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=10, logger=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path, callbacks=[_FillTheDiskThenSigterm(disk), callback],
    )  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        trainer.fit(BoringModel())
    assert exit_info.value.code == 75, "requeued: the node was going away, and step 2 is committed"
    said = [str(w.message) for w in recwarn if "Preemption" in str(w.message)]
    assert len(said) == 1 and "the save of step 3 failed (" in said[0] and "No space left on device" in said[0]
    assert f"a relaunch resumes from {disk / 'ckpt' / 'step-000000002'} (step 2)" in said[0]
    assert [step for step, _ in CheckpointStore(disk / "ckpt").committed()] == [2]


@pytest.mark.slow
def test_a_model_that_builds_modules_in_configure_model_resumes(tmp_path):
    """At setup such a model has no head yet: only shapes both sides hold are compared, not missing names."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Model(BoringModel):
        def configure_model(self) -> None:
            if not hasattr(self, "head"):
                self.head = torch.nn.Linear(2, 2)

    def fit(steps: int) -> pl.Trainer:
        callback = FaultTolerantCheckpoint(dirpath=str(tmp_path / "ckpt"), resume=Resume(final=True))
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False, limit_val_batches=0,
            enable_model_summary=False, default_root_dir=tmp_path, callbacks=[callback],
        )  # fmt: skip
        trainer.fit(Model())
        return trainer

    fit(2)
    assert fit(4).global_step == 4  # resumed from step 2, head and all
    assert [step for step, _ in CheckpointStore(tmp_path / "ckpt").committed()][-1] == 4


def test_lightnings_stopped_line_is_said_once_in_a_resumed_run(tmp_path, caplog):
    # Lightning says "`Trainer.fit` stopped" each time its loop's `done` is asked; on_fit_end asked again.
    import logging

    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_mlopt.callbacks import SaveOn

    def fit(steps: int, **settings: Any) -> int:
        folder = str(tmp_path / "ckpt")
        callback = FaultTolerantCheckpoint(dirpath=folder, every_n_steps=1, async_save=False, **settings)
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
            limit_val_batches=0, default_root_dir=tmp_path, callbacks=[callback],
        )  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.INFO):
            trainer.fit(BoringModel())
        return caplog.text.count(f"`Trainer.fit` stopped: `max_steps={steps}` reached.")

    assert fit(2, save_on=SaveOn(train_end=False)) == 1  # as a kill during the final save leaves it
    assert fit(2) == 1  # resumed at max_steps: the loop is skipped, and the run marked final
    entry = CheckpointStore(tmp_path / "ckpt").newest_valid()
    assert entry is not None and entry.step == 2 and entry.manifest.final
    assert fit(4, resume=Resume(final=True)) == 1  # resumed, trained on to the new max_steps
