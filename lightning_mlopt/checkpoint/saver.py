# long: one commit protocol for every layout (one file, sharded, in the background) and its timings
"""Writing checkpoints: staging, the strategy's write (now or in the background), agreement, commit, retention.

FaultTolerantCheckpoint decides *when* to save; :class:`CheckpointSaver` decides *how*: every save follows one
commit protocol for every layout (see ``checkpoint/store.py``), and every stage of it ends in a collective
that every rank reaches, whether its own part failed or not, so a failure is agreed, never a hang.

Example::

    saver = CheckpointSaver(CheckpointStore(root), RetentionPolicy(keep_last=3), async_save=True)
    saver.check_writable(trainer)            # before the first step (collective)
    saver.save(trainer, reason="every_n_steps")
    saver.wait(trainer)                      # collective: a failed background write raises on every rank
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.distributed.checkpoint.api import CheckpointException as _CheckpointException

from lightning_mlopt._compat import dump_checkpoint
from lightning_mlopt._metrics import log_metrics
from lightning_mlopt.checkpoint.async_writer import AsyncWriter
from lightning_mlopt.checkpoint.errors import (
    agree_and_gather,
    describe_write_error,
    failed_ranks,
    first_problem,
    space_problem,
)
from lightning_mlopt.checkpoint.layout import ONE_FILE, CheckpointingStrategy
from lightning_mlopt.checkpoint.manifest import MANIFEST_NAME, FileEntry, Manifest, describe_files, library_versions
from lightning_mlopt.checkpoint.remote.replicator import Replicator
from lightning_mlopt.checkpoint.resume import RNG_DIR
from lightning_mlopt.checkpoint.retention import RetentionPolicy
from lightning_mlopt.checkpoint.rng import capture_rng_state
from lightning_mlopt.checkpoint.serialization import StagingBuffer, save_file
from lightning_mlopt.checkpoint.settings import CHECKPOINT
from lightning_mlopt.checkpoint.store import STATE_NAME, CheckpointStore
from lightning_mlopt.exceptions import CheckpointWriteError, StoppedTogether
from lightning_mlopt.hooks import RunTracker, loggers_with
from lightning_mlopt.process.phase import phase

log = logging.getLogger(__name__)


class CheckpointSaver:
    """Saves checkpoints into ``store`` by the commit protocol, for every strategy; at most one write in flight.

    Args:
        store: the checkpoint folders.
        retention: which committed checkpoints to keep after each commit.
        async_save: stage in CPU memory and write in the background (every layout); else write at once.
        monitor: a logged metric recorded in each manifest (for retention by best value).
        strategy: what the run's strategy answers about saving (``strategies.contract.contract_of``): its layout
            and whether it saves in the background.
        replicator: copies committed checkpoints to a remote tier in the background (rank zero; None: none).

    """

    def __init__(
        self,
        store: CheckpointStore,
        retention: RetentionPolicy,
        async_save: bool = True,
        monitor: str | None = None,
        *,
        strategy: CheckpointingStrategy,
        replicator: Replicator | None = None,
    ) -> None:
        self.store = store
        self.replicator = replicator
        self.strategy = strategy
        self.retention = retention
        self.async_save = async_save
        self.monitor = monitor
        self.last_saved: Path | None = None  # the newest checkpoint this process committed
        self.save_timings: list[dict[str, float]] = []  # what each save logged, oldest first
        self._writer = AsyncWriter()
        self._staging = StagingBuffer()  # CPU memory reused by every async single-file save
        self._rng_entry: FileEntry | None = None  # this rank's RNG file of the save in progress, checksummed
        self._last_total_bytes = 0  # size of the newest committed checkpoint: the free space the next one needs
        self._last_commit_time: float | None = None  # UNIX time of the newest committed checkpoint (rank zero)
        self._committed: list[tuple[Path, Manifest]] = []
        self._abandoned = threading.Event()  # set when a preempted rank gives up the write in flight

    @property
    def failed(self) -> bool:
        """True when a background write or a must-succeed remote copy failed, not raised by ``wait`` yet."""
        return self._writer.failed or (self.replicator is not None and self.replicator.failed)

    @property
    def last_background_seconds(self) -> float | None:
        """How long the last finished background write ran."""
        return self._writer.last_seconds

    def expected_save_seconds(self) -> float | None:
        """How long a complete save of this run may take; None before the first save.

        The longest blocking part plus the longest background write seen so far: an upper bound.
        """
        if not self.save_timings:
            return None
        blocking = max(timings["checkpoint/blocking_s"] for timings in self.save_timings)
        return blocking + (self._writer.longest_seconds or 0.0)

    def in_flight_seconds_left(self) -> float:
        """How long the background write in flight may still take; 0 when none is.

        From the longest write so far; one already running longer than that is assumed to need as long again.
        """
        if not self._writer.busy:
            return 0.0
        running = self._writer.running_for
        longest = self._writer.longest_seconds or self.expected_save_seconds() or 0.0
        return longest - running if running < longest else running

    def finish_in_flight_within(self, trainer: pl.Trainer, seconds: float | None) -> bool:
        """Collective: let the background write in flight commit if every rank's ends within ``seconds``.

        ``seconds`` None (a rank that does not know the grace): as long as the write takes.

        Returns whether it did; otherwise it is abandoned on every rank (never committed), so the checkpoint a
        relaunch resumes from is the newest one committed before it. A failed write raises, as in ``wait``.
        """
        finished = self._writer.join(seconds)
        if first_problem(trainer, None if finished else "the write in flight did not end in time") is None:
            self.wait(trainer)
            return True
        self.abandon_in_flight()
        return False

    def abandon_in_flight(self) -> None:
        """Leave the background write in flight uncommitted: a preempted rank has no time left for it.

        The write may still finish before the process exits; it is then discarded, never committed, so the
        checkpoint a relaunch resumes from is the one the exit message named.
        """
        self._abandoned.set()
        self._writer.abandon()
        if self.replicator is not None:
            self.replicator.abandon()

    def note_resumed(self, manifest: Manifest) -> None:
        """The run resumes from a checkpoint with this manifest: the next save needs its size free."""
        self._last_total_bytes = manifest.total_bytes
        self._last_commit_time = manifest.created

    def take_committed(self) -> list[tuple[Path, Manifest]]:
        """Checkpoints committed since the last call (rank zero), for loggers that upload them."""
        committed, self._committed = self._committed, []
        return committed

    def close(self) -> None:
        """Wait for the write in flight (its error is raised) and the remote copies."""
        try:
            self._writer.close()
        finally:
            if self.replicator is not None:
                self.replicator.close()

    def finish_copies(self, trainer: pl.Trainer, seconds: float | None = None) -> bool:
        """Collective: wait up to ``seconds`` (None: no limit) for the remote copies; whether they all landed.

        A copy that had to succeed and failed raises on every rank, as a failed write does in ``wait``.
        """
        done = self.replicator.flush(seconds) if self.replicator is not None else True
        self.wait(trainer)
        return first_problem(trainer, None if done else "a remote copy is still running") is None

    def save(self, trainer: pl.Trainer, reason: str, final: bool = False, wait: bool = False) -> None:
        """Save on every rank (collective), following the commit protocol; ``wait``: until committed."""
        started = time.perf_counter()
        with phase("checkpoint"):  # what a hang watchdog reports if the save never returns
            waited_s = self._save_now(trainer, reason, final, wait)
        self._log_save_timings(trainer, blocking_s=time.perf_counter() - started, wait_s=waited_s)

    def save_for_stop(self, trainer: pl.Trainer, stop: StoppedTogether, training_started: bool) -> None:
        """Every rank raised ``stop`` at the same step boundary, so the save may be collective; say what it did."""
        if not training_started:
            stop.add_detail("  nothing was saved: training had not started")
            return
        try:
            self.save(trainer, stop.checkpoint_reason, final=False, wait=True)
        except CheckpointWriteError as error:
            stop.add_detail(f"  no checkpoint was saved: {error}")
            return
        stop.add_detail(f"  saved a checkpoint at step {trainer.global_step} (before this update): {self.last_saved}")

    def save_after_exception(self, trainer: pl.Trainer, exception: BaseException) -> None:
        """Rank zero alone, no collective (only this rank is known to be here): a single-file save, committed.

        Every rank of a single-file strategy holds the full state and would raise the same error: rank zero
        alone writes, so no two ranks ever write (and commit) the same staging folder. Other ranks' RNG
        states are not saved (a resume from it warns and continues, not bitwise). A sharded save needs every
        rank, and a rank that raised cannot bring the others along: sharded strategies save nothing here.
        """
        if self.strategy.checkpoint_layout != ONE_FILE or not trainer.is_global_zero:
            return
        if trainer.world_size > 1 and any(hasattr(each, "consolidate_state_dict") for each in trainer.optimizers):
            return  # a ZeroRedundancyOptimizer's state is gathered from every rank: rank zero alone would hang
        try:
            self._writer.wait()
            staging = self.store.stage(trainer.global_step)
            entry = save_file(dump_checkpoint(trainer), staging / STATE_NAME)
            self._write_rng(staging, trainer.global_rank)
            manifest = self._describe(trainer, reason="exception", final=False, world_size=trainer.world_size)
            self._commit_prepared(staging, manifest, self._known_entries(trainer, entry))
            log.warning("Saved a checkpoint at step %d after an exception: %r", trainer.global_step, exception)
        except Exception as error:
            log.error("Could not save a checkpoint after the exception: %s", error)

    def _log_save_timings(self, trainer: pl.Trainer, blocking_s: float, wait_s: float) -> None:
        """Log this save's timings to every logger (rank zero).

        ``checkpoint/blocking_s``: how long this save held training; ``checkpoint/wait_s``: the part of it spent
        waiting for the previous background write (saves closer together than a write takes: raise
        ``every_n_steps``); ``checkpoint/background_s``: how long the last finished background write ran;
        ``checkpoint/age_s``: the age of the newest committed checkpoint when this save started (what a crash
        at that moment would have lost).
        """
        timings = {"checkpoint/blocking_s": blocking_s, "checkpoint/wait_s": wait_s}
        if self._writer.last_seconds is not None:
            timings["checkpoint/background_s"] = self._writer.last_seconds
        if self._last_commit_time is not None:
            timings["checkpoint/age_s"] = time.time() - self._last_commit_time
        self.save_timings.append(timings)
        log_metrics(trainer, timings)

    def _save_now(self, trainer: pl.Trainer, reason: str, final: bool, wait: bool) -> float:
        """The save; returns the seconds it first waited for the previous background write."""
        step = trainer.global_step
        started = time.perf_counter()
        self.wait(trainer)
        waited_s = time.perf_counter() - started
        staging = self.store.staging_path(step)
        # Rank zero makes the staging folder (and checks the space the last checkpoint took is free); then
        # every rank writes its RNG state into it. Each stage ends in a collective every rank reaches,
        # whether its own part failed or not, so a failure is agreed, never a hang.
        problem = None
        if trainer.is_global_zero:
            try:
                self.store.stage(step)
                problem = space_problem(self.store.root, self._last_total_bytes)
            except OSError as error:
                problem = describe_write_error(error, staging)
        self._raise_if_any_failed(trainer, problem, staging)
        try:
            self._write_rng(staging, trainer.global_rank)
        except OSError as error:
            problem = describe_write_error(error, staging)
        self._raise_if_any_failed(trainer, problem, staging)
        world_size = trainer.world_size
        if self.strategy.checkpoint_layout == ONE_FILE:
            # One path for both modes: a synchronous save is a background write waited for at once.
            in_background = self.async_save and not wait
            self._save_single_file(trainer, staging, reason, final, world_size, copy_first=in_background)
            if not in_background:
                self.wait(trainer)
        elif self.async_save and self.strategy.background_saves:
            self._save_sharded_in_background(trainer, staging, reason, final, world_size)
            if wait:
                self.wait(trainer)
        else:
            self._save_sharded(trainer, staging, reason, final, world_size)
        return waited_s

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
        problem = first_problem(trainer, problem)
        if problem is None:
            return
        if trainer.is_global_zero:
            self.store.discard(staging)
        raise CheckpointWriteError(f"{problem}; earlier checkpoints are intact")

    def check_writable(self, trainer: pl.Trainer) -> None:
        """Before the first step: every rank can create and remove a file in the checkpoint folder (collective).

        A read-only mount, a path through a file, or a full disk is found here, in seconds, not at the first
        save hours later.
        """
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
        problem = first_problem(trainer, problem)
        if problem is not None:
            raise CheckpointWriteError(
                f"cannot save checkpoints: {problem}; stopped before training, earlier checkpoints are intact. "
                f"Choose a writable folder with {CHECKPOINT.setting('dirpath')}, or free space"
            )

    def _save_single_file(
        self, trainer: pl.Trainer, staging: Path, reason: str, final: bool, world_size: int, copy_first: bool
    ) -> None:
        """Every rank dumps (callbacks' hooks may be collective); rank zero writes and commits on the writer thread.

        Single-file strategies hold the full state on every rank. The state streams into the file through
        the checksum (no in-memory pickle, no second pass). ``copy_first``: stage it in CPU memory first, so
        training may change the live tensors while the write runs.
        """
        checkpoint = dump_checkpoint(trainer)
        if not trainer.is_global_zero:
            return
        staged = self._staging.stage(checkpoint) if copy_first else checkpoint  # the last write has finished
        manifest = self._describe(trainer, reason, final, world_size)
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
        checkpoint = dump_checkpoint(trainer)
        problem = None
        pending: Any = None
        try:
            pending = self.strategy.save_checkpoint_async(checkpoint, staging / STATE_NAME)
        except (Exception, _CheckpointException) as error:
            problem = describe_write_error(error, staging / STATE_NAME)
        self._raise_if_any_failed(trainer, problem, staging)
        manifest = self._describe(trainer, reason, final, world_size)
        group = self.strategy.checkpoint_process_group
        rank, known = trainer.global_rank, self._known_entries(trainer)
        store = self.store

        def write() -> None:
            problem = None
            written: dict[str, FileEntry] = {}
            try:
                written = {f"{STATE_NAME}/{name}": entry for name, entry in (pending.result() or {}).items()}
            except (Exception, _CheckpointException) as error:
                blamed = failed_ranks(error)  # DCP raises on every rank; the failed rank reports its own cause
                if not blamed or rank in blamed:
                    problem = describe_write_error(error, staging / STATE_NAME)
            # One exchange over the checkpoint group: every rank's problem, and the checksums of what it wrote.
            problem, everyones = agree_and_gather(problem, written, world_size, group)
            if problem is not None:
                if rank == 0:
                    store.discard(staging)
                raise CheckpointWriteError(problem)
            if rank == 0:
                for entries in everyones:
                    known.update(entries)
                self._commit_prepared(staging, manifest, known)

        self._writer.submit(write)

    def _known_entries(self, trainer: pl.Trainer, state: FileEntry | None = None) -> dict[str, FileEntry]:
        """Checksums this rank computed while writing (the committer reads no file twice)."""
        known = {} if state is None else {STATE_NAME: state}
        if self._rng_entry is not None:
            known[f"{RNG_DIR}/rank-{trainer.global_rank}.pt"] = self._rng_entry
        return known

    def wait(self, trainer: pl.Trainer | None = None) -> None:
        """Wait for the background write; with ``trainer``, a collective: a failure raises on every rank."""
        problem = agreed = None
        try:
            self._writer.wait()
        except CheckpointWriteError as error:  # agreed by every rank in the background, naming the failed rank
            agreed = f"the background checkpoint write failed: {error}"
        except Exception as error:
            problem = f"the background checkpoint write failed: {describe_write_error(error, self.store.root)}"
        copy_error = self.replicator.take_error() if self.replicator is not None else None
        if copy_error is not None and problem is None:
            problem = f"the remote checkpoint copy failed: {copy_error}"
        if trainer is not None:
            problem = first_problem(trainer, problem)  # reached by every rank, whatever happened here
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
            layout=self.strategy.checkpoint_layout,
            reason=reason,
            final=final,
            metric=self._metric(trainer),
            run_ids=_tracker_run_ids(trainer),
        )

    def _commit_prepared(self, staging: Path, manifest: Manifest, known: dict[str, FileEntry]) -> None:
        """Rank zero (or the background writer): manifest, rename into place, ``latest``, retention."""
        if self._abandoned.is_set():  # a preempted rank gave up on this save: never commit after that
            self.store.discard(staging)
            return
        manifest.files = describe_files(staging, known, manifest.checksum)
        manifest.versions = library_versions()
        manifest.created = time.time()
        self.last_saved = self.store.commit(staging, manifest)
        self._last_commit_time = manifest.created
        self._last_total_bytes = manifest.total_bytes
        if self.replicator is not None:  # the final and the signal save are copied whatever the schedule
            self.replicator.offer(self.last_saved, manifest.step, force=manifest.final or manifest.reason == "signal")
        self._apply_retention(protected=manifest.step)
        self._committed.append((self.last_saved, manifest))  # loggers hear of it on the main thread

    def _apply_retention(self, protected: int) -> None:
        scored: list[tuple[int, float | None]] = []
        paths = {}
        for step, path in self.store.committed():
            try:
                manifest = Manifest.from_json((path / MANIFEST_NAME).read_bytes())
            except (OSError, ValueError, Exception):
                continue
            metric = manifest.metric
            scored.append((step, None if metric is None else metric.get("value")))
            paths[step] = path
        copying = self.replicator.busy_steps() if self.replicator is not None else set()
        for step in self.retention.to_delete(scored, protected=[protected, *copying]):
            shutil.rmtree(paths[step], ignore_errors=True)

    def _metric(self, trainer: pl.Trainer) -> dict[str, float] | None:
        if self.monitor is None or self.monitor not in trainer.callback_metrics:
            return None
        return {"name": self.monitor, "value": float(trainer.callback_metrics[self.monitor])}  # type: ignore[dict-item]

    def _write_rng(self, staging: Path, rank: int) -> None:
        folder = staging / RNG_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self._rng_entry = None
        self._rng_entry = save_file(capture_rng_state(), folder / f"rank-{rank}.pt")


def _tracker_run_ids(trainer: pl.Trainer) -> dict[str, str]:
    """Run ids of the experiment trackers that resume by id (W&B, MLflow), for the manifest. Rank zero has them."""
    from lightning.pytorch.loggers import WandbLogger

    run_ids = {}
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and logger.version:  # Lightning's own, or ours
            run_ids["wandb"] = str(logger.version)
    for tracker in loggers_with(trainer, RunTracker):
        named = tracker.tracker_run_id()
        if named is not None:
            run_ids[named[0]] = named[1]
    return run_ids
