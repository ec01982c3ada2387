"""FaultTolerantCheckpoint: crash-safe, optionally asynchronous, auto-resuming checkpoints for every strategy."""

from __future__ import annotations

import copy
import logging
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_mlopt.checkpoint import (
    STATE_NAME,
    AsyncWriter,
    CheckpointStore,
    Manifest,
    RetentionPolicy,
)
from lightning_mlopt.checkpoint.manifest import MANIFEST_NAME, describe_files, library_versions
from lightning_mlopt.checkpoint.resume import skip_first_batches
from lightning_mlopt.checkpoint.rng import capture_rng_state, restore_rng_state
from lightning_mlopt.distributed.phase import phase

log = logging.getLogger(__name__)
_RNG_DIR = "rng"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; earlier checkpoints are intact."""


class FaultTolerantCheckpoint(Checkpoint):
    """Checkpoints that survive a kill at any instant, resume by themselves, and resume exactly.

    Every save follows one commit protocol, for single-file and sharded strategies alike: the strategy
    writes the state into a staging folder; every rank confirms; rank zero writes a manifest (step, epoch,
    world size, strategy, every file's size and SHA-256, versions, time), renames the folder to
    ``step-NNNNNNNNN`` and only then moves ``latest``. Resume picks the newest checkpoint whose manifest and
    checksums verify, before unpickling anything, and falls back to the previous one with a warning.

    Triggers: every N optimizer steps, every T minutes (decided collectively, so all ranks save at the same
    step), end of epoch, end of training (marked final: a relaunch does not train again), an exception
    (single-file strategies; see below), and preemption signals: the handler only sets a flag, the save
    happens at the next step boundary on all ranks, then the process exits with ``exit_code``.

    Exact resume: besides what Lightning saves (model, optimizer, scheduler, scaler, loops, callbacks), each
    rank's Python, NumPy, torch and CUDA RNG states are saved and restored, and a mid-epoch resume skips the
    batches the epoch already consumed (at the sampler, without loading them). With a seeded sampler (the
    DistributedSampler of every multi-process run) the resumed run is bitwise identical on CPU.

    Args:
        dirpath: where checkpoints go. None: ``<trainer.default_root_dir>/checkpoints`` (the CLI's run dir).
        every_n_steps: save every N optimizer steps; None: never by step count.
        every_n_minutes: save when T minutes passed since the last save; None: never by time.
        save_on_epoch_end: save at the end of every training epoch.
        save_on_train_end: save at the end of training, marked final.
        save_on_exception: save when training raises. Single-file strategies (DDP, one device) only: a
            sharded save needs every rank, and a rank that raised cannot bring the others along.
        signals: signal names that request a save and a non-zero exit (preemption).
        exit_code: exit status after a signal-triggered save; 75 is EX_TEMPFAIL ("try again"), so a
            scheduler sees the job did not finish.
        keep_last: keep the newest K checkpoints (>= 1).
        keep_every_n_steps: also keep forever the checkpoints whose step is a multiple of M.
        monitor: a logged metric; the best ``keep_best`` checkpoints by it are kept too.
        mode: ``min`` or ``max``: which values of ``monitor`` are best.
        keep_best: how many best checkpoints to keep when ``monitor`` is set.
        async_save: stage the state in CPU memory and write it from a background thread (single-file
            strategies; sharded strategies write synchronously). At most one save is in flight.
        auto_resume: on ``fit`` without ``ckpt_path``, resume from the newest valid checkpoint in ``dirpath``.
            An explicit ``ckpt_path`` wins.

    Raises:
        ValueError: a bad value, e.g. ``every_n_steps: 0`` or an unknown signal name.

    Example::

        trainer = Trainer(callbacks=[FaultTolerantCheckpoint(every_n_steps=500, every_n_minutes=30)])
        trainer.fit(model)  # relaunching the same script resumes from the newest valid checkpoint

    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_steps: int | None = None,
        every_n_minutes: float | None = None,
        save_on_epoch_end: bool = True,
        save_on_train_end: bool = True,
        save_on_exception: bool = True,
        signals: list[str] | None = None,
        exit_code: int = 75,
        keep_last: int = 3,
        keep_every_n_steps: int | None = None,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        keep_best: int = 1,
        async_save: bool = True,
        auto_resume: bool = True,
    ) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if every_n_minutes is not None and every_n_minutes <= 0:
            raise ValueError(f"every_n_minutes must be > 0, got {every_n_minutes}")
        if not 1 <= exit_code <= 255:
            raise ValueError(f"exit_code must be in 1..255 (non-zero, so a scheduler sees it), got {exit_code}")
        signal_names = ["SIGTERM", "SIGUSR1"] if signals is None else list(signals)
        unknown = [name for name in signal_names if not hasattr(signal, name)]
        if unknown:
            raise ValueError(f"signals: unknown signal name(s) {unknown}; e.g. SIGTERM, SIGUSR1, SIGUSR2")
        self.retention = RetentionPolicy(keep_last, keep_every_n_steps, keep_best if monitor else 0, mode)
        self.dirpath = dirpath
        self.every_n_steps = every_n_steps
        self.every_n_minutes = every_n_minutes
        self.save_on_epoch_end = save_on_epoch_end
        self.save_on_train_end = save_on_train_end
        self.save_on_exception = save_on_exception
        self.signals = signal_names
        self.exit_code = exit_code
        self.monitor = monitor
        self.async_save = async_save
        self.auto_resume = auto_resume
        self.store: CheckpointStore | None = None
        self.resumed_from: Path | None = None
        self.last_saved: Path | None = None
        self._writer = AsyncWriter()
        self._signal_received: int | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._last_save_step = -1
        self._last_save_time = time.monotonic()
        self._resume_final = False
        self._exiting = False
        self._pending_rng: dict[str, Any] | None = None
        self._training_started = False
        self._committed: list[tuple[Path, Manifest]] = []

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=self.dirpath, every_n_steps=self.every_n_steps)

    def checkpoint_dir(self, trainer: pl.Trainer) -> Path:
        """Where checkpoints go: ``dirpath``, or ``<trainer.default_root_dir>/checkpoints``."""
        return Path(self.dirpath or os.path.join(trainer.default_root_dir, "checkpoints"))

    # ------------------------------------------------------------------ lifecycle

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # Every rank must write to and resume from the same place: rank zero's path decides.
        self.store = CheckpointStore(Path(trainer.strategy.broadcast(str(self.checkpoint_dir(trainer)))))
        self._install_signal_handlers()
        resume = self._choose_resume_checkpoint(trainer) if self.auto_resume else None
        self.resumed_from, self._resume_final = trainer.strategy.broadcast(resume or (None, False))
        if self.resumed_from is not None and not trainer.strategy.restore_checkpoint_after_setup:
            self._preload(trainer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Sharded strategies (FSDP, DeepSpeed) can only load once the model is wrapped, after setup.
        if self.resumed_from is not None and trainer.strategy.restore_checkpoint_after_setup:
            self._preload(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._training_started = True
        self._last_save_time = time.monotonic()
        self._last_save_step = trainer.global_step
        if self.resumed_from is None or not self._resumed_from_ours(trainer):
            return
        if self._resume_final:
            trainer.should_stop = True  # even if max_steps was raised since: a finished run stays finished
            return
        rng_state = self._load_rng(trainer)
        # `processed`, not `completed`: a save inside on_train_batch_end precedes that batch's completion,
        # which Lightning itself counts again on restart.
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]
        fetcher = trainer.fit_loop._data_fetcher  # Lightning created this epoch's iterator before this hook
        if 0 < done < trainer.num_training_batches:
            combined = trainer.fit_loop._combined_loader
            skip_first_batches(combined.flattened if combined is not None else [], done)
            rank_zero_info(f"Resuming mid-epoch: skipping the {done} batches epoch {trainer.current_epoch} used")
            if fetcher is not None:
                iter(fetcher)  # a new iterator that starts after the skipped batches
            # The uninterrupted run created this epoch's iterator (which draws a seed from the global RNG)
            # before it saved; here it was just created again. Restoring the RNG right before the next step
            # puts both runs in the same state for it.
            self._pending_rng = rng_state
        elif rng_state is not None:
            # Saved at the end of an epoch: the uninterrupted run created the next epoch's iterator after the
            # save, from the saved RNG state. Do the same: restore, then create it again.
            restore_rng_state(rng_state)
            if fetcher is not None:
                iter(fetcher)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._pending_rng is not None:
            restore_rng_state(self._pending_rng)
            self._pending_rng = None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        try:
            self._writer.close()
        finally:
            self._restore_signal_handlers()

    # ------------------------------------------------------------------ triggers

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._tell_loggers(trainer)
        step = trainer.global_step
        if step == self._last_save_step:  # gradient accumulation: no optimizer step happened
            return
        due_by_steps = self.every_n_steps is not None and step % self.every_n_steps == 0
        # The end of an epoch is saved here, at its last batch, not in on_train_epoch_end: Lightning restores
        # a save made inside on_train_batch_end exactly (it knows that batch finished), while one made inside
        # on_train_epoch_end restarts the next epoch short.
        epoch_ends = self.save_on_epoch_end and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        signalled, due_by_time = self._agree_on_signal_and_time(trainer)
        if signalled:
            self._save(trainer, reason="signal", wait=True)
            self._tell_loggers(trainer)
            rank_zero_warn(f"Preemption signal: saved step {step}; exiting with status {self.exit_code}.")
            self._exiting = True
            raise SystemExit(self.exit_code)
        if due_by_steps or due_by_time or epoch_ends:
            reason = "every_n_steps" if due_by_steps else "every_n_minutes" if due_by_time else "epoch_end"
            self._save(trainer, reason=reason)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_on_train_end and not self._resume_final:
            self._save(trainer, reason="final", final=True, wait=True)
        self._writer.wait()
        self._tell_loggers(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._exiting or isinstance(exception, (CheckpointWriteError, KeyboardInterrupt)):
            return
        if not self.save_on_exception or self.store is None:
            return
        if not self._training_started or not _is_single_file(trainer.strategy):
            return  # an error while setting up or resuming leaves nothing new worth saving
        if trainer.global_step == self._last_save_step:
            return
        # Only this rank is known to be here, so no collective may run: write the full state from this rank.
        try:
            self._writer.wait()
            staging = self.store.stage(trainer.global_step)
            torch.save(trainer._checkpoint_connector.dump_checkpoint(), staging / STATE_NAME)
            self._write_rng(staging, trainer.global_rank)
            self._commit(trainer, staging, reason="exception", final=False, world_size=trainer.world_size)
            log.warning("Saved a checkpoint at step %d after an exception: %r", trainer.global_step, exception)
        except Exception as error:
            log.error("Could not save a checkpoint after the exception: %s", error)

    # ------------------------------------------------------------------ state

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_saved": str(self.last_saved) if self.last_saved else None}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        last = state_dict.get("last_saved")
        self.last_saved = Path(last) if last else None

    # ------------------------------------------------------------------ saving

    def _agree_on_signal_and_time(self, trainer: pl.Trainer) -> tuple[bool, bool]:
        """One small all-reduce: did any rank get a signal, has any rank's timer run out? All ranks reach it."""
        if not self.signals and self.every_n_minutes is None:
            return False, False
        local = torch.tensor(
            [
                float(self._signal_received is not None),
                float(
                    self.every_n_minutes is not None
                    and time.monotonic() - self._last_save_time >= 60.0 * self.every_n_minutes
                ),
            ],
            device=trainer.strategy.root_device,
        )
        total = trainer.strategy.reduce(local, reduce_op="sum")
        signalled, due = (bool(value > 0) for value in total.tolist())
        return signalled, due

    def _save(self, trainer: pl.Trainer, reason: str, final: bool = False, wait: bool = False) -> None:
        """Save on every rank (collective), following the commit protocol."""
        with phase("checkpoint"):  # what a hang watchdog reports if the save never returns
            self._save_in_phase(trainer, reason, final, wait)

    def _save_in_phase(self, trainer: pl.Trainer, reason: str, final: bool, wait: bool) -> None:
        assert self.store is not None
        step = trainer.global_step
        self._wait_for_writer()
        staging = self.store.staging_path(step)
        ok = True
        try:
            if trainer.is_global_zero:
                self.store.stage(step)
            trainer.strategy.barrier("FaultTolerantCheckpoint.stage")
            self._write_rng(staging, trainer.global_rank)
        except OSError as error:
            ok = False
            log.error("rank %d could not write into %s: %s", trainer.global_rank, staging, error)
        # Every rank confirms before anything is committed (all ranks reach this collective).
        if not trainer.strategy.reduce_boolean_decision(ok, all=True):
            if trainer.is_global_zero:
                self.store.discard(staging)
            raise CheckpointWriteError(
                f"could not write a checkpoint into {self.store.root} (see the log for the rank and the reason); "
                "earlier checkpoints are intact. Check that the folder is writable and the disk has space."
            )
        world_size = trainer.world_size
        if self.async_save and _is_single_file(trainer.strategy):
            self._save_async(trainer, staging, reason, final, world_size)
            if wait:
                self._wait_for_writer()
        else:
            self._save_sync(trainer, staging, reason, final, world_size)
        self._last_save_step = step
        self._last_save_time = time.monotonic()

    def _save_sync(self, trainer: pl.Trainer, staging: Path, reason: str, final: bool, world_size: int) -> None:
        ok = True
        try:
            trainer.save_checkpoint(staging / STATE_NAME)  # the strategy decides the layout; all ranks call
        except OSError as error:
            ok = False
            log.error("rank %d failed to write its part of the checkpoint: %s", trainer.global_rank, error)
        if not trainer.strategy.reduce_boolean_decision(ok, all=True):
            if trainer.is_global_zero:
                assert self.store is not None
                self.store.discard(staging)
            raise CheckpointWriteError(
                f"writing the checkpoint for step {trainer.global_step} failed; earlier checkpoints are intact"
            )
        if trainer.is_global_zero:
            self._commit(trainer, staging, reason, final, world_size)
        trainer.strategy.barrier("FaultTolerantCheckpoint.commit")

    def _save_async(self, trainer: pl.Trainer, staging: Path, reason: str, final: bool, world_size: int) -> None:
        # Single-file strategies hold the full state on every rank; rank zero writes it.
        checkpoint = trainer._checkpoint_connector.dump_checkpoint()
        if not trainer.is_global_zero:
            return
        staged = _to_cpu_copy(checkpoint)  # training may now change the live tensors
        manifest = self._describe(trainer, reason, final, world_size)

        def write() -> None:
            torch.save(staged, staging / STATE_NAME)
            self._commit_prepared(staging, manifest)

        self._writer.submit(write)

    def _wait_for_writer(self) -> None:
        try:
            self._writer.wait()
        except Exception as error:
            raise CheckpointWriteError(
                f"the background checkpoint write failed: {error}. Earlier checkpoints are intact."
            ) from error

    def _commit(self, trainer: pl.Trainer, staging: Path, reason: str, final: bool, world_size: int) -> None:
        self._commit_prepared(staging, self._describe(trainer, reason, final, world_size))

    def _describe(self, trainer: pl.Trainer, reason: str, final: bool, world_size: int) -> Manifest:
        """The manifest of a save, taken when it starts (the files are added at commit)."""
        return Manifest(
            step=trainer.global_step,
            epoch=trainer.current_epoch,
            world_size=world_size,
            strategy=type(trainer.strategy).__name__,
            reason=reason,
            final=final,
            metric=self._metric(trainer),
            run_ids=_tracker_run_ids(trainer),
        )

    def _commit_prepared(self, staging: Path, manifest: Manifest) -> None:
        """Rank zero (or the background writer): manifest, rename into place, ``latest``, retention."""
        assert self.store is not None
        manifest.files = describe_files(staging)
        manifest.versions = library_versions()
        manifest.created = time.time()
        self.last_saved = self.store.commit(staging, manifest)
        self._apply_retention(protected=manifest.step)
        self._committed.append((self.last_saved, manifest))  # loggers hear of it on the main thread

    def _tell_loggers(self, trainer: pl.Trainer) -> None:
        """Rank zero, main thread: hand each newly committed checkpoint to loggers that upload them."""
        while self._committed:
            path, manifest = self._committed.pop(0)
            for logger in trainer.loggers:
                upload = getattr(logger, "log_checkpoint_artifact", None)
                if upload is not None:
                    upload(path, manifest)

    def _apply_retention(self, protected: int) -> None:
        assert self.store is not None
        scored: list[tuple[int, float | None]] = []
        paths = {}
        for step, path in self.store.committed():
            try:
                manifest = Manifest.from_json((path / MANIFEST_NAME).read_text())
            except (OSError, ValueError, Exception):
                continue
            metric = manifest.metric
            scored.append((step, None if metric is None else metric.get("value")))
            paths[step] = path
        for step in self.retention.to_delete(scored, protected=[protected]):
            import shutil

            shutil.rmtree(paths[step], ignore_errors=True)

    def _metric(self, trainer: pl.Trainer) -> dict[str, float] | None:
        if self.monitor is None or self.monitor not in trainer.callback_metrics:
            return None
        return {"name": self.monitor, "value": float(trainer.callback_metrics[self.monitor])}  # type: ignore[dict-item]

    @staticmethod
    def _write_rng(staging: Path, rank: int) -> None:
        folder = staging / _RNG_DIR
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(capture_rng_state(), folder / f"rank-{rank}.pt")

    # ------------------------------------------------------------------ resuming

    def _choose_resume_checkpoint(self, trainer: pl.Trainer) -> tuple[Path, bool] | None:
        """Rank zero: clean interrupted saves, then find the newest checkpoint that verifies."""
        if not trainer.is_global_zero:
            return None
        assert self.store is not None
        for leftover in self.store.clean_staging():
            rank_zero_info(f"Removed an interrupted save: {leftover}")
        skipped: list[Any] = []
        entry = self.store.newest_valid(skipped)
        for bad in skipped:
            rank_zero_warn(f"Checkpoint {bad.path} failed verification ({bad.problem}); trying an older one.")
        if entry is None:
            return None
        assert entry.manifest is not None
        if entry.manifest.final:
            rank_zero_info(f"{entry.path} is marked final: this run already finished; not training again.")
        else:
            rank_zero_info(f"Auto-resuming from {entry.path} (step {entry.step}, saved by {entry.manifest.reason}).")
        return entry.path, entry.manifest.final

    def _preload(self, trainer: pl.Trainer) -> None:
        # Lightning takes the checkpoint path only as a `fit` argument; loading it into the checkpoint
        # connector here makes the restore Lightning does next use it (an explicit ckpt_path loads later
        # and wins).
        assert self.resumed_from is not None
        trainer._checkpoint_connector.resume_start(self.resumed_from / STATE_NAME, weights_only=False)
        self._preloaded_path = str(self.resumed_from / STATE_NAME)

    def _resumed_from_ours(self, trainer: pl.Trainer) -> bool:
        explicit = trainer.ckpt_path
        if explicit and str(explicit) != getattr(self, "_preloaded_path", None):
            rank_zero_info(f"An explicit ckpt_path ({explicit}) was given; it takes precedence over auto-resume.")
            self.resumed_from = None
            return False
        return True

    def _load_rng(self, trainer: pl.Trainer) -> dict[str, Any] | None:
        """Load the saved RNG states of this rank; None when the world size changed."""
        assert self.resumed_from is not None
        path = self.resumed_from / _RNG_DIR / f"rank-{trainer.global_rank}.pt"
        saved_world = len(list((self.resumed_from / _RNG_DIR).glob("rank-*.pt")))
        if saved_world != trainer.world_size or not path.is_file():
            rank_zero_warn(
                f"Resuming at world size {trainer.world_size} from a checkpoint written by {saved_world} processes: "
                "RNG states are not restored, so the run continues correctly but not bitwise identically."
            )
            return None
        # Verified with the rest of the checkpoint (manifest checksums) before this unpickling.
        return torch.load(path, weights_only=False)

    # ------------------------------------------------------------------ signals

    def _install_signal_handlers(self) -> None:
        if not self.signals or not _in_main_thread():
            return
        for name in self.signals:
            number = getattr(signal, name)
            self._previous_handlers[number] = signal.getsignal(number)
            signal.signal(number, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: saving here could interrupt a collective or a half-written tensor.
        self._signal_received = signum

    def _restore_signal_handlers(self) -> None:
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)
        self._previous_handlers.clear()


def _is_single_file(strategy: Strategy) -> bool:
    """Strategies that save through the base implementation: one file, written by rank zero's CheckpointIO.

    (DDP and single device. FSDP and DeepSpeed override ``save_checkpoint`` with sharded formats; note that
    Lightning's DeepSpeedStrategy is a DDPStrategy subclass, so an isinstance test would be wrong.)
    """
    return type(strategy).save_checkpoint is Strategy.save_checkpoint


def _to_cpu_copy(value: Any) -> Any:
    """A deep copy with every tensor cloned to CPU memory (the staging copy async writes read from)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return type(value)((key, _to_cpu_copy(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu_copy(item) for item in value)
    return copy.deepcopy(value)


def _tracker_run_ids(trainer: pl.Trainer) -> dict[str, str]:
    """Run ids of the experiment trackers that resume by id (W&B), for the manifest. Rank zero has them."""
    from lightning.pytorch.loggers import WandbLogger

    run_ids = {}
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and logger.version:
            run_ids["wandb"] = str(logger.version)
    return run_ids


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
