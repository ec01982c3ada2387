"""Checkpoints through the real Trainer for every strategy; FSDP's load at another world size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_mlopt.checkpoint import STATE_NAME, CheckpointStore
from tests.strategy_runs import train


def _saved_checkpoint(tmp_path: Path, name: str) -> Path:
    """What the strategy wrote for the newest committed checkpoint of a run (FaultTolerantCheckpoint's layout)."""
    entry = CheckpointStore(tmp_path / "runs" / name / "checkpoints").newest_valid()
    assert entry is not None and entry.step == 3
    return entry.path / STATE_NAME


def _assert_resumed_from(out_dir: Path, saved_params: dict[str, torch.Tensor], step: int) -> None:
    start = torch.load(out_dir / "start_params.pt")
    assert start["step"] == step
    for name, value in saved_params.items():
        assert torch.equal(start["params"][name], value), f"{name} was not restored exactly"


@pytest.mark.multiprocess
# DDP, FSDP and ZeRO-2 resume bitwise in test_fault_tolerant_checkpoint's kill tests; ZeRO-1 writes ZeRO-2's
# partitioned layout through the same code (the suite's time goes where paths differ): ZeRO-3 is the rest.
@pytest.mark.parametrize("strategy", ["zero3"])
def test_save_and_resume_at_the_same_world_size(tmp_path, strategy):
    saved = train(tmp_path, "first", strategy, steps=3).params
    checkpoint = _saved_checkpoint(tmp_path, "first")
    if strategy != "ddp":
        assert checkpoint.is_dir(), "sharded strategies write a folder of shards"
    records = train(tmp_path, "resumed", strategy, steps=5, extra=(f"--ckpt_path={checkpoint}",)).records
    _assert_resumed_from(tmp_path / "resumed", saved, step=3)
    assert len(records[0]["losses"]) == 2  # steps 4 and 5 only


@pytest.mark.multiprocess
@pytest.mark.parametrize(("save_devices", "load_devices"), [(2, 1), (1, 2)])
def test_fsdp_checkpoint_loads_at_another_world_size(tmp_path, save_devices, load_devices):
    saved = train(tmp_path, "first", "fsdp", steps=3, devices=save_devices).params
    checkpoint = _saved_checkpoint(tmp_path, "first")
    assert checkpoint.is_dir() and any(checkpoint.glob("*.distcp")), "a torch.distributed.checkpoint folder"
    records = train(
        tmp_path, "resumed", "fsdp", steps=5, devices=load_devices, extra=(f"--ckpt_path={checkpoint}",)
    ).records
    _assert_resumed_from(tmp_path / "resumed", saved, step=3)
    assert len(records) == load_devices
    assert all(len(record["losses"]) == 2 for record in records)
