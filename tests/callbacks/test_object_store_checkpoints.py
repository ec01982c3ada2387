"""``checkpoint.dirpath: s3://...`` through the real CLI, against a real S3-compatible server on loopback (moto):
the store as the only durable tier, and two tiers (``local_dirpath``) where a failing store is said once."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lightning_mlopt.checkpoint import CheckpointStore
from lightning_mlopt.checkpoint.remote.checkpoints import RemoteCheckpoints
from lightning_mlopt.checkpoint.remote.object_store import ObjectStore
from lightning_mlopt.cli import main
from lightning_mlopt.tools.checkpoint import main as checkpoint_tool
from tests.conftest import CONFIGS
from tests.support.s3_server import SECRET_KEY, FaultyProxy, free_port

QUICK = [
    "--trainer.limit_val_batches=0",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.enable_progress_bar=false",
    "--checkpoint.every_n_steps=2",
]


def _fit(tmp_path: Path, *extra: str) -> None:
    main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), f"--run_dir={tmp_path / 'run'}", *QUICK, *extra])


def _remote(url: str) -> RemoteCheckpoints:
    return RemoteCheckpoints(ObjectStore.for_url(url))


@pytest.mark.slow
def test_checkpoints_in_a_bucket_survive_the_loss_of_the_node(s3_bucket, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    url = f"s3://{s3_bucket}/runs/quickstart"
    _fit(tmp_path, f"--checkpoint.dirpath={url}", "--trainer.max_steps=4")
    remote = _remote(url)
    assert remote.committed() == [2, 4]
    assert remote.read_manifest(4).final and remote.latest_name() == "step-000000004"
    # The checkpoint tool reads the store: list, verify, consolidate.
    capsys.readouterr()
    assert checkpoint_tool(["list", url]) == 0
    listed = capsys.readouterr().out
    assert listed.count("complete (verify reads the checksums)") == 2 and "<- latest" in listed
    assert checkpoint_tool(["verify", f"{url}/step-000000004"]) == 0
    assert f"OK       {url}/step-000000004 (step 4, " in capsys.readouterr().out
    assert checkpoint_tool(["consolidate", url, str(tmp_path / "q.ckpt")]) == 0
    assert torch.load(tmp_path / "q.ckpt", weights_only=False)["global_step"] == 4

    shutil.rmtree(tmp_path / "run" / "checkpoints")  # a new VM: the local tier is gone
    capsys.readouterr()
    _fit(tmp_path, f"--checkpoint.dirpath={url}", "--trainer.max_steps=6", "--checkpoint.resume.final=true")
    # Resumed from the store's step 4 (downloaded into the new local tier), not from scratch: no step 2 here.
    assert [step for step, _ in CheckpointStore(tmp_path / "run" / "checkpoints").committed()] == [4, 6]
    assert _remote(url).committed() == [2, 4, 6]
    assert SECRET_KEY not in capsys.readouterr().err


@pytest.mark.slow
def test_a_store_that_fails_mid_upload_stops_the_run_in_one_line_with_earlier_commits_intact(
    moto_server, s3_bucket, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    url = f"s3://{s3_bucket}/runs/q"
    # Every request that writes step 4 or 6 loses its connection (each retry too); step 2 goes through. Both
    # fail because copies never queue: while step 2 still uploads on a slow machine, step 4 waiting is replaced
    # by the newer step 6, and step 4 is never copied (seen in CI).
    failing = ("step-000000004/", "step-000000006/")
    with FaultyProxy(
        moto_server.port, fail=lambda r: r.method == "PUT" and any(step in r.path for step in failing)
    ) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        with pytest.raises(SystemExit) as exit_info:
            _fit(tmp_path, f"--checkpoint.dirpath={url}", "--trainer.max_steps=6")
    assert exit_info.value.code == 74
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("error: the remote checkpoint copy failed: "), message
    assert any(f"{url}/{step}" in message for step in failing), message
    assert "closed the connection before answering" in message, message
    assert message.endswith("Earlier checkpoints are intact")
    assert SECRET_KEY not in message
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    remote = _remote(url)
    assert remote.committed() == [2] and remote.latest_name() == "step-000000002"
    assert proxy.failed >= 1


@pytest.mark.slow
def test_an_unreachable_store_stops_before_training_unless_a_local_tier_is_set(
    s3_bucket, tmp_path, monkeypatch, capsys, caplog
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    url = f"s3://{s3_bucket}/runs/q"
    with pytest.raises(SystemExit) as exit_info:
        _fit(tmp_path, f"--checkpoint.dirpath={url}", "--trainer.max_steps=4")
    assert exit_info.value.code == 74
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith(f"error: cannot save checkpoints: {url}") and "cannot reach http://127.0.0.1:" in message
    assert "stopped before training" in message

    local = tmp_path / "local-tier"
    _fit(tmp_path, f"--checkpoint.dirpath={url}", f"--checkpoint.tiers.local_dirpath={local}", "--trainer.max_steps=6")
    assert [step for step, _ in CheckpointStore(local).committed()] == [2, 4, 6]  # training went on, saved locally
    said = [record.getMessage() for record in caplog.records if "copies are failing" in record.getMessage()]
    assert len(said) == 1 and "cannot reach http://127.0.0.1:" in said[0], said  # once, not at every save


def test_tier_settings_that_cannot_work_are_refused(tmp_path):
    from lightning_mlopt.callbacks import FaultTolerantCheckpoint, Tiers

    with pytest.raises(
        ValueError,
        match=r"Tiers\(local_dirpath=\.\.\.\)\) sets the local tier of an object",
    ):
        FaultTolerantCheckpoint(dirpath=str(tmp_path), tiers=Tiers(local_dirpath=str(tmp_path / "l")))
    with pytest.raises(ValueError, match=r"Tiers\(remote_every_n_steps=\.\.\.\)\) sets the local tier"):
        FaultTolerantCheckpoint(tiers=Tiers(remote_every_n_steps=10))
    with pytest.raises(ValueError, match="names no bucket"):
        FaultTolerantCheckpoint(dirpath="s3://")
    with pytest.raises(ValueError, match=r"local_dirpath.*'s3://b/x' is a URL where a folder"):
        FaultTolerantCheckpoint(dirpath="s3://b/run", tiers=Tiers(local_dirpath="s3://b/x"))
