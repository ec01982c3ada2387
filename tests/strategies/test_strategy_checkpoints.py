"""Checkpoints through the real Trainer for every strategy; FSDP's load at another world size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_mlopt.checkpoint import STATE_NAME, CheckpointStore
from tests.conftest import SHARED_RUN_STEPS
from tests.support.strategy_runs import train


def _saved_checkpoint(run_dir: Path, step: int) -> Path:
    """What the strategy wrote for the newest committed checkpoint of a run (FaultTolerantCheckpoint's layout)."""
    entry = CheckpointStore(run_dir / "checkpoints").newest_valid()
    assert entry is not None and entry.step == step
    return entry.path / STATE_NAME


def _assert_resumed_from(out_dir: Path, saved_params: dict[str, torch.Tensor], step: int) -> None:
    start = torch.load(out_dir / "start_params.pt")
    assert start["step"] == step
    for name, value in saved_params.items():
        assert torch.equal(start["params"][name], value), f"{name} was not restored exactly"


@pytest.mark.multiprocess
# DDP, FSDP and ZeRO-2 resume bitwise in test_fault_tolerant_checkpoint's kill tests; ZeRO-1 writes ZeRO-2's
# partitioned layout through the same code (the suite's time goes where paths differ): ZeRO-3 is the rest. The
# checkpoint is the final one of the session's shared ZeRO-3 run (read only: the resumed run writes elsewhere).
def test_zero3_saves_and_resumes_at_the_same_world_size(tmp_path, strategy_runs):
    shared = strategy_runs["zero3"]
    checkpoint = _saved_checkpoint(shared.run_dir, SHARED_RUN_STEPS)
    assert checkpoint.is_dir(), "sharded strategies write a folder of shards"
    steps = SHARED_RUN_STEPS + 2
    records = train(tmp_path, "resumed", "zero3", steps=steps, extra=(f"--ckpt_path={checkpoint}",)).records
    _assert_resumed_from(tmp_path / "resumed", shared.params, step=SHARED_RUN_STEPS)
    assert len(records[0]["losses"]) == 2  # the two steps after the checkpoint only


@pytest.mark.multiprocess
@pytest.mark.parametrize(("save_devices", "load_devices"), [(2, 1), (1, 2)])
def test_fsdp_checkpoint_loads_at_another_world_size(tmp_path, strategy_runs, save_devices, load_devices):
    if save_devices == 2:  # the session's shared FSDP run, on 2 processes, saved at its end
        first, saved_at = strategy_runs["fsdp"], SHARED_RUN_STEPS
    else:
        first, saved_at = train(tmp_path, "first", "fsdp", steps=3, devices=save_devices), 3
    checkpoint = _saved_checkpoint(first.run_dir, saved_at)
    assert checkpoint.is_dir() and any(checkpoint.glob("*.distcp")), "a torch.distributed.checkpoint folder"
    records = train(
        tmp_path, "resumed", "fsdp", steps=saved_at + 2, devices=load_devices, extra=(f"--ckpt_path={checkpoint}",)
    ).records
    _assert_resumed_from(tmp_path / "resumed", first.params, step=saved_at)
    assert len(records) == load_devices
    assert all(len(record["losses"]) == 2 for record in records)
