"""Where the training data stands, in samples of the whole job, and where each rank starts at another world size.

Every epoch's global order is ``randperm(n)`` from (seed, epoch) at any world size (``data_order.py``): one
process reads it in order; N processes read it through DistributedSampler, rank r taking positions r, r+N,
r+2N... After k batches of b samples per rank, an N-process job has consumed exactly the first ``k*b*N``
positions of that order, whatever N. So the checkpoint records samples, not batches
(:func:`data_position`), and a resume with M data-parallel ranks skips ``S/M`` samples of each rank's own share
(under TP or 2D, the data-parallel size counts, not the world size):
rank r then starts at position ``S + r`` and takes every M-th, which is where the uninterrupted run at size M
stands when ``S`` is a multiple of ``M*b``, and otherwise the nearest thing that exists: every sample of the
epoch is seen exactly once across the ranks, none twice, none skipped (DistributedSampler's padding aside, as
in any epoch). Lightning's count of the epoch's batches is set to the batches the new size has consumed, so
the epoch ends where its data does.

Example::

    checkpoint["data_position"] = data_position(trainer)     # {"epoch": 1, ..., "samples": 512, "replicas": 2}
    per_rank, _ = samples_to_skip(saved_position, loaders, replicas=1)   # 512: skip the first 512 of the order
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Any, Literal, cast

from torch.utils.data import BatchSampler, Sampler

from lightning_mlopt._compat import epoch_loaders, reopen_last_epoch, start_next_epoch_afresh
from lightning_mlopt.checkpoint.data_order import data_seed, resumable_loaders, samples_in_epoch

DATA_POSITION_KEY = "data_position"  # in every checkpoint's state


def data_replicas(trainer: Any) -> int:
    """The processes that share each epoch's data: the world size, or under TP/2D the data-parallel size only.

    What the strategy's DistributedSampler is given (``distributed_sampler_kwargs``); one device has none.
    """
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", trainer.world_size))


def data_position(trainer: Any) -> dict[str, Any]:
    """Where the training data stands, world-size free: epoch, order seed and samples the job consumed in it.

    ``samples`` is None where a loader's batch size is unknown; ``replicas``: the processes that shared the epoch
    (:func:`data_replicas`).

    Example::

        {"epoch": 1, "seed": 1234, "batches_per_rank": 8, "samples": 512, "replicas": 4}
    """
    _, combined = epoch_loaders(trainer)
    epoch, batches = epoch_and_batches(trainer)
    loaders = combined.flattened if combined is not None else []
    replicas = data_replicas(trainer)
    return {
        "epoch": epoch,
        "seed": data_seed(),
        "batches_per_rank": batches,
        "samples": samples_in_epoch(batches, loaders, replicas),
        "replicas": replicas,
    }


def epoch_and_batches(trainer: Any) -> tuple[int, int]:
    """The epoch a resume continues and the batches per rank it has used: Lightning's counts, read as a resume must.

    While an epoch runs these are Lightning's own. Once training has stopped (the final save, in
    ``on_train_end``), Lightning has counted the last epoch complete whether its data was used up or not: a run
    stopped by ``max_steps`` after 30 of 32 batches reads "epoch 1, 30 batches", and continuing it would skip 30
    batches of epoch 1 and never see the rest of epoch 0. Here that is epoch 0 with 30 batches used; an epoch that
    did use up its data continues as the next one, with none used.

    Example::

        epoch_and_batches(trainer)   # (0, 30) at the end of a run stopped by max_steps=30 in a 32-batch epoch
    """
    batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    stopped = _how_training_stopped(trainer)
    if stopped is None:
        return trainer.current_epoch, batches
    if stopped == "used up":
        return trainer.current_epoch, 0
    return trainer.current_epoch - 1, batches


def loops_as_resumable(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Make a checkpoint saved after training stopped hold the loop state :func:`epoch_and_batches` reads.

    Lightning, restoring "epoch 1 complete, 30 batches of it processed", would run epoch 1 from batch 30 (or,
    with the epoch's data used up, end it after one batch). Saves while an epoch runs are left as they are.
    """
    stopped = _how_training_stopped(trainer)
    if stopped == "used up":
        start_next_epoch_afresh(checkpoint)
    elif stopped == "cut":
        reopen_last_epoch(checkpoint)


