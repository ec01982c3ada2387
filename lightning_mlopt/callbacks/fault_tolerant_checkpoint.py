"""FaultTolerantCheckpoint: crash-safe, optionally asynchronous, auto-resuming checkpoints for every strategy."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.checkpoint.api import CheckpointException as _CheckpointException
from typing_extensions import override

from lightning_mlopt import exit_codes
from lightning_mlopt._bad_input import BadInputError
from lightning_mlopt._compat import keep_lightning_off_signals, preload_checkpoint
from lightning_mlopt.checkpoint import (
    STATE_NAME,
    AsyncWriter,
    CheckpointStore,
    Manifest,
    RetentionPolicy,
)
from lightning_mlopt.checkpoint.errors import CheckpointWriteError, describe_write_error, failed_ranks
from lightning_mlopt.checkpoint.manifest import MANIFEST_NAME, FileEntry, describe_files, library_versions
from lightning_mlopt.checkpoint.preemption import DEFAULT_DEADLINE_S, preemption
from lightning_mlopt.checkpoint.resume import skip_first_batches
from lightning_mlopt.checkpoint.rng import capture_rng_state, restore_rng_state
from lightning_mlopt.checkpoint.serialization import StagingBuffer, allowlisted_loading, load_file, save_file
from lightning_mlopt.checkpoint.trust import UntrustedCheckpointError, check_trusted
from lightning_mlopt.distributed.phase import phase
from lightning_mlopt.checkpoint.layout import ONE_FILE, can_resume, checkpoint_layout, layout_of_manifest

log = logging.getLogger(__name__)
_RNG_DIR = "rng"


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
    happens at the next step boundary on all ranks, then the process exits with ``exit_code``. The callback
    owns its ``signals`` for the whole run: Lightning's own handlers for them (which run a collective inside
    the handler and can hang the job) are kept off.

    Failures end, never hang: a folder that cannot be written is found before the first step; a write that
    fails on any rank (full disk, read-only mount, I/O error) is agreed by every rank and raises
    :class:`CheckpointWriteError` naming the path and the operating system's reason, with earlier checkpoints
    intact (the CLI exits with status 74).

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
            sharded save needs every rank, and a rank that raised cannot bring the others along. Rank zero
            writes it (every rank holds the same state), so ranks never write one folder at once.
        signals: signal names that request a save and a non-zero exit (preemption).
        exit_code: exit status after a signal-triggered save; 75 is EX_TEMPFAIL ("try again"), so a
            scheduler sees the job did not finish.
        signal_deadline_s: seconds from a signal to a forced exit with ``exit_code`` when the process cannot
            reach a step boundary (e.g. a rank stuck in a collective, which never runs a Python handler);
            the previous checkpoint stays the one to resume from. None: wait forever.
        keep_last: keep the newest K checkpoints (>= 1).
        keep_every_n_steps: also keep forever the checkpoints whose step is a multiple of M.
        monitor: a logged metric; the best ``keep_best`` checkpoints by it are kept too.
        mode: ``min`` or ``max``: which values of ``monitor`` are best.
        keep_best: how many best checkpoints to keep when ``monitor`` is set.
        async_save: stage the state in CPU memory and write it from a background thread (single-file
            strategies; sharded strategies write synchronously). At most one save is in flight.
        auto_resume: on ``fit`` without ``ckpt_path``, resume from the newest valid checkpoint in ``dirpath``.
            An explicit ``ckpt_path`` wins.
        resume_final: resume a run whose newest checkpoint is marked final and train on (e.g. after raising
            ``max_steps``). Off: a finished run stays finished, whatever the limits say now.
        trust_pickles: load checkpoints that reference Python types outside the allowlist of what
            lightning_mlopt checkpoints contain. Off (the default): every pickle in a checkpoint is checked
            before anything loads it, and one naming any other type is refused (exit 2), since unpickling it
            could run arbitrary code. Turn on only for checkpoints whose origin you trust.

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
        exit_code: int = exit_codes.REQUEUE,
        signal_deadline_s: float | None = DEFAULT_DEADLINE_S,
        keep_last: int = 3,
        keep_every_n_steps: int | None = None,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        keep_best: int = 1,
        async_save: bool = True,
        auto_resume: bool = True,
        resume_final: bool = False,
        trust_pickles: bool = False,
    ) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if every_n_minutes is not None and every_n_minutes <= 0:
            raise ValueError(f"every_n_minutes must be > 0, got {every_n_minutes}")
        if not 1 <= exit_code <= 255:
            raise ValueError(f"exit_code must be in 1..255 (non-zero, so a scheduler sees it), got {exit_code}")
        if signal_deadline_s is not None and signal_deadline_s <= 0:
            raise ValueError(f"signal_deadline_s must be > 0 or null, got {signal_deadline_s}")
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
        self.signal_deadline_s = signal_deadline_s
        self.monitor = monitor
        self.async_save = async_save
        self.auto_resume = auto_resume
        self.resume_final = resume_final
        self.trust_pickles = trust_pickles
        self.store: CheckpointStore | None = None
        self.resumed_from: Path | None = None
        self.last_saved: Path | None = None
        self._writer = AsyncWriter()
        self._staging = StagingBuffer()  # CPU memory reused by every async single-file save
        self._last_save_step = -1
        self._last_save_time = time.monotonic()
        self._resume_final = False
        self._exiting = False
        self._pending_rng: dict[str, Any] | None = None
        self._training_started = False
        self._final_saved = False
        self._committed: list[tuple[Path, Manifest]] = []
        self._last_total_bytes = 0  # size of the newest committed checkpoint: the free space the next one needs
        self._rng_entry: FileEntry | None = None  # this rank's RNG file of the save in progress, checksummed
        self._last_commit_time: float | None = None  # UNIX time of the newest committed checkpoint (rank zero)
        self.save_timings: list[dict[str, float]] = []  # what each save logged, oldest first

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
        self._own_signals(trainer)
        self._check_writable(trainer)
        resume = self._choose_resume_checkpoint(trainer) if self.auto_resume else None
        # Rank zero chose; every rank gets its choice, or its refusal, and acts on it alike.
        self.resumed_from, self._resume_final, refusal = trainer.strategy.broadcast(resume or (None, False, None))
        if refusal is not None:
            raise BadInputError(refusal)
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
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Resumed from a checkpoint at max_steps that is not marked final (a kill landed during the final
        # save): Lightning skips the training loop, so on_train_end never runs. Mark the run finished now.
        if (
            self.save_on_train_end
            and self.store is not None
            and not self._training_started
            and not self._resume_final
            and not self._final_saved
            and self.resumed_from is not None
            and trainer.fit_loop.done
        ):
            self._save(trainer, reason="final", final=True, wait=True)
            self._tell_loggers(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        try:
            self._writer.close()
        finally:
            if stage == "fit":
                preemption.release()

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
        signalled, due_by_time = self._agree_at_step_boundary(trainer)
        if signalled:
            preemption.acknowledge()  # acted on: it must not end the process a second time
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
        preemption.acknowledge()  # a signal after the last step boundary: the run finishes and is saved
        if self.save_on_train_end and not self._resume_final:
            self._save(trainer, reason="final", final=True, wait=True)
        self._wait_for_writer(trainer)
        self._tell_loggers(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # The exception decides how the process ends; a signal received meanwhile must not end it again.
        preemption.acknowledge()
        preemption.release()
        if self._exiting or isinstance(exception, (CheckpointWriteError, KeyboardInterrupt)):
            return
        if not self.save_on_exception or self.store is None:
            return
        if not self._training_started or checkpoint_layout(trainer.strategy) != ONE_FILE:
            return  # an error while setting up or resuming leaves nothing new worth saving
        if trainer.global_step == self._last_save_step or not trainer.is_global_zero:
            return
        # Only this rank is known to be here, so no collective may run. Every rank of a single-file strategy
        # holds the full state and would raise the same error: rank zero alone writes, so no two ranks ever
        # write (and commit) the same staging folder. Other ranks' RNG states are not saved (a resume from
        # it warns and continues, not bitwise).
        try:
            self._writer.wait()
            staging = self.store.stage(trainer.global_step)
            entry = save_file(trainer._checkpoint_connector.dump_checkpoint(weights_only=False), staging / STATE_NAME)
            self._write_rng(staging, trainer.global_rank)
            manifest = self._describe(trainer, reason="exception", final=False, world_size=trainer.world_size)
            self._commit_prepared(staging, manifest, self._known_entries(trainer, entry))
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

    def _agree_at_step_boundary(self, trainer: pl.Trainer) -> tuple[bool, bool]:
        """One small all-reduce, reached by every rank: a signal, a timer run out, a failed background write.

        A failed background write raises on every rank here, at the step boundary after it failed.
        """
        if not self.signals and self.every_n_minutes is None and not self.async_save:
            return False, False
        local = torch.tensor(
            [
                float(preemption.received() is not None),
                float(
                    self.every_n_minutes is not None
                    and time.monotonic() - self._last_save_time >= 60.0 * self.every_n_minutes
                ),
                float(self._writer.failed),
            ],
            device=trainer.strategy.root_device,
        )
        total = trainer.strategy.reduce(local, reduce_op="sum")
        signalled, due, write_failed = (bool(value > 0) for value in total.tolist())
        if write_failed:
            self._wait_for_writer(trainer)  # collective: every rank raises the same error
        return signalled, due

    def _save(self, trainer: pl.Trainer, reason: str, final: bool = False, wait: bool = False) -> None:
        """Save on every rank (collective), following the commit protocol."""
        started = time.perf_counter()
        with phase("checkpoint"):  # what a hang watchdog reports if the save never returns
            self._save_in_phase(trainer, reason, final, wait)
        self._log_save_timings(trainer, blocking_s=time.perf_counter() - started)

    def _log_save_timings(self, trainer: pl.Trainer, blocking_s: float) -> None:
        """Log this save's timings to every logger (rank zero).

        ``checkpoint/blocking_s``: how long this save held training; ``checkpoint/background_s``: how long the
        last finished background write ran; ``checkpoint/age_s``: the age of the newest committed checkpoint
        when this save started (what a crash at that moment would have lost).
        """
        timings = {"checkpoint/blocking_s": blocking_s}
        if self._writer.last_seconds is not None:
            timings["checkpoint/background_s"] = self._writer.last_seconds
        if self._last_commit_time is not None:
            timings["checkpoint/age_s"] = time.time() - self._last_commit_time
        self.save_timings.append(timings)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(timings, step=trainer.global_step)

    def _save_in_phase(self, trainer: pl.Trainer, reason: str, final: bool, wait: bool) -> None:
        assert self.store is not None
        step = trainer.global_step
        self._wait_for_writer(trainer)
        staging = self.store.staging_path(step)
        # Rank zero makes the staging folder (and checks the space the last checkpoint took is free); then
        # every rank writes its RNG state into it. Each stage ends in a collective every rank reaches,
        # whether its own part failed or not, so a failure is agreed, never a hang.
        problem = None
        if trainer.is_global_zero:
            try:
                self.store.stage(step)
                problem = _space_problem(self.store.root, self._last_total_bytes)
            except OSError as error:
                problem = describe_write_error(error, staging)
        self._raise_if_any_failed(trainer, problem, staging)
        try:
            self._write_rng(staging, trainer.global_rank)
        except OSError as error:
            problem = describe_write_error(error, staging)
        self._raise_if_any_failed(trainer, problem, staging)
        world_size = trainer.world_size
        if checkpoint_layout(trainer.strategy) == ONE_FILE:
            # One path for both modes: a synchronous save is a background write waited for at once.
            in_background = self.async_save and not wait
            self._save_single_file(trainer, staging, reason, final, world_size, copy_first=in_background)
            if not in_background:
                self._wait_for_writer(trainer)
        elif self.async_save and hasattr(trainer.strategy, "save_checkpoint_async"):
            self._save_sharded_in_background(trainer, staging, reason, final, world_size)
            if wait:
                self._wait_for_writer(trainer)
        else:
            self._save_sharded(trainer, staging, reason, final, world_size)
        self._last_save_step = step
        self._last_save_time = time.monotonic()
        self._final_saved = self._final_saved or final

    def _save_sharded(self, trainer: pl.Trainer, staging: Path, reason: str, final: bool, world_size: int) -> None:
        problem = None
        try:
            # The strategy decides the layout; all ranks call.
            trainer.save_checkpoint(staging / STATE_NAME, weights_only=False)
        except (Exception, _CheckpointException) as error:  # DCP's CheckpointException is a BaseException
            problem = describe_write_error(error, staging / STATE_NAME)
            # Trainer.save_checkpoint ends in a barrier that the failed rank skipped; the ranks that
            # succeeded wait in it. Reach it here, so that every rank is in the same collective again.
            trainer.strategy.barrier("Trainer.save_checkpoint")
        self._raise_if_any_failed(trainer, problem, staging)
        if trainer.is_global_zero:
            self._commit(trainer, staging, reason, final, world_size)
        trainer.strategy.barrier("FaultTolerantCheckpoint.commit")

    def _raise_if_any_failed(self, trainer: pl.Trainer, problem: str | None, staging: Path) -> None:
        """Collective (every rank calls it): if any rank had a problem, every rank raises the same error."""
        problem = _first_problem(trainer, problem)
        if problem is None:
            return
        if trainer.is_global_zero:
            assert self.store is not None
            self.store.discard(staging)
        raise CheckpointWriteError(f"{problem}; earlier checkpoints are intact")

    def _check_writable(self, trainer: pl.Trainer) -> None:
        """Before the first step: every rank can create and remove a file in the checkpoint folder (collective).

        A read-only mount, a path through a file, or a full disk is found here, in seconds, not at the first
        save hours later.
        """
        assert self.store is not None
        probe = self.store.root / f".write-test-rank{trainer.global_rank}-{os.getpid()}"
        problem = None
        try:
            self.store.root.mkdir(parents=True, exist_ok=True)
            with probe.open("wb") as handle:
                handle.write(b"\0" * 4096)
                handle.flush()
                os.fsync(handle.fileno())
            probe.unlink()
        except OSError as error:
            problem = describe_write_error(error, self.store.root)
        problem = _first_problem(trainer, problem)
        if problem is not None:
            raise CheckpointWriteError(
                f"cannot save checkpoints: {problem}; stopped before training, earlier checkpoints are intact. "
                "Choose a writable folder with checkpoint.dirpath, or free space"
            )

    def _save_single_file(
        self, trainer: pl.Trainer, staging: Path, reason: str, final: bool, world_size: int, copy_first: bool
    ) -> None:
        """Every rank dumps (callbacks' hooks may be collective); rank zero writes and commits on the writer thread.

        Single-file strategies hold the full state on every rank. The state streams into the file through
        the checksum (no in-memory pickle, no second pass). ``copy_first``: stage it in CPU memory first, so
        training may change the live tensors while the write runs.
        """
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        if not trainer.is_global_zero:
            return
        staged = self._staging.stage(checkpoint) if copy_first else checkpoint  # the last write has finished
        manifest = self._describe(trainer, reason, final, world_size)
        assert self.store is not None
        store = self.store

        def write() -> None:
            try:
                entry = save_file(staged, staging / STATE_NAME)
                self._commit_prepared(staging, manifest, self._known_entries(trainer, entry))
            except BaseException:
                store.discard(staging)
                raise

        self._writer.submit(write)

    def _save_sharded_in_background(
        self, trainer: pl.Trainer, staging: Path, reason: str, final: bool, world_size: int
    ) -> None:
        """Sharded strategies that write in the background (``save_checkpoint_async``); the commit waits for all.

        Blocking: dump, stage to CPU memory, start the write (failures there are agreed at once). In the
        background, each rank waits for its own write, then every rank agrees over the strategy's
        checkpoint group (not training's): only if every rank's write completed (and was fsynced) does rank
        zero commit. A failure anywhere fails the save on every rank, reported at the next step boundary.
        """
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        problem = None
        pending: Any = None
        try:
            pending = trainer.strategy.save_checkpoint_async(checkpoint, staging / STATE_NAME)  # type: ignore[attr-defined]
        except (Exception, _CheckpointException) as error:
            problem = describe_write_error(error, staging / STATE_NAME)
        self._raise_if_any_failed(trainer, problem, staging)
        manifest = self._describe(trainer, reason, final, world_size)
        group = trainer.strategy.checkpoint_process_group  # type: ignore[attr-defined]
        rank, known = trainer.global_rank, self._known_entries(trainer)
        assert self.store is not None
        store = self.store

        def write() -> None:
            problem = None
            try:
                pending.result()
            except (Exception, _CheckpointException) as error:
                blamed = failed_ranks(error)  # DCP raises on every rank; the failed rank reports its own cause
                if not blamed or rank in blamed:
                    problem = describe_write_error(error, staging / STATE_NAME)
            problem = _agree(problem, world_size, group)
            if problem is not None:
                if rank == 0:
                    store.discard(staging)
                raise CheckpointWriteError(problem)
            if rank == 0:
                self._commit_prepared(staging, manifest, known)

        self._writer.submit(write)

    def _known_entries(self, trainer: pl.Trainer, state: FileEntry | None = None) -> dict[str, FileEntry]:
        """Checksums this rank computed while writing (the committer reads no file twice)."""
        known = {} if state is None else {STATE_NAME: state}
        if self._rng_entry is not None:
            known[f"{_RNG_DIR}/rank-{trainer.global_rank}.pt"] = self._rng_entry
        return known

    def _wait_for_writer(self, trainer: pl.Trainer | None = None) -> None:
        """Wait for the background write; with ``trainer``, a collective: a failure raises on every rank."""
        problem = agreed = None
        try:
            self._writer.wait()
        except CheckpointWriteError as error:  # agreed by every rank in the background, naming the failed rank
            agreed = f"the background checkpoint write failed: {error}"
        except Exception as error:
            assert self.store is not None
            problem = f"the background checkpoint write failed: {describe_write_error(error, self.store.root)}"
        if trainer is not None:
            problem = _first_problem(trainer, problem)  # reached by every rank, whatever happened here
        problem = agreed or problem
        if problem is not None:
            raise CheckpointWriteError(f"{problem}. Earlier checkpoints are intact")

    def _commit(self, trainer: pl.Trainer, staging: Path, reason: str, final: bool, world_size: int) -> None:
        self._commit_prepared(staging, self._describe(trainer, reason, final, world_size), self._known_entries(trainer))

    def _describe(self, trainer: pl.Trainer, reason: str, final: bool, world_size: int) -> Manifest:
        """The manifest of a save, taken when it starts (the files are added at commit)."""
        return Manifest(
            step=trainer.global_step,
            epoch=trainer.current_epoch,
            world_size=world_size,
            strategy=type(trainer.strategy).__name__,
            layout=checkpoint_layout(trainer.strategy),
            reason=reason,
            final=final,
            metric=self._metric(trainer),
            run_ids=_tracker_run_ids(trainer),
        )

    def _commit_prepared(self, staging: Path, manifest: Manifest, known: dict[str, FileEntry]) -> None:
        """Rank zero (or the background writer): manifest, rename into place, ``latest``, retention."""
        assert self.store is not None
        manifest.files = describe_files(staging, known, manifest.checksum)
        manifest.versions = library_versions()
        manifest.created = time.time()
        self.last_saved = self.store.commit(staging, manifest)
        self._last_commit_time = manifest.created
        self._last_total_bytes = manifest.total_bytes
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
            shutil.rmtree(paths[step], ignore_errors=True)

    def _metric(self, trainer: pl.Trainer) -> dict[str, float] | None:
        if self.monitor is None or self.monitor not in trainer.callback_metrics:
            return None
        return {"name": self.monitor, "value": float(trainer.callback_metrics[self.monitor])}  # type: ignore[dict-item]

    def _write_rng(self, staging: Path, rank: int) -> None:
        folder = staging / _RNG_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self._rng_entry = None
        self._rng_entry = save_file(capture_rng_state(), folder / f"rank-{rank}.pt")

    # ------------------------------------------------------------------ resuming

    def _choose_resume_checkpoint(self, trainer: pl.Trainer) -> tuple[Path | None, bool, str | None] | None:
        """Rank zero: clean interrupted saves, find the newest checkpoint that verifies, check it fits the strategy.

        Returns (path, marked final and staying finished, a refusal message or None); None on other ranks.
        """
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
        self._last_total_bytes = entry.manifest.total_bytes
        self._last_commit_time = entry.manifest.created
        refusal = _strategy_switch_refusal(entry.manifest, trainer.strategy, entry.path)
        if refusal is None:
            try:
                check_trusted(entry.path, self.trust_pickles)  # before anything in it is unpickled
            except UntrustedCheckpointError as error:
                refusal = str(error)
        if refusal is not None:
            return None, False, refusal
        if entry.manifest.final and not self.resume_final:
            rank_zero_info(
                f"{entry.path} is marked final: this run already finished at step {entry.step}; not training again. "
                "To train on (e.g. with a larger max_steps), set checkpoint.resume_final: true."
            )
            return entry.path, True, None
        how = "a finished run, resume_final is set" if entry.manifest.final else f"saved by {entry.manifest.reason}"
        rank_zero_info(f"Auto-resuming from {entry.path} (step {entry.step}, {how}).")
        return entry.path, False, None

    def _preload(self, trainer: pl.Trainer) -> None:
        # Lightning takes the checkpoint path only as a `fit` argument; loading it into the checkpoint
        # connector here makes the restore Lightning does next use it (an explicit ckpt_path loads later
        # and wins).
        assert self.resumed_from is not None
        state = self.resumed_from / STATE_NAME
        if state.is_file():
            # One file: memory-mapped (verification just read it, so its pages are cached: no second copy;
            # ranks on one machine share them), under the allowlist.
            preload_checkpoint(trainer, state, load_file(state, self.trust_pickles, mmap=True))
        else:
            # Every pickle in it was checked against the allowlist when it was chosen; torch's own loader checks
            # again where Lightning calls it (DCP's meta.pt).
            with allowlisted_loading():
                trainer._checkpoint_connector.resume_start(state, weights_only=not self.trust_pickles)
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
        # Verified with the rest of the checkpoint (manifest checksums, allowlist) before this unpickling.
        return load_file(path, trust_pickles=self.trust_pickles)

    # ------------------------------------------------------------------ signals

    def _own_signals(self, trainer: pl.Trainer) -> None:
        """Own ``signals`` for the run (flag-only handlers, see checkpoint/preemption.py); keep Lightning's off.

        A signal that came before this (the entry point owns them from its first second) stays recorded and
        is acted on at the first step boundary.
        """
        if not self.signals or not _in_main_thread():
            return
        owned = preemption.install(self.signals, deadline_s=self.signal_deadline_s, exit_code=self.exit_code)
        keep_lightning_off_signals(trainer, owned)


def _strategy_switch_refusal(saved: Manifest, strategy: Strategy, path: Path) -> str | None:
    """A one-line refusal when the checkpoint's layout cannot be resumed by this run's strategy, else None."""
    saved_layout = layout_of_manifest(saved.layout, saved.strategy)
    current_layout = checkpoint_layout(strategy)
    if can_resume(saved_layout, current_layout):
        return None
    current = type(strategy).__name__
    return (
        f"cannot resume {path} (written by {saved.strategy}: {saved_layout}) with {current} ({current_layout}). "
        "Resuming works with the same strategy family at any world size (DDP, FSDP; ZeRO at the same world size), "
        "and from DDP to FSDP. Go back to the strategy that wrote it, or start a new run (another run_dir); "
        "`python -m lightning_mlopt checkpoint consolidate` turns any checkpoint into one Lightning file of weights."
    )


def _first_problem(trainer: pl.Trainer, problem: str | None) -> str | None:
    """Collective over every rank: the first rank's problem (prefixed with its rank), or None if none had one."""
    return _agree(problem, trainer.world_size)


def _agree(problem: str | None, world_size: int, group: Any = None) -> str | None:
    """:func:`_first_problem` over ``group`` (None: the default group); callable from a background thread."""
    import torch.distributed as dist

    if world_size < 2 or not (dist.is_available() and dist.is_initialized()):
        return problem
    problems: list[str | None] = [None] * world_size
    dist.all_gather_object(problems, problem, group=group)
    for rank, found in enumerate(problems):
        if found is not None:
            return f"rank {rank}: {found}"
    return None


def _space_problem(root: Path, needed_bytes: int) -> str | None:
    """A full disk, found before writing: the last checkpoint's size must be free.

    (Retention frees space only after the next commit.)
    """
    if needed_bytes <= 0:
        return None
    free = shutil.disk_usage(root).free
    if free >= needed_bytes:
        return None
    return (
        f"No space left on device: the checkpoint needs about {needed_bytes / 2**20:.1f} MiB and {root} has "
        f"{free / 2**20:.1f} MiB free"
    )


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
