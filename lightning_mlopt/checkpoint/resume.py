"""Mid-epoch resume: skip the batches an epoch already used, at the sampler, without loading them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Sampler


class _SkipOnce(Sampler[list[int]]):
    """A batch sampler that drops its first ``skip`` batches once, then passes everything through."""

    def __init__(self, batch_sampler: Iterable[list[int]], skip: int) -> None:
        self.batch_sampler = batch_sampler
        self.skip = skip

    def __iter__(self) -> Iterator[list[int]]:
        iterator = iter(self.batch_sampler)
        skip, self.skip = self.skip, 0
        for _ in range(skip):  # indices only: no sample is loaded
            next(iterator, None)
        yield from iterator

    def __len__(self) -> int:
        # The full length: Lightning counts batches from the restored position itself.
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # batch_size, drop_last, sampler... are read through by DataLoader and Lightning.
        return getattr(self.batch_sampler, name)


def skip_first_batches(loaders: Iterable[Any], count: int) -> None:
    """Make each map-style DataLoader's next iteration start at batch ``count``.

    Raises:
        ValueError: a loader cannot skip at the sampler (an iterable-style dataset, or no batch sampler).

    """
    for loader in loaders:
        if not isinstance(loader, DataLoader) or loader.batch_sampler is None:
            raise ValueError(
                f"cannot resume mid-epoch with {type(loader).__name__}: it has no batch sampler to skip through"
            )
        # DataLoader forbids reassigning batch_sampler after construction; this is the one sanctioned use.
        object.__setattr__(loader, "batch_sampler", _SkipOnce(loader.batch_sampler, count))
