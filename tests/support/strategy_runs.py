"""Launch the GPT demo through the real CLI on 2 CPU processes and read back what the workers recorded."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from tests.conftest import failure_report, run_cli
from tests.support.cli_args import fit_args
from tests.support.helpers import read_records


class TrainedRun(NamedTuple):
    """What a run recorded: one dict per rank, the full parameters at the end, and its run directory."""

    records: list[dict]
    params: dict[str, torch.Tensor]
    run_dir: Path


def train(
    tmp_path: Path, name: str, strategy: str, steps: int, devices: int = 2, extra: tuple[str, ...] = ()
) -> TrainedRun:
    """Fit ``steps`` steps with a strategy name or overlay file under ``tmp_path/runs/name``.

    What it printed is kept in ``tmp_path/name/output.txt``.

    Example::

        records, params, run_dir = train(tmp_path, "first", "fsdp", steps=3)
    """
    out = tmp_path / name
    result = run_cli(
        fit_args(
            "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.callbacks+=tests.support.helpers.RecordEverything",
            f"--trainer.callbacks.out_dir={out}",
            *extra,
            strategy=strategy,
            devices=devices,
            steps=steps,
            run_dir=tmp_path / "runs" / name,
        ),
        cwd=tmp_path,
    )
    assert result.returncode == 0, f"{name} failed (exit {result.returncode}):\n{failure_report(result)}"
    (out / "output.txt").write_text(result.stdout + result.stderr)  # what the run printed, for tests to read
    return trained_run(tmp_path, name, devices)


def trained_run(tmp_path: Path, name: str, devices: int = 2) -> TrainedRun:
    """What :func:`train` returns, read back from ``tmp_path`` (a run another test worker trained)."""
    out = tmp_path / name
    records = read_records(out)
    assert [r["rank"] for r in records] == list(range(devices))
    return TrainedRun(records, torch.load(out / "params.pt"), tmp_path / "runs" / name)
