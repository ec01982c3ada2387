"""``python -m lightning_mlopt checkpoint list|verify|consolidate|export`` on real checkpoints of every format."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lightning_mlopt.checkpoint import CheckpointStore
from lightning_mlopt.demos import GPTLanguageModel
from tests.conftest import SHARED_RUN_STEPS, run_cli, run_tool_here


@pytest.mark.multiprocess
# One strategy per checkpoint layout (one file, DCP shards, ZeRO partitions): ZeRO-1 and -2 write the same
# partitioned layout as ZeRO-3 through the same code, and the suite's time budget is spent where paths differ.
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_consolidate_and_export_any_checkpoint(tmp_path, monkeypatch, strategy_runs, strategy):
    # The session's run (tests/conftest.py), read only: every output goes under tmp_path.
    _, expected, run_dir = strategy_runs[strategy]
    checkpoints = run_dir / "checkpoints"
    newest = CheckpointStore(checkpoints).newest_valid()
    assert newest is not None
    output = tmp_path / "consolidated.ckpt"
    result = run_tool_here("checkpoint", ["consolidate", str(newest.path), str(output)], tmp_path, monkeypatch)
    assert result.returncode == 0, result.stderr
    consolidated = torch.load(output, weights_only=False)
    assert consolidated["global_step"] == SHARED_RUN_STEPS
    plain = GPTLanguageModel()  # the demo's defaults are gpt.yaml's model
    plain.load_state_dict(consolidated["state_dict"], strict=True)
    for name, value in plain.named_parameters():
        assert torch.equal(value.detach(), expected[name]), name
    if strategy == "ddp":  # what follows does not depend on the format (one run is enough)
        # Nothing is overwritten.
        again = run_tool_here("checkpoint", ["consolidate", str(newest.path), str(output)], tmp_path, monkeypatch)
        assert again.returncode == 2 and "exists" in again.stderr
        # The checkpoints folder itself: its newest valid checkpoint.
        from_folder = run_tool_here(
            "checkpoint", ["consolidate", str(checkpoints), str(tmp_path / "b.ckpt")], tmp_path, monkeypatch
        )
        assert from_folder.returncode == 0, from_folder.stderr
        assert f"consolidating the newest valid checkpoint: {newest.path}" in from_folder.stdout
        consolidated_again = torch.load(tmp_path / "b.ckpt", weights_only=False)
        assert consolidated_again["state_dict"].keys() == consolidated["state_dict"].keys()

    # safetensors, sharded as Hugging Face shards (a small limit here, to get several files), bit for bit.
    out = tmp_path / "export"
    exported = run_tool_here(
        "checkpoint", ["export", str(checkpoints), str(out), "--max-shard-size", "1MB"], tmp_path, monkeypatch
    )
    assert exported.returncode == 0, exported.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(out / shard))
    assert len(set(index["weight_map"].values())) > 1
    assert tensors.keys() == consolidated["state_dict"].keys()
    for name, value in consolidated["state_dict"].items():
        assert tensors[name].dtype == value.dtype and torch.equal(tensors[name], value), name
    config = json.loads((out / "model_config.json").read_text())
    assert config["class_path"] == "lightning_mlopt.demos.GPTLanguageModel"
    assert GPTLanguageModel(**config["init_args"]).state_dict().keys() == tensors.keys()
    if strategy == "ddp":  # into a folder that has files: refused, nothing overwritten
        again = run_tool_here("checkpoint", ["export", str(checkpoints), str(out)], tmp_path, monkeypatch)
        assert again.returncode == 2 and "not empty" in again.stderr


@pytest.mark.slow
def test_list_and_verify_report_validity_with_exit_status(tmp_path, monkeypatch):
    from tests.checkpoint.test_checkpoint_store import _commit

    store = CheckpointStore(tmp_path)
    _commit(store, 2)
    _commit(store, 4)
    listed = run_tool_here("checkpoint", ["list", str(tmp_path)], tmp_path, monkeypatch)
    assert listed.returncode == 0
    lines = listed.stdout.splitlines()
    assert lines[1].split()[0] == "2" and "valid" in lines[1]
    assert "<- latest" in lines[2]
    assert run_tool_here("checkpoint", ["verify", str(tmp_path)], tmp_path, monkeypatch).returncode == 0

    (tmp_path / "step-000000004" / "state.ckpt").write_bytes(b"trunc")
    verified = run_tool_here("checkpoint", ["verify", str(tmp_path)], tmp_path, monkeypatch)
    assert verified.returncode == 1
    assert "INVALID" in verified.stdout and "state.ckpt has 5 bytes" in verified.stdout
    listed = run_tool_here("checkpoint", ["list", str(tmp_path)], tmp_path, monkeypatch)
    assert "INVALID" in listed.stdout
    assert run_cli(["checkpoint", "verify", str(tmp_path / "nothing")], cwd=tmp_path).returncode == 2
