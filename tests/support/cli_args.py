"""One builder for the command lines the tests run: ``fit`` of a bundled config on CPU processes.

Example::

    run_cli(fit_args("--trainer.max_steps=3", strategy="zero2", run_dir=tmp_path / "run"), cwd=tmp_path)
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import CONFIGS

QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.logger=false"]


def strategy_args(strategy: str) -> list[str]:
    """A strategy by its overlay file in ``configs/strategies/`` where there is one, else by name."""
    overlay = CONFIGS / "strategies" / f"{strategy}.yaml"
    return ["--config", str(overlay)] if overlay.is_file() else [f"--trainer.strategy={strategy}"]


def fit_args(
    *extra: str,
    config: str = "gpt.yaml",
    strategy: str | None = None,
    devices: int = 2,
    steps: int | None = None,
    run_dir: Path | None = None,
    quiet: bool = True,
    subcommand: str = "fit",
) -> list[str]:
    """``SUBCOMMAND --config CONFIG [strategy] --trainer.accelerator=cpu --trainer.devices=N ... EXTRA``."""
    return [
        subcommand,
        "--config",
        str(CONFIGS / config),
        *(strategy_args(strategy) if strategy else []),
        "--trainer.accelerator=cpu",
        f"--trainer.devices={devices}",
        *([f"--trainer.max_steps={steps}"] if steps is not None else []),
        *([f"--run_dir={run_dir}"] if run_dir is not None else []),
        *(QUIET if quiet else []),
        *extra,
    ]
