"""A CIFAR-shaped ResNet classifier built from ``torch.nn`` (no torchvision)."""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
import torch
import torchmetrics
from torch import Tensor, nn
from typing_extensions import override

from lightning_mlopt.demos._progress import progress_bar_shown

# Blocks per stage for the standard depths (He et al., 2016).
_STAGES: dict[int, tuple[Literal["basic", "bottleneck"], tuple[int, int, int, int]]] = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
}


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity (or projected) shortcut."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = _shortcut(in_planes, planes * self.expansion, stride)

    @override
    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4), with a shortcut: the ResNet-50 block."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.shortcut = _shortcut(in_planes, planes * self.expansion, stride)

    @override
    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + self.shortcut(x))


def _shortcut(in_planes: int, out_planes: int, stride: int) -> nn.Module:
    if stride == 1 and in_planes == out_planes:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(in_planes, out_planes, 1, stride, bias=False), nn.BatchNorm2d(out_planes))


class ResNet(nn.Module):
    """ResNet for small images: a 3x3 stem without max-pool, as in the CIFAR variants of the paper.

    Args:
        depth: 18, 34 (basic blocks), 50 or 101 (bottleneck blocks).
        width: channels of the first stage; later stages double it. 64 is the paper's width.
        in_channels: image channels (3 for CIFAR, 1 for digits).
        num_classes: size of the output layer.

    """

    def __init__(self, depth: int = 18, width: int = 64, in_channels: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        if depth not in _STAGES:
            raise ValueError(f"depth must be one of {sorted(_STAGES)}, got {depth}")
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        kind, blocks = _STAGES[depth]
        block = BasicBlock if kind == "basic" else Bottleneck
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        stages: list[nn.Module] = []
        in_planes = width
        for index, count in enumerate(blocks):
            planes = width * 2**index
            layers: list[nn.Module] = []
            for position in range(count):
                stride = 2 if index > 0 and position == 0 else 1
                layers.append(block(in_planes, planes, stride))
                in_planes = planes * block.expansion
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(in_planes, num_classes)

    @override
    def forward(self, x: Tensor) -> Tensor:
        features = self.stages(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(features, 1), 1))


class ResNetClassifier(pl.LightningModule):
    """Image classifier: a ResNet trained with cross-entropy, logging loss and torchmetrics accuracy.

    Args:
        depth: ResNet depth: 18, 34, 50 or 101.
        width: channels of the first stage (64 in the paper; 16 trains fast on CPU).
        in_channels: image channels.
        num_classes: number of classes.
        lr: learning rate of the default SGD optimizer (momentum 0.9, Nesterov): an SGD rate, about ten times an
            Adam one. A config's ``optimizer:`` (and ``lr_scheduler:``) replaces this default; ``lr`` and
            ``weight_decay`` are then unused (``docs/configuration.md``).
        weight_decay: weight decay of the default optimizer.

    Example::

        model = ResNetClassifier(depth=18, width=16, in_channels=1, num_classes=10)
        logits = model(torch.randn(4, 1, 8, 8))  # (4, 10)

    """

    def __init__(
        self,
        depth: int = 18,
        width: int = 64,
        in_channels: int = 3,
        num_classes: int = 10,
        lr: float = 0.05,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.save_hyperparameters()
        self.net = ResNet(depth, width, in_channels, num_classes)
        self.train_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.val_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.test_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        logits = self(images)
        loss = nn.functional.cross_entropy(logits, labels)
        self.train_accuracy(logits, labels)
        self.log("train/loss", loss, prog_bar=progress_bar_shown(self))
        self.log("train/acc", self.train_accuracy, on_step=False, on_epoch=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_accuracy)

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_accuracy)

    @override
    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(dim=1)

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str, metric: torchmetrics.Metric) -> None:
        images, labels = batch
        logits = self(images)
        self.log(f"{stage}/loss", nn.functional.cross_entropy(logits, labels), sync_dist=True)
        metric(logits, labels)
        self.log(f"{stage}/acc", metric, prog_bar=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            self.parameters(),
            lr=self.hparams["lr"],
            momentum=0.9,
            nesterov=True,
            weight_decay=self.hparams["weight_decay"],
        )
