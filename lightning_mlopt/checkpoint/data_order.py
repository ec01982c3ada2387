"""A training epoch's data order as a function of (seed, epoch): what makes a mid-epoch resume find its place.

Lightning leaves a one-process run's shuffled DataLoader with a ``RandomSampler`` that draws its permutation
from the global torch RNG when the epoch's iterator starts, and every DataLoader draws its workers' base seed
from that RNG too. A relaunch that resumes mid-epoch creates the iterator from another RNG state: another
permutation, so skipping "the batches this epoch used" skips the wrong samples (some seen twice, some never),
and other worker seeds (other random augmentations). Multi-process runs escaped the first half only because
Lightning gives them a ``DistributedSampler``, seeded with (seed, epoch).

:func:`seed_epoch` gives every training DataLoader that property at any world size, before each epoch's
iterator is created: a ``RandomSampler`` draws from a generator seeded with ``seed + epoch``, so its order is
exactly DistributedSampler's global order (``torch.randperm(n)`` from that seed): one process sees the samples
an N-process run of the same seed sees, in the same global order. The loader's own generator, which seeds
its workers, gets a stream of its own from (seed, epoch); evaluation loaders get one too
(:func:`seed_evaluation`), so a validation inside an epoch takes nothing from the global RNG that the next
training step draws from. Creating an iterator then draws nothing from the global RNG at all.

What cannot be made exact this way is said, one line per loader (:func:`exactness_notes`): an iterable-style
dataset with no ``state_dict``, a sampler whose order depends on hidden state, samples that draw from a global
random generator as they load (augmentation), workers that keep their random state across epochs.

Example::

    seed_epoch(combined_loader.flattened, seed=1234, epoch=trainer.current_epoch)  # before iter(...)
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

# Streams of (seed, epoch) that must not coincide with the order's own seed (``seed + epoch``).
_WORKER_STREAM = 1 << 40
_EVALUATION_STREAM = 1 << 41
# Generators this module made (a user's own generator is replaced, and said so once).
_OURS: weakref.WeakSet[torch.Generator] = weakref.WeakSet()
_EXACT_SAMPLERS = (RandomSampler, SequentialSampler, DistributedSampler)


def data_seed() -> int:
    """The run's data seed: the one ``seed_everything`` exported, as Lightning's DistributedSampler reads it."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def seed_epoch(loaders: Iterable[Any], seed: int, epoch: int) -> list[str]:
    """Make each training DataLoader's next iterator draw its order and worker seeds from (seed, epoch) alone.

    Call it before the epoch's iterator is created. Samplers with ``set_epoch`` (DistributedSampler) are told
    the epoch too, as Lightning does later. Loaders that restore their own position (a ``state_dict``, such
    as torchdata's StatefulDataLoader) are left alone. Returns one line per user-supplied generator replaced.
    """
    replaced = []
    for loader in resumable_loaders(loaders):
        for sampler in _samplers(loader):
            if type(sampler) is RandomSampler:
                if sampler.generator is not None and sampler.generator not in _OURS:
                    replaced.append(
                        f"the {type(loader.dataset).__name__} train DataLoader's RandomSampler had a generator of its"
                        " own: it is replaced by one seeded with seed + epoch, so that a resume can restore the order"
                    )
                sampler.generator = _generator(seed + epoch)
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
        loader.generator = _generator(seed + epoch + _WORKER_STREAM)
    return replaced


def seed_evaluation(loaders: Iterable[Any], seed: int) -> None:
    """Give evaluation DataLoaders a generator of their own for their workers' seeds (left alone if set).

    A validation inside an epoch would otherwise draw one number from the global RNG when its iterator starts,
    between two training steps: a resumed run, which restores the RNG before its next step, would not draw it.
    """
    for loader in resumable_loaders(loaders):
        if loader.generator is None:
            loader.generator = _generator(seed + _EVALUATION_STREAM)


