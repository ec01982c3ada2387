"""CollectiveSequenceCheck: ranks that issue different collectives are stopped at a step boundary, named."""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_mlopt._compat import default_store
from lightning_mlopt.distributed.collective_recorder import CollectiveRecorder, installed_recorder
from lightning_mlopt.distributed.collective_reports import SegmentSummary, all_agree, describe_reports, to_report
from lightning_mlopt.distributed.peer_loss import is_peer_loss
from lightning_mlopt.distributed.step_exchange import step_exchange
from lightning_mlopt.distributed.store_gather import gather_through_store
from lightning_mlopt.exceptions import CollectivesDivergedError
from lightning_mlopt.hooks import DescribesHang, SaveVetter

_KEY = "collectives"
GATHER_WAIT_S = 10.0
"""How long a rank waits for the others' records in the store (they are at the same boundary, or hung)."""


class CollectiveSequenceCheck(pl.Callback, SaveVetter, DescribesHang):
    """Compares the collectives each rank issued in every step; stops every rank, naming them, when they differ.

    A collective behind a rank-dependent branch (``self.log(..., sync_dist=True)`` inside
    ``if self.global_rank == 0``, an ``all_gather`` for a metric on one rank) is the commonest hang that is not
    the network's. While training runs, a recorder (``distributed/collective_recorder.py``) wraps
    ``torch.distributed``'s Python collectives and keeps, per step, their count and an order-sensitive
    fingerprint of their ops, shapes and dtypes. Both ride in the per-step exchange (four float64 in the sum
    every callback shares, summed in the background: nothing waits for it on the step's path), and are
    compared at the next step boundary; before any checkpoint is saved, everything up to that moment is.
    When they differ, every rank learns it from the same sum, reads the others' records through the job's
    store (not a collective: they no longer pair up), and raises
    :class:`~lightning_mlopt.exceptions.CollectivesDivergedError` with one line, e.g.::

        ranks diverged at collective #1 of step 2: rank 0 all_reduce(float32[4]) at model.py:42;
        rank 1 all_reduce(float32[2, 2]) at model.py:42

    Nothing from the diverged step is saved (FaultTolerantCheckpoint keeps the newest clean checkpoint), and
    the CLI exits with status 1. Where the diverged collectives hang inside the step instead (two different
    ops that cannot pair: the usual case), NCCLHealthCheck's watchdog fires and its report leads with the same
    kind of line, read from each rank's recorder through the store.

    Not compared, because every rank issues them in the same order by construction: DDP's gradient
    all-reduce, DTensor's collectives (tensor parallelism) and point-to-point sends (pipelines). One process
    (or no process group) records nothing and costs nothing; off, torch.distributed is untouched.

    Args:
        wait_s: how long a rank waits for the others' records in the store when they disagree or hang.
        enabled: False turns the check off (the CLI adds an enabled one unless the run's callbacks hold one).

    Example::

        trainer = Trainer(strategy="ddp", devices=2, callbacks=[CollectiveSequenceCheck()])

    """

    _fits = 0  # fits started in this process, for store keys of their own

    def __init__(self, wait_s: float = GATHER_WAIT_S, enabled: bool = True) -> None:
        if wait_s <= 0:
            raise ValueError(f"wait_s must be > 0, got {wait_s}")
        self.wait_s = wait_s
        self.enabled = enabled
        self.steps_compared = 0
        self._recorder: CollectiveRecorder | None = None
        self._trainer: pl.Trainer | None = None
        self._in_exchange: list[SegmentSummary] = []  # segments closed for a sum not yet delivered, oldest first
        self._diverged: SegmentSummary | None = None
        self._hang_line: str | None = None
        self._fit = 0

    @property
    def recorder(self) -> CollectiveRecorder | None:
        """The run's recorder (kept after training ends, for a hang report), or None on one process."""
        return self._recorder

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled or trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return
        if installed_recorder() is not None:  # another Trainer's, in the same process: theirs records
            return
        self._trainer, self._in_exchange, self._diverged, self._hang_line = trainer, [], None, None
        CollectiveSequenceCheck._fits += 1
        self._fit = CollectiveSequenceCheck._fits  # the same on every rank: they run the same fits
        self._recorder = CollectiveRecorder().install()
        self._recorder.step = trainer.global_step
        # Asked at the batch's first exchange, whichever callback makes it (the same point on every rank).
        step_exchange(trainer).provide(_KEY, self._close_segment, receive=self._compare)

    def _close_segment(self) -> torch.Tensor:
        assert self._recorder is not None and self._trainer is not None
        summary = self._recorder.close_segment(next_step=self._trainer.global_step)
        self._in_exchange.append(summary)
        return summary.comparable()

    def _compare(self, summed: list[float]) -> None:
        if self._trainer is None or not self._in_exchange:  # a sum that was in flight when the check stopped
            return
        self._judge(self._in_exchange.pop(0), summed)

    def _judge(self, summary: SegmentSummary, summed: list[float]) -> None:
        assert self._trainer is not None
        self.steps_compared += 1
        if self._diverged is None and not all_agree(summed, self._trainer.world_size):
            self._diverged = summary

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        recorder = self._recorder
        if recorder is None or not recorder.installed:
            return
        # In the background: a sum made in step here would be a wait for the slowest rank every step (measured
        # +5-8% under FSDP on 2 CPU processes, against about 1% for one left in flight). Where another callback
        # reads in step (FaultTolerantCheckpoint's vote under FSDP on CPU), it reads this same sum.
        with recorder.paused():  # the comparison's own sum is not part of any step
            step_exchange(trainer).read_previous(trainer, _KEY)  # starts this step's sum, delivers the last one
        self._stop_if_diverged(trainer)

    @override
    def before_checkpoint(self, trainer: pl.Trainer) -> None:
        """Right before a save, every rank: everything up to here is compared now; a diverged step is never saved."""
        self._compare_all_now(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._compare_all_now(trainer)
        self._stop_recording(trainer)

    def _compare_all_now(self, trainer: pl.Trainer) -> None:
        """The sum in flight, and the segment still open (its collectives since the batch's exchange), now."""
        recorder = self._recorder
        if recorder is None or not recorder.installed:
            return
        exchange = step_exchange(trainer)
        with recorder.paused():
            exchange.settle()
            summary = recorder.close_segment(next_step=trainer.global_step)
            self._judge(summary, exchange.sum_now(trainer, summary.comparable()).tolist())
        self._stop_if_diverged(trainer)

    def _stop_if_diverged(self, trainer: pl.Trainer) -> None:
        diverged = self._diverged
        if diverged is None:
            return
        # Every rank is here, at the same boundary: the same sum told each of them.
        prefix = f"{self._store_prefix()}/diverged"
        reports = gather_through_store(
            default_store(), prefix, trainer.global_rank, trainer.world_size, to_report(diverged, True), self.wait_s
        )
        self._stop_recording(trainer)
        raise CollectivesDivergedError(
            f"{describe_reports(reports, trainer.world_size)}. Nothing from that step was saved. Every rank must "
            "issue the same collectives: move a sync_dist log, an all_gather or a barrier out of any branch that "
            "depends on the rank or on the data."
        )

    def _store_prefix(self) -> str:
        """Keys of this fit in this launch: a relaunch under torchrun shares the store; tests run several fits."""
        return f"mlopt/collectives/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{self._fit}"

    def hang_report(self, trainer: pl.Trainer) -> str | None:
        """One line: which collective each rank is in and where they first differ; None without a recorder.

        For the hang watchdog's thread: each rank puts its recorder's open segment in the store and reads the
        others' (every rank's watchdog fires at about the same moment).
        """
        recorder = self._recorder
        if recorder is None:
            return None
        if self._hang_line is None:  # once: the watchdog and a peer's loss may both ask
            prefix = f"{self._store_prefix()}/hang"
            text = recorder.hang_report()
            reports = gather_through_store(
                default_store(), prefix, trainer.global_rank, trainer.world_size, text, self.wait_s
            )
            self._hang_line = describe_reports(reports, trainer.world_size)
        return self._hang_line

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_recording(trainer)
        recorder = self._recorder
        if recorder is not None and is_peer_loss(exception) and self._hang_line is None:
            # A peer died in a collective (gloo aborts a process whose collective pairs with one of another
            # size), and the launcher may kill this one any moment: say at once which collective this rank was
            # in. No waiting for the others' records: the one that could explain it is gone.
            last = recorder.last()
            where = (
                f"collective #{last.number} of step {recorder.step}: {last.call} at {last.site}"
                if last
                else f"no recorded collective of step {recorder.step}"
            )
            sys.stderr.write(f"CollectiveSequenceCheck: a peer left while rank {trainer.global_rank} was in {where}\n")
            sys.stderr.flush()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_recording(trainer)

    def _stop_recording(self, trainer: pl.Trainer) -> None:
        if self._recorder is not None and self._recorder.installed:  # kept: a hang report may still read it
            self._recorder.uninstall()
            step_exchange(trainer).withdraw(_KEY)
