"""Which layout each strategy writes (strategies/contract.py), and which resume which (checkpoint/layout.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
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
        if cls.background_saves:  # its own background save and group, not the defaults that refuse
            assert cls.save_checkpoint_async is not DeclaresContract.save_checkpoint_async, name
            assert cls.checkpoint_process_group is not DeclaresContract.checkpoint_process_group, name


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


def test_a_foreign_strategy_keeps_what_it_has_and_nothing_runs_at_adaptation():
    class Declares(SingleDeviceStrategy):
        checkpoint_layout = DCP_SHARDS
        evaluated = 0

        @property
        def sharding(self):  # type: ignore[no-untyped-def]
            type(self).evaluated += 1
            raise RuntimeError("a property that fails (or runs a collective) must not run at adaptation")

        def check_model(self, module):  # type: ignore[no-untyped-def]
            raise ValueError("wrap_classes names Foo, which the model lacks")

        def save_checkpoint_async(self, checkpoint, filepath):  # type: ignore[no-untyped-def]
            return "pending"

    class Inherits(Declares):
        def save_checkpoint(self, checkpoint, filepath, storage_options=None):  # type: ignore[no-untyped-def]
            pass

    contract = contract_of(Inherits("cpu"))
    assert Declares.evaluated == 0
    assert contract.checkpoint_layout == DCP_SHARDS  # declared by a base class: still declared
    assert contract.background_saves and contract.save_checkpoint_async({}, "x") == "pending"
    with pytest.raises(ValueError, match="wrap_classes"):
        contract.check_model(torch.nn.Linear(1, 1))
    plain = contract_of(SingleDeviceStrategy("cpu"))
    assert not plain.background_saves
    plain.check_model(torch.nn.Linear(1, 1))  # nothing to check


def test_layout_questions_before_any_registration_fail_loudly(monkeypatch):
    from lightning_mlopt.checkpoint import layout

    monkeypatch.setattr(layout, "_LAYOUTS", {})
    with pytest.raises(RuntimeError, match=r"import lightning_mlopt\.strategies first"):
        layout.layout_of_manifest(None, "DeepSpeedStrategy")
    assert layout.can_resume(ONE_FILE, ONE_FILE)  # the same layout needs no table
