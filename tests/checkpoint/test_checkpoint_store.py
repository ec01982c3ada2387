"""Commit protocol, manifests, retention and the async writer (single process, no training)."""

from __future__ import annotations

import math
import os
import shutil
import threading
from pathlib import Path

import pytest

from lightning_mlopt.checkpoint import AsyncWriter, CheckpointInvalidError, CheckpointStore, Manifest, RetentionPolicy
from lightning_mlopt.checkpoint.manifest import describe_files, verify


def _commit(store: CheckpointStore, step: int, payload: bytes = b"weights", **fields) -> None:
    staging = store.stage(step)
    (staging / "state.ckpt").write_bytes(payload)
    (staging / "rng").mkdir()
    (staging / "rng" / "rank-0.pt").write_bytes(b"rng")
    manifest = Manifest(step=step, epoch=0, world_size=1, strategy="X", reason="test", **fields)
    manifest.files = describe_files(staging)
    store.commit(staging, manifest)


def test_commit_writes_manifest_renames_and_moves_latest(tmp_path):
    store = CheckpointStore(tmp_path)
    _commit(store, 5)
    folder = tmp_path / "step-000000005"
    manifest = verify(folder)
    assert manifest.files.keys() == {"state.ckpt", "rng/rank-0.pt"}
    assert manifest.files["state.ckpt"].size == len(b"weights")
    assert store.latest_name() == "step-000000005"
    assert not any(p.name.startswith(".staging") for p in tmp_path.iterdir())


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda f: (f / "state.ckpt").write_bytes(b"weigh"), "has 5 bytes, the manifest says 7"),
        (lambda f: (f / "state.ckpt").write_bytes(b"WEIGHTS"), "does not match its checksum"),
        (lambda f: (f / "rng" / "rank-0.pt").unlink(), "rng/rank-0.pt is missing"),
        (lambda f: (f / "manifest.json").unlink(), "no manifest.json"),
        (lambda f: (f / "manifest.json").write_text("{"), "manifest is malformed"),
        # Shapes that once escaped as AttributeError / UnicodeDecodeError, past the resume's fallback.
        (lambda f: (f / "manifest.json").write_text("[]"), "manifest is malformed"),
        (lambda f: (f / "manifest.json").write_text('{"files": 5}'), "manifest is malformed"),
        (lambda f: (f / "manifest.json").write_bytes(b'{"step": \xff}'), "manifest is malformed"),
    ],
)
def test_verification_names_the_damage_and_resume_falls_back(tmp_path, damage, problem):
    store = CheckpointStore(tmp_path)
    _commit(store, 1)
    _commit(store, 2)
    damage(tmp_path / "step-000000002")
    with pytest.raises(CheckpointInvalidError, match=problem):
        verify(tmp_path / "step-000000002")
    skipped: list = []
    assert store.newest_valid(skipped).step == 1
    assert [entry.step for entry in skipped] == [2]


def test_an_interrupted_save_is_never_picked_and_is_cleaned(tmp_path):
    store = CheckpointStore(tmp_path)
    _commit(store, 1)
    staging = store.stage(2)  # a save killed before its commit: no manifest, staging name
    (staging / "state.ckpt").write_bytes(b"half")
    assert store.newest_valid().step == 1
    assert store.clean_staging() == [staging]
    assert not staging.exists()


def test_saving_the_same_step_again_replaces_it(tmp_path):
    store = CheckpointStore(tmp_path)
    _commit(store, 3, payload=b"old")
    _commit(store, 3, payload=b"newer")
    assert (tmp_path / "step-000000003" / "state.ckpt").read_bytes() == b"newer"
    assert verify(tmp_path / "step-000000003").step == 3


@pytest.mark.parametrize("killed_while", ["renaming the new copy into place", "removing the old copy"])
def test_a_kill_while_replacing_a_step_keeps_a_committed_copy(tmp_path, monkeypatch, killed_while):
    """Killed between the renames, the old copy comes back; after them, the new one stays and the old one goes."""
    store = CheckpointStore(tmp_path)
    _commit(store, 3, payload=b"old")
    target = tmp_path / "step-000000003"
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def replace(source, destination, *args, **kwargs):
        if killed_while.startswith("renaming") and Path(destination) == target:
            raise KeyboardInterrupt  # the process dies here: nothing after it runs
        real_replace(source, destination, *args, **kwargs)

    def rmtree(path, *args, **kwargs):
        if killed_while.startswith("removing") and Path(path).name == "replaced-step-000000003":
            raise KeyboardInterrupt
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        _commit(store, 3, payload=b"newer")
    monkeypatch.undo()
    assert (tmp_path / "replaced-step-000000003").is_dir()

    relaunched = CheckpointStore(tmp_path)
    restored = relaunched.restore_replaced()
    relaunched.clean_staging()
    entry = relaunched.newest_valid()
    assert entry is not None and entry.path == target
    old_copy_back = killed_while.startswith("renaming")
    assert (target / "state.ckpt").read_bytes() == (b"old" if old_copy_back else b"newer")
    assert restored == ([target] if old_copy_back else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000000003"]


def test_retention_ranks_a_non_finite_metric_last():
    """A NaN sorts anywhere; counted as no metric, it can neither be 'best' nor push the best out."""
    checkpoints = [(100, math.nan), (200, 0.5), (300, 0.9), (400, math.inf)]
    assert RetentionPolicy(keep_last=1, keep_best=1).to_delete(checkpoints) == [100, 300]
    assert RetentionPolicy(keep_last=1, keep_best=1, mode="max").to_delete(checkpoints) == [100, 200]


def test_retention_keeps_last_every_nth_and_best():
    policy = RetentionPolicy(keep_last=2, keep_every_n_steps=10, keep_best=1, mode="min")
    checkpoints = [(5, 0.9), (10, 0.8), (15, 0.1), (20, 0.7), (25, 0.6), (30, 0.5)]
    # last two: 25, 30; every 10th: 10, 20, 30; best (min): 15
    assert policy.to_delete(checkpoints) == [5]
    assert RetentionPolicy(keep_last=1, keep_best=0).to_delete([(1, None), (2, None)], protected=[1]) == []
    assert RetentionPolicy(keep_last=1, keep_best=2, mode="max").to_delete(
        [(1, 0.1), (2, 0.9), (3, 0.5), (4, 0.2)]
    ) == [1]
    with pytest.raises(ValueError, match=r"keep\.last must be >= 1"):
        RetentionPolicy(keep_last=0)


def test_async_writer_runs_one_at_a_time_and_reports_failures():
    writer = AsyncWriter()
    started, release = threading.Event(), threading.Event()
    order: list[str] = []

    def slow() -> None:
        started.set()
        release.wait(5)
        order.append("first")

    writer.submit(slow)
    started.wait(5)
    assert writer.busy
    release.set()
    writer.submit(lambda: order.append("second"))  # waits for the first
    writer.wait()
    assert order == ["first", "second"]

    def fail() -> None:
        raise OSError(28, "No space left on device")

    writer.submit(fail)
    with pytest.raises(OSError, match="No space left"):
        writer.wait()
    writer.wait()  # reported once
    writer.close()
