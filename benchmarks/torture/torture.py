"""Torture trials: faults as a cluster delivers them, N trials per fault and strategy, pass x/N per cell.

Each trial runs the real CLI on 2 CPU processes (the GPT demo, dropout on, a checkpoint every 2 steps) in its
own process group and delivers one fault. The one-process cells (``single``: Lightning's single-device strategy;
``single-w2``: the same with 2 DataLoader workers; ``ddp1``: our DDP at devices=1) run the same job in one
process, where no DistributedSampler orders the data:

- ``kill``: SIGKILL to every process at a random instant of the run (start-up, mid-step, mid-save, the final
  save), then the identical command again: it must finish with parameters bitwise equal to an uninterrupted
  run and a checkpoint marked final.
- ``sigterm`` / ``sigusr1``: the signal to every process at a random instant after the first checkpoint: exit
  75 within 30 s with a checkpoint saved by the signal, then a relaunch bitwise equal to the uninterrupted run.
- ``unwritable``: the checkpoint folder on a read-only tmpfs, or under a file: exit 74 within 60 s, a message
  of at most 15 lines that names the path and the cause.
- ``full``: the checkpoint folder on a tmpfs too small for one checkpoint (the save fails inside the
  strategy's writer) or filled up after the first ones (found before writing): exit 74 within 60 s, the path
  and "No space left on device" named.
- ``corrupt``: the newest checkpoint's largest file is truncated after an interrupted run: the relaunch warns,
  resumes from the previous one and ends bitwise equal.
- ``sigterm-launcher``: the job started by ``launch`` (torchrun in-process), SIGTERM to the launcher alone (what
  the kubelet sends a container's PID 1) at a random instant after the first checkpoint: exit 75 within 30 s,
  one ``launch:`` line and no traceback, a checkpoint saved by the signal, then a relaunch bitwise equal.
- ``grace``: every save takes longer than the grace (``checkpoint.preemption.grace_s``): SIGTERM to every
  process, exit 75 within the grace without starting a save, the previous checkpoint intact and resumed from,
  bitwise equal.
- ``notice``: an AWS spot notice (IMDSv2) posted by a fake metadata server on loopback, polled by the run
  (``preemption.notices: [aws]``): exit 75 before the notice's deadline with a checkpoint, then a relaunch
  bitwise equal.

A trial the harness has to end by its own timeout is a hang and fails, whatever else happened.

``--store s3`` runs the ``kill`` fault with ``checkpoint.dirpath: s3://...`` on a real S3-compatible server on
loopback (moto): SIGKILL lands anywhere, background uploads included; half the relaunches find their local tier
deleted (a new VM) and must resume from the store. A pass also needs the store's newest checkpoint to verify as
the final one.

    python benchmarks/torture/torture.py --trials 20                      # every fault x every strategy
    python benchmarks/torture/torture.py --trials 2 --strategies ddp --faults sigusr1,unwritable --no-publish
    python benchmarks/torture/torture.py --trials 20 --strategies ddp,fsdp --faults kill --store s3

Needs root for the tmpfs faults (skipped otherwise, and said so in the table).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

STRATEGIES = ("ddp", "fsdp", "zero2", "zero3", "single", "single-w2", "ddp1")
# The one-process cells (the single-GPU user's run): Lightning's single-device strategy, with the data in the
# training process or in 2 DataLoader workers, and our DDP at devices=1. Each is the overlay (or strategy name),
# the process count and the extra arguments.
CELLS: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "single": ("auto", 1, ()),
    "single-w2": ("auto", 1, ("--data.init_args.num_workers=2",)),
    "ddp1": ("ddp", 1, ()),
}
FAULTS = ("kill", "sigterm", "sigusr1", "unwritable", "full", "corrupt", "sigterm-launcher", "grace", "notice")
NEEDS_REFERENCE = {"kill", "sigterm", "sigusr1", "corrupt", "sigterm-launcher", "grace", "notice"}
GRACE_S, SAVE_S = 4.0, 3.5  # the `grace` fault: each save takes 3.5 s more; the grace leaves 3 s after its margin
NOTICE_S = 20.0  # the `notice` fault: the spot notice's deadline
HARNESS_TIMEOUT_S = 300  # a run still going after this is a hang
MAX_STEPS = 12


@dataclass
class Cell:
    """The trials of one (fault, strategy) pair."""

    passed: int = 0
    failures: list[str] = field(default_factory=list)  # "seed N: why"
    skipped: str | None = None

    @property
    def trials(self) -> int:
        return self.passed + len(self.failures)


class Hang(Exception):
    """A run outlived the harness timeout."""


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}  # warnings kept: some are checked
    env.pop("MASTER_PORT", None)
    return env


def command(run_dir: Path, strategy: str, *extra: str, launcher: list[str] | None = None) -> list[str]:
    """The job: GPT demo, 2 CPU processes (1 for the one-process cells), dropout (the RNG state matters), a
    checkpoint every 2 steps; epochs of 5 steps (10 in one process), so a random kill lands mid-epoch often.

    ``launcher``: e.g. ``["launch", "--nproc-per-node=2"]`` to start it with ``launch`` instead of Lightning.
    """
    overlay, devices, cell_extra = CELLS.get(strategy, (strategy, 2, ()))
    overlay_file = REPO / "configs" / "strategies" / f"{overlay}.yaml"
    strategy_args = ["--config", str(overlay_file)] if overlay_file.is_file() else [f"--trainer.strategy={overlay}"]
    return [
        sys.executable,
        "-m",
        "lightning_mlopt",
        *(launcher or []),
        "fit",
        "--config",
        str(REPO / "configs" / "gpt.yaml"),
        *strategy_args,
        "--trainer.accelerator=cpu",
        f"--trainer.devices={devices}",
        *cell_extra,
        f"--trainer.max_steps={MAX_STEPS}",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.logger=false",
        "--model.init_args.dropout=0.1",
        "--data.init_args.num_sequences=160",
        "--checkpoint.every_n_steps=2",
        f"--run_dir={run_dir}",
        "--trainer.callbacks+=tests.support.recorders.RecordEverything",
        f"--trainer.callbacks.out_dir={run_dir / 'record'}",
        "--trainer.callbacks+=tests.support.faults.Pace",
        f"--trainer.callbacks.out_dir={run_dir / 'pace'}",
        "--trainer.callbacks.seconds_per_step=0.25",  # a few seconds of training to land faults in
        *extra,
    ]


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a job in its own process group (a fault reaches every process of it, as on a cluster)."""
    handle = log.open("w")
    return subprocess.Popen(
        cmd,
        cwd=log.parent,
        env={**_env(), **(env or {})},
        stdout=handle,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def finish(process: subprocess.Popen, timeout: float = HARNESS_TIMEOUT_S) -> int:
    """Wait for the job; kill the whole group and raise Hang if it outlives ``timeout``."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise Hang(f"still running after {timeout:.0f} s") from None


def run(cmd: list[str], log: Path, timeout: float = HARNESS_TIMEOUT_S, env: dict[str, str] | None = None) -> int:
    return finish(start(cmd, log, env), timeout)


def reap(process: subprocess.Popen) -> None:
    """Leave nothing of a job behind (ranks it launched share its process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def params(run_dir: Path):  # type: ignore[no-untyped-def]
    import torch

    return torch.load(run_dir / "record" / "params.pt", weights_only=False)


def equal(run_dir: Path, reference: dict) -> str | None:
    import torch

    from lightning_mlopt.checkpoint import CheckpointStore

    if not (run_dir / "record" / "params.pt").is_file():
        return "the relaunch wrote no parameters"
    actual = params(run_dir)
    differ = [name for name in reference if not torch.equal(actual[name], reference[name])]
    if differ:
        return f"parameters differ from the uninterrupted run: {differ[:3]}"
    final = CheckpointStore(run_dir / "checkpoints").newest_valid()
    if final is None or final.step != MAX_STEPS or not final.manifest.final:
        return f"no final checkpoint at step {MAX_STEPS} (newest: {final.step if final else None})"
    return None


def wait_for(predicate, process: subprocess.Popen, timeout: float = 240) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if process.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def has_checkpoint(run_dir: Path) -> bool:
    return bool(list((run_dir / "checkpoints").glob("step-*"))) if (run_dir / "checkpoints").is_dir() else False


# ---------------------------------------------------------------------- faults


def trial_kill(
    strategy: str, work: Path, rng: random.Random, reference: dict, duration: float, store: Any = None
) -> str | None:
    run_dir = work / "run"
    extra, env = _on_store(store, work)
    cmd = command(run_dir, strategy, *extra)
    process = start(cmd, work / "killed.log", env)
    time.sleep(rng.uniform(0.0, duration))  # anywhere: imports, rendezvous, DeepSpeed's op load, steps, saves
    reap(process)
    process.wait()
    if store is not None and rng.random() < 0.5:  # a new VM: only the store has the checkpoints
        import shutil

        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    if run(cmd, work / "relaunch.log", env=env) != 0:
        return "relaunch failed: " + _last_error(work / "relaunch.log")
    return equal(run_dir, reference) or (_store_has_final(extra, work, env) if store is not None else None)


def _on_store(store: Any, work: Path) -> tuple[list[str], dict[str, str]]:
    """With the loopback S3 server: a bucket of the trial's own, the dirpath naming it, and the environment."""
    if store is None:
        return [], {}
    bucket = f"torture-{work.name}".lower().replace("_", "-")[:63]
    store.create_bucket(bucket)
    return [f"--checkpoint.dirpath=s3://{bucket}/run"], store.environment()


def _store_has_final(extra: list[str], work: Path, env: dict[str, str]) -> str | None:
    """The store's newest checkpoint downloads, verifies, and is the final one."""
    from lightning_mlopt.checkpoint import CheckpointStore
    from lightning_mlopt.checkpoint.remote.checkpoints import RemoteCheckpoints
    from lightning_mlopt.checkpoint.remote.object_store import ObjectStore

    os.environ.update(env)
    url = extra[0].split("=", 1)[1]
    entry = RemoteCheckpoints(ObjectStore.for_url(url)).download_newest_valid(CheckpointStore(work / "from-store"))
    if entry is None or entry.step != MAX_STEPS or not (entry.manifest and entry.manifest.final):
        return f"the store's newest valid checkpoint is not the final one (step {entry.step if entry else None})"
    return None


def start_after_first_checkpoint(
    cmd: list[str], log: Path, run_dir: Path, pause_s: float, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen | None, str | None]:
    """Start the job and return it ``pause_s`` after its first checkpoint; or None and why it could not be."""
    process = start(cmd, log, env)
    if not wait_for(lambda: has_checkpoint(run_dir), process):
        reap(process)
        return None, "the job ended before its first checkpoint: " + _last_error(log)
    time.sleep(pause_s)
    if process.poll() is not None:
        return None, "the job finished before the fault (trial too short)"
    return process, None


def trial_signal(
    strategy: str, work: Path, rng: random.Random, reference: dict, signum: int, launcher_only: bool = False
) -> str | None:
    run_dir = work / "run"
    cmd = command(run_dir, strategy, launcher=LAUNCH if launcher_only else None)
    process, problem = start_after_first_checkpoint(cmd, work / "signalled.log", run_dir, rng.uniform(0.0, 1.5))
    if process is None:
        return problem
    started = time.monotonic()
    if launcher_only:
        os.kill(process.pid, signum)  # the launcher alone, as the kubelet signals a container's PID 1
    else:
        os.killpg(process.pid, signum)
    status = finish(process)
    if launcher_only:
        problem = _launcher_output_problem(work / "signalled.log")
        if problem:
            return problem
    seconds = time.monotonic() - started
    if status == 0 and (run_dir / "record" / "params.pt").is_file():
        # The signal came after the last step boundary: the run finished normally, as it should.
        return equal(run_dir, reference)
    if status != 75:
        return f"exit {status}, not 75: " + _last_error(work / "signalled.log")
    if seconds > 30:
        return f"exit 75 after {seconds:.0f} s (> 30 s)"
    from lightning_mlopt.checkpoint import CheckpointStore

    entry = CheckpointStore(run_dir / "checkpoints").newest_valid()
    reached = max(
        (int(p.name.split("-")[1].split(".")[0]) for p in (run_dir / "pace").glob("step-*.rank0")), default=-1
    )
    if entry is None or entry.manifest.reason != "signal" or entry.step != reached:
        return f"no checkpoint at the signalled step {reached} (newest: {entry.step if entry else None})"
    if run(cmd, work / "relaunch.log") != 0:
        return "relaunch failed: " + _last_error(work / "relaunch.log")
    return equal(run_dir, reference)


def _launcher_output_problem(log: Path) -> str | None:
    """``launch`` says what happened in one line, and no traceback reaches the output."""
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith("launch:")]
    if "Traceback" in text or "SignalException" in text:
        return "a traceback in the output: " + _last_error(log)
    if len(lines) != 1:
        return f"{len(lines)} launch: lines, not 1"
    return None


def trial_grace(strategy: str, work: Path, rng: random.Random, reference: dict) -> str | None:
    """Saves slower than the grace: the signal ends the run at once, without a save it could not finish."""
    run_dir = work / "run"
    slow = ["--trainer.callbacks+=tests.support.faults.SlowSaves", f"--trainer.callbacks.seconds={SAVE_S}"]
    cmd = command(run_dir, strategy, f"--checkpoint.preemption.grace_s={GRACE_S}", *slow)
    process, problem = start_after_first_checkpoint(cmd, work / "signalled.log", run_dir, rng.uniform(0.0, 2.0))
    if process is None:
        return problem
    from lightning_mlopt.checkpoint import CheckpointStore

    before = [step for step, _ in CheckpointStore(run_dir / "checkpoints").committed()]
    started = time.monotonic()
    os.killpg(process.pid, signal.SIGTERM)
    status = finish(process)
    seconds = time.monotonic() - started
    if status != 75:
        return f"exit {status}, not 75: " + _last_error(work / "signalled.log")
    if seconds > GRACE_S + 1.0:  # the exit itself may take a moment past the decision
        return f"exit 75 after {seconds:.1f} s, past the {GRACE_S:.0f} s grace"
    store = CheckpointStore(run_dir / "checkpoints")
    entry = store.newest_valid()
    if entry is None or entry.manifest.reason == "signal":
        return f"a save was started within a grace it could not fit in (newest: {entry and entry.manifest.reason})"
    if before and entry.step < before[-1]:
        return f"the previous checkpoint (step {before[-1]}) was lost; newest valid is {entry.step}"
    if run(cmd, work / "relaunch.log") != 0:
        return "relaunch failed: " + _last_error(work / "relaunch.log")
    return equal(run_dir, reference)


def trial_notice(strategy: str, work: Path, rng: random.Random, reference: dict) -> str | None:
    """An AWS spot notice from a metadata server on loopback stops the run like a SIGTERM, before its deadline."""
    from tests.support.metadata_server import FakeMetadataServer

    run_dir = work / "run"
    with FakeMetadataServer() as server:
        notices = ["--preemption.notices=[aws]", "--preemption.poll_interval_s=0.2"]
        cmd = command(run_dir, strategy, *notices)
        env = server.environment()
        pause = rng.uniform(0.0, 1.5)
        process, problem = start_after_first_checkpoint(cmd, work / "noticed.log", run_dir, pause, env)
        if process is None:
            return problem
        started = time.monotonic()
        server.post_aws_notice(seconds_from_now=NOTICE_S)
        status = finish(process)
        seconds = time.monotonic() - started
        server.clear()  # the relaunch runs on a VM with no notice
        if status != 75:
            return f"exit {status}, not 75: " + _last_error(work / "noticed.log")
        if seconds > NOTICE_S:
            return f"exit 75 after {seconds:.0f} s, past the notice's {NOTICE_S:.0f} s"
        from lightning_mlopt.checkpoint import CheckpointStore

        entry = CheckpointStore(run_dir / "checkpoints").newest_valid()
        if entry is None or entry.manifest.reason != "signal":
            return f"no checkpoint saved for the notice (newest: {entry.step if entry else None})"
        if run(cmd, work / "relaunch.log", env=env) != 0:
            return "relaunch failed: " + _last_error(work / "relaunch.log")
    return equal(run_dir, reference)


def trial_unwritable(strategy: str, work: Path, rng: random.Random, mount) -> str | None:  # type: ignore[no-untyped-def]
    if rng.random() < 0.5:
        folder = mount(work / "ro", "1m", read_only=True) / "checkpoints"
        cause = "Read-only file system (errno 30)"
    else:
        (work / "a_file").write_text("not a folder")
        folder, cause = work / "a_file" / "checkpoints", "Not a directory (errno 20)"
    return _expect_write_error(strategy, work, folder, cause)


def trial_full(strategy: str, work: Path, rng: random.Random, mount) -> str | None:  # type: ignore[no-untyped-def]
    # 4 MB: less than one checkpoint (the save fails inside the strategy's writer); 30 MB: two or three fit.
    size = rng.choice(["4m", "30m"])
    folder = mount(work / "disk", size) / "checkpoints"
    return _expect_write_error(strategy, work, folder, "No space left on device", "--checkpoint.keep.last=10")


def _expect_write_error(strategy: str, work: Path, folder: Path, cause: str, *extra: str) -> str | None:
    run_dir = work / "run"
    started = time.monotonic()
    status = run(command(run_dir, strategy, f"--checkpoint.dirpath={folder}", *extra), work / "run.log", timeout=120)
    seconds = time.monotonic() - started
    errors = [line for line in (work / "run.log").read_text().splitlines() if line.startswith("error:")]
    if status != 74:
        return f"exit {status}, not 74: " + _last_error(work / "run.log")
    if seconds > 60:
        return f"took {seconds:.0f} s (> 60 s)"
    if not errors or any(cause not in line or str(folder) not in line for line in errors):
        return f"the message does not name the path and '{cause}': {errors[:1]}"
    if any(len(line.splitlines()) > 15 for line in errors):
        return "message longer than 15 lines"
    return None


def trial_corrupt(strategy: str, work: Path, rng: random.Random, reference: dict, duration: float) -> str | None:
    from lightning_mlopt.checkpoint import CheckpointStore

    run_dir = work / "run"
    cmd = command(run_dir, strategy)
    process = start(cmd, work / "first.log")
    if not wait_for(lambda: len(CheckpointStore(run_dir / "checkpoints").committed()) >= 2, process):
        reap(process)
        return "the job ended before two checkpoints: " + _last_error(work / "first.log")
    reap(process)
    process.wait()
    newest = CheckpointStore(run_dir / "checkpoints").committed()[-1][1]
    files = sorted(
        (p for p in newest.rglob("*") if p.is_file() and p.name != "manifest.json"), key=lambda p: p.stat().st_size
    )
    victim = files[-1]
    victim.write_bytes(victim.read_bytes()[: rng.randint(0, victim.stat().st_size - 1)])
    if run(cmd, work / "relaunch.log") != 0:
        return "relaunch failed: " + _last_error(work / "relaunch.log")
    if "failed verification" not in (work / "relaunch.log").read_text():
        return "the damaged checkpoint was not reported"
    return equal(run_dir, reference)


def _last_error(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    picked = [line for line in lines if "error" in line.lower()][-2:] or lines[-2:]
    return " | ".join(line.strip()[:200] for line in picked)


# ---------------------------------------------------------------------- harness


class Mounts:
    """Real tmpfs mounts (root only), unmounted at the end of each trial."""

    def __init__(self) -> None:
        self.points: list[Path] = []

    def __call__(self, point: Path, size: str, read_only: bool = False) -> Path:
        point.mkdir(parents=True, exist_ok=True)
        options = f"size={size}" + (",ro" if read_only else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], check=True, capture_output=True)
        self.points.append(point)
        return point

    def release(self) -> None:
        for point in reversed(self.points):
            subprocess.run(["umount", "-l", str(point)], capture_output=True)
        self.points.clear()


def can_mount() -> bool:
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", scratch], capture_output=True)
        if done.returncode == 0:
            subprocess.run(["umount", scratch], capture_output=True)
            return True
    return False


LAUNCH = ["launch", "--nproc-per-node=2"]


def reference_run(strategy: str, work: Path, launcher: list[str] | None = None) -> tuple[dict, float]:
    """The uninterrupted run every trial is compared with, and how long it took.

    Under ``launch`` the reference is a ``launch`` run too: torchrun gives each worker one OpenMP thread
    (Lightning's launcher does not), and on CPU the thread count changes the order of float reductions.
    """
    name = f"reference-{strategy}" + ("-launch" if launcher else "")
    run_dir = work / name
    started = time.monotonic()
    status = run(command(run_dir, strategy, launcher=launcher), work / f"{name}.log")
    if status != 0:
        raise RuntimeError(f"the reference {strategy} run failed: {_last_error(work / f'{name}.log')}")
    return params(run_dir), time.monotonic() - started


def torture(
    strategies: list[str], faults: list[str], trials: int, seed: int, work: Path, store: Any = None
) -> dict[tuple[str, str], Cell]:
    """Run every trial; return the cells."""
    cells = {(fault, strategy): Cell() for fault in faults for strategy in strategies}
    mountable = can_mount()
    for strategy in strategies:
        needs_reference = (NEEDS_REFERENCE - {"sigterm-launcher"}) & set(faults)
        reference, duration = reference_run(strategy, work) if needs_reference else ({}, 0.0)
        launched = reference_run(strategy, work, LAUNCH)[0] if "sigterm-launcher" in faults else {}
        for fault in faults:
            cell = cells[(fault, strategy)]
            if fault in ("unwritable", "full") and not mountable:
                cell.skipped = "needs root to mount a tmpfs"
                continue
            for number in range(trials):
                trial_seed = seed * 1000 + number
                rng = random.Random(f"{fault}-{strategy}-{trial_seed}")
                folder = work / f"{fault}-{strategy}-{trial_seed}"
                folder.mkdir(parents=True)
                mounts = Mounts()
                try:
                    compared = launched if fault == "sigterm-launcher" else reference
                    problem = _one(fault, strategy, folder, rng, compared, duration, mounts, store)
                except Hang as hang:
                    problem = f"HANG: {hang}"
                finally:
                    mounts.release()
                if problem is None:
                    cell.passed += 1
                else:
                    cell.failures.append(f"seed {trial_seed}: {problem}")
                mark = "pass" if problem is None else f"FAIL ({problem})"
                print(f"{fault:<10} {strategy:<6} seed {trial_seed}: {mark}", flush=True)
    return cells


def _one(fault, strategy, folder, rng, reference, duration, mounts, store) -> str | None:  # type: ignore[no-untyped-def]
    if fault == "kill":
        return trial_kill(strategy, folder, rng, reference, duration, store)
    if fault in ("sigterm", "sigusr1"):
        return trial_signal(strategy, folder, rng, reference, signal.SIGTERM if fault == "sigterm" else signal.SIGUSR1)
    if fault == "sigterm-launcher":
        return trial_signal(strategy, folder, rng, reference, signal.SIGTERM, launcher_only=True)
    if fault == "grace":
        return trial_grace(strategy, folder, rng, reference)
    if fault == "notice":
        return trial_notice(strategy, folder, rng, reference)
    if fault == "unwritable":
        return trial_unwritable(strategy, folder, rng, mounts)
    if fault == "full":
        return trial_full(strategy, folder, rng, mounts)
    return trial_corrupt(strategy, folder, rng, reference, duration)


def table(cells: dict[tuple[str, str], Cell], strategies: list[str], faults: list[str]) -> str:
    """Markdown: pass x/N per cell, then the failing seeds."""
    lines = ["| fault | " + " | ".join(strategies) + " |", "|---|" + "---|" * len(strategies)]
    for fault in faults:
        row = []
        for strategy in strategies:
            cell = cells[(fault, strategy)]
            row.append(f"skipped ({cell.skipped})" if cell.skipped else f"{cell.passed}/{cell.trials}")
        lines.append(f"| {fault} | " + " | ".join(row) + " |")
    failures = [
        f"- {fault} / {strategy}: {line}" for (fault, strategy), cell in cells.items() for line in cell.failures
    ]
    return "\n".join(lines) + "\n\n" + ("Failures:\n" + "\n".join(failures) if failures else "No failures.") + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials per fault and strategy")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None, help="folder for the trials (default: a temporary one)")
    parser.add_argument("--no-publish", action="store_true", help="print the table; write no result file")
    parser.add_argument(
        "--store",
        choices=["local", "s3"],
        default="local",
        help="where the kill fault's runs save (the other faults: a local folder)",
    )
    options = parser.parse_args()
    strategies = options.strategies.split(",")
    faults = options.faults.split(",")
    unknown = sorted({*strategies} - set(STRATEGIES)) + sorted({*faults} - set(FAULTS))
    if unknown:
        parser.error(f"unknown: {unknown}; strategies {STRATEGIES}, faults {FAULTS}")
    with contextlib.ExitStack() as stack:
        work = options.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="torture-")))
        started = time.monotonic()
        store = None
        if options.store == "s3":
            from tests.support.s3_server import MotoServer

            store = stack.enter_context(MotoServer())  # one server for every trial, a bucket per trial
        cells = torture(strategies, faults, options.trials, options.seed, work, store)
        body = ("Store: s3 (moto on loopback)\n\n" if store is not None else "") + table(cells, strategies, faults)
        body += f"\n{options.trials} trial(s) per cell, {time.monotonic() - started:.0f} s in all.\n"
    if options.no_publish:
        print(body)
    else:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from _common import publish

        publish("torture", "cpu-1proc" if set(strategies) <= set(CELLS) else "cpu-2proc", body)
    return 0 if all(not cell.failures for cell in cells.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
