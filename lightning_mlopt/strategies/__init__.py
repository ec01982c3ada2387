"""Our strategies, and the one table that gives them their YAML names.

Grouped by concern: DDP and FSDP (with HSDP) here, ``tensor/`` (tensor parallelism and its plan), ``pipeline/``
(pipeline parallelism: the cut, the schedules, the stages' tensor split) and ``deepspeed/`` (ZeRO and its
checkpoints). Import the classes from this package: the modules behind them may move.

In the CLI, ``trainer.strategy: <name>`` takes a name from :data:`STRATEGIES` (ours) or any name in
Lightning's own registry. Importing this package also registers each of ours in Lightning's
``StrategyRegistry`` as ``mlopt_<name>``, so ``Trainer(strategy="mlopt_ddp")`` works in a plain script;
the prefix keeps Lightning's own ``ddp`` meaning what it always meant outside our CLI.
"""

from __future__ import annotations

import difflib
from typing import Any

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightning_mlopt.checkpoint.layout import CheckpointLayout
from lightning_mlopt.strategies import ddp, fsdp
from lightning_mlopt.strategies.ddp import DDPStrategy
from lightning_mlopt.strategies.deepspeed import deepspeed_strategy
from lightning_mlopt.strategies.deepspeed.deepspeed_strategy import DeepSpeedStrategy
from lightning_mlopt.strategies.fsdp import FSDPStrategy
from lightning_mlopt.strategies.pipeline import pipeline_parallel
from lightning_mlopt.strategies.pipeline.pipeline_parallel import PipelineParallelStrategy
from lightning_mlopt.strategies.spec import StrategySpec, layouts_table, names_table, registered_name
from lightning_mlopt.strategies.tensor import tensor_parallel
from lightning_mlopt.strategies.tensor.tensor_parallel import TensorParallelStrategy

__all__ = [
    "LAYOUTS",
    "SPECS",
    "STRATEGIES",
    "DDPStrategy",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "PipelineParallelStrategy",
    "StrategySpec",
    "TensorParallelStrategy",
    "layout_named",
    "registered_name",
    "resolve_strategy",
]

# The one table: every strategy family of ours, each described in its own module's SPEC.
SPECS: tuple[StrategySpec, ...] = (
    ddp.SPEC,
    fsdp.SPEC,
    deepspeed_strategy.SPEC,
    tensor_parallel.SPEC,
    pipeline_parallel.SPEC,
)
# name -> (class, constructor arguments, one-line description)
STRATEGIES: dict[str, tuple[type[Strategy], dict[str, Any], str]] = names_table(SPECS)
# layout name -> the layout (its reader, how to recognise its files, what it resumes from)
LAYOUTS: dict[str, CheckpointLayout] = layouts_table(SPECS)


def layout_named(name: str) -> CheckpointLayout:
    """The layout called ``name``; a format no strategy of ours writes gets an entry that reads nothing.

    Example::

        layout_named("DCP shards").read(state)        # FSDP's reader
        layout_named("the format of MyStrategy")       # resumes only itself; .read raises
    """
    return LAYOUTS.get(name) or CheckpointLayout(name, resumes_from=())


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
