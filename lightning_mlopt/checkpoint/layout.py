"""How a strategy lays out its checkpoints, and which layouts can resume which: asked here, nowhere else.

Our strategies declare it (their ``checkpoint_layout`` class attribute); a strategy that is not ours is
recognised by how it saves (the documented fallback): Lightning's DeepSpeed strategy writes ZeRO partitions,
its FSDP and model-parallel strategies DCP shards, and a strategy that keeps Lightning's base
``save_checkpoint`` writes one file from rank zero. Anything else has its own format, which
FaultTolerantCheckpoint saves synchronously through the strategy and resumes only with the same strategy
class.

Each layout's strategy also says how to consolidate such a checkpoint into one full state dict (its
``consolidate_checkpoint``); :func:`consolidator` finds it, :func:`layout_of_folder` recognises a checkpoint
without a manifest by its files.

Example::

    checkpoint_layout(trainer.strategy)               # "one file", "DCP shards", "ZeRO partitions", ...
    can_resume(saved="one file", current="DCP shards")  # True: DCP reads a full state dict and shards it
    full = consolidator(layout_of_folder(state))(state)   # any layout, as one Lightning dict on CPU
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

ONE_FILE = "one file"
DCP_SHARDS = "DCP shards"
ZERO_PARTITIONS = "ZeRO partitions"
# Lightning's name for the non-tensor state next to DCP's shards (it loads it from there; so does our tool).
DCP_META_NAME = "meta.pt"

# Resuming works within a layout, and from one file into DCP shards (DCP reads a full state dict and shards it).
_CROSS_LAYOUT_RESUMES = {(ONE_FILE, DCP_SHARDS)}

# Manifests written before the layout was recorded name the strategy class only.
_LAYOUT_BY_CLASS_NAME = {
    "DeepSpeedStrategy": ZERO_PARTITIONS,
    "FSDPStrategy": DCP_SHARDS,
    "ModelParallelStrategy": DCP_SHARDS,
}


def checkpoint_layout(strategy: Any) -> str:
    """The layout ``strategy`` writes: its declared ``checkpoint_layout``, else recognised (see the module)."""
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


def layout_of_manifest(layout: str | None, strategy_name: str) -> str:
    """The layout a manifest records, or for manifests that predate the field, the one its strategy wrote."""
    return layout or _LAYOUT_BY_CLASS_NAME.get(strategy_name, ONE_FILE)


def can_resume(saved: str, current: str) -> bool:
    """Whether a checkpoint in layout ``saved`` loads into a strategy that writes ``current``."""
    return saved == current or (saved, current) in _CROSS_LAYOUT_RESUMES


def layout_of_folder(state: Path) -> str:
    """The layout of a saved ``state`` by its files (for checkpoints without a manifest that records it).

    Raises:
        FileNotFoundError: nothing there that any layout writes.

    """
    if state.is_file():
        return ONE_FILE
    if any(state.glob("*.distcp")):  # torch.distributed.checkpoint
        return DCP_SHARDS
    if (state / "checkpoint").is_dir() or (state / "latest").is_file():  # DeepSpeed's tag folder
        return ZERO_PARTITIONS
    raise FileNotFoundError(f"{state}: not a checkpoint file, a DCP folder or a DeepSpeed folder")


def consolidator(layout: str) -> Callable[..., dict[str, Any]]:
    """How to read a checkpoint of ``layout`` as one full state dict.

    The ``consolidate_checkpoint`` of our strategy that writes it, called as
    ``consolidator(layout)(state, trust_pickles)``.
    """
    from lightning_mlopt.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

    readers: dict[str, Callable[..., dict[str, Any]]] = {
        ONE_FILE: DDPStrategy.consolidate_checkpoint,
        DCP_SHARDS: FSDPStrategy.consolidate_checkpoint,
        ZERO_PARTITIONS: DeepSpeedStrategy.consolidate_checkpoint,
    }
    if layout not in readers:
        raise ValueError(f"no strategy of ours reads {layout!r}; resume it with the strategy that wrote it")
    return readers[layout]
