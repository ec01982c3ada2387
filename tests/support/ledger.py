"""A model that writes down which samples each rank trained on: the ledger of an epoch across launches.

Each training step appends ``<epoch> <index> ...`` (the batch's sample indices) to
``<out_dir>/ledger-rank<R>-<pid>.txt``; a test reads every launch's lines back and checks that each sample of
an epoch appears exactly once across ranks and launches.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset


class IndexedSamples(Dataset):
    """``n`` samples ``(index, x, y)`` of a fixed linear problem."""

    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=generator)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class LedgerData(pl.LightningDataModule):
    """Shuffled training batches of :class:`IndexedSamples`."""

    def __init__(self, samples: int = 64, batch_size: int = 4) -> None:
        super().__init__()
        self.samples = samples
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedSamples(self.samples), batch_size=self.batch_size, shuffle=True)


class LedgerModel(pl.LightningModule):
    """A linear regression that records each batch's sample indices, per rank and launch."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = Path(out_dir)
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        index, x, y = batch
        self.out_dir.mkdir(parents=True, exist_ok=True)
        line = " ".join(str(i) for i in [self.current_epoch, *index.tolist()])
        with (self.out_dir / f"ledger-rank{self.global_rank}-{os.getpid()}.txt").open("a") as ledger:
            ledger.write(line + "\n")
        return torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def read_ledger(out_dir: Path, epoch: int) -> list[int]:
    """Every sample index trained on in ``epoch``, across all ranks and launches (repeats kept)."""
    seen: list[int] = []
    for path in sorted(out_dir.glob("ledger-rank*.txt")):
        for line in path.read_text().splitlines():
            numbers = [int(word) for word in line.split()]
            if numbers and numbers[0] == epoch:
                seen += numbers[1:]
    return seen
