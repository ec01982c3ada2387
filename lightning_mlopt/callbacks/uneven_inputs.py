"""UnevenInputs: when one rank's data runs out, every rank ends the epoch at that same batch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import has_len
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch.utils.data import IterableDataset
from typing_extensions import override

from lightning_mlopt._compat import data_ends_after_this_batch, end_loop_after_this_batch
from lightning_mlopt.distributed.step_exchange import step_exchange

_KEY = "uneven.train"
UNKNOWN = -1.0  # a batch count a loader without a length cannot give


@dataclass(frozen=True)
class EarlyEnd:
    """One loop that UnevenInputs ended early on some ranks.

    Attributes:
        stage: ``train``, ``validate``, ``test`` or ``sanity check``.
        epoch: the trainer's epoch.
        batches: the batches every rank ran in it.
        short_ranks: the ranks whose data ended there.
        unused: for each other rank, the batches it left unused (``None``: its loader has no length).

    """

    stage: str
    epoch: int
    batches: int
    short_ranks: tuple[int, ...]
    unused: dict[int, int | None]

    def describe(self) -> str:
        """The one line a user reads, with the fix."""
        short = ", ".join(str(rank) for rank in self.short_ranks)
        left = "; ".join(
            f"rank {rank}: {count} batch{'es' if count != 1 else ''}"
            if count is not None
            else f"rank {rank}: at least 1 (its loader has no length)"
            for rank, count in self.unused.items()
        )
        return (
            f"UnevenInputs: {self.stage} epoch {self.epoch} ended on every rank after {self.batches} batches: the "
            f"data of rank{'s' if len(self.short_ranks) > 1 else ''} {short} ran out there, and the others stopped "
            f"with it, leaving unused {left}. Give every rank as many batches (a DistributedSampler, which "
            "Lightning adds to a map-style dataset; drop_last=True; an IterableDataset that splits its shards "
            "evenly across ranks)."
        )


class UnevenInputs(pl.Callback):
    """Ends every rank's epoch (training, validation, test) at the batch where the first rank's data runs out.

    Ranks whose loaders give different numbers of batches (an IterableDataset over uneven shards, a sampler
    of its own, ``drop_last=False`` with a remainder) fall out of step: the rank with more batches waits in a
    collective the others never join, a hang under DDP or a crash under FSDP when the others exit. Here they
    stop together, and one line says which rank ran short and what the others left unused.

    At the start of each loop (a training epoch, a validation or test run), one small all-reduce compares the
    ranks' batch counts. Loaders that have a length, equal on every rank (Lightning's DistributedSampler
    gives that), need nothing more. Otherwise each batch's "this is this rank's last batch" is summed at the
    batch's start: for training in the per-step exchange (FaultTolerantCheckpoint's vote rides in the same
    sum, so the CLI makes no more collectives, only an in-step one instead of the vote's background one), for
    evaluation in one small all-reduce per batch. When any rank is on its last batch, every rank makes that
    batch its last: it is finished (the optimizer steps, as on any epoch's last batch) and the epoch ends.

    torch's ``Join`` is the alternative: ranks that run out keep shadowing the others' collectives until all
    are done. It covers DDP's gradient all-reduce only (not FSDP's all-gathers, ZeRO or tensor parallelism,
    nor a metric's sync), and the short rank's shadow steps train on nothing; ending together is one rule
    for every strategy, at the cost of the longer ranks' remaining batches, which the line counts.

    Not covered: a rank with no batch at all in an epoch (it never reaches a batch start); several
    validation or test dataloaders whose lengths differ across ranks (warned once, left to Lightning); a
    ``training_step`` that takes ``dataloader_iter`` (its last batch is not known at the batch's start).

    Attributes:
        early_ends: every loop it ended early, in order (the lines it printed, as records).

    Example::

        trainer = Trainer(strategy="ddp", devices=2, callbacks=[UnevenInputs()])  # the CLI adds it

    """

    def __init__(self) -> None:
        self.early_ends: list[EarlyEnd] = []
        self._counts: dict[str, list[float] | None] = {}  # per stage: every rank's batch count; None: no watch
        self._warned_multiple = False

    # ------------------------------------------------------------------ training

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A run resumed in the middle of an epoch does not call on_train_epoch_start for it: watch it from here.
        # Batches of the epoch already ran only then (every rank restored the same progress); a fresh run's
        # epoch start compares, once.
        if trainer.fit_loop.epoch_loop.batch_progress.current.ready > 0:
            self._watch_training(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._watch_training(trainer, pl_module)

    def _watch_training(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
            self._counts["train"] = None
            return
        counts = self._compare(trainer, [trainer.num_training_batches], trainer.train_dataloader)
        self._counts["train"] = counts
        fraction = isinstance(trainer.val_check_interval, float) and trainer.val_check_batch != float("inf")
        if counts is not None and UNKNOWN not in counts and fraction:
            # Lightning works out the batch to validate at from each rank's own count: with counts that differ,
            # the ranks would validate at different batches (or one not at all). Every rank takes the shortest's.
            trainer.val_check_batch = max(1, int(min(counts) * trainer.val_check_interval))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        counts = self._counts.get("train")
        if counts is None:
            return
        exchange = step_exchange(trainer)
        loops = (trainer.fit_loop, trainer.fit_loop.epoch_loop)
        exchange.put(trainer, _KEY, self._my_state(trainer, counts, batch_idx, *loops))
        self._end_if_any_rank_ends(trainer, "train", exchange.read(trainer, _KEY), batch_idx, *loops)

    # ------------------------------------------------------------------ validation and test

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if is_param_in_hook_signature(pl_module.validation_step, "dataloader_iter", explicit=True):
            self._counts["validate"] = None
            return
        counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        self._counts["validate"] = self._compare(trainer, list(counts), trainer.val_dataloaders)

    @override
    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if is_param_in_hook_signature(pl_module.test_step, "dataloader_iter", explicit=True):
            self._counts["test"] = None
            return
        self._counts["test"] = self._compare(trainer, list(trainer.num_test_batches), trainer.test_dataloaders)

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._evaluation_batch(trainer, "validate", batch_idx)

    @override
    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._evaluation_batch(trainer, "test", batch_idx)

    def _evaluation_batch(self, trainer: pl.Trainer, stage: str, batch_idx: int) -> None:
        counts = self._counts.get(stage)
        if counts is None:
            return
        loop = self._evaluation_loop(trainer, stage)
        summed = step_exchange(trainer).sum_now(trainer, self._my_state(trainer, counts, batch_idx, loop, loop))
        self._end_if_any_rank_ends(trainer, stage, summed.tolist(), batch_idx, loop, loop)

    @staticmethod
    def _evaluation_loop(trainer: pl.Trainer, stage: str) -> Any:
        if stage == "test":
            return trainer.test_loop
        return trainer.fit_loop.epoch_loop.val_loop if trainer.state.fn == TrainerFn.FITTING else trainer.validate_loop

    # ------------------------------------------------------------------ shared

    def _compare(self, trainer: pl.Trainer, counts: list[float], loaders: Any) -> list[float] | None:
        """Every rank's batch count (UNKNOWN for a loader without a length) if they differ or are unknown."""
        if trainer.world_size < 2:
            return None
        if len(counts) != 1:  # several evaluation dataloaders: one count each, compared below only if one
            if not self._warned_multiple:
                rank_zero_warn(
                    "UnevenInputs watches one validation or test dataloader; with several, ranks whose loaders "
                    "differ in length are left to Lightning (give each rank as many batches)."
                )
                self._warned_multiple = True
            return None
        # An IterableDataset's length is what it says, not what each rank's shard holds (streaming datasets).
        sized = all(
            has_len(loader) and not isinstance(getattr(loader, "dataset", None), IterableDataset)
            for loader in CombinedLoader(loaders).flattened
        )
        mine = counts[0] if sized and math.isfinite(counts[0]) else UNKNOWN
        every = torch.zeros(trainer.world_size, dtype=torch.float64)
        every[trainer.global_rank] = mine
        lengths = step_exchange(trainer).sum_now(trainer, every).tolist()
        if UNKNOWN not in lengths and len(set(lengths)) == 1:
            return None  # equal lengths: every rank ends at the same batch by itself
        return lengths

    @staticmethod
    def _my_state(
        trainer: pl.Trainer, counts: list[float], batch_idx: int, fetcher_owner: Any, loop: Any
    ) -> torch.Tensor:
        """[1 at my slot if this is my last batch] + [my unused batches after this one, at my slot]."""
        world, rank = trainer.world_size, trainer.global_rank
        state = torch.zeros(2 * world, dtype=torch.float64)
        count = counts[rank]
        if count == UNKNOWN:  # no length: look one batch ahead where Lightning does not (a limit on it)
            last = data_ends_after_this_batch(fetcher_owner)
        else:  # a length: this rank's count says it (also after a mid-epoch resume)
            last = batch_idx + 1 >= count or bool(loop.batch_progress.is_last_batch)
        if last:
            loop.batch_progress.is_last_batch = True
            state[rank] = 1.0
        state[world + rank] = UNKNOWN if count == UNKNOWN else max(0.0, count - batch_idx - 1)
        return state

    def _end_if_any_rank_ends(
        self, trainer: pl.Trainer, stage: str, summed: list[float], batch_idx: int, fetcher_owner: Any, loop: Any
    ) -> None:
        world = trainer.world_size
        last, unused = summed[:world], summed[world:]
        short = tuple(rank for rank in range(world) if last[rank] > 0)
        if not short or len(short) == world:
            return
        end_loop_after_this_batch(fetcher_owner, loop)
        left = {rank: None if unused[rank] == UNKNOWN else int(unused[rank]) for rank in range(world)}
        stage_name = "sanity check" if trainer.sanity_checking else stage
        early = EarlyEnd(
            stage_name, trainer.current_epoch, batch_idx + 1, short, {r: n for r, n in left.items() if r not in short}
        )
        self.early_ends.append(early)
        rank_zero_warn(early.describe())
