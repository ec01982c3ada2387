"""``python -m lightning_mlopt checkpoint list|verify|consolidate`` on real checkpoints of every format."""

from __future__ import annotations

import pytest
import torch

from lightning_mlopt.checkpoint import CheckpointStore
from lightning_mlopt.demos import GPTLanguageModel
from tests.conftest import run_cli
from tests.strategy_runs import train


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_consolidate_any_checkpoint_into_one_lightning_file(tmp_path, strategy):
    _, expected = train(tmp_path, strategy, strategy, steps=2)
    checkpoints = tmp_path / "runs" / strategy / "checkpoints"
    newest = CheckpointStore(checkpoints).newest_valid()
    assert newest is not None
    output = tmp_path / "consolidated.ckpt"
    result = run_cli(["checkpoint", "consolidate", str(newest.path), str(output)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    consolidated = torch.load(output, weights_only=False)
    assert consolidated["global_step"] == 2
    plain = GPTLanguageModel()  # the demo's defaults are gpt.yaml's model
    plain.load_state_dict(consolidated["state_dict"], strict=True)
    for name, value in plain.named_parameters():
        assert torch.equal(value.detach(), expected[name]), name
    # Nothing is overwritten.
    again = run_cli(["checkpoint", "consolidate", str(newest.path), str(output)], cwd=tmp_path)
    assert again.returncode == 2 and "exists" in again.stderr
    # The checkpoints folder itself: its newest valid checkpoint.
    from_folder = run_cli(["checkpoint", "consolidate", str(checkpoints), str(tmp_path / "b.ckpt")], cwd=tmp_path)
    assert from_folder.returncode == 0, from_folder.stderr
    assert f"consolidating the newest valid checkpoint: {newest.path}" in from_folder.stdout
    assert torch.load(tmp_path / "b.ckpt", weights_only=False)["state_dict"].keys() == consolidated["state_dict"].keys()


def test_list_and_verify_report_validity_with_exit_status(tmp_path):
    from tests.test_checkpoint_store import _commit

    store = CheckpointStore(tmp_path)
    _commit(store, 2)
    _commit(store, 4)
    listed = run_cli(["checkpoint", "list", str(tmp_path)], cwd=tmp_path)
    assert listed.returncode == 0
    lines = listed.stdout.splitlines()
    assert lines[1].split()[0] == "2" and "valid" in lines[1]
    assert "<- latest" in lines[2]
    assert run_cli(["checkpoint", "verify", str(tmp_path)], cwd=tmp_path).returncode == 0

    (tmp_path / "step-000000004" / "state.ckpt").write_bytes(b"trunc")
    verified = run_cli(["checkpoint", "verify", str(tmp_path)], cwd=tmp_path)
    assert verified.returncode == 1
    assert "INVALID" in verified.stdout and "state.ckpt has 5 bytes" in verified.stdout
    listed = run_cli(["checkpoint", "list", str(tmp_path)], cwd=tmp_path)
    assert "INVALID" in listed.stdout
    assert run_cli(["checkpoint", "verify", str(tmp_path / "nothing")], cwd=tmp_path).returncode == 2
