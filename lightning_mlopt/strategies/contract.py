"""The strategy contract, declared once: what the package asks of a strategy, and one adapter for the rest.

A strategy owns how state is placed, sharded, saved and loaded; callbacks, the CLI and the checkpoint
package never look inside it. They ask :func:`contract_of` (``contract_of(trainer.strategy)``), which gives
them a :class:`StrategyContract`:

- ``sharding``: which gradient and parameter pieces this rank holds, which tensors are replicated where
  (GradNormMonitor, ReplicaConsistencyCheck, module norms);
- ``checkpoint_layout`` and ``consolidate_checkpoint``: the layout it writes and how to read one back whole
  (the layout is described in the family's spec, ``strategies/spec.py``);
- ``background_saves``, ``save_checkpoint_async`` and ``checkpoint_process_group``: async saves;
- ``check_model``, ``check_batch_size`` and ``check_sequence_length``: checks of the model and of the data's
  batch size and sequence length against the strategy's settings, before anything runs;
- ``process_mesh``: the named device mesh its ranks form, if any (NCCLHealthCheck checks each dimension);
- ``collectives_at_step_start``: whether its first collective of a step comes at the step's start (a host
  sum must not be in flight on its group then).

Our strategies declare it by subclassing :class:`DeclaresContract` (which supplies the defaults) and setting
what differs. Any other strategy (Lightning's own, a user's) goes through :class:`ForeignStrategy`, which
uses what the strategy itself has (a ``checkpoint_layout``, ``sharding``, ``check_model``,
``save_checkpoint_async``) and otherwise recognises Lightning's DeepSpeed, FSDP and model-parallel strategies
by class; a strategy with its own ``save_checkpoint`` writes "the format of <its class>", any other one file.

Adding a strategy (e.g. tensor parallel): one file with a ``DeclaresContract`` subclass and its ``SPEC``
(names, layout, overlay: ``strategies/spec.py``), one entry in ``strategies/__init__.py``'s ``SPECS``, an
overlay in ``configs/strategies/``, its tests.

Example::

    contract = contract_of(trainer.strategy)
    contract.checkpoint_layout           # "one file", "DCP shards", "ZeRO partitions", ...
    pieces = contract.sharding.gradient_pieces(params)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_mlopt.checkpoint.layout import (
    DCP_SHARDS,
    ONE_FILE,
    ZERO_PARTITIONS,
    CheckpointingStrategy,
    PendingWrite,
)
from lightning_mlopt.distributed.sharding import Sharding, TensorSharding

__all__ = ["DCP_SHARDS", "ZERO_PARTITIONS", "DeclaresContract", "ForeignStrategy", "StrategyContract", "contract_of"]


class StrategyContract(CheckpointingStrategy, Protocol):
    """Everything the package asks of a strategy (the checkpoint part is :class:`CheckpointingStrategy`)."""

    @property
    def collectives_at_step_start(self) -> bool:
        """Whether the strategy's first collective of a step comes at its start (FSDP, ZeRO-3)."""
        ...

    @property
    def sharding(self) -> Sharding:
        """What this rank holds of each parameter and gradient."""
        ...

    @property
    def process_mesh(self) -> DeviceMesh | None:
        """The named device mesh the strategy lays its ranks out on (FSDP, HSDP, FSDP x TP); None: the world."""
        ...

    def check_model(self, module: nn.Module) -> None:
        """Raise ``ValueError`` (naming the setting and what the model lacks) when they do not fit."""
        ...

    def check_batch_size(self, batch_size: int | None) -> None:
        """Raise ``ValueError`` when the data's batch size (per rank; None: unknown) does not fit the settings."""
        ...

    def check_sequence_length(self, length: int | None) -> None:
        """Raise ``ValueError`` when the data's sequence length (None: unknown) does not fit the settings."""
        ...

    def consolidate_checkpoint(self, state: Path, trust_pickles: bool = False) -> dict[str, Any]:
        """One full Lightning state dict on CPU from a checkpoint this strategy wrote."""
        ...


