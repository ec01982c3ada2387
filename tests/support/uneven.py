"""Data that gives each rank a different number of batches: the uneven inputs UnevenInputs must end together."""

from __future__ import annotations

from collections.abc import Iterator

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, TensorDataset


class _RankBatches(IterableDataset):
    """``counts[rank] x batch_size`` random token sequences for the rank that iterates it (no length)."""

    def __init__(self, counts: list[int], batch_size: int, block_size: int, vocab_size: int, seed: int) -> None:
        self.counts, self.batch_size, self.block_size, self.vocab_size, self.seed = (
            counts,
            batch_size,
            block_size,
            vocab_size,
            seed,
        )

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        generator = torch.Generator().manual_seed(self.seed + rank)
        for _ in range(self.counts[rank] * self.batch_size):
            tokens = torch.randint(0, self.vocab_size, (self.block_size + 1,), generator=generator)
            yield tokens[:-1], tokens[1:]


class UnevenTokens(pl.LightningDataModule):
    """Random token batches, ``train_batches[rank]`` for training and ``val_batches[rank]`` for validation.

    Neither loader has a length (the dataset is iterable), so nothing tells a rank how many the others have.
    With ``sized``, each rank's loader is over a map-style dataset of its own length instead (run it with
    ``trainer.use_distributed_sampler=false``): lengths that Lightning knows, and that differ.
    """

    def __init__(
        self,
        train_batches: tuple[int, ...] = (10, 6),
        val_batches: tuple[int, ...] = (4, 2),
        batch_size: int = 8,
        block_size: int = 64,
        vocab_size: int = 256,
        sized: bool = False,
    ) -> None:
        super().__init__()
        self.sized = sized
        self.train_batches, self.val_batches = list(train_batches), list(val_batches)
        self.batch_size, self.block_size, self.vocab_size = batch_size, block_size, vocab_size

    def _loader(self, counts: list[int], seed: int) -> DataLoader:
        dataset = _RankBatches(counts, self.batch_size, self.block_size, self.vocab_size, seed)
        if self.sized:
            inputs, targets = zip(*dataset, strict=True)
            return DataLoader(TensorDataset(torch.stack(inputs), torch.stack(targets)), batch_size=self.batch_size)
        return DataLoader(dataset, batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_batches, seed=0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_batches, seed=1000)
