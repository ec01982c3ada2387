"""Launch the GPT demo through the real CLI on 2 CPU processes and read back what the workers recorded."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.conftest import CONFIGS, failure_report, run_cli
from tests.helpers import read_records

QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.logger=false"]


def train(
    tmp_path: Path, name: str, strategy: str, steps: int, devices: int = 2, extra: tuple[str, ...] = ()
) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Fit ``steps`` steps with a strategy name or overlay file; return the per-rank records and full params."""
    out = tmp_path / name
    strategy_args = (
        ["--config", str(CONFIGS / "strategies" / f"{strategy}.yaml")]
        if (CONFIGS / "strategies" / f"{strategy}.yaml").is_file()
        else [f"--trainer.strategy={strategy}"]
    )
    result = run_cli(
        [
            "fit",
            "--config",
            str(CONFIGS / "gpt.yaml"),
            *strategy_args,
            "--trainer.accelerator=cpu",
            f"--trainer.devices={devices}",
            f"--trainer.max_steps={steps}",
            "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0",
            f"--run_dir={tmp_path / 'runs' / name}",
            *QUIET,
            "--trainer.callbacks+=tests.helpers.RecordEverything",
            f"--trainer.callbacks.out_dir={out}",
            *extra,
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, f"{name} failed (exit {result.returncode}):\n{failure_report(result)}"
    records = read_records(out)
    assert [r["rank"] for r in records] == list(range(devices))
    return records, torch.load(out / "params.pt")
