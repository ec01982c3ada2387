# long: one callback's whole run (resume, the per-step vote, signal and exception saves); storage is in checkpoint/
"""FaultTolerantCheckpoint: crash-safe, optionally asynchronous, auto-resuming checkpoints for every strategy."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any, Literal, NoReturn

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_mlopt._compat import callback_state_key, log_this_steps_metrics
from lightning_mlopt.checkpoint import (
    CheckpointStore,
    RetentionPolicy,
)
from lightning_mlopt.checkpoint.layout import ONE_FILE
from lightning_mlopt.checkpoint.replicator import Replicator
from lightning_mlopt.checkpoint.resume import (
    DATA_POSITION_KEY,
    ResumeChoice,
    ResumingStrategy,
    choose_checkpoint,
    data_position,
    load_rng,
    order_this_epoch,
    position_in_epoch,
    preload,
)
from lightning_mlopt.checkpoint.rng import restore_rng_state
from lightning_mlopt.checkpoint.saver import CheckpointSaver
from lightning_mlopt.checkpoint.tiers import attach_remote, check_tier_settings, checkpoint_folder, store_url
from lightning_mlopt.distributed.step_exchange import step_exchange
from lightning_mlopt.exceptions import BadInputError, CheckpointWriteError, StoppedTogether
from lightning_mlopt.hooks import (
    CheckpointEvents,
    CheckpointUploader,
    DescribesOutputs,
    ResumeListener,
    SaveVetter,
    callbacks_with,
    checkpoint_events,
    loggers_with,
)
from lightning_mlopt.process import exit_codes, launch_report
from lightning_mlopt.process.grace import ANY_SIGNAL, SaveBudget, graces_from_environment, safety_margin_s
from lightning_mlopt.process.phase import phase
from lightning_mlopt.process.signals import DEFAULT_DEADLINE_S, preemption
from lightning_mlopt.strategies import LAYOUTS, layout_named
from lightning_mlopt.strategies.contract import contract_of

log = logging.getLogger(__name__)
# This callback's flags in the step exchange: signal, timer due, write failed, and after a signal: no time for a
# new save, no time for the save in flight; then the rank's last step in seconds (summed: the ranks' mean x world).
_VOTE = "checkpoint.vote"
_VOTE_SLOTS = 6
# Below this mean step time the vote is read one batch late, from a sum started at the previous batch end (no
# wait on the step's path: an all-reduce is ~0.5 ms on busy CPU cores, 3-5% of a short step). One more step
# before a signal is acted on is then under a second of a grace of tens of seconds; longer steps vote in step.
_LAG_BELOW_S = 1.0


class FaultTolerantCheckpoint(Checkpoint, DescribesOutputs):
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
    rank's Python, NumPy, torch and CUDA RNG states are saved and restored, each training epoch's data order
    and worker seeds are a function of (seed, epoch) (``checkpoint/data_order.py``: one process as many), and
    a mid-epoch resume skips the batches the epoch already consumed (at the sampler, without loading them):
    the resumed run is bitwise identical on CPU. A loader that cannot be placed exactly (an IterableDataset
    without ``state_dict``, a sampler with hidden state) is named in one line at start and at resume.

    Args:
        dirpath: where checkpoints go: a folder, or an S3-compatible object store (``s3://bucket/prefix``, with
            the standard AWS configuration: ``AWS_*`` variables including ``AWS_ENDPOINT_URL``, profiles,
            instance roles). On a store, each save commits to the local tier first (``local_dirpath``) and is
            copied up in the background, committed there by a create-only manifest (no rename); a copy that
            fails stops the run (exit 74) unless ``local_dirpath`` is set. None:
            ``<trainer.default_root_dir>/checkpoints`` (the CLI's run dir).
        local_dirpath: with ``dirpath`` on an object store: the fast local tier (node-local disk, tmpfs), saved
            every time; the store gets a copy when ``remote_every_n_steps`` / ``remote_every_n_minutes`` say,
            and a failing copy is said once while training goes on. Resume takes the newest checkpoint that
            verifies across both tiers. None: ``<trainer.default_root_dir>/checkpoints``, and every save is
            copied.
        remote_every_n_steps: copy to the object store when at least N steps passed since the last copy.
        remote_every_n_minutes: copy to the object store when at least T minutes passed since the last copy.
            With neither, every save is copied; the final and the signal save always are.
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
            the previous checkpoint stays the one to resume from. None: wait forever. Moved below the
            preemption grace when one is known.
        preemption_grace_s: seconds from a preemption signal to the forced kill. None: what the launcher
            announced (``launch``: torchrun's shutdown timeout; the sbatch script: ``--signal_seconds``; a
            Kubernetes manifest: its grace), else unknown. Known, a save starts after a signal only if this
            run's earlier saves say it ends in time; otherwise the run exits with ``exit_code`` at once,
            naming the checkpoint a relaunch resumes from (a save in flight is finished if it fits).
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
        local_dirpath: str | None = None,
        remote_every_n_steps: int | None = None,
        remote_every_n_minutes: float | None = None,
        every_n_steps: int | None = None,
        every_n_minutes: float | None = None,
        save_on_epoch_end: bool = True,
        save_on_train_end: bool = True,
        save_on_exception: bool = True,
        signals: list[str] | None = None,
        exit_code: int = exit_codes.REQUEUE,
        signal_deadline_s: float | None = DEFAULT_DEADLINE_S,
        preemption_grace_s: float | None = None,
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
        if preemption_grace_s is not None and preemption_grace_s <= 0:
            raise ValueError(f"preemption_grace_s must be > 0 or null, got {preemption_grace_s}")
        check_tier_settings(dirpath, local_dirpath, remote_every_n_steps, remote_every_n_minutes)
        signal_names = ["SIGTERM", "SIGUSR1"] if signals is None else list(signals)
        unknown = [name for name in signal_names if not hasattr(signal, name)]
        if unknown:
            raise ValueError(f"signals: unknown signal name(s) {unknown}; e.g. SIGTERM, SIGUSR1, SIGUSR2")
        self.retention = RetentionPolicy(keep_last, keep_every_n_steps, keep_best if monitor else 0, mode)
        self.dirpath = dirpath
        self.local_dirpath = local_dirpath
        self.remote_every_n_steps = remote_every_n_steps
        self.remote_every_n_minutes = remote_every_n_minutes
        self.every_n_steps = every_n_steps
        self.every_n_minutes = every_n_minutes
        self.save_on_epoch_end = save_on_epoch_end
        self.save_on_train_end = save_on_train_end
        self.save_on_exception = save_on_exception
        self.signals = signal_names
        self.exit_code = exit_code
        self.signal_deadline_s = signal_deadline_s
        self.preemption_grace_s = preemption_grace_s
        self.monitor = monitor
        self.async_save = async_save
        self.auto_resume = auto_resume
        self.resume_final = resume_final
        self.trust_pickles = trust_pickles
        self._events = CheckpointEvents()  # the run's, from setup on: what this callback tells its neighbours
        self.saver: CheckpointSaver | None = None  # how checkpoints are written; made at setup
        self._restored_last_saved: Path | None = None
        self._preloaded_path: str | None = None
        self._last_save_step = -1
        self._last_save_time = time.monotonic()
        self._resume_final = False
        self._exiting = False
        self._pending_rng: dict[str, Any] | None = None
        self._training_started = False
        self._final_saved = False
        self._vote_lagged = False  # agreed at each boundary from the ranks' mean step time (identical on all)
        self._may_lag = True  # whether the vote may be summed in the background at all (set at setup)
        self._last_boundary: float | None = None
        self._step_s = 0.0  # this rank's last step, boundary to boundary
        self._save_step_at_vote = -1  # the last save when the vote now in the background was sampled
        self._state_key: tuple[tuple[Any, ...], str] | None = None  # (the settings it was made from, the key)

    @property
    def last_saved(self) -> Path | None:
        """The newest checkpoint this run committed (or, resumed, the one the checkpoint remembers)."""
        if self.saver is not None and self.saver.last_saved is not None:
            return self.saver.last_saved
        return self._restored_last_saved

    @property
    def resumed_from(self) -> Path | None:
        """The checkpoint this launch resumed from (None: a fresh start, or an explicit ``ckpt_path`` won)."""
        return self._events.resumed_from

    @property
    def store(self) -> CheckpointStore | None:
        """The checkpoint folders of this run (set at setup)."""
        return self.saver.store if self.saver is not None else None

    @property
    def save_timings(self) -> list[dict[str, float]]:
        """What each save logged (``checkpoint/blocking_s``, ...), oldest first."""
        return self.saver.save_timings if self.saver is not None else []

    @property
    @override
    def state_key(self) -> str:
        # Lightning reads this at every hook call of every batch (its profiler's label): made once per settings.
        fields = (self.dirpath, self.every_n_steps)
        if self._state_key is None or self._state_key[0] != fields:
            self._state_key = (fields, callback_state_key(self, dirpath=fields[0], every_n_steps=fields[1]))
        return self._state_key[1]

    @property
    def remote_url(self) -> str | None:
        """The object store holding the checkpoints (``dirpath`` when it is one), else None."""
        return store_url(self.dirpath)

    def checkpoint_dir(self, trainer: pl.Trainer) -> Path:
        """The folder saves commit to: ``dirpath`` (a folder), else ``local_dirpath``, else the run dir's."""
        return checkpoint_folder(self.dirpath, self.local_dirpath, trainer.default_root_dir)

    def describe_outputs(self, trainer: pl.Trainer) -> list[str]:
        """Where the checkpoints go, and whether a relaunch resumes from them (the CLI's start-up lines)."""
        resume = "resumes from the newest valid one" if self.auto_resume else "auto_resume off"
        return [f"checkpoints  {self.checkpoint_dir(trainer)} ({resume})"]

    # ------------------------------------------------------------------ lifecycle

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # Every rank must write to and resume from the same place: rank zero's path decides.
        store = CheckpointStore(Path(trainer.strategy.broadcast(str(self.checkpoint_dir(trainer)))))
        contract = contract_of(trainer.strategy)
        remote = attach_remote(trainer, self.remote_url, self.retention, required=self.local_dirpath is None)
        replicator = None
        if remote is not None:
            replicator = Replicator(
                remote, self.remote_every_n_steps, self.remote_every_n_minutes, must_succeed=self.local_dirpath is None
            )
        self.saver = CheckpointSaver(
            store, self.retention, self.async_save, self.monitor, strategy=contract, replicator=replicator
        )
        # Own the signals for the run (flag-only handlers), with Lightning's own kept off them; the last-resort
        # deadline sits below the grace when the grace is known.
        graces = {ANY_SIGNAL: self.preemption_grace_s} if self.preemption_grace_s else graces_from_environment()
        preemption.own_for_run(trainer, self.signals, self.signal_deadline_s, self.exit_code, graces)
        launch_report.note(checkpoints=str(store.root))
        self._events = checkpoint_events(trainer)
        self._events.store = store
        self.saver.check_writable(trainer)
        if self._votes():  # each batch's exchange carries what this rank saw (read in on_train_batch_end)
            step_exchange(trainer).provide(_VOTE, lambda: self._local_flags(trainer))
        # On CPU the vote shares training's gloo group: left in flight across a boundary it would delay a
        # strategy that gathers at the step's start (FSDP: 13% a step), so such a strategy votes in step there.
        self._may_lag = not (trainer.world_size > 1 and _on_gloo() and contract.collectives_at_step_start)
        # Finding, verifying and loading the checkpoint is the run's restore time (the goodput ledger's figure).
        with phase("restore"):
            self._resume(trainer, store, contract, remote)

    def _resume(self, trainer: pl.Trainer, store: CheckpointStore, contract: Any, remote: Any) -> None:
        """Rank zero chooses the checkpoint to resume from; every rank gets its choice and preloads it."""
        assert self.saver is not None  # made at setup
        choice = None
        if self.auto_resume and trainer.is_global_zero:
            layout = layout_named(contract.checkpoint_layout)
            current = ResumingStrategy(type(trainer.strategy).__name__, layout, tuple(LAYOUTS.values()))
            choice = choose_checkpoint(
                store,
                current,
                self.trust_pickles,
                self.resume_final,
                remote,
                remote_required=self.local_dirpath is None,
            )
            if choice is not None and choice.manifest is not None:
                self.saver.note_resumed(choice.manifest)
        # Rank zero chose; every rank gets its choice, or its refusal, and acts on it alike.
        choice = trainer.strategy.broadcast(choice) or ResumeChoice(None)
        self._events.resumed_from, self._resume_final = choice.path, choice.stays_final
        if choice.refusal is not None:
            raise BadInputError(choice.refusal)
        if choice.failure is not None:
            raise CheckpointWriteError(choice.failure)
        if self.resumed_from is not None and not trainer.strategy.restore_checkpoint_after_setup:
            self._preloaded_path = preload(trainer, self.resumed_from, self.trust_pickles)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Sharded strategies (FSDP, DeepSpeed) can only load once the model is wrapped, after setup.
        if self.resumed_from is not None and trainer.strategy.restore_checkpoint_after_setup:
            with phase("restore"):
                self._preloaded_path = preload(trainer, self.resumed_from, self.trust_pickles)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._training_started = True
        self._last_save_time = time.monotonic()
        self._last_save_step = trainer.global_step
        explicit = trainer.ckpt_path
        if self.resumed_from is not None and explicit and str(explicit) != self._preloaded_path:
            rank_zero_info(f"An explicit ckpt_path ({explicit}) was given; it takes precedence over auto-resume.")
            self._events.resumed_from = None
        self._tell_loggers_resumed(trainer, Path(str(explicit)) if explicit else self.resumed_from)
        if self.resumed_from is not None and self._resume_final:
            trainer.should_stop = True  # even if max_steps was raised since: a finished run stays finished
            return
        rng_state = None
        if self.resumed_from is not None:
            rng_state = load_rng(self.resumed_from, trainer.global_rank, trainer.world_size, self.trust_pickles)
        # Fresh or resumed, this epoch's data comes in the order (seed, epoch) gives: a later resume finds it.
        self._pending_rng = position_in_epoch(trainer, rng_state, resumed=self.resumed_from is not None)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        order_this_epoch(trainer)  # before Lightning creates the epoch's iterator

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
            self.save(trainer, reason="final", final=True, wait=True)
            self._tell_loggers(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        try:
            if self.saver is not None:
                self.saver.close()
        finally:
            if stage == "fit":
                preemption.release()
                step_exchange(trainer).withdraw(_VOTE)

    # ------------------------------------------------------------------ triggers

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # All of it, the per-step vote included, is what fault tolerance costs: a step's checkpoint time.
        with phase("checkpoint"):
            self._at_step_boundary(trainer)

    def _at_step_boundary(self, trainer: pl.Trainer) -> None:
        self._tell_loggers(trainer)
        step = trainer.global_step
        if step == self._last_save_step:  # gradient accumulation: no optimizer step happened
            return
        due_by_steps = self.every_n_steps is not None and step % self.every_n_steps == 0
        # The end of an epoch is saved here, at its last batch, not in on_train_epoch_end: Lightning restores
        # a save made inside on_train_batch_end exactly (it knows that batch finished), while one made inside
        # on_train_epoch_end restarts the next epoch short.
        epoch_ends = self.save_on_epoch_end and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        signalled, due_by_time, no_time, no_time_in_flight = self._agree_at_step_boundary(trainer)
        if signalled:
            preemption.acknowledge()  # acted on: it must not end the process a second time
            if no_time:
                self._exit_without_saving(trainer, finish_in_flight=not no_time_in_flight)
            # This batch's row goes to the loggers before the save: the run ends in this hook, where Lightning's
            # loop would log it next, and the checkpoint releases it to loggers that hold rows until one commits.
            log_this_steps_metrics(trainer)
            _before_checkpoint(trainer)
            self.save(trainer, reason="signal", wait=True)
            self._tell_loggers(trainer)
            rank_zero_warn(f"Preemption signal: saved step {step}; exiting with status {self.exit_code}.")
            self._exit_preempted(trainer, self.last_saved, resume_step=step)
        if due_by_steps or due_by_time or epoch_ends:
            reason = "every_n_steps" if due_by_steps else "every_n_minutes" if due_by_time else "epoch_end"
            _before_checkpoint(trainer)
            self.save(trainer, reason=reason)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        preemption.acknowledge()  # a signal after the last step boundary: the run finishes and is saved
        if self.save_on_train_end and not self._resume_final:
            _before_checkpoint(trainer)
            self.save(trainer, reason="final", final=True, wait=True)
        assert self.saver is not None  # made at setup
        self.saver.wait(trainer)
        if self.remote_url is not None:  # every rank knows: the final checkpoint is in the store before the end
            self.saver.finish_copies(trainer)
        self._tell_loggers(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # The exception decides how the process ends; a signal received meanwhile must not end it again.
        preemption.acknowledge()
        preemption.release()
        if self._exiting or isinstance(exception, (CheckpointWriteError, KeyboardInterrupt)):
            return
        if isinstance(exception, StoppedTogether) and exception.unsafe_to_save:
            return  # e.g. replicas that diverged: the newest clean checkpoint is the one to resume
        if isinstance(exception, StoppedTogether) and exception.checkpoint_first:
            self._save_for_stop(trainer, exception)
            return
        if not self.save_on_exception or self.saver is None:
            return
        if not self._training_started or self.saver.strategy.checkpoint_layout != ONE_FILE:
            return  # an error while setting up or resuming leaves nothing new worth saving
        if trainer.global_step == self._last_save_step or not trainer.is_global_zero:
            return
        # Only this rank is known to be here, so no collective may run: rank zero writes alone.
        self.saver.save_after_exception(trainer, exception)

    def _save_for_stop(self, trainer: pl.Trainer, stop: StoppedTogether) -> None:
        """Every rank raised ``stop`` at the same step boundary, so the save may be collective; say what it did."""
        if self.saver is None or not self._training_started:
            stop.add_detail("  nothing was saved: training had not started")
            return
        try:
            self.save(trainer, reason=stop.checkpoint_reason, wait=True)
        except CheckpointWriteError as error:
            stop.add_detail(f"  no checkpoint was saved: {error}")
            return
        stop.add_detail(f"  saved a checkpoint at step {trainer.global_step} (before this update): {self.last_saved}")

    # ------------------------------------------------------------------ state

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_saved": str(self.last_saved) if self.last_saved else None}

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint[DATA_POSITION_KEY] = data_position(trainer)  # where the epoch is, in samples of the whole job

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        last = state_dict.get("last_saved")
        self._restored_last_saved = Path(last) if last else None

    # ------------------------------------------------------------------ saving

    def _votes(self) -> bool:
        """Whether anything needs the ranks' agreement at each step boundary."""
        return bool(self.signals) or self.every_n_minutes is not None or self.async_save

    def _local_flags(self, trainer: pl.Trainer) -> torch.Tensor:
        """What this rank sees now: a signal received, the timer run out, a background write failed."""
        assert self.saver is not None  # made at setup
        due = self.every_n_minutes is not None and (
            time.monotonic() - self._last_save_time >= 60.0 * self.every_n_minutes
        )
        signalled = preemption.received() is not None
        flags = [float(signalled), float(due), float(self.saver.failed), 0.0, 0.0, self._step_s]
        if signalled:  # the time left matters only after a signal: without one, any save fits
            budget = self._save_budget()
            flags[3:5] = [float(not budget.new_save_fits), float(not budget.in_flight_fits)]
        return torch.tensor(flags)  # host values for a host exchange: no copy to or from a GPU, every step

    def _save_budget(self) -> SaveBudget:
        """After a signal: what the time left allows (unknown grace, or no signal: anything)."""
        assert self.saver is not None  # made at setup
        left = preemption.seconds_left()
        if left is not None:
            announced = launch_report.announced_seconds_left()  # a cloud notice that `launch` polled
            if announced is not None:
                left = min(left, announced)
            left -= safety_margin_s(preemption.grace_s or left)
        return SaveBudget(left, self.saver.expected_save_seconds(), self.saver.in_flight_seconds_left())

    def _exit_without_saving(self, trainer: pl.Trainer, finish_in_flight: bool) -> NoReturn:
        """A preempted run whose grace has no room for a save: commit the save in flight if it fits, then exit."""
        assert self.saver is not None and self.store is not None  # made at setup
        budget = self._save_budget()
        if finish_in_flight:  # it fits by the estimate; if it runs late anyway, it is abandoned at the limit
            self.saver.finish_in_flight_within(trainer, budget.seconds_left)
        else:
            self.saver.abandon_in_flight()
        committed = self.store.committed() if trainer.is_global_zero else []
        step, path = committed[-1] if committed else (0, None)
        redo = trainer.global_step - step
        resumes = (
            f"a relaunch resumes from {path} (step {step}; {redo} step(s) redone)"
            if path
            else (f"nothing is committed yet: a relaunch starts again ({redo} step(s) redone)")
        )
        rank_zero_warn(
            f"Preemption ({preemption.describe()}): no time to save step {trainer.global_step} (a save takes up "
            f"to {budget.save_s or 0:.1f} s, {max(budget.seconds_left or 0, 0):.1f} s left before the kill); "
            f"{resumes}. Exiting with status {self.exit_code}."
        )
        self._exit_preempted(trainer, path, resume_step=step)

    def _exit_preempted(self, trainer: pl.Trainer, resume_from: Path | None, resume_step: int) -> NoReturn:
        """End this rank with the preemption status, telling `launch` what a relaunch resumes from.

        A remote copy still running gets what is left of the grace; if it does not land, the local tier has
        the checkpoint (a relaunch on this node resumes from it) and the store keeps its previous one.
        """
        assert self.saver is not None  # made at setup
        if self.remote_url is not None and not self.saver.finish_copies(trainer, self._save_budget().seconds_left):
            rank_zero_warn(
                f"Preemption: the copy to {self.remote_url} did not finish within the grace; {resume_from} is in "
                "the local tier, the object store keeps its previous checkpoint."
            )
        launch_report.note(preempted=True)
        if trainer.is_global_zero:  # the rank that knows what was committed
            launch_report.note(
                resume_from=str(resume_from) if resume_from else None,
                resume_step=resume_step,
                redo_steps=trainer.global_step - resume_step,
            )
        self._exiting = True
        raise SystemExit(self.exit_code)

    def _agree_at_step_boundary(self, trainer: pl.Trainer) -> tuple[bool, bool, bool, bool]:
        """What any rank saw: a signal, a timer run out, a failed background write.

        Summed over the ranks in the batch's one exchange (see distributed/step_exchange.py), which every rank
        reaches; when another callback exchanged earlier in the batch, its collective carried these too. A
        failed background write raises on every rank here, at the step boundary after it failed.

        With short steps (the ranks' mean under ``_LAG_BELOW_S``, on 2+ ranks) the vote is read one boundary
        late: the sum started at the previous boundary, finished while this step trained, so no rank waits for
        the collective; what a rank saw is then acted on one step later, by every rank at the same step.
        """
        if not self._votes():
            return False, False, False, False
        assert self.saver is not None  # made at setup
        now = time.monotonic()
        # The first boundary knows no step time: it says "not short", so voting starts in step.
        self._step_s = now - self._last_boundary if self._last_boundary is not None else _LAG_BELOW_S
        self._last_boundary = now
        exchange = step_exchange(trainer)
        if self._vote_lagged and not exchange.exchanged(trainer, _VOTE):
            total = exchange.read_previous(trainer, _VOTE) or [0.0] * _VOTE_SLOTS
            if self._save_step_at_vote != self._last_save_step:
                total[1] = 0.0  # "timer due" from before the save made since: that save reset the timer
            self._save_step_at_vote = self._last_save_step
        else:
            total = exchange.read(trainer, _VOTE)
        # Every rank reads the same sums, so every rank votes the same way at the next boundary.
        self._vote_lagged = self._may_lag and trainer.world_size > 1 and total[5] / trainer.world_size < _LAG_BELOW_S
        signalled, due, write_failed, no_time, no_time_in_flight = (value > 0 for value in total[:5])
        if write_failed:
            self.saver.wait(trainer)  # collective: every rank raises the same error
        return signalled, due, no_time, no_time_in_flight

    def save(self, trainer: pl.Trainer, reason: str = "manual", final: bool = False, wait: bool = False) -> None:
        """Save now, on every rank (collective), by the commit protocol; ``wait``: return once committed.

        What the triggers call; call it yourself from a hook every rank runs (e.g. ``on_train_batch_end``).
        """
        assert self.saver is not None, "save() needs the trainer's setup (fit) to have run"
        self.saver.save(trainer, reason, final, wait)
        self._last_save_step = trainer.global_step
        self._last_save_time = time.monotonic()
        self._final_saved = self._final_saved or final

    def _tell_loggers_resumed(self, trainer: pl.Trainer, path: Path | None) -> None:
        """Rank zero: loggers that hold step rows until a checkpoint commits learn where this launch starts."""
        if not trainer.is_global_zero:
            return
        folder = path.parent if path is not None and path.is_file() else path
        for logger in loggers_with(trainer, ResumeListener):
            logger.checkpoints_resumed(trainer.global_step, folder)

    def _tell_loggers(self, trainer: pl.Trainer) -> None:
        """Rank zero, main thread: hand each newly committed checkpoint to loggers that upload them."""
        if self.saver is None:
            return
        for path, manifest in self.saver.take_committed():
            for logger in loggers_with(trainer, CheckpointUploader):
                logger.log_checkpoint_artifact(path, manifest)


def _before_checkpoint(trainer: pl.Trainer) -> None:
    """Every rank, right before a save the ranks agreed on: callbacks that vet the state get their say.

    A :class:`~lightning_mlopt.hooks.SaveVetter` (ReplicaConsistencyCheck) may raise to keep a state it finds
    bad from being saved.
    """
    for vetter in callbacks_with(trainer, SaveVetter):
        vetter.before_checkpoint(trainer)


def _on_gloo() -> bool:
    """Whether training's own process group is gloo (CPU), the one the vote's sums then share."""
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and (torch.distributed.get_backend() == "gloo")
    )
