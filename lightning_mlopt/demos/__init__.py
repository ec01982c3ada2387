"""Demo models and datamodules, built from ``torch.nn`` alone: nothing is downloaded."""

from lightning_mlopt.demos.cifar import CIFAR10DataModule
from lightning_mlopt.demos.digits import DigitsDataModule
from lightning_mlopt.demos.gpt import GPTLanguageModel, TransformerBlock
from lightning_mlopt.demos.resnet import ResNetClassifier
from lightning_mlopt.demos.tokens import TokenDataModule

__all__ = [
    "CIFAR10DataModule",
    "DigitsDataModule",
    "GPTLanguageModel",
    "ResNetClassifier",
    "TokenDataModule",
    "TransformerBlock",
]
