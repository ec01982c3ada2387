"""One launch's resume, in order: rank zero chooses, every rank preloads, training starts at the exact position.

The steps themselves are in ``resume.py``; this object runs them at the Trainer hooks where each belongs and
remembers what was decided between them. The checkpoint callback calls it from ``setup``, ``on_fit_start``,
``on_train_start`` and ``on_train_batch_start``.

Example::

    resumption = Resumption(Resume(), remote_required=True, events=checkpoint_events(trainer))
    resumption.choose(trainer, store, ResumingStrategy("DDPStrategy", layout), remote=None, saver=saver)
    resumption.preload(trainer, after_setup=False)       # setup; sharded strategies: on_fit_start
    if resumption.start_training(trainer): ...           # on_train_start: False when the run is finished
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_mlopt.checkpoint.remote.checkpoints import RemoteCheckpoints
from lightning_mlopt.checkpoint.resume import (
    ResumeChoice,
    ResumingStrategy,
    choose_checkpoint,
    converted_for,
    load_rng,
    number_optimizer_states,
    position_in_epoch,
    preload,
    refuse_misfit,
)
from lightning_mlopt.checkpoint.rng import restore_rng_state
from lightning_mlopt.checkpoint.saver import CheckpointSaver
from lightning_mlopt.checkpoint.settings import Resume
from lightning_mlopt.checkpoint.store import CheckpointStore
from lightning_mlopt.exceptions import (
    BadInputError,
    CheckpointWriteError,
    ObjectStoreError,
    first_line,
    said_by_rank_zero,
)


class RemembersResume(Protocol):
    """Where the launch's resume point is published to its neighbours (``hooks.CheckpointEvents``)."""

    resumed_from: Path | None


