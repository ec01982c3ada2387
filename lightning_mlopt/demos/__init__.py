"""Demo models and datamodules, built from ``torch.nn`` alone: nothing is downloaded."""

from lightning.pytorch import LightningModule

from lightning_mlopt.demos.cifar import CIFAR10DataModule
from lightning_mlopt.demos.digits import DigitsDataModule
from lightning_mlopt.demos.gpt import GPTLanguageModel, TransformerBlock
from lightning_mlopt.demos.resnet import ResNetClassifier
from lightning_mlopt.demos.tokens import TokenDataModule

OPTIMIZER_DEFAULTS: tuple[type[LightningModule], ...] = (ResNetClassifier, GPTLanguageModel)
"""Demo models whose ``configure_optimizers`` is a default (SGD, AdamW) that a config's ``optimizer:`` and
``lr_scheduler:`` replace as intended: the CLI does not warn of it; their ``lr``/``weight_decay`` then go unused."""

__all__ = [
    "OPTIMIZER_DEFAULTS",
    "CIFAR10DataModule",
    "DigitsDataModule",
    "GPTLanguageModel",
    "ResNetClassifier",
    "TokenDataModule",
    "TransformerBlock",
]
