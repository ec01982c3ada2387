"""Demo models and datamodules: sizes match the literature, loaders read the real formats, knobs reach torch."""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_mlopt.demos import (
    CIFAR10DataModule,
    DigitsDataModule,
    GPTLanguageModel,
    ResNetClassifier,
    TokenDataModule,
    TransformerBlock,
)
from lightning_mlopt.demos.cifar import load_cifar_batch, synthetic_images
from lightning_mlopt.demos.resnet import ResNet
from lightning_mlopt.demos.tokens import markov_sequences


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize(("depth", "params"), [(18, 11_173_962), (50, 23_520_842)])
def test_resnet_cifar_parameter_counts_match_the_reference(depth, params):
    # The CIFAR ResNet-18/50 (3x3 stem, no max-pool, 10 classes) in the widely used reference implementation.
    assert _count(ResNet(depth=depth, width=64, in_channels=3, num_classes=10)) == params


def test_resnet_width_and_shapes():
    model = ResNetClassifier(depth=18, width=8, in_channels=1, num_classes=10)
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    assert _count(ResNet(18, 16)) < _count(ResNet(18, 32))
    with pytest.raises(ValueError, match="depth must be one of"):
        ResNet(depth=20)


def test_gpt_blocks_are_named_class_and_shapes():
    model = GPTLanguageModel(vocab_size=64, block_size=16, n_layer=3, n_head=2, d_model=32)
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    assert len(blocks) == 3
    assert model(torch.randint(0, 64, (2, 16))).shape == (2, 16, 64)
    with pytest.raises(ValueError, match="must divide d_model"):
        GPTLanguageModel(n_head=3, d_model=32)


def _write_cifar_batch(path: Path, count: int, seed: int) -> tuple[np.ndarray, list[int]]:
    """A file in the exact CIFAR-10 python format: a protocol-2 pickle of a dict with bytes keys."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(count, 3072), dtype=np.uint8)
    labels = [int(x) for x in rng.integers(0, 10, size=count)]
    batch = {
        b"batch_label": b"test batch",
        b"labels": labels,
        b"data": data,
        b"filenames": [b"x.png"] * count,
    }
    with path.open("wb") as handle:
        pickle.dump(batch, handle, protocol=2)
    return data, labels


def test_cifar_loader_reads_the_python_pickle_batches(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    written = [_write_cifar_batch(folder / f"data_batch_{i}", 6, seed=i) for i in range(1, 6)]
    _write_cifar_batch(folder / "test_batch", 4, seed=9)
    images, labels = load_cifar_batch(folder / "data_batch_1")
    assert images.shape == (6, 3, 32, 32) and images.dtype == torch.uint8
    # Row layout is 1024 red, then green, then blue values, row-major: pixel (c=1, y=0, x=2) is index 1026.
    assert int(images[0, 1, 0, 2]) == int(written[0][0][0, 1026])
    assert labels.tolist() == written[0][1]

    data = CIFAR10DataModule(root=str(tmp_path), batch_size=4, augment=False)
    data.setup("fit")
    assert len(data.train_set) == 30 and len(data.val_set) == 4
    batch_images, _ = next(iter(data.train_dataloader()))
    assert batch_images.shape == (4, 3, 32, 32) and batch_images.dtype == torch.float32


def test_cifar_loader_refuses_code_in_the_pickle(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "data_batch_1").write_bytes(pickle.dumps({b"data": Evil()}))
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        load_cifar_batch(tmp_path / "data_batch_1")


def test_cifar_root_without_batches_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not hold the CIFAR-10 python batches"):
        CIFAR10DataModule(root=str(tmp_path))


def test_synthetic_images_carry_a_learnable_signal():
    images, labels = synthetic_images(400, seed=1)
    assert images.shape == (400, 3, 32, 32)
    templates = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    # Nearest template by correlation recovers the label: the signal is there to learn.
    predicted = (images.flatten(1) @ templates.flatten(1).T).argmax(1)
    assert (predicted == labels).float().mean() > 0.9


def test_digits_is_the_real_dataset_split_the_same_on_every_call():
    first, second = DigitsDataModule(batch_size=8), DigitsDataModule(batch_size=8)
    first.setup("fit")
    second.setup("fit")
    assert len(first.train_set) + len(first.val_set) == 1797
    assert torch.equal(first.val_set.tensors[1], second.val_set.tensors[1])
    assert float(first.train_set.tensors[0].max()) == 1.0


def test_markov_tokens_follow_the_chain():
    tokens = markov_sequences(32, 20, vocab_size=50, branching=3, seed=1)
    table = torch.randint(0, 50, (50, 3), generator=torch.Generator().manual_seed(0))
    for row in tokens:
        for current, following in itertools.pairwise(row):
            assert following in table[current]
    data = TokenDataModule(vocab_size=50, block_size=20, num_sequences=64, batch_size=8)
    data.setup("fit")
    inputs, targets = data.train_set[0]
    assert torch.equal(inputs[1:], targets[:-1])


def test_dataloader_knobs_reach_the_dataloader():
    data = TokenDataModule(
        num_sequences=32,
        batch_size=4,
        num_workers=2,
        pin_memory=True,
        prefetch_factor=3,
        persistent_workers=True,
    )
    data.setup("fit")
    loader = data.train_dataloader()
    assert (loader.batch_size, loader.num_workers, loader.prefetch_factor) == (4, 2, 3)
    assert loader.pin_memory and loader.persistent_workers


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"prefetch_factor": 2}, "need data.num_workers > 0"),
        ({"persistent_workers": True}, "need data.num_workers > 0"),
        ({"num_workers": -1}, "num_workers must be >= 0"),
    ],
)
def test_bad_dataloader_knobs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TokenDataModule(**kwargs)
