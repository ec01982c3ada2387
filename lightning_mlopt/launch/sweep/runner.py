"""Running the trials of a local sweep one after another, each a ``fit`` of its own, signals passed on."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from lightning_mlopt.commands import command_line
from lightning_mlopt.launch.sweep.results import TrialResult, read_metric, trial_name
from lightning_mlopt.launch.sweep.spec import SweepSpec, Trial, describe_trial, trial_arguments


def run_local(
    base_args: Sequence[str],
    spec: SweepSpec,
    trials: Sequence[Trial],
    sweep_dir: Path,
    only: int | None = None,
) -> list[TrialResult]:
    """Run the trials one after another (or just trial ``only``); a finished trial is read, not run again."""
    results: list[TrialResult] = []
    durations: list[float] = []
    env = child_fit_env(WANDB_RUN_GROUP=sweep_dir.name)  # a WandbTracker groups the trials in W&B
    for number, trial in enumerate(trials):
        if only is not None and number != only:
            continue
        name = trial_name(number)
        folder = sweep_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "params.json").write_text(json.dumps(trial, indent=2, sort_keys=True))
        metric = read_metric(folder, spec.metric)
        if metric is not None:
            results.append(TrialResult(name, trial, metric, "done earlier", 0.0, 0))
            print(f"[{number + 1}/{len(trials)}] {name}: done earlier, {spec.metric}={metric:.4g}", flush=True)
            continue
        command = command_line("fit", *base_args, *trial_arguments(trial), f"--run_dir={folder}")
        started = time.monotonic()
        with open(folder / "output.log", "ab") as log:
            code, signalled = run_forwarding_signals(command, log, env)
        seconds = time.monotonic() - started
        durations.append(seconds)
        metric = read_metric(folder, spec.metric)
        status = "ok" if code == 0 and metric is not None else f"failed (exit {code})" if code else "no metric"
        results.append(TrialResult(name, trial, metric, status, seconds, code))
        left = (len(trials) - number - 1) if only is None else 0
        eta = datetime.timedelta(seconds=round(left * sum(durations) / len(durations)))
        shown = f"{spec.metric}={metric:.4g}" if metric is not None else status
        print(
            f"[{number + 1}/{len(trials)}] {name} ({describe_trial(trial)}): {shown} in {seconds:.0f}s, eta {eta}",
            flush=True,
        )
        if signalled:
            print(f"Stopped after {name}: the sweep was signalled (the trial saved and can resume)", flush=True)
            break
    return results


def child_fit_env(**extra: str) -> dict[str, str]:
    """The environment of a ``fit`` this process starts (a sweep's trial, a ``profile`` measurement).

    Outside SLURM, ``MASTER_PORT`` is dropped so that each child's ranks pick a free port (a port left set
    by an earlier run, or by our own parent, would be taken); under ``srun`` SLURM's rules hold and it stays.

    Example::

        subprocess.run(command_line("fit", "--config", "c.yaml"), env=child_fit_env(WANDB_RUN_GROUP="s1"))
    """
    env = {**os.environ, **extra}
    if "SLURM_NTASKS" not in env:
        env.pop("MASTER_PORT", None)
    return env


_FORWARDED = (signal.SIGTERM, signal.SIGUSR1)


def run_forwarding_signals(command: Sequence[str], log: IO[bytes], env: dict[str, str]) -> tuple[int, bool]:
    """Run a trial, forwarding SIGTERM/SIGUSR1 sent to the sweep (preemption, a SLURM time limit) to it.

    The trial's FaultTolerantCheckpoint saves and exits 75, instead of the signal killing the sweep and
    orphaning the trial. Returns the trial's exit status and whether a signal came.
    """
    child = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, env=env)
    received: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        if child.poll() is None:
            child.send_signal(signum)

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {number: signal.signal(number, forward) for number in _FORWARDED} if in_main_thread else {}
    try:
        return child.wait(), bool(received)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
