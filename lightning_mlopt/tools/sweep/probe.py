"""Before a sweep's first trial: a two-batch ``fit`` of trial 0 that shows which metrics the model logs.

A metric name the model never logs would otherwise be found only after the first trial ran to its end (hours,
on a cluster). The probe trains two batches and validates two, with no logger, checkpoint or progress bar, in
a temporary folder, and reads the names from its ``metrics.json``: the metric must be among them. A probe that
fails (e.g. it needs a GPU this machine lacks) checks nothing, says so, and the first trial checks instead.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_mlopt.cli.commands import command_line
from lightning_mlopt.process.child import child_fit_env, run_forwarding_signals
from lightning_mlopt.tools.sweep.results import logged_metrics
from lightning_mlopt.tools.sweep.spec import Trial, trial_arguments

# Two training batches, then two validation batches at the epoch's end, whatever the config's validation
# schedule (no max_steps: reaching it ends the epoch before its validation). Two, not one: the CLI's parser
# reads `limit_*_batches=1` as the float 1.0, which Lightning takes as 100% of the batches. Nothing that writes
# outside the probe's folder (no logger: W&B would open a run) or costs time (a save).
PROBE_RUN = (
    "--trainer.max_steps=-1",
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=2",
    "--trainer.limit_val_batches=2",
    "--trainer.val_check_interval=1.0",
    "--trainer.check_val_every_n_epoch=1",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--checkpoint.resume.auto=false",
    "--checkpoint.save_on.train_end=false",
    "--checkpoint.save_on.epoch_end=false",
)


@dataclass(frozen=True)
class ProbeResult:
    """What the probe saw.

    Attributes:
        logged: the metric names the two-batch fit logged; None when it failed.
        exit_code: the probe's exit status.
        seconds: how long it took.
        signalled: the sweep got SIGTERM/SIGUSR1 while it ran (passed on to it).
        log_tail: the last lines of its output, when it failed.

    """

    logged: tuple[str, ...] | None
    exit_code: int
    seconds: float
    signalled: bool = False
    log_tail: tuple[str, ...] = ()


def probe_metrics(base_args: Sequence[str], trial: Trial) -> ProbeResult:
    """Run trial ``trial``'s config for two batches in a temporary folder; the metric names it logged.

    Example::

        result = probe_metrics(["--config", "configs/quickstart.yaml"], {"model.init_args.lr": 0.1})
        result.logged  # ('train/acc', 'train/loss', 'val/acc', 'val/loss')

    """
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lightning_mlopt-sweep-probe-") as folder:
        run_dir = Path(folder) / "run"
        command = command_line("fit", *base_args, *trial_arguments(trial), *PROBE_RUN, f"--run_dir={run_dir}")
        log_path = Path(folder) / "output.log"
        with open(log_path, "wb") as log:
            code, signalled = run_forwarding_signals(command, log, child_fit_env())
        logged = logged_metrics(run_dir) if code == 0 else None
        tail = () if logged is not None else tuple(log_path.read_text(errors="replace").splitlines()[-5:])
    return ProbeResult(tuple(logged) if logged is not None else None, code, time.monotonic() - started, signalled, tail)