def exactness_notes(loaders: Iterable[Any]) -> list[str]:
    """One line per training loader whose mid-epoch resume cannot be exact, naming it and what would make it so."""
    notes = []
    for loader in loaders:
        name = _describe(loader)
        if not isinstance(loader, DataLoader):
            if not _restores_itself(loader):
                notes.append(
                    f"{name} is not a DataLoader and has no state_dict: a mid-epoch resume cannot find its position "
                    "(a DataLoader over a map-style dataset, or a state_dict/load_state_dict on it, makes it exact)"
                )
            continue
        if _restores_itself(loader):
            continue
        if isinstance(loader.dataset, IterableDataset):
            if not _restores_itself(loader.dataset):
                notes.append(
                    f"{name} iterates an IterableDataset with no state_dict: a mid-epoch resume starts its iteration "
                    "again (the skipped batches are not skipped); torchdata's StatefulDataLoader, or a map-style "
                    "dataset, makes it exact"
                )
            continue
        if loader.batch_sampler is None:
            notes.append(
                f"{name} has no batch sampler (batch_size=None): a mid-epoch resume cannot skip through it "
                "(a batch_size, or a BatchSampler, makes it exact)"
            )
            continue
        for sampler in _samplers(loader):
            if not isinstance(sampler, (*_EXACT_SAMPLERS, BatchSampler)) and not hasattr(sampler, "set_epoch"):
                notes.append(
                    f"{name} draws its order from a {type(sampler).__name__}, which may depend on state a checkpoint "
                    "does not hold; give it set_epoch(epoch) and draw from (seed, epoch), as DistributedSampler "
                    "does, or use torchdata's StatefulDataLoader"
                )
        # With workers the sample is not read here: a dataset that opens its files lazily, in each worker (h5py),
        # must not have them opened in the main process before the workers fork.
        if loader.num_workers == 0 and _draws_random_numbers(loader):
            notes.append(
                f"{name} loads samples that draw from a global random generator (torch's, Python's or NumPy's: "
                "augmentation, masking), whose draws after a mid-epoch resume differ from the uninterrupted run's "
                "(the same distribution, not the same bits); drawing each sample's randomness from a generator "
                "seeded with (seed, epoch, index) makes it exact"
            )
        if loader.num_workers > 0 and loader.persistent_workers:
            notes.append(
                f"{name} keeps its {loader.num_workers} workers across epochs (persistent_workers), and their "
                "random state with them; a resume restarts them: exact only if the dataset draws no random numbers "
                "(persistent_workers: false makes it exact)"
            )
    return notes


def samples_in_epoch(batches: int, loaders: Iterable[Any], world_size: int) -> int | None:
    """Samples the whole job consumed in an epoch after ``batches`` batches per rank (None if unknown)."""
    sizes = [loader.batch_size for loader in resumable_loaders(loaders)]
    known = [size for size in sizes if size is not None]
    if not known or len(known) != len(sizes):
        return None
    return batches * world_size * sum(known)


def resumable_loaders(loaders: Iterable[Any]) -> list[DataLoader]:
    """The DataLoaders among ``loaders`` whose position a resume sets by skipping at the sampler."""
    return [
        loader
        for loader in loaders
        if isinstance(loader, DataLoader)
        and not isinstance(loader.dataset, IterableDataset)
        and loader.batch_sampler is not None
        and not _restores_itself(loader)
    ]


def _samplers(loader: DataLoader) -> list[Any]:
    """The loader's sampler and, with a custom batch sampler, the batch sampler and the sampler inside it."""
    found = [loader.sampler]
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
        found.append(loader.batch_sampler)
    inner = getattr(loader.batch_sampler, "sampler", None)
    if inner is not None and inner is not loader.sampler:
        found.append(inner)
    return found


def _draws_random_numbers(loader: DataLoader) -> bool:
    """Whether loading and collating the dataset's first sample moves a global RNG (every RNG is put back).

    The batches after a resume would draw from another point of that generator's stream. One sample is read
    to find out, in the process that loads them (``num_workers=0``).
    """
    from lightning_mlopt.checkpoint.rng import capture_rng_state, restore_rng_state

    before = capture_rng_state()
    try:
        loader.collate_fn([loader.dataset[next(iter(range(len(loader.dataset))))]])  # type: ignore[arg-type]
    except Exception:  # an empty dataset, or one that loads otherwise: nothing can be told
        return False
    finally:
        after = capture_rng_state()
        restore_rng_state(before)
    return not (
        torch.equal(before["torch"], after["torch"])
        and before["python"] == after["python"]
        and all(_same(a, b) for a, b in zip(before["numpy"], after["numpy"], strict=True))
    )


def _same(first: Any, second: Any) -> bool:
    return bool((first == second).all()) if hasattr(first, "all") else first == second


def _restores_itself(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _generator(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed % (1 << 63))
    _OURS.add(generator)
    return generator


def _describe(loader: Any) -> str:
    dataset = getattr(loader, "dataset", None)
    return f"the train {type(loader).__name__}" + (f" over {type(dataset).__name__}" if dataset is not None else "")
