"""What the CLI adds around a Trainer run: its config, start-up, outputs, final metrics and model summary.

Also: a run that finished before (nothing to train), and the optimizer a config chooses for a demo model.

Example::

    callbacks = [SaveResolvedConfig(parser, config, run_dir, "config.yaml"), StartupComplete()]
    print(describe_outputs(trainer, run_dir))
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.cli import LightningArgumentParser, SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count
from typing_extensions import override

from lightning_mlopt.checkpoint.manifest import MANIFEST_NAME, Manifest
from lightning_mlopt.checkpoint.remote.object_store import store_url
from lightning_mlopt.checkpoint.remote.tiers import checkpoint_folder
from lightning_mlopt.checkpoint.settings import CHECKPOINT, configured
from lightning_mlopt.checkpoint.store import CheckpointStore
from lightning_mlopt.cli.ckpt_path import imported_class, strategy_resumes
from lightning_mlopt.demos import OPTIMIZER_DEFAULTS
from lightning_mlopt.hooks import DescribesOutputs, RunTracker, callbacks_with, loggers_with
from lightning_mlopt.process.notices import NOTICES_BY_LAUNCHER_ENV, PreemptionNotices, start_polling
from lightning_mlopt.process.signals import preemption
from lightning_mlopt.process.startup import startup_guard
from lightning_mlopt.run_dir import METRICS_NAME, keep_earlier_config


class SaveResolvedConfig(SaveConfigCallback):
    """Writes the resolved config into the run directory (not a per-version log folder), rank zero only.

    One file per run, not one per version folder: the run directory is derived from the config, so a relaunch
    writes the same content. A relaunch with other settings (an explicit ``run_dir``, ``resume.final`` with a
    larger ``max_steps``) keeps what the file said before in ``earlier_configs/``.
    """

    def __init__(self, parser: LightningArgumentParser, config: Namespace, run_dir: Path, name: str) -> None:
        super().__init__(parser, config, config_filename=name, overwrite=True, save_to_log_dir=False)
        self.run_dir = run_dir

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            super().setup(trainer, pl_module, stage)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Not at setup: a relaunch whose checkpoint does not fit the model stops there (bad input), and must leave
        # config.yaml saying what the run is, not what the mistaken launch asked for.
        super().setup(trainer, pl_module, "fit")

    @override
    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        written = self.run_dir / f".{self.config_filename}.new"
        self.parser.save(self.config, written, skip_none=False, overwrite=True, multifile=False)
        earlier = keep_earlier_config(self.run_dir / self.config_filename, written)
        if earlier is not None:
            rank_zero_info(f"{self.config_filename} holds this launch's settings now; the earlier ones: {earlier}")
        # Trackers that keep the full configuration (WandbTracker) get it once, from rank zero (this hook).
        for tracker in loggers_with(trainer, RunTracker):
            tracker.log_run_config(self.config.clone().as_dict())


class StartupComplete(Callback):
    """Disarms the start-up deadline at the first batch of any loop: from here on, step watchdogs take over.

    And at the first training batch, a preemption signal stops ending the process at once: it is saved.
    """

    @override
    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        startup_guard.disarm()
        preemption.training_started()

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
    for callback in callbacks_with(trainer, DescribesOutputs):
        lines += [f"  {line}" for line in callback.describe_outputs(trainer)]
    for logger in trainer.loggers:
        location: str | None
        if isinstance(logger, RunTracker):
            location = logger.describe_location()
        else:  # Lightning's own loggers: CSVLogger and TensorBoardLogger have a log_dir, the others a save_dir
            location = getattr(logger, "log_dir", None) or logger.save_dir
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


def write_final_metrics(trainer: Trainer, run_dir: Path) -> None:
    """Rank zero: write ``metrics.json`` (final metrics, for sweeps and scripts) and print the result."""
    metrics = {}
    for key, value in trainer.callback_metrics.items():
        try:
            metrics[key] = float(value)
        except (TypeError, ValueError, RuntimeError):
            continue  # not a scalar: no place in a table of final metrics
    # A relaunch (a requeued job, a resumed run) logs only what it ran itself: keep what the run logged
    # before, newer values winning, so a sweep ranking by val/loss still finds it.
    metrics = {**_previous_metrics(run_dir / METRICS_NAME), **metrics}
    record = {"global_step": trainer.global_step, "epoch": trainer.current_epoch, "metrics": metrics}
    (run_dir / METRICS_NAME).write_text(json.dumps(record, indent=2, sort_keys=True))
    validation = {key: value for key, value in metrics.items() if key.startswith("val")}
    if validation:
        summary = "  ".join(f"{key}={value:.4f}" for key, value in sorted(validation.items()))
        print(f"Final validation metrics: {summary}")
    print(f"Run directory: {run_dir}")


def _previous_metrics(path: Path) -> dict[str, float]:
    """The metrics an earlier launch of this run wrote; empty when there is none or it is unreadable."""
    try:
        metrics = json.loads(path.read_text()).get("metrics", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return {str(key): float(value) for key, value in metrics.items() if isinstance(value, (int, float))}


class RunFinished(Exception):
    """A ``fit`` whose run finished before (its newest checkpoint is marked final): nothing to train or log."""

    def say(self) -> None:
        """The message, as FaultTolerantCheckpoint says it (Lightning's info log, rank zero)."""
        rank_zero_info(str(self))


def finished_run(config: dict[str, Any], run_dir: Path) -> str | None:
    """Why a ``fit`` of this config would not train, before any Trainer, logger or log folder exists; or None.

    It would not when FaultTolerantCheckpoint resumes (``resume.auto``) from a checkpoint marked final, without
    ``resume.final``: the same rule it applies, read here from the newest committed manifest (verified only when
    it is final: a relaunch of an unfinished run pays nothing). A ``ckpt_path`` changes nothing unless
    ``resume.ckpt_path: always`` (else it is the warm start of a run with no checkpoint: ``warm_start.py``). Only
    with the checkpoints in one folder: a node-local tier (``tiers.local_dirpath``) may differ from node to node,
    and every rank must come to the same answer without a collective.
    """
    checkpoint = config.get("checkpoint")
    if not checkpoint or not configured(checkpoint, "resume.auto", True):
        return None
    if config.get("ckpt_path") and configured(checkpoint, "resume.ckpt_path") == "always":
        return None
    dirpath = configured(checkpoint, "dirpath")
    if configured(checkpoint, "resume.final") or configured(checkpoint, "tiers.local_dirpath") or store_url(dirpath):
        return None
    store = CheckpointStore(checkpoint_folder(dirpath, None, run_dir))
    committed = store.committed()
    if not committed:
        return None
    step, path = committed[-1]
    try:
        manifest = Manifest.from_json((path / MANIFEST_NAME).read_bytes())
    except (OSError, ValueError):
        return None
    if not manifest.final or not strategy_resumes(config.get("trainer") or {}, manifest):
        return None  # a strategy that cannot resume it is refused by FaultTolerantCheckpoint, in one line
    if not store.inspect(step, path).valid:
        return None  # FaultTolerantCheckpoint falls back to an older checkpoint, and trains on from it
    return (
        f"{path} is marked final: this run already finished at step {step}; not training again (nothing is "
        "logged, no log folder is made). To train on (e.g. with a larger max_steps), set "
        f"{CHECKPOINT.setting('resume.final', True)}."
    )


def default_optimizer_replaced(section: Namespace) -> type[LightningModule] | None:
    """The demo class whose default ``configure_optimizers`` the config's ``optimizer:`` replaces, or None.

    LightningCLI warns that a model's ``configure_optimizers`` "will be overridden" whenever ``optimizer:`` is
    set; for the demos (``demos.OPTIMIZER_DEFAULTS``), whose method is only a default, that is what the config
    asks for. A model that defines its own keeps the warning.
    """
    if section.get("optimizer") is None:
        return None
    model_class = _class_of(section.get("model"))
    if model_class is None:
        return None
    for demo in OPTIMIZER_DEFAULTS:
        if model_class.configure_optimizers is demo.configure_optimizers:  # its own, or inherited unchanged
            return model_class
    return None


def unused_model_arguments(section: Namespace, model_class: type[LightningModule]) -> str | None:
    """A line naming the demo's optimizer arguments that the config set and ``optimizer:`` makes unused."""
    init_args = (section.get("model") or Namespace()).get("init_args") or Namespace()
    defaults = inspect.signature(model_class).parameters
    unused = [
        f"model.init_args.{name}={init_args.get(name)}"
        for name in ("lr", "weight_decay", "warmup_steps")
        if name in defaults and init_args.get(name, defaults[name].default) != defaults[name].default
    ]
    if not unused:
        return None
    optimizer = section["optimizer"].get("class_path", "optimizer")
    return (
        f"Not used: {', '.join(unused)}: the config's optimizer ({optimizer}) replaces {model_class.__name__}'s "
        "default; set it under optimizer.init_args"
    )


def _class_of(value: Any) -> type[LightningModule] | None:
    class_path = value.get("class_path") if isinstance(value, (Namespace, dict)) else None
    found = imported_class(class_path)
    return found if found is not None and issubclass(found, LightningModule) else None


class MeasuredModelSummary(ModelSummary):
    """Lightning's model summary, with its FLOPs column and total only when they were measured.

    Lightning counts FLOPs by running the model's ``example_input_array`` through it; without one (most models,
    ours included: an image model does not know its image size) it prints a column of zeros and "0 Total Flops",
    which reads as a measurement. ``perf/mfu`` (PerformanceMonitor) is where this package measures FLOPs.
    """

    @staticmethod
    @override
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        columns = [column for column in summary_data if total_flops or column[0] != "FLOPs"]
        widths = [max(len(header), *(len(str(cell)) for cell in cells)) for header, cells in columns]
        rule = "-" * (sum(widths) + 3 * (len(columns) + 1))
        rows = [" | ".join(header.ljust(width) for (header, _), width in zip(columns, widths, strict=True)), rule]
        for index in range(len(columns[0][1]) if columns else 0):
            rows.append(
                " | ".join(str(cells[index]).ljust(width) for (_, cells), width in zip(columns, widths, strict=True))
            )
        totals = [
            (get_human_readable_count(trainable_parameters), "Trainable params"),
            (get_human_readable_count(total_parameters - trainable_parameters), "Non-trainable params"),
            (get_human_readable_count(total_parameters), "Total params"),
            (get_formatted_model_size(model_size), "Total estimated model params size (MB)"),
            (str(total_training_modes["train"]), "Modules in train mode"),
            (str(total_training_modes["eval"]), "Modules in eval mode"),
            *([(get_human_readable_count(total_flops), "Total Flops")] if total_flops else []),
        ]
        rows += [rule, *(f"{value:<10}{label}" for value, label in totals)]
        rank_zero_info("\n" + "\n".join(rows))


def check_fits_strategy(strategy: Any, model: LightningModule, datamodule: Any) -> None:
    """The strategy's checks of the model and of the data's batch size and sequence length, before anything runs.

    Examples: FSDP's ``wrap_classes`` naming a class the model lacks, PP's ``microbatches`` not dividing the
    batch size, ``context_parallel_size`` not dividing the data's ``block_size``. A model that builds its layers
    in ``configure_model`` is checked by the strategy at setup instead.

    Raises:
        BadInputError: a check failed; the message names the strategy's setting.

    """
    from lightning_mlopt.exceptions import BadInputError
    from lightning_mlopt.strategies.contract import contract_of

    contract = contract_of(strategy)
    batch_size = getattr(datamodule if datamodule is not None else model, "batch_size", None)
    try:
        contract.check_batch_size(batch_size if isinstance(batch_size, int) else None)
        length = getattr(datamodule, "block_size", None)  # the demos' name for the sequence length
        contract.check_sequence_length(length if isinstance(length, int) else None)
        if type(model).configure_model is LightningModule.configure_model:
            contract.check_model(model)
    except ValueError as error:
        raise BadInputError(f"trainer.strategy: {error}") from None
