"""``python -m lightning_mlopt``: the command-line entry point.

The process is guarded before anything slow is imported (torch and Lightning take seconds, and a scheduler's
signal may come meanwhile): a ``fit`` owns its preemption signals from here on (flag-only handlers; before its
first training step a signal ends it at once, with status 75: nothing to save), and every Trainer run gets a
start-up deadline; a rank started by a launcher also ends when its launcher is gone. A native
crash of a Trainer run (a segmentation fault in an extension, an abort) prints every thread's Python stack before
the process dies, instead of an exit status alone.
"""

from __future__ import annotations

import faulthandler
import os
import sys

from lightning_mlopt.cli.commands import TOOLS, TRAINER_RUNS, run_tool
from lightning_mlopt.spelling import CLI_ENV


def run() -> None:
    """Guard the process, then import and run the CLI (``lightning-mlopt`` and ``python -m lightning_mlopt``)."""
    subcommand = sys.argv[1] if len(sys.argv) > 1 else ""
    os.environ[CLI_ENV] = "1"  # the tools' messages, like the runs', name settings by their YAML keys
    if subcommand in TOOLS:
        raise SystemExit(run_tool(subcommand, sys.argv[2:]))
    if subcommand in TRAINER_RUNS:
        faulthandler.enable(all_threads=True)  # a crash at hour 47 names its frames (stderr, every rank)
        from lightning_mlopt.process.signals import preemption
        from lightning_mlopt.process.startup import DEFAULT_STARTUP_TIMEOUT_S, startup_guard

        if subcommand == "fit":
            from lightning_mlopt.process.grace import graces_from_environment  # stdlib only

            preemption.install(graces=graces_from_environment())
            preemption.end_at_once_before_training()  # a signal in start-up: nothing to save, exit 75 now
        startup_guard.arm(DEFAULT_STARTUP_TIMEOUT_S)  # the config's startup_timeout replaces it once parsed
        if "LOCAL_RANK" in os.environ:  # started by a launcher (Lightning's, for ranks 1.., or torchrun)
            from lightning_mlopt.process.launcher import remember_launcher  # stdlib only

            remember_launcher()  # an exit that waits for it must not wait for whoever adopts an orphan
            startup_guard.watch_parent()

    from lightning_mlopt.cli.entry import main

    main()


if __name__ == "__main__":
    run()