class DeclaresContract:
    """The contract's defaults, for our strategies to subclass: one file, plain tensors, no background saves.

    A subclass overrides what differs (``checkpoint_layout``, ``sharding``, ``background_saves`` with
    ``save_checkpoint_async`` and ``checkpoint_process_group``, ``check_model``, ``consolidate_checkpoint``).
    """

    checkpoint_layout: str = ONE_FILE
    background_saves: bool = False
    # Whether a step's first collective of the strategy's own comes at its very start (FSDP's and ZeRO-3's
    # parameter all-gathers) rather than late in backward (DDP's buckets, ZeRO-1/2's reductions). A host sum
    # left in flight on training's own gloo group across a step boundary delays such a collective: FSDP on 2
    # CPU processes stepped 13% slower with FaultTolerantCheckpoint's vote summed in the background there.
    collectives_at_step_start: bool = False

    @property
    def sharding(self) -> Sharding:
        """Every rank holds whole torch tensors (or DTensors that say what they hold)."""
        return _PLAIN_TENSORS

    @property
    def process_mesh(self) -> DeviceMesh | None:
        """The mesh of a model-parallel strategy's set-up (FSDP, FSDP x TP); else None: one flat world."""
        return _mesh_of(self)

    def check_model(self, module: nn.Module) -> None:
        """Every model fits (no settings that name parts of it)."""

    def check_batch_size(self, batch_size: int | None) -> None:
        """Every batch size fits (no settings that divide it)."""

    def check_sequence_length(self, length: int | None) -> None:
        """Every sequence length fits (no settings that divide it)."""

    def save_checkpoint_async(self, checkpoint: dict[str, Any], filepath: str | Path) -> PendingWrite:
        """Not offered (``background_saves`` is False): the saver saves synchronously instead."""
        raise NotImplementedError(f"{type(self).__name__} saves {self.checkpoint_layout!r} synchronously")

    @property
    def checkpoint_process_group(self) -> Any:
        """Not offered (``background_saves`` is False)."""
        raise NotImplementedError(f"{type(self).__name__} has no background saves")

    def consolidate_checkpoint(self, state: Path, trust_pickles: bool = False) -> dict[str, Any]:
        """Read through the reader of this strategy's layout (the spec of the family that writes it)."""
        from lightning_mlopt.strategies import layout_named  # the table imports this module: at call time

        return layout_named(self.checkpoint_layout).read(state, trust_pickles)


_PLAIN_TENSORS = TensorSharding()


class ForeignStrategy(DeclaresContract):
    """The contract of a strategy that does not declare it: what the strategy has, else recognised by class.

    Whatever the strategy itself has is used as it is: a ``checkpoint_layout`` (its class's or a base's), a
    ``sharding`` (read when asked, never before), ``check_model``, ``save_checkpoint_async`` with
    ``checkpoint_process_group`` (background saves). Otherwise: Lightning's DeepSpeed strategy writes ZeRO
    partitions and is read through its ZeRO optimizer; its FSDP and model-parallel strategies write DCP shards;
    a strategy that keeps Lightning's base ``save_checkpoint`` writes one file from rank zero. Anything else
    has its own format, which FaultTolerantCheckpoint saves synchronously through the strategy and resumes
    only with the same strategy class.

    Args:
        strategy: the Lightning strategy.

    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.checkpoint_layout = _recognised_layout(strategy)
        self.background_saves = callable(getattr(type(strategy), "save_checkpoint_async", None))
        declared = getattr(type(strategy), "collectives_at_step_start", None)
        self.collectives_at_step_start = (
            declared if isinstance(declared, bool) else self.checkpoint_layout == DCP_SHARDS  # FSDP gathers first
        )

    @property
    def sharding(self) -> Sharding:
        """The strategy's own ``sharding``; ZeRO's partitions for Lightning's DeepSpeed; else plain tensors."""
        declared = getattr(self.strategy, "sharding", None)
        if isinstance(declared, Sharding):
            return declared
        from lightning.pytorch.strategies import DeepSpeedStrategy

        if isinstance(self.strategy, DeepSpeedStrategy):
            from lightning_mlopt.strategies.deepspeed.zero_sharding import ZeroSharding

            return ZeroSharding(self.strategy)
        return _PLAIN_TENSORS

    @property
    def process_mesh(self) -> DeviceMesh | None:
        """Lightning's model-parallel strategy's ``device_mesh`` (built in its set-up); else None."""
        return _mesh_of(self.strategy)

    def check_model(self, module: nn.Module) -> None:
        """The strategy's own ``check_model``, where it has one."""
        check = getattr(self.strategy, "check_model", None)
        if callable(check):
            check(module)

    def save_checkpoint_async(self, checkpoint: dict[str, Any], filepath: str | Path) -> PendingWrite:
        """The strategy's own background save (only called when ``background_saves``)."""
        pending: PendingWrite = self.strategy.save_checkpoint_async(checkpoint, filepath)
        return pending

    @property
    def checkpoint_process_group(self) -> Any:
        """The strategy's own group for background writes."""
        return self.strategy.checkpoint_process_group


def _mesh_of(strategy: Any) -> DeviceMesh | None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    if isinstance(strategy, ModelParallelStrategy):
        mesh: DeviceMesh = strategy.device_mesh
        return mesh
    return None


def _recognised_layout(strategy: Any) -> str:
    declared = getattr(type(strategy), "checkpoint_layout", None)
    if isinstance(declared, str):
        return declared
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, Strategy

    if isinstance(strategy, DeepSpeedStrategy):
        return ZERO_PARTITIONS
    if isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
        return DCP_SHARDS
    if type(strategy).save_checkpoint is Strategy.save_checkpoint:
        return ONE_FILE
    return f"the format of {type(strategy).__name__}"


def contract_of(strategy: Any) -> StrategyContract:
    """The strategy itself when it declares the contract (a :class:`DeclaresContract`), else its adapter.

    Nothing of the strategy is evaluated here: the adapter reads a property (``sharding``,
    ``checkpoint_process_group``, which creates a process group, a collective) only when it is asked for it.
    """
    if isinstance(strategy, DeclaresContract):
        return strategy
    return ForeignStrategy(strategy)
