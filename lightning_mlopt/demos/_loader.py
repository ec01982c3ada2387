"""The DataLoader settings every demo datamodule shares, so that each is a YAML key once."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset
from typing_extensions import override


class InMemoryTensors(TensorDataset):
    """A ``TensorDataset`` whose batches are gathered with one index per tensor, not one call per sample.

    The DataLoader asks for a whole batch through ``__getitems__``: ``tensor[indices]`` for each tensor, where a
    plain TensorDataset makes a Python call per sample and ``default_collate`` stacks them (about half the
    time per 64-sample digits batch). The batches are the same values in the same order. Use it with
    ``collate_fn=already_batched``, as ``LoaderDataModule`` does.

    Example::

        data = InMemoryTensors(torch.randn(100, 3), torch.arange(100))
        loader = DataLoader(data, batch_size=10, collate_fn=already_batched)
    """

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, ...]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return tuple(tensor[index] for tensor in self.tensors)


def already_batched(batch: Any) -> Any:
    """The collate function for :class:`InMemoryTensors`: its ``__getitems__`` returned the batch itself."""
    return batch


class LoaderDataModule(pl.LightningDataModule):
    """Base datamodule: owns the DataLoader knobs; subclasses build the datasets in ``setup``.

    Args:
        batch_size: samples per batch on each process (the global batch is this times the world size).
        num_workers: DataLoader worker processes; 0 loads in the training process.
        pin_memory: page-lock batches for faster host-to-GPU copies (no effect on CPU).
        prefetch_factor: batches each worker loads ahead; needs ``num_workers > 0``. None: PyTorch's default.
        persistent_workers: keep workers alive between epochs; needs ``num_workers > 0``.

    """

    def __init__(
        self,
        batch_size: int = 32,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {num_workers}")
        if num_workers == 0 and (prefetch_factor is not None or persistent_workers):
            raise ValueError(
                "data.prefetch_factor and data.persistent_workers need data.num_workers > 0; "
                "set num_workers or leave them unset"
            )
        if prefetch_factor is not None and prefetch_factor < 1:
            raise ValueError(f"data.prefetch_factor must be >= 1, got {prefetch_factor}")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers

    def _loader(self, dataset: Dataset[Any], shuffle: bool) -> DataLoader[Any]:
        # Lightning replaces the sampler with a DistributedSampler under DDP/FSDP/DeepSpeed, keeping
        # `shuffle`; drop_last on training keeps every rank's step count equal.
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            collate_fn=already_batched if isinstance(dataset, InMemoryTensors) else None,
            shuffle=shuffle,
            drop_last=shuffle,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor,
            persistent_workers=self.persistent_workers,
        )

    # Subclasses set these in `setup`; evaluation, test and prediction share the held-out split.
    train_set: Dataset[Any]
    val_set: Dataset[Any]

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.train_set, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.val_set, shuffle=False)

    @override
    def test_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.val_set, shuffle=False)

    @override
    def predict_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.val_set, shuffle=False)
