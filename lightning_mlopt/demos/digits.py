"""scikit-learn's bundled handwritten digits (1,797 8x8 images): a small real dataset, no download."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_mlopt.demos._loader import InMemoryTensors, LoaderDataModule


class DigitsDataModule(LoaderDataModule):
    """The UCI digits bundled with scikit-learn, as ``(1, 8, 8)`` float images in [0, 1] and labels 0-9.

    Needs the ``digits`` extra: ``pip install "lightning-mlopt[digits]"``.

    Args:
        val_fraction: share of the 1,797 images held out for validation (a fixed, seeded split).
        **loader: DataLoader knobs, see :class:`LoaderDataModule`.

    Example::

        data = DigitsDataModule(batch_size=64)

    """

    def __init__(self, val_fraction: float = 0.2, **loader: Any) -> None:
        super().__init__(**loader)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
        self.val_fraction = val_fraction

    @override
    def setup(self, stage: str) -> None:
        try:
            from sklearn.datasets import load_digits
        except ImportError as error:
            raise ImportError('DigitsDataModule needs scikit-learn: pip install "lightning-mlopt[digits]"') from error
        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.int64)
        # The same permutation on every rank and every run: the split must not depend on the global seed.
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
        n_val = int(len(labels) * self.val_fraction)
        val, train = order[:n_val], order[n_val:]
        self.train_set = InMemoryTensors(images[train], labels[train])
        self.val_set = InMemoryTensors(images[val], labels[val])
