"""How a strategy lays out its checkpoints, and which layouts can resume which: asked here, nowhere else.

Our strategies declare it (their ``checkpoint_layout`` class attribute); a strategy that is not ours is
recognised by how it saves (the documented fallback): Lightning's DeepSpeed strategy writes ZeRO partitions,
its FSDP and model-parallel strategies DCP shards, and a strategy that keeps Lightning's base
``save_checkpoint`` writes one file from rank zero. Anything else has its own format, which
FaultTolerantCheckpoint saves synchronously through the strategy and resumes only with the same strategy
class.

Example::

    checkpoint_layout(trainer.strategy)               # "one file", "DCP shards", "ZeRO partitions", ...
    can_resume(saved="one file", current="DCP shards")  # True: DCP reads a full state dict and shards it
"""

from __future__ import annotations

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
