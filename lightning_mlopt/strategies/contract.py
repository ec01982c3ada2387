"""The strategy contract, declared once: what the package asks of a strategy, and one adapter for the rest.

A strategy owns how state is placed, sharded, saved and loaded; callbacks, the CLI and the checkpoint
package never look inside it. They ask :func:`contract_of` (``contract_of(trainer.strategy)``), which gives
them a :class:`StrategyContract`:

- ``sharding``: which gradient and parameter pieces this rank holds, which tensors are replicated where
  (GradNormMonitor, ReplicaConsistencyCheck, module norms);
- ``checkpoint_layout`` and ``consolidate_checkpoint``: the layout it writes and how to read one back whole
  (the layout is registered in ``checkpoint/layout.py`` by the strategy's module);
- ``background_saves``, ``save_checkpoint_async`` and ``checkpoint_process_group``: async saves;
- ``check_model``: a check of the model against the strategy's settings, before anything runs.

Our strategies declare it by subclassing :class:`DeclaresContract` (which supplies the defaults) and setting
what differs. Any other strategy (Lightning's own, a user's) goes through :class:`ForeignStrategy`, which
recognises Lightning's DeepSpeed, FSDP and model-parallel strategies by class and otherwise treats the
strategy as one that keeps torch tensors and saves one file from rank zero.

Adding a strategy (e.g. tensor parallel): one file with a ``DeclaresContract`` subclass (its layout
registered at the bottom if it writes a new one), one row in ``strategies/__init__.py``'s table, an overlay
in ``configs/strategies/``, its tests.

Example::

    contract = contract_of(trainer.strategy)
    contract.checkpoint_layout           # "one file", "DCP shards", "ZeRO partitions", ...
    pieces = contract.sharding.gradient_pieces(params)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Protocol

from torch import nn

from lightning_mlopt.checkpoint.layout import ONE_FILE, CheckpointingStrategy, PendingWrite, consolidator
from lightning_mlopt.distributed.sharding import Sharding, TensorSharding

# Layouts that belong to strategy families; their strategies' modules register them.
DCP_SHARDS = "DCP shards"
ZERO_PARTITIONS = "ZeRO partitions"


class StrategyContract(CheckpointingStrategy, Protocol):
    """Everything the package asks of a strategy (the checkpoint part is :class:`CheckpointingStrategy`)."""

    @property
    def sharding(self) -> Sharding:
        """What this rank holds of each parameter and gradient."""
        ...

    def check_model(self, module: nn.Module) -> None:
        """Raise ``ValueError`` (naming the setting and what the model lacks) when they do not fit."""
        ...

    def consolidate_checkpoint(self, state: Path, trust_pickles: bool = False) -> dict[str, Any]:
        """One full Lightning state dict on CPU from a checkpoint this strategy wrote."""
        ...


class DeclaresContract:
    """The contract's defaults, for our strategies to subclass: one file, plain tensors, no background saves.

    A subclass overrides what differs (``checkpoint_layout``, ``sharding``, ``background_saves`` with
    ``save_checkpoint_async``, ``check_model``, ``consolidate_checkpoint``).
    """

    checkpoint_layout: ClassVar[str] = ONE_FILE
    background_saves: ClassVar[bool] = False
    sharding: Sharding = TensorSharding()

    def check_model(self, module: nn.Module) -> None:
        """Every model fits (no settings that name parts of it)."""

    def save_checkpoint_async(self, checkpoint: dict[str, Any], filepath: str | Path) -> PendingWrite:
        """Not offered (``background_saves`` is False): the saver saves synchronously instead."""
        raise NotImplementedError(f"{type(self).__name__} saves {self.checkpoint_layout!r} synchronously")

    @property
    def checkpoint_process_group(self) -> Any:
        """Not offered (``background_saves`` is False)."""
        raise NotImplementedError(f"{type(self).__name__} has no background saves")

    def consolidate_checkpoint(self, state: Path, trust_pickles: bool = False) -> dict[str, Any]:
        """Read through the registered reader of this strategy's layout."""
        return consolidator(self.checkpoint_layout)(state, trust_pickles)


class ForeignStrategy(DeclaresContract):
    """The contract of a strategy that does not declare it, recognised by its class and how it saves.

    Lightning's DeepSpeed strategy writes ZeRO partitions and is read through its ZeRO optimizer; its FSDP and
    model-parallel strategies write DCP shards; a strategy that keeps Lightning's base ``save_checkpoint``
    writes one file from rank zero. Anything else has its own format, which FaultTolerantCheckpoint saves
    synchronously through the strategy and resumes only with the same strategy class. A ``sharding``
    attribute the strategy has is used as it is.

    Args:
        strategy: the Lightning strategy.

    """

    def __init__(self, strategy: Any) -> None:
        from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, Strategy

        self.strategy = strategy
        self.name = type(strategy).__name__
        declared = getattr(strategy, "sharding", None)
        if isinstance(strategy, DeepSpeedStrategy):
            from lightning_mlopt.strategies.sharding import ZeroSharding

            self.checkpoint_layout = ZERO_PARTITIONS  # type: ignore[misc]
            self.sharding = ZeroSharding(strategy)
        elif isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
            self.checkpoint_layout = DCP_SHARDS  # type: ignore[misc]
        elif type(strategy).save_checkpoint is not Strategy.save_checkpoint:
            self.checkpoint_layout = f"the format of {self.name}"  # type: ignore[misc]
        if isinstance(declared, Sharding):
            self.sharding = declared


def contract_of(strategy: Any) -> StrategyContract:
    """The strategy itself when it declares the contract (its class sets ``checkpoint_layout``), else its adapter.

    The declaration is read from the class, never by evaluating the instance's properties: one of them
    (``checkpoint_process_group``) creates a process group, a collective.
    """
    if isinstance(type(strategy).__dict__.get("checkpoint_layout"), str) or isinstance(strategy, DeclaresContract):
        return strategy  # type: ignore[no-any-return]
    return ForeignStrategy(strategy)


def strategy_name(strategy: Any) -> str:
    """The class name a manifest records for ``strategy`` (the adapted one's, for a foreign strategy)."""
    return strategy.name if isinstance(strategy, ForeignStrategy) else type(strategy).__name__
