"""The hooks our components offer each other, declared once: no method looked up by its name as a string.

Lightning's callbacks and loggers do not know each other. Ours meet in a few places, each declared here as a
Protocol that an implementer subclasses explicitly, so a misspelt or missing method makes the class abstract
(it cannot be built) and mypy checks the signature; the test ``tests/test_hooks.py`` finds every
implementer in the package and checks it. A user's own logger or callback that has the methods satisfies the
Protocol without subclassing it (the checks are ``isinstance`` against a ``runtime_checkable`` Protocol).

- :class:`RunTracker`: an experiment tracker that keeps the run's configuration, says where its run lives and
  is resumed by a run id (WandbTracker, MLflowTracker). The CLI and the checkpoint manifest use it.
- :class:`CheckpointUploader`: a logger that stores each committed checkpoint (W&B, MLflow artifacts).
- :class:`ResumeListener`: a logger that holds step rows until a checkpoint commits and must learn where a
  launch resumed (MLflowTracker).
- :class:`SaveVetter`: a callback with a say before every save the ranks agreed on; it may raise to keep a bad
  state out of the checkpoints (ReplicaConsistencyCheck).
- :class:`DescribesOutputs`: a callback that says where its files go, for the CLI's start-up lines.
- :class:`ConvertsModel` and :class:`CompilesModel`: callbacks that convert the model's layers (Float8Training)
  or compile its regions (CompileModel), called by our strategies at the steps where each belongs
  (:func:`convert_model` first, :func:`compile_model` after tensor parallelism and activation checkpointing).
- :class:`RunsPipeline`: a strategy that runs pipeline schedules (PipelineParallelStrategy): its bubble, measured
  and in theory, which PerformanceMonitor reports (:func:`pipeline_of`).
- :func:`checkpoint_events`: one :class:`CheckpointEvents` per Trainer, published by the checkpointing
  callback (FaultTolerantCheckpoint) and read by its neighbours (the goodput ledger, ReplicaConsistencyCheck,
  GradNormMonitor) instead of scanning ``trainer.callbacks`` for a class; obtained the way
  ``step_exchange(trainer)`` is.

The dispatchers :func:`vet_save`, :func:`tell_resumed` and :func:`hand_over_committed` call every holder of a
hook; the checkpoint callback calls them. :func:`convert_model` and :func:`compile_model` are called by the
strategies.

Example::

    for logger in loggers_with(trainer, CheckpointUploader):
        logger.log_checkpoint_artifact(path, manifest)

    events = checkpoint_events(trainer)
    if events.store is not None:  # a checkpointing callback is in this run
        events.store.add_commit_listener(on_commit)
"""

from __future__ import annotations

import weakref
from abc import abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_mlopt.checkpoint.manifest import Manifest
    from lightning_mlopt.checkpoint.store import CheckpointStore

__all__ = [
    "CheckpointEvents",
    "CheckpointUploader",
    "CompilesModel",
    "ConvertsModel",
    "DescribesHang",
    "DescribesOutputs",
    "ResumeListener",
    "RunTracker",
    "SaveVetter",
    "callbacks_with",
    "checkpoint_events",
    "compile_model",
    "convert_model",
    "describe_hang",
    "hand_over_committed",
    "loggers_with",
    "tell_resumed",
    "vet_save",
]

Hook = TypeVar("Hook")


@runtime_checkable
class RunTracker(Protocol):
    """An experiment tracker of ours: the run's configuration, where it lives, and the id it resumes by."""

    @abstractmethod
    def tracker_run_id(self) -> tuple[str, str] | None:
        """The tracker's name and its id of this run, for a manifest's ``run_ids``; None before the run exists.

        A relaunch reads it back to log into the same run. Names: ``wandb``, ``mlflow``.
        """

    @abstractmethod
    def log_run_config(self, config: dict[str, Any]) -> None:
        """Keep the run's full resolved configuration (rank zero, once per launch)."""

    @abstractmethod
    def describe_location(self) -> str:
        """Where the run can be found (a URL, a folder), for the start-up lines."""


@runtime_checkable
class CheckpointUploader(Protocol):
    """A logger that stores each checkpoint the run commits (an artifact)."""

    @abstractmethod
    def log_checkpoint_artifact(self, path: Path, manifest: Manifest) -> None:
        """Rank zero, main thread: the checkpoint folder ``path`` committed, described by ``manifest``."""


@runtime_checkable
class ResumeListener(Protocol):
    """A logger that must learn where a launch starts: rows past a resumed checkpoint are to be replaced."""

    @abstractmethod
    def checkpoints_resumed(self, step: int, path: Path | None) -> None:
        """Rank zero, at the start of training: this launch starts at ``step``, from ``path`` (None: fresh)."""


@runtime_checkable
class SaveVetter(Protocol):
    """A callback with a say right before every save the ranks agreed on."""

    @abstractmethod
    def before_checkpoint(self, trainer: pl.Trainer) -> None:
        """Every rank, at the same step: raise to keep the current state out of the checkpoints."""


@runtime_checkable
class DescribesHang(Protocol):
    """A callback that can say, in one line, why the ranks stopped moving (the hang watchdog's first line)."""

    @abstractmethod
    def hang_report(self, trainer: pl.Trainer) -> str | None:
        """From the watchdog's thread while training is stuck; None when it has nothing to say."""


def describe_hang(trainer: pl.Trainer) -> str | None:
    """The first line any :class:`DescribesHang` callback gives, or None."""
    for describer in callbacks_with(trainer, DescribesHang):
        line = describer.hang_report(trainer)
        if line:
            return line
    return None


