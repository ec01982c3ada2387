"""CIFAR-10 from the standard python-pickle batches, or a synthetic CIFAR-shaped set with a learnable signal."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_mlopt.demos._loader import InMemoryTensors, LoaderDataModule

_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
_TEST_FILE = "test_batch"
# Per-channel statistics of the CIFAR-10 training set.
_MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
_STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles the CIFAR batch format (dicts, lists, numpy arrays) and nothing else.

    The batches are pickles; a file planted under ``data.root`` must not be able to run code.
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # how protocol 2 spells bytes when written by Python 3
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
    }

    @override
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a CIFAR batch file")


def load_cifar_batch(path: Path) -> tuple[Tensor, Tensor]:
    """Read one CIFAR-10 python batch file into uint8 images ``(N, 3, 32, 32)`` and int64 labels ``(N,)``.

    Example::

        images, labels = load_cifar_batch(Path("cifar-10-batches-py/data_batch_1"))
    """
    with path.open("rb") as handle:
        batch = _ArrayUnpickler(handle, encoding="bytes").load()
    data = np.asarray(batch[b"data"], dtype=np.uint8)
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise ValueError(f"{path} is not a CIFAR-10 batch: data {data.shape}, labels {labels.shape}")
    return torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()), torch.from_numpy(labels)


def find_cifar_dir(root: Path) -> Path | None:
    """Return the folder under ``root`` holding the CIFAR-10 python batches, or None."""
    for candidate in (root, root / "cifar-10-batches-py"):
        if all((candidate / name).is_file() for name in (*_TRAIN_FILES, _TEST_FILE)):
            return candidate
    return None


class _AugmentedImages(Dataset[tuple[Tensor, Tensor]]):
    """uint8 images normalised on access, with random crop (pad 4) and horizontal flip when training."""

    def __init__(self, images: Tensor, labels: Tensor, augment: bool) -> None:
        self.images, self.labels, self.augment = images, labels, augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        image = (self.images[index].float() / 255.0 - _MEAN) / _STD
        if self.augment:
            padded = torch.nn.functional.pad(image, (4, 4, 4, 4))
            top, left = torch.randint(0, 9, (2,)).tolist()
            image = padded[:, top : top + 32, left : left + 32]
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
        return image, self.labels[index]


def synthetic_images(size: int, seed: int, num_classes: int = 10) -> tuple[Tensor, Tensor]:
    """CIFAR-shaped float images whose class is a fixed random template under noise: learnable, not trivial."""
    generator = torch.Generator().manual_seed(seed)
    # Templates come from a seed of their own so that train and validation sets share them.
    templates = torch.randn(num_classes, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, num_classes, (size,), generator=generator)
    noise = torch.randn(size, 3, 32, 32, generator=generator)
    return 0.5 * templates[labels] + noise, labels


class CIFAR10DataModule(LoaderDataModule):
    """CIFAR-10: the real python-pickle batches when ``root`` holds them, else a synthetic stand-in.

    Args:
        root: folder holding ``data_batch_1..5`` and ``test_batch`` (or a ``cifar-10-batches-py`` folder
            with them). None: use a synthetic CIFAR-shaped set (nothing is ever downloaded).
        synthetic_size: training samples of the synthetic set (validation gets a fifth of it).
        augment: random crop and flip on the real training images.
        **loader: DataLoader knobs, see :class:`LoaderDataModule`.

    Raises:
        FileNotFoundError: ``root`` is set but does not hold the CIFAR-10 batches.

    Example::

        data = CIFAR10DataModule(root=None, synthetic_size=2000, batch_size=64)

    """

    def __init__(self, root: str | None = None, synthetic_size: int = 5000, augment: bool = True, **loader: Any):
        super().__init__(**loader)
        if synthetic_size < 1:
            raise ValueError(f"data.synthetic_size must be >= 1, got {synthetic_size}")
        self.root = root
        self.synthetic_size = synthetic_size
        self.augment = augment
        self.folder: Path | None = None
        if root is not None:
            self.folder = find_cifar_dir(Path(root))
            if self.folder is None:
                raise FileNotFoundError(
                    f"data.root={root!r} does not hold the CIFAR-10 python batches "
                    f"({', '.join((*_TRAIN_FILES, _TEST_FILE))}); "
                    "point it at the extracted cifar-10-batches-py folder, or leave it unset for synthetic data"
                )

    @override
    def setup(self, stage: str) -> None:
        if self.folder is None:
            self.train_set = InMemoryTensors(*synthetic_images(self.synthetic_size, seed=1))
            self.val_set = InMemoryTensors(*synthetic_images(max(1, self.synthetic_size // 5), seed=2))
            return
        parts = [load_cifar_batch(self.folder / name) for name in _TRAIN_FILES]
        train_images = torch.cat([images for images, _ in parts])
        train_labels = torch.cat([labels for _, labels in parts])
        self.train_set = _AugmentedImages(train_images, train_labels, augment=self.augment)
        self.val_set = _AugmentedImages(*load_cifar_batch(self.folder / _TEST_FILE), augment=False)
