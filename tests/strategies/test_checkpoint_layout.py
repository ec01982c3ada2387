"""Which layout each strategy writes (strategies/contract.py), which resume which (checkpoint/layout.py), and
the one table every family is described in (strategies/spec.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeed
from lightning.pytorch.strategies import FSDPStrategy as LightningFSDP
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_mlopt.checkpoint.layout import (
    DCP_SHARDS,
    ONE_FILE,
    ZERO_PARTITIONS,
    CheckpointLayout,
    can_resume,
    layout_of_folder,
    layout_of_manifest,
)
from lightning_mlopt.strategies import LAYOUTS, DDPStrategy, DeepSpeedStrategy, FSDPStrategy, layout_named
from lightning_mlopt.strategies.contract import DeclaresContract, contract_of
from lightning_mlopt.strategies.spec import StrategySpec, layouts_table, names_table
from tests.conftest import CONFIGS


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
    def resumes(saved: str, current: str) -> bool:
        return can_resume(saved, layout_named(current))

    assert resumes(ONE_FILE, ONE_FILE) and resumes(DCP_SHARDS, DCP_SHARDS)
    assert resumes(ONE_FILE, DCP_SHARDS)  # DCP reads a full state dict and shards it
    assert not resumes(DCP_SHARDS, ONE_FILE)
    assert resumes(ONE_FILE, ZERO_PARTITIONS)  # loaded into the partitions at any world size
    assert not resumes(ZERO_PARTITIONS, DCP_SHARDS)  # converted to one file first (checkpoint/conversion.py)
    assert not resumes("the format of OwnFormat", ONE_FILE)
    assert resumes("the format of OwnFormat", "the format of OwnFormat")  # a foreign format resumes itself
    # Manifests written before the layout was recorded: by the strategy's class name.
    known = LAYOUTS.values()
    assert layout_of_manifest(None, "DeepSpeedStrategy", known) == ZERO_PARTITIONS
    assert layout_of_manifest(None, "DDPStrategy", known) == ONE_FILE
    assert layout_of_manifest(DCP_SHARDS, "MyFSDP", known) == DCP_SHARDS


def test_every_strategy_in_the_table_declares_the_contract_and_its_specs_layout():
    from lightning_mlopt.strategies import SPECS, STRATEGIES
    from lightning_mlopt.strategies.contract import StrategyContract

    annotated = {name for base in StrategyContract.__mro__ for name in getattr(base, "__annotations__", {})}
    members = {name for name in {*dir(StrategyContract), *annotated} if not name.startswith("_")}
    assert {"checkpoint_layout", "background_saves", "sharding", "check_model", "consolidate_checkpoint"} <= members
    for name, (cls, _, _) in STRATEGIES.items():
        assert issubclass(cls, DeclaresContract), name
        assert all(hasattr(cls, member) for member in members), name  # read on the class: no property runs
        assert cls.checkpoint_layout in LAYOUTS, name
        if cls.background_saves:  # its own background save and group, not the defaults that refuse
            assert cls.save_checkpoint_async is not DeclaresContract.save_checkpoint_async, name
            assert cls.checkpoint_process_group is not DeclaresContract.checkpoint_process_group, name
    for spec in SPECS:  # each overlay the spec names exists and configures the spec's class
        assert spec.strategy_class.strategy_name == f"mlopt_{spec.family}"
        for overlay in spec.overlays:
            text = (CONFIGS / "strategies" / overlay).read_text()
            assert f"class_path: lightning_mlopt.strategies.{spec.strategy_class.__name__}" in text, overlay


def test_layouts_are_recognised_by_their_files(tmp_path):
    (tmp_path / "one.ckpt").write_bytes(b"x")
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "zero" / "checkpoint").mkdir(parents=True)
    (tmp_path / "nothing").mkdir()
    known = LAYOUTS.values()
    assert layout_of_folder(tmp_path / "one.ckpt", known).name == ONE_FILE
    assert layout_of_folder(tmp_path / "dcp", known).name == DCP_SHARDS
    assert layout_of_folder(tmp_path / "zero", known).name == ZERO_PARTITIONS
    with pytest.raises(FileNotFoundError, match="not a checkpoint in any known layout"):
        layout_of_folder(tmp_path / "nothing", known)
    assert layout_named(DCP_SHARDS).consolidate is FSDPStrategy.consolidate_checkpoint
    with pytest.raises(ValueError, match="no strategy of ours reads"):
        layout_named("the format of OwnFormat").read(tmp_path / "one.ckpt")


class _TensorParallel(DeclaresContract, SingleDeviceStrategy):
    """A throwaway tensor-parallel strategy: what a new family brings is its class and one spec."""

    checkpoint_layout = "TP shards"


def test_a_new_strategy_is_one_spec():
    from lightning_mlopt.strategies import SPECS

    tp = StrategySpec(
        _TensorParallel,
        names={"tp_sketch": ({}, "tensor parallel"), "fsdp_tp_sketch": ({"data_parallel": "fsdp"}, "2D: FSDP x TP")},
        layout=CheckpointLayout("TP shards", lambda state, trust=False: {"state_dict": {}}, resumes_from=(DCP_SHARDS,)),
        overlays=("tp.yaml",),
    )
    names, layouts = names_table((*SPECS, tp)), layouts_table((*SPECS, tp))
    assert names["fsdp_tp_sketch"] == (_TensorParallel, {"data_parallel": "fsdp"}, "2D: FSDP x TP")
    assert _TensorParallel.strategy_name == "mlopt_tp_sketch"  # derived from the spec, not written on the class
    assert can_resume(DCP_SHARDS, layouts["TP shards"]) and layouts["TP shards"].read(CONFIGS) == {"state_dict": {}}
    assert contract_of(_TensorParallel("cpu")).checkpoint_layout == "TP shards"
    with pytest.raises(ValueError, match="claimed by"):
        names_table((*SPECS, tp, tp))
    with pytest.raises(ValueError, match="declares checkpoint_layout 'TP shards'; its spec's layout is 'one file'"):
        StrategySpec(_TensorParallel, names={"x": ({}, "")}, layout=LAYOUTS[ONE_FILE])


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


def test_the_checkpoint_package_needs_no_strategy_imported(tmp_path):
    # No registration by import: the layout functions are given the layouts they judge.
    import subprocess
    import sys

    code = (
        "from pathlib import Path\n"
        "from lightning_mlopt.checkpoint.layout import CheckpointLayout, can_resume, layout_of_manifest\n"
        "import sys\n"
        "assert not any(name.startswith('lightning_mlopt.strategies') for name in sys.modules)\n"
        "assert layout_of_manifest(None, 'DDPStrategy', ()) == 'one file'\n"
        "assert can_resume('one file', CheckpointLayout('one file'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]


def test_which_strategies_gather_at_the_start_of_a_step():
    # FaultTolerantCheckpoint votes in step on CPU under these: a sum in flight on training's gloo group across
    # the boundary delayed FSDP's first all-gathers (benchmarks/results/parity-trace-fsdp_cpu-2proc_202611.md).
    assert contract_of(FSDPStrategy()).collectives_at_step_start
    assert contract_of(DeepSpeedStrategy(preset="zero3")).collectives_at_step_start
    assert not contract_of(DeepSpeedStrategy(preset="zero2")).collectives_at_step_start
    assert not contract_of(DDPStrategy()).collectives_at_step_start
    assert contract_of(LightningFSDP()).collectives_at_step_start  # a foreign DCP writer: FSDP
    assert not contract_of(SingleDeviceStrategy("cpu")).collectives_at_step_start