@runtime_checkable
class DescribesOutputs(Protocol):
    """A callback that writes files of its own and says where, in the CLI's start-up lines."""

    @abstractmethod
    def describe_outputs(self, trainer: pl.Trainer) -> list[str]:
        """Lines ``<what>  <where> (<detail>)``, one per kind of output; before setup, on every rank."""


@runtime_checkable
class ConvertsModel(Protocol):
    """A callback that swaps the model's layers for other implementations (float8 linears), before anything else.

    Our strategies call :func:`convert_model` first of their steps (torchtitan's order: float8 conversion, tensor
    parallelism, activation checkpointing, compile, FSDP); a strategy that never calls it leaves the callback to
    convert at the start of fit, or to refuse that strategy.
    """

    @abstractmethod
    def convert_model(self, trainer: pl.Trainer, module: Any) -> None:
        """Every rank, once per fit, with the LightningModule (an ``nn.Module``) before any parallelism."""


def convert_model(trainer: pl.Trainer, module: Any) -> None:
    """Every :class:`ConvertsModel` callback converts its layers of ``module`` (called by the strategies)."""
    for converter in callbacks_with(trainer, ConvertsModel):
        converter.convert_model(trainer, module)


@runtime_checkable
class CompilesModel(Protocol):
    """A callback that compiles regions of the model, when the strategy says the model is ready for it.

    Our strategies call :func:`compile_model` after tensor parallelism and activation checkpointing and before
    FSDP shards or DDP wraps the model (torchtitan's order); a strategy that never calls it (Lightning's own,
    DeepSpeed) leaves the callback to compile at the start of fit.
    """

    @abstractmethod
    def compile_model(self, trainer: pl.Trainer, module: Any) -> None:
        """Every rank, once per fit, with the LightningModule (an ``nn.Module``) about to be wrapped."""


def compile_model(trainer: pl.Trainer, module: Any) -> None:
    """Every :class:`CompilesModel` callback compiles its regions of ``module`` (called by the strategies)."""
    for compiler in callbacks_with(trainer, CompilesModel):
        compiler.compile_model(trainer, module)


@runtime_checkable
class RunsPipeline(Protocol):
    """A strategy that runs pipeline schedules: its bubble, measured and in theory (PerformanceMonitor reads it)."""

    @property
    @abstractmethod
    def bubble_clock(self) -> Any:
        """The clock of this rank's stages: ``take()`` gives (seconds idle, seconds in steps) since last asked."""

    @property
    @abstractmethod
    def theoretical_bubble(self) -> float:
        """The idle share of a step the schedule has with equal stages and free communication."""

    @abstractmethod
    def bubble_advice(self, measured: float, worst_rank: int) -> str:
        """One line for a bubble over 20%: what was measured, the theory, and what to change."""


def pipeline_of(strategy: Any) -> RunsPipeline | None:
    """The strategy as a :class:`RunsPipeline` once its schedule is built, else None."""
    if isinstance(strategy, RunsPipeline) and strategy.bubble_clock is not None:
        return strategy
    return None


@dataclass
class CheckpointEvents:
    """What the run's checkpointing callback tells its neighbours (one per Trainer: :func:`checkpoint_events`).

    Attributes:
        store: where the run's checkpoints commit (``store.add_commit_listener`` to hear each commit); None
            while no checkpointing callback has set up (or none is in the run).
        resumed_from: the checkpoint this launch resumed from (None: a fresh start, or an explicit ckpt_path).

    """

    store: CheckpointStore | None = None
    resumed_from: Path | None = None


_EVENTS: weakref.WeakKeyDictionary[Any, CheckpointEvents] = weakref.WeakKeyDictionary()


def checkpoint_events(trainer: pl.Trainer) -> CheckpointEvents:
    """The trainer's checkpoint events (one per Trainer, shared by its callbacks)."""
    events = _EVENTS.get(trainer)
    if events is None:
        events = _EVENTS[trainer] = CheckpointEvents()
    return events


def loggers_with(trainer: pl.Trainer, hook: type[Hook]) -> list[Hook]:
    """The trainer's loggers that offer ``hook`` (one of the Protocols above)."""
    return [logger for logger in trainer.loggers if isinstance(logger, hook)]


def callbacks_with(trainer: pl.Trainer, hook: type[Hook]) -> list[Hook]:
    """The trainer's callbacks that offer ``hook`` (one of the Protocols above), in the trainer's order."""
    return [callback for callback in trainer.callbacks if isinstance(callback, hook)]  # type: ignore[attr-defined]


def vet_save(trainer: pl.Trainer) -> None:
    """Every rank, right before a save the ranks agreed on: each :class:`SaveVetter` may raise to prevent it."""
    for vetter in callbacks_with(trainer, SaveVetter):
        vetter.before_checkpoint(trainer)


def tell_resumed(trainer: pl.Trainer, path: Path | None) -> None:
    """Rank zero: each :class:`ResumeListener` learns where this launch starts (a checkpoint folder, or None)."""
    if not trainer.is_global_zero:
        return
    folder = path.parent if path is not None and path.is_file() else path
    for logger in loggers_with(trainer, ResumeListener):
        logger.checkpoints_resumed(trainer.global_step, folder)


def hand_over_committed(trainer: pl.Trainer, committed: Iterable[tuple[Path, Manifest]]) -> None:
    """Rank zero, main thread: each newly committed checkpoint goes to every :class:`CheckpointUploader`."""
    for path, manifest in committed:
        for logger in loggers_with(trainer, CheckpointUploader):
            logger.log_checkpoint_artifact(path, manifest)
