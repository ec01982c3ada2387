"""Which layout each strategy writes, and which layouts resume which (checkpoint/layout.py)."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeed
from lightning.pytorch.strategies import FSDPStrategy as LightningFSDP
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_mlopt.checkpoint.layout import (
    DCP_SHARDS,
    ONE_FILE,
    ZERO_PARTITIONS,
    can_resume,
    checkpoint_layout,
    layout_of_manifest,
)
from lightning_mlopt.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy


class OwnFormat(SingleDeviceStrategy):
    def save_checkpoint(self, checkpoint, filepath, storage_options=None):  # type: ignore[no-untyped-def]
        pass


def test_ours_declare_and_others_are_recognised_by_how_they_save():
    assert checkpoint_layout(DDPStrategy()) == ONE_FILE
    assert checkpoint_layout(FSDPStrategy()) == DCP_SHARDS
    assert checkpoint_layout(DeepSpeedStrategy()) == ZERO_PARTITIONS
    assert checkpoint_layout(SingleDeviceStrategy("cpu")) == ONE_FILE
    assert checkpoint_layout(LightningFSDP()) == DCP_SHARDS
    # Lightning's DeepSpeedStrategy subclasses its DDPStrategy: recognised as ZeRO, not as one file.
    assert checkpoint_layout(LightningDeepSpeed()) == ZERO_PARTITIONS
    assert checkpoint_layout(OwnFormat("cpu")) == "the format of OwnFormat"
    assert checkpoint_layout(pl.Trainer(accelerator="cpu", logger=False).strategy) == ONE_FILE


def test_which_layouts_resume_which():
    assert can_resume(ONE_FILE, ONE_FILE) and can_resume(DCP_SHARDS, DCP_SHARDS)
    assert can_resume(ONE_FILE, DCP_SHARDS)  # DCP reads a full state dict and shards it
    assert not can_resume(DCP_SHARDS, ONE_FILE)
    assert not can_resume(ONE_FILE, ZERO_PARTITIONS) and not can_resume(ZERO_PARTITIONS, DCP_SHARDS)
    assert not can_resume("the format of OwnFormat", ONE_FILE)
    # Manifests written before the layout was recorded: by the strategy's class name.
    assert layout_of_manifest(None, "DeepSpeedStrategy") == ZERO_PARTITIONS
    assert layout_of_manifest(None, "DDPStrategy") == ONE_FILE
    assert layout_of_manifest(DCP_SHARDS, "MyFSDP") == DCP_SHARDS
