"""What the CLI adds around a Trainer run: its resolved config, the end of start-up, where its outputs go.

Example::

    callbacks = [SaveResolvedConfig(parser, config, run_dir, "config.yaml"), StartupComplete()]
    print(describe_outputs(trainer, run_dir))
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, SaveConfigCallback
from typing_extensions import override

from lightning_mlopt.callbacks import FaultTolerantCheckpoint, NCCLHealthCheck, PerformanceMonitor
from lightning_mlopt.process.notices import NOTICES_BY_LAUNCHER_ENV, PreemptionNotices, start_polling
from lightning_mlopt.process.signals import preemption
from lightning_mlopt.process.startup import startup_guard
from lightning_mlopt.run_dir import METRICS_NAME


class SaveResolvedConfig(SaveConfigCallback):
    """Writes the resolved config into the run directory (not a per-version log folder), rank zero only.

    Overwriting is deliberate: the run directory is derived from the config, so a relaunch writes the same
    content, and a fresh version folder per relaunch would scatter one run across many.
    """

    def __init__(self, parser: LightningArgumentParser, config: Namespace, run_dir: Path, name: str) -> None:
        super().__init__(parser, config, config_filename=name, overwrite=True, save_to_log_dir=False)
        self.run_dir = run_dir

    @override
    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.parser.save(self.config, self.run_dir / self.config_filename, skip_none=False, overwrite=True)
        # Trackers that keep the full configuration (WandbTracker) get it once, from rank zero (this hook).
        for logger in trainer.loggers:
            log_run_config = getattr(logger, "log_run_config", None)
            if log_run_config is not None:
                log_run_config(self.config.clone().as_dict())


class StartupComplete(Callback):
    """Disarms the start-up deadline at the first batch of any loop: from here on, step watchdogs take over."""

    @override
    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        startup_guard.disarm()

    @override
    def on_validation_batch_start(self, *args: Any, **kwargs: Any) -> None:
        startup_guard.disarm()

    @override
    def on_test_batch_start(self, *args: Any, **kwargs: Any) -> None:
        startup_guard.disarm()

    @override
    def on_predict_batch_start(self, *args: Any, **kwargs: Any) -> None:
        startup_guard.disarm()


def describe_outputs(trainer: Trainer, run_dir: Path | None) -> str:
    """A few lines saying where a run's config, checkpoints, logs and hang dumps go."""
    lines = [f"Run directory: {run_dir}", f"  config       {Path(str(run_dir)) / 'config.yaml'}"]
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, FaultTolerantCheckpoint):
            resume = "resumes from the newest valid one" if callback.auto_resume else "auto_resume off"
            lines.append(f"  checkpoints  {callback.checkpoint_dir(trainer)} ({resume})")
        if isinstance(callback, NCCLHealthCheck):
            lines.append(f"  hang dumps   {callback.dump_folder(trainer)}")
        if isinstance(callback, PerformanceMonitor):
            traces = f", traces of steps {callback.profile_steps}" if callback.profile_steps else ""
            lines.append(f"  performance  {callback.folder(trainer)} (summary.json at the end{traces}; perf/* logged)")
    for logger in trainer.loggers:
        describe = getattr(logger, "describe_location", None)
        location = describe() if describe else getattr(logger, "log_dir", None) or logger.save_dir
        lines.append(f"  logs         {type(logger).__name__}: {location}")
    lines.append(f"  results      {Path(str(run_dir)) / METRICS_NAME} (at the end)")
    return "\n".join(lines)


def poll_preemption_notices(trainer: Trainer, settings: Namespace | None) -> None:
    """Poll the cloud's preemption notices once per node (local rank zero), unless ``launch`` polls for the node.

    A notice raises the same flag as a SIGTERM (every rank acts on it at the next step boundary).
    """
    if settings is None or os.environ.get(NOTICES_BY_LAUNCHER_ENV) or trainer.local_rank != 0:
        return
    start_polling(PreemptionNotices(**settings.as_dict()), preemption.notify)
