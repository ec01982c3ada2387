"""Launch the GPT demo through the real CLI on 2 CPU processes and read back what the workers recorded."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.cli_args import fit_args
from tests.conftest import failure_report, run_cli
from tests.helpers import read_records


def train(
    tmp_path: Path, name: str, strategy: str, steps: int, devices: int = 2, extra: tuple[str, ...] = ()
) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Fit ``steps`` steps with a strategy name or overlay file; return the per-rank records and full params."""
    out = tmp_path / name
    result = run_cli(
        fit_args(
            "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.callbacks+=tests.helpers.RecordEverything",
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
    records = read_records(out)
    assert [r["rank"] for r in records] == list(range(devices))
    return records, torch.load(out / "params.pt")
