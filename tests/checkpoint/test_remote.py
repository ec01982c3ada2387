"""The remote tier's commit protocol on a real S3-compatible server (moto on loopback): create-only commits,
``latest`` by compare-and-swap, retention after the commit, and a reader that takes only what verifies."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from lightning_mlopt.checkpoint.manifest import MANIFEST_NAME, Manifest, describe_files, verify
from lightning_mlopt.checkpoint.remote.checkpoints import RemoteCheckpoints, data_folder
from lightning_mlopt.checkpoint.remote.object_store import ObjectStore
from lightning_mlopt.checkpoint.retention import RetentionPolicy
from lightning_mlopt.checkpoint.store import CheckpointStore
from lightning_mlopt.exceptions import ConcurrentWriterError

MiB = 2**20


def _remote(bucket: str, keep_last: int | None = None) -> RemoteCheckpoints:
    retention = RetentionPolicy(keep_last=keep_last, keep_best=0) if keep_last else None
    return RemoteCheckpoints(ObjectStore.for_url(f"s3://{bucket}/runs/gpt", max_attempts=3), retention)


def _local_checkpoint(root: Path, step: int, state_bytes: int = 1000) -> Path:
    """A committed local checkpoint as the saver leaves one: a state file, an RNG file, a manifest."""
    store = CheckpointStore(root)
    staging = store.stage(step)
    (staging / "state.ckpt").write_bytes(os.urandom(state_bytes))
    (staging / "rng").mkdir()
    (staging / "rng" / "rank-0.pt").write_bytes(os.urandom(64))
    manifest = Manifest(step=step, epoch=0, world_size=1, strategy="DDPStrategy", reason="every_n_steps")
    manifest.files = describe_files(staging)
    return store.commit(staging, manifest)


@pytest.mark.slow
def test_an_upload_commits_with_its_manifest_and_another_node_downloads_it_verified(s3_bucket, tmp_path):
    local = _local_checkpoint(tmp_path / "node-a", step=5, state_bytes=9 * MiB)  # above one part: multipart
    remote = _remote(s3_bucket)
    assert remote.upload(local) == f"s3://{s3_bucket}/runs/gpt/step-000000005"
    manifest = verify(local)
    folder = data_folder(manifest)
    assert sorted(remote.store.list_keys()) == [
        "latest",
        f"step-000000005/{folder}/rng/rank-0.pt",
        f"step-000000005/{folder}/state.ckpt",
        "step-000000005/manifest.json",
    ]
    assert remote.latest_name() == "step-000000005"

    other_node = CheckpointStore(tmp_path / "node-b")  # a new VM: its local tier is empty
    entry = _remote(s3_bucket).download_newest_valid(other_node)
    assert entry is not None and entry.valid and entry.step == 5
    assert verify(entry.path).files == manifest.files
    assert (entry.path / "state.ckpt").read_bytes() == (local / "state.ckpt").read_bytes()
    assert other_node.latest_name() == "step-000000005"


@pytest.mark.slow
def test_a_corrupted_or_half_written_remote_step_is_skipped_for_the_older_one(moto_server, s3_bucket, tmp_path, capsys):
    remote = _remote(s3_bucket)
    for step in (1, 2, 3):
        remote.upload(_local_checkpoint(tmp_path / "a", step))
    client, folder = moto_server.client(), data_folder(remote.read_manifest(3))
    client.put_object(Bucket=s3_bucket, Key=f"runs/gpt/step-000000003/{folder}/state.ckpt", Body=b"bit rot")
    client.put_object(Bucket=s3_bucket, Key="runs/gpt/step-000000004/x/state.ckpt", Body=b"no manifest: not a commit")
    skipped: list = []
    entry = _remote(s3_bucket).download_newest_valid(CheckpointStore(tmp_path / "b"), skipped=skipped)
    assert entry is not None and entry.step == 2
    assert [s.step for s in skipped] == [3]
    assert "state.ckpt has 7 bytes" in skipped[0].problem
    assert [step for step, _ in CheckpointStore(tmp_path / "b").committed()] == [2]  # the bad one left nothing
    assert remote.incomplete(3) == "state.ckpt: 7 bytes, the manifest says 1000 bytes"
    assert remote.incomplete(2) is None

    from lightning_mlopt.tools.checkpoint import main as checkpoint_tool

    url = f"s3://{s3_bucket}/runs/gpt"
    assert checkpoint_tool(["verify", url]) == 1
    out = capsys.readouterr().out
    assert out.count("OK       ") == 2 and f"INVALID  {url}/step-000000003: " in out
    assert checkpoint_tool(["list", url]) == 0
    assert "INCOMPLETE: state.ckpt: 7 bytes" in capsys.readouterr().out


def test_retention_deletes_older_steps_manifest_first_only_after_the_new_commit(s3_bucket, tmp_path):
    remote = _remote(s3_bucket, keep_last=2)
    for step in (10, 20, 30):
        remote.upload(_local_checkpoint(tmp_path, step))
    assert remote.committed() == [20, 30]
    assert not [key for key in remote.store.list_keys() if key.startswith("step-000000010/")]


@pytest.mark.slow
def test_a_second_run_on_the_same_prefix_stops_at_its_next_commit_in_one_line(s3_bucket, tmp_path):
    first, second = _remote(s3_bucket), _remote(s3_bucket)
    first.upload(_local_checkpoint(tmp_path / "a", 1))
    second.upload(_local_checkpoint(tmp_path / "b", 2))  # it saw step 1's latest, and moved it
    with pytest.raises(ConcurrentWriterError) as failure:
        first.upload(_local_checkpoint(tmp_path / "a", 3))
    message = str(failure.value)
    assert message == (
        f"s3://{s3_bucket}/runs/gpt/latest: another writer moved it (to step-000000002) since this run last did: "
        f"two runs are writing to s3://{s3_bucket}/runs/gpt. Give each run its own FaultTolerantCheckpoint(dirpath=...)"
    )
    assert first.store.get_bytes("latest")[0] == b"step-000000002\n"  # the winner's pointer stands


@pytest.mark.slow
def test_two_writers_racing_on_one_step_exactly_one_commits(s3_bucket, tmp_path):
    writers = [_remote(s3_bucket) for _ in range(2)]
    checkpoints = [_local_checkpoint(tmp_path / name, 7, state_bytes=2 * MiB) for name in "ab"]
    outcomes: list[str] = [""] * 2
    start = threading.Barrier(2)

    def race(index: int) -> None:
        start.wait()
        try:
            writers[index].upload(checkpoints[index])
            outcomes[index] = "won"
        except ConcurrentWriterError as error:
            outcomes[index] = str(error)

    threads = [threading.Thread(target=race, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes)[-1] == "won" and outcomes.count("won") == 1, outcomes
    loser = next(outcome for outcome in outcomes if outcome != "won")
    assert "another writer" in loser and "\n" not in loser
    winner = checkpoints[outcomes.index("won")]
    entry = _remote(s3_bucket).download_newest_valid(CheckpointStore(tmp_path / "c"))
    assert entry is not None and (entry.path / "state.ckpt").read_bytes() == (winner / "state.ckpt").read_bytes()


@pytest.mark.slow
def test_one_step_saved_again_replaces_its_commit_and_re_uploading_a_commit_is_a_no_op(s3_bucket, tmp_path):
    remote = _remote(s3_bucket)
    periodic = _local_checkpoint(tmp_path / "a", 4)
    remote.upload(periodic)
    final = _local_checkpoint(tmp_path / "b", 4)  # the final save right after the periodic one, at the same step
    remote.upload(final)
    relaunched = _remote(s3_bucket)  # the same run after a kill between its commit and its exit
    relaunched.upload(final)
    assert remote.committed() == [4]
    folder = data_folder(verify(final))
    assert sorted(remote.store.list_keys("step-000000004/")) == [
        f"step-000000004/{folder}/rng/rank-0.pt",
        f"step-000000004/{folder}/state.ckpt",
        f"step-000000004/{MANIFEST_NAME}",
    ]  # the replaced commit's files are gone
    entry = _remote(s3_bucket).download_newest_valid(CheckpointStore(tmp_path / "c"))
    assert entry is not None and (entry.path / "state.ckpt").read_bytes() == (final / "state.ckpt").read_bytes()


@pytest.mark.slow
def test_a_step_saved_again_while_it_is_copied_ends_with_the_newer_save_committed(s3_bucket, tmp_path):
    # The final save right after a periodic one of the same step: the local folder is committed anew while the
    # replicator streams the older files (the torture's kill trials met it). Not a failure: the newer save is
    # copied, and the store ends with it.
    from lightning_mlopt.checkpoint.remote.replicator import Replicator

    local = _local_checkpoint(tmp_path / "node", step=12, state_bytes=9 * MiB)
    remote = _remote(s3_bucket)
    upload_file = remote.store.upload_file
    resaved = threading.Event()

    def upload_while_saved_again(path, key, algorithm="xxh3_128"):  # type: ignore[no-untyped-def]
        if not resaved.is_set():  # the first file's copy starts, then the saver commits step 12 again
            resaved.set()
            _local_checkpoint(tmp_path / "node", step=12, state_bytes=9 * MiB)
        return upload_file(path, key, algorithm)

    remote.store.upload_file = upload_while_saved_again  # type: ignore[method-assign]
    replicator = Replicator(remote)  # must succeed: dirpath is the store
    replicator.offer(local, 12)
    assert replicator.flush(timeout=60)
    replicator.close()
    assert not replicator.failed, replicator.take_error()
    newest = verify(local)
    remote_manifest = Manifest.from_json(remote.store.get_bytes("step-000000012/manifest.json")[0].decode())
    assert remote_manifest.files == newest.files, "the store holds the newer save"
