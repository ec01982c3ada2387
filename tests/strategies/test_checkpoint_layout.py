"""Which layout each strategy writes (strategies/contract.py), and which resume which (checkpoint/layout.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeed
from lightning.pytorch.strategies import FSDPStrategy as LightningFSDP
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_mlopt.checkpoint.layout import ONE_FILE, can_resume, layout_of_manifest
from lightning_mlopt.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy
from lightning_mlopt.strategies.contract import DCP_SHARDS, ZERO_PARTITIONS, contract_of


def checkpoint_layout(strategy):  # type: ignore[no-untyped-def]
    return contract_of(strategy).checkpoint_layout


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


def test_every_registered_strategy_declares_the_contract():
    from lightning_mlopt.checkpoint.layout import registered_layouts
    from lightning_mlopt.strategies import STRATEGIES
    from lightning_mlopt.strategies.contract import DeclaresContract, StrategyContract

    annotated = {name for base in StrategyContract.__mro__ for name in getattr(base, "__annotations__", {})}
    members = {name for name in {*dir(StrategyContract), *annotated} if not name.startswith("_")}
    assert {"checkpoint_layout", "background_saves", "sharding", "check_model", "consolidate_checkpoint"} <= members
    for name, (cls, _, _) in STRATEGIES.items():
        assert issubclass(cls, DeclaresContract), name
        assert all(hasattr(cls, member) for member in members), name  # read on the class: no property runs
        assert cls.checkpoint_layout in registered_layouts(), name
        if cls.background_saves:  # its own background save, not the default that refuses
            assert cls.save_checkpoint_async is not DeclaresContract.save_checkpoint_async, name


def test_layouts_are_recognised_by_their_files(tmp_path):
    from lightning_mlopt.checkpoint.layout import consolidator, layout_of_folder

    (tmp_path / "one.ckpt").write_bytes(b"x")
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "zero" / "checkpoint").mkdir(parents=True)
    (tmp_path / "nothing").mkdir()
    assert layout_of_folder(tmp_path / "one.ckpt") == ONE_FILE
    assert layout_of_folder(tmp_path / "dcp") == DCP_SHARDS
    assert layout_of_folder(tmp_path / "zero") == ZERO_PARTITIONS
    with pytest.raises(FileNotFoundError, match="not a checkpoint in any known layout"):
        layout_of_folder(tmp_path / "nothing")
    assert consolidator(DCP_SHARDS) is FSDPStrategy.consolidate_checkpoint
    with pytest.raises(ValueError, match="no strategy of ours reads"):
        consolidator("the format of OwnFormat")
