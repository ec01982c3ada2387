"""FaultTolerantCheckpoint: crash-safe, optionally asynchronous, auto-resuming checkpoints for every strategy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_mlopt._compat import callback_state_key, fit_loop_done_quietly
from lightning_mlopt.checkpoint import CheckpointStore
from lightning_mlopt.checkpoint.data_position import DATA_POSITION_KEY, data_position, loops_as_resumable
from lightning_mlopt.checkpoint.preempted_exit import PreemptedExit
from lightning_mlopt.checkpoint.remote.object_store import store_url
from lightning_mlopt.checkpoint.remote.tiers import attach_tiers, checkpoint_folder
from lightning_mlopt.checkpoint.resume import ResumingStrategy, order_this_epoch
from lightning_mlopt.checkpoint.resumption import Resumption
from lightning_mlopt.checkpoint.saver import CheckpointSaver
from lightning_mlopt.checkpoint.settings import Keep, Preemption, Resume, SaveOn, Tiers, refuse_flat_keys
from lightning_mlopt.checkpoint.step_vote import StepVote
from lightning_mlopt.exceptions import CheckpointWriteError, StoppedTogether
from lightning_mlopt.hooks import (
    CheckpointEvents,
    DescribesOutputs,
    checkpoint_events,
    hand_over_committed,
    tell_resumed,
    vet_save,
)
from lightning_mlopt.process import launch_report
from lightning_mlopt.process.phase import phase
from lightning_mlopt.process.signals import preemption
from lightning_mlopt.strategies import LAYOUTS, layout_named
from lightning_mlopt.strategies.contract import contract_of


class FaultTolerantCheckpoint(Checkpoint, DescribesOutputs):
    """Checkpoints that survive a kill at any instant, resume by themselves, and resume exactly.

    Every save follows one commit protocol, single-file and sharded alike: the state goes into a staging folder,
    every rank confirms, rank zero writes a manifest (step, world size, strategy, each file's size and SHA-256)
    and renames the folder to ``step-NNNNNNNNN``. Resume takes the newest checkpoint that verifies, before
    unpickling anything. Exact resume: RNG states, each epoch's data order and the position in it are restored,
    so a resumed run is bitwise identical on CPU. A write that fails on any rank (full disk, I/O error) stops
    every rank with :class:`CheckpointWriteError` (exit 74), earlier checkpoints intact.

    This class decides *when* to save: every N steps, every T minutes (voted on: all ranks save at the same
    step), at an epoch's last batch, at the end (marked final: a relaunch does not train again), on an
    exception, and on a preemption signal (saved at the next step boundary on every rank, then exit 75). The
    rest is in ``checkpoint/``: ``saver.py`` writes, ``step_vote.py`` agrees, ``preempted_exit.py`` ends a
    preempted run, ``resumption.py`` resumes, ``settings.py`` holds the grouped settings.

    Args:
        dirpath: a folder, or an S3-compatible object store (``s3://bucket/prefix``; see ``tiers``). None:
            ``<trainer.default_root_dir>/checkpoints``.
        every_n_steps: save every N optimizer steps; None: never by step count.
        every_n_minutes: save when T minutes passed since the last save; None: never by time.
        async_save: write single-file saves from a background thread after staging them in CPU memory.
        save_on: the events that save (:class:`SaveOn`).
        keep: which checkpoints retention keeps (:class:`Keep`).
        tiers: with ``dirpath`` on an object store: the local tier and how often it is copied (:class:`Tiers`).
        preemption: the signals, exit status, deadline and grace (:class:`Preemption`).
        resume: auto-resume, from a finished run too, what to trust, and whether ``ckpt_path`` is only a warm
            start (:class:`Resume`).

    Raises:
        ValueError: a bad value, e.g. ``every_n_steps: 0``. TypeError: a flat key of 0.1, naming the new one.

    Example::

        trainer = Trainer(callbacks=[FaultTolerantCheckpoint(every_n_steps=500, keep=Keep(last=5))])
        trainer.fit(model)  # relaunching the same script resumes from the newest valid checkpoint

    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_steps: int | None = None,
        every_n_minutes: float | None = None,
        async_save: bool = True,
        save_on: SaveOn = SaveOn(),
        keep: Keep = Keep(),
        tiers: Tiers = Tiers(),
        preemption: Preemption = Preemption(),
        resume: Resume = Resume(),
        **renamed: Any,
    ) -> None:
        refuse_flat_keys(renamed)
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if every_n_minutes is not None and every_n_minutes <= 0:
            raise ValueError(f"every_n_minutes must be > 0, got {every_n_minutes}")
        tiers.check(dirpath)
        self.dirpath, self.every_n_steps, self.every_n_minutes = dirpath, every_n_steps, every_n_minutes
        self.async_save, self.save_on, self.keep, self.tiers = async_save, save_on, keep, tiers
        self.preemption, self.resume = preemption, resume
        self.saver: CheckpointSaver | None = None  # how checkpoints are written; made at setup
        self._vote: StepVote | None = None  # made at setup, with the saver
        self._exit: PreemptedExit | None = None
        self._resumption = Resumption(resume, tiers.local_dirpath is None, CheckpointEvents())  # remade at setup
        self._restored_last_saved: Path | None = None
        self._last_save_step = -1
        self._training_started = False
        self._mid_update = False  # between the optimizer step's start and its return (or the batch's end)
        self._watched_optimizers: dict[Any, Any] = {}  # optimizer -> its post-step hook's handle
        self._training_ended = False  # on_train_end ran: the run finished (and saved)
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
        return self._resumption.resumed_from

    @property
    @override
    def state_key(self) -> str:
        # Lightning reads this at every hook call of every batch (its profiler's label): made once per settings.
        fields = (self.dirpath, self.every_n_steps)
        if self._state_key is None or self._state_key[0] != fields:
            self._state_key = (fields, callback_state_key(self, dirpath=fields[0], every_n_steps=fields[1]))
        return self._state_key[1]

    def checkpoint_dir(self, trainer: pl.Trainer) -> Path:
        """The folder saves commit to: ``dirpath`` (a folder), else ``tiers.local_dirpath``, else the run dir's."""
        return checkpoint_folder(self.dirpath, self.tiers.local_dirpath, trainer.default_root_dir)

    def describe_outputs(self, trainer: pl.Trainer) -> list[str]:
        """Where the checkpoints go, and whether a relaunch resumes from them (the CLI's start-up lines)."""
        resume = "resumes from the newest valid one" if self.resume.auto else "resume.auto off"
        return [f"checkpoints  {self.checkpoint_dir(trainer)} ({resume})"]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._mid_update = self._training_ended = False  # this Trainer's fit, not an earlier one's
        # Every rank must write to and resume from the same place: rank zero's path decides.
        store = CheckpointStore(Path(trainer.strategy.broadcast(str(self.checkpoint_dir(trainer)))))
        contract = contract_of(trainer.strategy)
        retention = self.keep.retention()
        remote, replicator = attach_tiers(trainer, self.dirpath, self.tiers, retention)
        self.saver = CheckpointSaver(
            store, retention, self.async_save, self.keep.monitor, strategy=contract, replicator=replicator
        )
        self._exit = PreemptedExit(self.preemption, self.saver, store_url(self.dirpath))
        self._vote = StepVote(self.every_n_minutes, self.saver, self._exit.budget, bool(self.preemption.signals))
        self._exit.take_signals(trainer)
        launch_report.note(checkpoints=str(store.root))
        events = checkpoint_events(trainer)  # what this callback tells its neighbours
        events.store = store
        self._resumption = Resumption(self.resume, self.tiers.local_dirpath is None, events)
        self.saver.check_writable(trainer)
        self._vote.start(trainer, contract.collectives_at_step_start)
        # Finding, verifying and loading the checkpoint is the run's restore time (the goodput ledger's figure).
        with phase("restore"):
            layout = layout_named(contract.checkpoint_layout)
            loads_own = getattr(trainer.strategy, "loads_own_checkpoint", None)
            current = ResumingStrategy(type(trainer.strategy).__name__, layout, tuple(LAYOUTS.values()), loads_own)
            self._resumption.choose(trainer, store, current, remote, self.saver)
            self._resumption.preload(trainer, after_setup=False)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Sharded strategies (FSDP, DeepSpeed) can only load once the model is wrapped, after setup.
        with phase("restore"):
            self._resumption.preload(trainer, after_setup=True)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._training_started = True
        self._last_save_step = trainer.global_step
        if self._vote is not None:
            self._vote.saved()  # the timer counts from here
        trains = self._resumption.start_training(trainer)
        tell_resumed(trainer, Path(str(trainer.ckpt_path)) if trainer.ckpt_path else self.resumed_from)
        if not trains:
            trainer.should_stop = True  # even if max_steps was raised since: a finished run stays finished

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        order_this_epoch(trainer)  # before Lightning creates the epoch's iterator

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._resumption.restore_rng_once()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Resumed from a checkpoint at max_steps that is not marked final (a kill landed during the final
        # save): Lightning skips the training loop, so on_train_end never runs. Mark the run finished now.
        # The loop's `done` last: Lightning said "`Trainer.fit` stopped" when it asked; asked again, quietly.
        resumed_unfinished = self.resumed_from is not None and not self._resumption.stays_final
        skipped = resumed_unfinished and not self._training_started
        if self.save_on.train_end and skipped and fit_loop_done_quietly(trainer):
            self.save(trainer, reason="final", final=True, wait=True)
            self._tell_loggers(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        try:
            if self.saver is not None:
                self.saver.close()
        finally:
            if stage == "fit":
                for handle in self._watched_optimizers.values():
                    handle.remove()
                self._watched_optimizers.clear()
                if self._training_ended:  # finished and saved: a signal from then on must not turn it into a kill
                    preemption.acknowledge()
                preemption.release()
                if self._vote is not None:
                    self._vote.stop(trainer)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._mid_update = True  # an exception from here until the step returns may leave parameters half-updated
        if optimizer not in self._watched_optimizers and hasattr(optimizer, "register_step_post_hook"):
            self._watched_optimizers[optimizer] = optimizer.register_step_post_hook(self._update_done)

    def _update_done(self, *args: Any) -> None:
        self._mid_update = False  # the optimizer's step returned: every parameter has its update

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._mid_update = False
        # All of it, the per-step vote included, is what fault tolerance costs: a step's checkpoint time.
        with phase("checkpoint"):
            self._at_step_boundary(trainer)

    def _at_step_boundary(self, trainer: pl.Trainer) -> None:
        self._tell_loggers(trainer)
        step = trainer.global_step
        if step == self._last_save_step:  # gradient accumulation: no optimizer step happened
            return
        assert self._vote is not None and self._exit is not None  # made at setup
        due_by_steps = self.every_n_steps is not None and step % self.every_n_steps == 0
        # The end of an epoch is saved here, at its last batch, not in on_train_epoch_end: Lightning restores
        # a save made inside on_train_batch_end exactly (it knows that batch finished), while one made inside
        # on_train_epoch_end restarts the next epoch short.
        epoch_ends = self.save_on.epoch_end and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        agreed = self._vote.agree(trainer, self._last_save_step)
        if agreed.signalled:
            self._exit.respond(trainer, agreed, save=lambda: self._save_agreed(trainer, "signal", wait=True))
        if due_by_steps or agreed.due_by_time or epoch_ends:
            reason = "every_n_steps" if due_by_steps else "every_n_minutes" if agreed.due_by_time else "epoch_end"
            self._save_agreed(trainer, reason)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        preemption.acknowledge()  # a signal after the last step boundary: the run finishes and is saved
        if self.save_on.train_end and not self._resumption.stays_final:
            self._save_agreed(trainer, "final", final=True, wait=True)
        assert self.saver is not None  # made at setup
        self.saver.wait(trainer)
        if store_url(self.dirpath) is not None:  # every rank knows: the final checkpoint is in the store before the end
            self.saver.finish_copies(trainer)
        self._tell_loggers(trainer)
        self._training_ended = True

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # The exception decides how the process ends; a signal received meanwhile must not end it again. The
        # signals are given back only after the save below: one arriving during it must not kill the rank mid-write.
        preemption.acknowledge()
        try:
            self._save_after_exception(trainer, exception)
        finally:
            preemption.acknowledge()
            preemption.release()

    def _save_after_exception(self, trainer: pl.Trainer, exception: BaseException) -> None:
        exiting = self._exit is not None and self._exit.exiting
        if exiting or isinstance(exception, (CheckpointWriteError, KeyboardInterrupt)):
            return
        if isinstance(exception, StoppedTogether) and exception.unsafe_to_save:
            return  # e.g. replicas that diverged: the newest clean checkpoint is the one to resume
        if isinstance(exception, StoppedTogether) and exception.checkpoint_first:
            if self.saver is not None:  # every rank raised it at the same step boundary: the save may be collective
                self.saver.save_for_stop(trainer, exception, self._training_started)
            return
        # An error while setting up or resuming, or right after a save, leaves nothing new worth saving; one inside
        # the optimizer step (out of memory for its state, a scheduler's error) may leave some parameters updated
        # and others not, which a resume would silently train on: the newest clean checkpoint is the one to resume.
        if self.save_on.exception and self._training_started and trainer.global_step != self._last_save_step:
            if self._mid_update:
                rank_zero_warn(
                    "No checkpoint after the exception: it came inside the optimizer step, which may have "
                    "updated some parameters and not others; the newest checkpoint is the one to resume."
                )
                return
            assert self.saver is not None  # made at setup
            self.saver.save_after_exception(trainer, exception)  # rank zero alone: no collective may run

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_saved": str(self.last_saved) if self.last_saved else None}

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint[DATA_POSITION_KEY] = data_position(trainer)  # where the epoch is, in samples of the whole job
        loops_as_resumable(trainer, checkpoint)  # the final save: the stopped epoch as a resume must continue it

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # Every way in (auto-resume, ckpt_path) under every strategy: the position, read before Lightning drops it.
        self._resumption.saved_position = checkpoint.get(DATA_POSITION_KEY)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        last = state_dict.get("last_saved")
        self._restored_last_saved = Path(last) if last else None

    def save(self, trainer: pl.Trainer, reason: str = "manual", final: bool = False, wait: bool = False) -> None:
        """Save now, on every rank (collective), by the commit protocol; ``wait``: return once committed.

        What the triggers call; call it yourself from a hook every rank runs (e.g. ``on_train_batch_end``).
        """
        assert self.saver is not None, "save() needs the trainer's setup (fit) to have run"
        self.saver.save(trainer, reason, final, wait)
        self._last_save_step = trainer.global_step
        if self._vote is not None:
            self._vote.saved()

    def _save_agreed(self, trainer: pl.Trainer, reason: str, final: bool = False, wait: bool = False) -> Path | None:
        """A save every rank agreed on: the vetters have their say first; committed ones go to the loggers."""
        vet_save(trainer)
        self.save(trainer, reason, final, wait)
        if wait:
            self._tell_loggers(trainer)
        return self.last_saved

    def _tell_loggers(self, trainer: pl.Trainer) -> None:
        """Rank zero, main thread: hand each newly committed checkpoint to loggers that upload them."""
        if self.saver is not None:
            hand_over_committed(trainer, self.saver.take_committed())
