"""DeepSpeed ZeRO 1/2/3 on CPU and GPU: the strategy, its start-up, and its checkpoints (and their conversion)."""

from lightning_mlopt.strategies.deepspeed.deepspeed_strategy import DeepSpeedStrategy

__all__ = ["DeepSpeedStrategy"]
