"""lightning_mlopt: reliable distributed training for PyTorch Lightning.

Strategies (DDP, FSDP, DeepSpeed ZeRO) that switch by YAML and run on CPU as on GPU, callbacks that keep
week-long runs safe, and a LightningCLI entry point (``python -m lightning_mlopt``).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
