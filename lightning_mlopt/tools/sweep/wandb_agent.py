"""A sweep on the W&B server: its configuration (an agent command that runs our CLI), and one agent here."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_mlopt.cli.commands import command_line
from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.tools.sweep.results import collect_run_dirs, results_table, write_results
from lightning_mlopt.tools.sweep.spec import SweepSpec


def wandb_sweep_config(spec: SweepSpec, base_args: Sequence[str], sweep_dir: Path) -> dict[str, Any]:
    """The configuration sent to W&B: the sweep file plus an agent command that runs our CLI.

    W&B replaces ``${args}`` with ``--key=value`` per parameter; the trials' run directories go under
    ``sweep_dir``, so the results table can be built from their ``metrics.json`` afterwards.
    """
    command = command_line("fit", *base_args, f"--trainer.default_root_dir={sweep_dir}", "${args}")
    return {**spec.raw, "command": ["${env}", *command]}


def run_wandb(spec: SweepSpec, base_args: Sequence[str], sweep_dir: Path, options: argparse.Namespace) -> int:
    """Create the sweep on the W&B server and run one agent here (``--count`` trials at most)."""
    from lightning_mlopt.tracking.wandb_tracker import _api_key_configured

    if not _api_key_configured():
        raise BadInputError(
            "--mode wandb needs a W&B server and an API key (run `wandb login` or set WANDB_API_KEY); "
            "without them use --mode local"
        )
    import wandb

    sweep_id = wandb.sweep(
        wandb_sweep_config(spec, base_args, sweep_dir), project=options.project, entity=options.entity
    )
    print(f"W&B sweep {sweep_id}: more agents with `wandb agent <entity>/{options.project}/{sweep_id}`", flush=True)
    target = "/".join(part for part in (options.entity, options.project, sweep_id) if part)
    agent = [sys.executable, "-m", "wandb", "agent", *(["--count", str(options.count)] if options.count else [])]
    status = subprocess.call([*agent, target])
    results = collect_run_dirs(spec, sweep_dir)  # the trials this and other agents ran into sweep_dir
    if results:
        print(results_table(results, spec))
        print(f"Results: {write_results(results, spec, sweep_dir)}")
    return status