def _how_training_stopped(trainer: Any) -> Literal["used up", "cut"] | None:
    """After training stopped, whether its last epoch used up its data or was cut; None while an epoch runs.

    Lightning counts an epoch complete when its loop ends, whatever ended it (``max_steps``, ``should_stop``),
    and resets the epoch's batch count only when the next epoch starts: both counted, nothing begun since.
    """
    loop = trainer.fit_loop
    epochs, progress = loop.epoch_progress.current, loop.epoch_loop.batch_progress
    batches = progress.current.processed
    if epochs.ready != epochs.completed or batches == 0:  # an epoch in flight, or none begun
        return None
    return "used up" if progress.is_last_batch or batches >= trainer.num_training_batches else "cut"


def saved_replicas(position: dict[str, Any], loaders: Iterable[Any]) -> int | None:
    """The data replicas that wrote ``position`` (recorded, or for older checkpoints, from samples and batches)."""
    if position.get("replicas"):
        return int(position["replicas"])
    per_rank = samples_in_epoch(int(position.get("batches_per_rank") or 0), loaders, 1)
    if not per_rank or position.get("samples") is None:
        return None
    return int(position["samples"]) // per_rank


def samples_to_skip(position: dict[str, Any], loaders: list[Any], replicas: int) -> tuple[int | None, str]:
    """Samples each of ``replicas`` data-parallel ranks skips to continue ``position``'s epoch; or None and why not.

    0 when the epoch was used up (saved at its end): the next epoch starts as it would have.
    """
    samples = position.get("samples")
    if samples is None:
        return None, "the checkpoint does not record the samples the epoch used (a loader's batch size is unknown)"
    usable = resumable_loaders(loaders)
    if len(usable) != 1 or len(loaders) != 1:
        return None, "the position is placed exactly for one training DataLoader over a map-style dataset"
    if type(usable[0].batch_sampler) is not BatchSampler:
        return None, "the DataLoader has a batch sampler of its own, which cannot be entered mid-batch"
    if samples >= len(cast(Sized, usable[0].dataset)):  # a partial last batch counts as a whole one: >=
        return 0, ""
    if samples % replicas:
        return None, f"{samples} samples consumed do not split evenly over {replicas} ranks"
    return samples // replicas, ""


def skip_first_samples(loader: Any, count: int) -> None:
    """Make the DataLoader's next iteration start after the first ``count`` indices of its sampler (once)."""
    batch_sampler = loader.batch_sampler
    skipping = SkipFirstOnce(batch_sampler.sampler, count)
    # DataLoader forbids reassigning batch_sampler after construction; this is the one sanctioned use.
    object.__setattr__(
        loader, "batch_sampler", BatchSampler(skipping, batch_sampler.batch_size, batch_sampler.drop_last)
    )


def set_batches_done(trainer: Any, batches: int) -> None:
    """Lightning's count of this epoch's batches, as the job at this world size would have it.

    A save inside ``on_train_batch_end`` counts its batch processed, not yet completed; Lightning completes it
    when the loop restarts. That one-batch difference is kept.
    """
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    pending = current.processed - current.completed
    current.ready = current.started = current.processed = batches
    current.completed = batches - pending


class SkipFirstOnce(Sampler[Any]):
    """A sampler or batch sampler whose next iteration drops its first ``skip`` items, then passes all through.

    Only indices are drawn: no sample is loaded. Its length stays the full one (Lightning counts the epoch's
    batches from the restored position itself), and every other attribute (``set_epoch``, ``batch_size``,
    ``drop_last``, ``generator``...) is read through.
    """

    def __init__(self, sampler: Any, skip: int) -> None:
        self.sampler = sampler
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.sampler)
        skip, self.skip = self.skip, 0
        for _ in range(skip):
            next(iterator, None)
        yield from iterator

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["sampler"], name)
