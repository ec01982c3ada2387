"""One live job per run directory, for ``fit``: rank zero holds it, and every rank of a refused job exits 2.

Rank zero takes the run's lock (``process/run_lock.py``) in ``before_fit``: after every check of the input, before
any file of the run is written and before it meets any other rank. How the other ranks of a refused job end
depends on who started them:

- one process, or ranks that Lightning's launcher starts from rank zero: rank zero refuses at once, in one line,
  exit 2; those ranks are never started, and nothing waits for them;
- ranks that started on their own (torchrun, ``launch``, srun, several nodes): they already wait in the
  rendezvous, and an absent rank zero would keep them there until ``startup_timeout``. So rank zero joins it
  with its loggers dropped (they would open a version folder in the holder's directory), and at the first
  callback ``setup`` every rank reads rank zero's verdict in one broadcast; refused, every rank exits 2
  before any other callback is set up (rank zero says why). Ranks started by Lightning's launcher learn which
  of the two it is from their launcher's environment, so every rank of a job takes the same path.

Example::

    RunDirGuard.add_arguments(parser)                                   # --run_dir_wait
    RunDirGuard.hold(trainer, run_dir, wait_s=config["run_dir_wait"])   # before_fit, every rank
"""

from __future__ import annotations

import os
from pathlib import Path

from jsonargparse.typing import NonNegativeFloat
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override

from lightning_mlopt.exceptions import RunDirBusy
from lightning_mlopt.process.run_lock import DEFAULT_WAIT_S, JOB_ID_VARIABLES, RunLock
from lightning_mlopt.run_dir import DEFAULT_RUNS_ROOT

MODE_ENV = "LIGHTNING_MLOPT_RUN_DIR_GUARD"
"""``<agreed|decided>:<pid>``: set by a process before Lightning's launcher starts ranks from it."""


class RunDirGuard(Callback):
    """Where ranks started on their own learn, at setup, whether rank zero holds the run directory.

    Args:
        refusal: rank zero's verdict: the refusal naming the live holder, or None (held). Read on rank zero only.

    """

    def __init__(self, refusal: str | None = None) -> None:
        self.refusal = refusal

    @staticmethod
    def add_arguments(parser: LightningArgumentParser) -> None:
        """The run directory's top-level keys: ``run_dir`` and ``run_dir_wait``."""
        parser.add_argument(
            "--run_dir",
            type=str | None,
            default=None,
            help=(
                "Folder for this run's config, logs and checkpoints. Default: "
                f"<trainer.default_root_dir or '{DEFAULT_RUNS_ROOT}'>/<config file stems>-<config hash>, "
                "the same on every relaunch of the same command. One live fit at a time: a second is refused."
            ),
        )
        parser.add_argument(
            "--run_dir_wait",
            type=NonNegativeFloat,
            default=DEFAULT_WAIT_S,
            help=(
                "Seconds a fit waits for the job holding its run directory when that job is an earlier attempt of "
                f"the same job (the same {' or '.join(JOB_ID_VARIABLES)}: a requeue that came while the old job is "
                "still ending), then refuses with status 2; any other live holder is refused at once. 0: no wait."
            ),
        )

    @classmethod
    def hold(cls, trainer: Trainer, run_dir: Path | None, wait_s: float | None) -> None:
        """``before_fit``, every rank: rank zero holds ``run_dir`` or the job is refused (see the module).

        The lock goes when this rank writes its exit status (``launch_report``), or with the process.
        """
        if run_dir is None:
            return
        agreed = _agreed_at_setup(trainer)
        refusal = None
        if trainer.global_rank == 0:
            lock = RunLock(run_dir)
            try:
                lock.acquire(wait_s or 0.0)
            except RunDirBusy as busy:
                if not agreed:
                    raise
                refusal = str(busy)
                trainer.loggers = []  # a logger's first act, before any callback, is a version folder
            if lock.took_over is not None:
                print(f"run_dir: took it over from a job that is gone ({lock.took_over.describe()})", flush=True)
        if agreed:
            # First, so that a refusal comes before any other callback's setup.
            trainer.callbacks.insert(0, cls(refusal))  # type: ignore[attr-defined]

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Every rank, right after the rendezvous, before any other callback: one broadcast from rank zero.
        refusal = trainer.strategy.broadcast(self.refusal, src=0)
        if refusal is None:
            return
        # No other callback or logger was set up: none has anything to close, and none may write on the way out.
        trainer.callbacks = [self]  # type: ignore[attr-defined]
        trainer.loggers = []
        error = RunDirBusy(refusal)
        error.said_elsewhere = trainer.global_rank != 0
        raise error


def _agreed_at_setup(trainer: Trainer) -> bool:
    """Whether the job's ranks learn rank zero's verdict at setup (True) or rank zero decides alone (False).

    Every rank must answer alike. Rank zero decides alone when it is the only process or when Lightning's launcher
    starts every other rank from it (one node); the ranks it starts inherit that answer, tagged with its pid so
    that a process that merely inherits the environment does not take it for its own.
    """
    mode, _, parent = os.environ.get(MODE_ENV, "").partition(":")
    if mode and parent == str(os.getppid()):
        return mode == "agreed"
    if trainer.world_size == 1:
        return False
    strategy = trainer.strategy
    launches_peers = isinstance(strategy, ParallelStrategy) and not (
        strategy.cluster_environment is not None and strategy.cluster_environment.creates_processes_externally
    )
    agreed = not (launches_peers and trainer.num_nodes == 1)
    if launches_peers:  # the ranks Lightning's launcher starts from this process take this answer
        os.environ[MODE_ENV] = f"{'agreed' if agreed else 'decided'}:{os.getpid()}"
    return agreed
