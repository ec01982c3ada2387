"""How a preempted run ends: within the time the signal left, with what a relaunch resumes from said and recorded.

The checkpoint callback decides *that* the ranks agreed on a signal (the step vote); this object decides what
the grace allows (:class:`~lightning_mlopt.process.grace.SaveBudget`) and ends the process with the preemption
status, telling ``launch`` what was committed.

Example::

    response = PreemptedExit(Preemption(grace_s=30), saver, remote_url=None)
    response.take_signals(trainer)                        # setup
    if agreed.signalled:                                  # a step boundary where the ranks agreed on a signal
        response.respond(trainer, agreed, save=lambda: save_now(trainer))   # never returns
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_mlopt._compat import log_this_steps_metrics
from lightning_mlopt.checkpoint.saver import CheckpointSaver
from lightning_mlopt.checkpoint.settings import Preemption
from lightning_mlopt.checkpoint.step_vote import Agreed
from lightning_mlopt.exceptions import CheckpointWriteError
from lightning_mlopt.process import launch_report
from lightning_mlopt.process.grace import ANY_SIGNAL, SaveBudget, graces_from_environment, safety_margin_s
from lightning_mlopt.process.signals import preemption


class PreemptedExit:
    """The end of a preempted run: a save only if it fits, then ``SystemExit(exit_code)`` on every rank.

    Args:
        settings: the signals, exit status and grace.
        saver: the run's saver (what a save costs, the save in flight, the remote copies).
        remote_url: the object store behind the local tier, if any: its copy in flight gets what is left.

    """

    def __init__(self, settings: Preemption, saver: CheckpointSaver, remote_url: str | None) -> None:
        self.settings = settings
        self.saver = saver
        self.remote_url = remote_url
        self.exiting = False  # set just before the SystemExit: the exception hooks must not save again

    def take_signals(self, trainer: Any) -> None:
        """Own the signals for the run (flag-only handlers), with Lightning's own kept off them.

        The last-resort deadline sits below the grace when the grace is known (set, or announced by the launcher).
        """
        settings = self.settings
        graces = {ANY_SIGNAL: settings.grace_s} if settings.grace_s else graces_from_environment()
        preemption.own_for_run(trainer, settings.signals, settings.deadline_s, settings.exit_code, graces)

    def budget(self) -> SaveBudget:
        """After a signal: what the time left allows (unknown grace, or no signal: anything)."""
        left = preemption.seconds_left()
        if left is not None:
            announced = launch_report.announced_seconds_left()  # a cloud notice that `launch` polled
            if announced is not None:
                left = min(left, announced)
            left -= safety_margin_s(preemption.grace_s or left)
        return SaveBudget(left, self.saver.expected_save_seconds(), self.saver.in_flight_seconds_left())

    def respond(self, trainer: Any, agreed: Agreed, save: Callable[[], Path | None]) -> NoReturn:
        """Every rank, at the boundary where they agreed on a signal: ``save`` if the grace allows it, then exit.

        ``save`` makes the collective save and returns the checkpoint it committed.
        """
        preemption.acknowledge()  # acted on: it must not end the process a second time
        if agreed.no_time:
            self.exit_without_saving(trainer, finish_in_flight=not agreed.no_time_in_flight)
        # This batch's row goes to the loggers before the save: the run ends in this hook, where Lightning's loop
        # would log it next, and the checkpoint releases it to loggers that hold rows until one commits.
        log_this_steps_metrics(trainer)
        try:
            saved = save()
        except CheckpointWriteError as error:  # every rank agreed on it
            # The node is going away anyway: requeued, the job resumes from its newest commit. A disk that stays
            # full stops the relaunch at its start-up probe instead (74), with nothing more lost.
            step, path = self._newest_committed(trainer)
            rank_zero_warn(
                f"Preemption: the save of step {trainer.global_step} failed ({error}); a relaunch resumes from "
                f"{path or 'the start'} (step {step}). Exiting with status {self.settings.exit_code}."
            )
            self.exit(trainer, path, resume_step=step)
        step = trainer.global_step
        rank_zero_warn(f"Preemption signal: saved step {step}; exiting with status {self.settings.exit_code}.")
        self.exit(trainer, saved, resume_step=step)

    def exit_without_saving(self, trainer: Any, finish_in_flight: bool) -> NoReturn:
        """No room for a save: commit the save in flight if it fits, say what a relaunch resumes from, exit."""
        budget = self.budget()
        if finish_in_flight:  # it fits by the estimate; if it runs late anyway, it is abandoned at the limit
            self.saver.finish_in_flight_within(trainer, budget.seconds_left)
        else:
            self.saver.abandon_in_flight()
        step, path = self._newest_committed(trainer)
        redo = trainer.global_step - step
        resumes = (
            f"a relaunch resumes from {path} (step {step}; {redo} step(s) redone)"
            if path
            else f"nothing is committed yet: a relaunch starts again ({redo} step(s) redone)"
        )
        rank_zero_warn(
            f"Preemption ({preemption.describe()}): no time to save step {trainer.global_step} (a save takes up "
            f"to {budget.save_s or 0:.1f} s, {max(budget.seconds_left or 0, 0):.1f} s left before the kill); "
            f"{resumes}. Exiting with status {self.settings.exit_code}."
        )
        self.exit(trainer, path, resume_step=step)

    def _newest_committed(self, trainer: Any) -> tuple[int, Path | None]:
        """Rank zero: the step and folder a relaunch resumes from ((0, None): none); other ranks: (0, None)."""
        committed = self.saver.store.committed() if trainer.is_global_zero else []
        return committed[-1] if committed else (0, None)

    def exit(self, trainer: Any, resume_from: Path | None, resume_step: int) -> NoReturn:
        """End this rank with the preemption status, telling ``launch`` what a relaunch resumes from.

        A remote copy still running gets what is left of the grace; if it does not land, the local tier has
        the checkpoint (a relaunch on this node resumes from it) and the store keeps its previous one.
        """
        if self.remote_url is not None and not self.saver.finish_copies(trainer, self.budget().seconds_left):
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
        self.exiting = True
        raise SystemExit(self.settings.exit_code)
