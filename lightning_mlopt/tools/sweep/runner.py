"""Running the trials of a local sweep one after another, each a ``fit`` of its own, signals passed on."""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Sequence
from pathlib import Path

from lightning_mlopt.cli.commands import command_line
from lightning_mlopt.process.child import child_fit_env, run_forwarding_signals
from lightning_mlopt.tools.sweep.results import TrialResult, read_metric, trial_name
from lightning_mlopt.tools.sweep.spec import SweepSpec, Trial, describe_trial, trial_arguments


def run_local(
    base_args: Sequence[str],
    spec: SweepSpec,
    trials: Sequence[Trial],
    sweep_dir: Path,
    only: int | None = None,
) -> list[TrialResult]:
    """Run the trials one after another (or just trial ``only``); a finished trial is read, not run again.

    A trial that ends without error but without the sweep's metric ends the sweep (status ``no metric``).
    """
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
        if code == 0 and metric is None:
            break  # the other trials would log the same names: the caller says which, and the sweep stops here
    return results
