"""Our strategies, and the one table that gives them their YAML names.

In the CLI, ``trainer.strategy: <name>`` takes a name from :data:`STRATEGIES` (ours) or any name in
Lightning's own registry. Importing this package also registers each of ours in Lightning's
``StrategyRegistry`` as ``mlopt_<name>``, so ``Trainer(strategy="mlopt_ddp")`` works in a plain script;
the prefix keeps Lightning's own ``ddp`` meaning what it always meant outside our CLI.
"""

from __future__ import annotations

import difflib
from typing import Any

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightning_mlopt.strategies.ddp import DDPStrategy
from lightning_mlopt.strategies.deepspeed import DeepSpeedStrategy
from lightning_mlopt.strategies.fsdp import FSDPStrategy

__all__ = ["STRATEGIES", "DDPStrategy", "DeepSpeedStrategy", "FSDPStrategy", "registered_name", "resolve_strategy"]

# name -> (class, constructor arguments, one-line description)
STRATEGIES: dict[str, tuple[type[Strategy], dict[str, Any], str]] = {
    "ddp": (DDPStrategy, {}, "DDP, CPU (gloo) or GPU (NCCL)"),
    "ddp_fp16": (DDPStrategy, {"comm_hook": "fp16"}, "DDP with fp16 gradient compression"),
    "ddp_bf16": (DDPStrategy, {"comm_hook": "bf16"}, "DDP with bf16 gradient compression"),
    "ddp_powersgd": (DDPStrategy, {"comm_hook": "powersgd"}, "DDP with PowerSGD gradient compression"),
    "fsdp": (FSDPStrategy, {}, "FSDP2 full shard; every direct child of the LightningModule is a unit"),
    "zero1": (DeepSpeedStrategy, {"preset": "zero1"}, "DeepSpeed ZeRO-1: optimizer state sharded"),
    "zero2": (DeepSpeedStrategy, {"preset": "zero2"}, "DeepSpeed ZeRO-2: optimizer state and gradients sharded"),
    "zero2_offload": (
        DeepSpeedStrategy,
        {"preset": "zero2", "offload_optimizer": True},
        "DeepSpeed ZeRO-2 with optimizer state offloaded to CPU memory",
    ),
    "zero3": (DeepSpeedStrategy, {"preset": "zero3"}, "DeepSpeed ZeRO-3: parameters sharded too"),
    "zero3_offload": (
        DeepSpeedStrategy,
        {"preset": "zero3_offload"},
        "DeepSpeed ZeRO-3 with parameters and optimizer state offloaded to CPU memory",
    ),
}


def registered_name(name: str) -> str:
    """Lightning-registry name of one of our strategies: ``ddp`` -> ``mlopt_ddp``."""
    return f"mlopt_{name}"


def resolve_strategy(name: str) -> str:
    """Map a YAML strategy name to the registry name the Trainer should get.

    Our names win over Lightning's (``ddp`` means ours); any other registered name passes through.

    Raises:
        ValueError: the name is neither ours nor in Lightning's registry; the message lists both.

    """
    if name in STRATEGIES:
        return registered_name(name)
    if name == "auto" or name in StrategyRegistry:
        return name
    known = [*STRATEGIES, *(n for n in StrategyRegistry.available_strategies() if not n.startswith("mlopt_"))]
    close = difflib.get_close_matches(name, list(dict.fromkeys(known)), n=3, cutoff=0.6)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    raise ValueError(
        f"unknown strategy {name!r}.{hint} Ours: {', '.join(STRATEGIES)}; or any name in Lightning's "
        "StrategyRegistry (e.g. single_device, ddp_spawn), or a class_path with init_args"
    )


def _register() -> None:
    for name, (strategy_class, init_args, description) in STRATEGIES.items():
        StrategyRegistry.register(
            registered_name(name), strategy_class, description=description, override=True, **init_args
        )


_register()