class Resumption:
    """A launch's resume, from the choice to the first batch.

    Args:
        settings: whether to resume, from a finished run too, and what to trust.
        remote_required: a remote tier that cannot be read fails the resume (no local tier of one's own).
        events: where the checkpoint resumed from is published (read back as :attr:`resumed_from`).

    """

    def __init__(self, settings: Resume, remote_required: bool, events: RemembersResume) -> None:
        self.settings = settings
        self.remote_required = remote_required
        self.events = events
        self.stays_final = False  # resumed from a finished run that stays finished
        self._preloaded_path: str | None = None
        self._store: CheckpointStore | None = None
        self._remote: RemoteCheckpoints | None = None
        self._pending_rng: dict[str, Any] | None = None
        # The loaded checkpoint's data position (FaultTolerantCheckpoint.on_load_checkpoint sets it).
        self.saved_position: dict[str, Any] | None = None

    @property
    def resumed_from(self) -> Path | None:
        """The checkpoint this launch resumes from (None: a fresh start, or an explicit ``ckpt_path`` won)."""
        return self.events.resumed_from

    def choose(
        self,
        trainer: Any,
        store: CheckpointStore,
        strategy: ResumingStrategy,
        remote: RemoteCheckpoints | None,
        saver: CheckpointSaver,
    ) -> None:
        """Collective: rank zero chooses the checkpoint to resume from; every rank gets its choice or refusal."""
        self._store, self._remote = store, remote
        choice = None
        if self.settings.auto and trainer.is_global_zero:
            try:
                choice = choose_checkpoint(
                    store,
                    strategy,
                    self.settings.trust_pickles,
                    self.settings.final,
                    remote,
                    remote_required=self.remote_required,
                )
            except Exception as error:  # every rank waits in the broadcast below: it carries the error to them
                failure = f"choosing a checkpoint in {store.root} failed: {type(error).__name__}: {first_line(error)}"
                choice = ResumeChoice(None, failure=failure)
            if choice is not None and choice.manifest is not None:
                saver.note_resumed(choice.manifest)
        choice = trainer.strategy.broadcast(choice) or ResumeChoice(None)
        if choice.refusal is not None:
            with said_by_rank_zero(trainer.global_rank):  # one decision, said once
                raise BadInputError(choice.refusal)
        if choice.failure is not None:
            raise CheckpointWriteError(choice.failure)
        path = choice.path
        if choice.convert_from is not None:  # after the collective: a long conversion meets no timeout
            with said_by_rank_zero(trainer.global_rank):
                path = converted_for(choice, strategy, store.root, self.settings.trust_pickles, trainer.global_rank)
        self.events.resumed_from, self.stays_final = path, choice.stays_final

    def preload(self, trainer: Any, after_setup: bool) -> None:
        """Load the chosen checkpoint now, if this is when the strategy can (sharded ones: once wrapped).

        After setup (the optimizers exist), a named optimizer state, auto-resumed or from ``ckpt_path``, is
        numbered for strategies that leave the optimizers to Lightning.
        """
        if self.resumed_from is not None and trainer.strategy.restore_checkpoint_after_setup == after_setup:
            self._preloaded_path = preload(trainer, self.resumed_from, self.settings.trust_pickles)
            if not after_setup:  # one file, loaded whole: its weights can be checked against the model before use
                refuse_misfit(trainer, self.resumed_from)
        if after_setup:
            number_optimizer_states(trainer)

    def start_training(self, trainer: Any) -> bool:
        """Training starts: from a ``ckpt_path`` Lightning loaded, if any; the exact position is set.

        Lightning loads one only when ``Trainer.fit`` was given it: the CLI passes it on while the run has no
        checkpoint of its own, or with ``resume.ckpt_path: always`` (``warm_start.py``); a script, whenever it
        passes one. Returns False when the run is finished.
        """
        explicit = trainer.ckpt_path
        if self.resumed_from is not None and explicit and str(explicit) != self._preloaded_path:
            rank_zero_info(
                f"Training from the given ckpt_path ({explicit}), not from this run's own {self.resumed_from}."
            )
            # The run trains from the explicit checkpoint: a finished auto-choice no longer holds its final save.
            self.events.resumed_from, self.stays_final = None, False
        if explicit and str(explicit) != self._preloaded_path and trainer.is_global_zero:
            self._set_aside_rolled_back(Path(str(explicit)).parent, trainer.global_step)
        if self.resumed_from is not None and self.stays_final:
            return False
        rng_state = None
        if self.resumed_from is not None:
            rng_state = load_rng(
                self.resumed_from, trainer.global_rank, trainer.world_size, self.settings.trust_pickles
            )
        # Fresh or resumed, this epoch's data comes in the order (seed, epoch) gives: a later resume finds it.
        resumed = self.resumed_from is not None or bool(explicit)
        self._pending_rng = position_in_epoch(trainer, rng_state, resumed, self.saved_position)
        return True

    def _set_aside_rolled_back(self, folder: Path, loaded_step: int) -> None:
        """Rank zero, before any save: a restart from an older step moves the run's newer checkpoints aside.

        The step is the folder's when it is one of this run's, else the step the loaded checkpoint restored
        (another run's, or a converted copy): the run's own newer saves would shadow the new branch all the same.
        """
        store, remote = self._store, self._remote
        if store is None:
            return
        step = store.step_of(folder)
        step = loaded_step if step is None else step
        moved = store.set_aside_newer_than(step)
        if moved:
            rank_zero_info(
                f"Rolled back to step {step}: the {len(moved)} newer checkpoints of this run were moved to "
                f"{moved[0].parent}, so auto-resume and retention see only this branch."
            )
        try:  # rank zero alone, the others on their way to the first step: a store error must not end it here
            newer_remote = [each for each in remote.committed() if each > step] if remote is not None else []
        except ObjectStoreError as error:
            rank_zero_warn(f"Rolled back to step {step}; whether the store holds newer checkpoints is unknown: {error}")
            return
        if remote is not None and newer_remote:
            rank_zero_warn(
                f"Rolled back to step {step}, but {remote.url} still holds newer checkpoints of this run (steps "
                f"{', '.join(map(str, newer_remote))}): until this branch saves past them, an auto-resume from the "
                "store would take them. Move them away in the store."
            )

    def restore_rng_once(self) -> None:
        """The first batch: every RNG where the uninterrupted run had it (after Lightning's own restore)."""
        if self._pending_rng is not None:
            restore_rng_state(self._pending_rng)
            self._pending_rng = None
