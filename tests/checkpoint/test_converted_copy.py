"""One process converts, the others wait on the file system: reuse, a killed converter's lock, a failure said once."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from lightning_mlopt.checkpoint import CheckpointStore, conversion
from lightning_mlopt.checkpoint.conversion import converted_copy
from lightning_mlopt.checkpoint.layout import CheckpointLayout
from lightning_mlopt.checkpoint.manifest import Manifest, describe_files, verify
from lightning_mlopt.exceptions import BadInputError

# A layout read with torch.load: what the conversion does with any readable layout, without a distributed run.
READABLE = CheckpointLayout("a test layout", lambda state, trust: torch.load(state, weights_only=True))


def _source(tmp_path: Path) -> Path:
    store = CheckpointStore(tmp_path / "source")
    staging = store.stage(7)
    torch.save({"global_step": 7, "state_dict": {"w": torch.arange(3.0)}}, staging / "state.ckpt")
    manifest = Manifest(step=7, epoch=0, world_size=2, strategy="Test", reason="every_n_steps", layout=READABLE.name)
    manifest.files = describe_files(staging)
    return store.commit(staging, manifest)


def test_the_first_caller_converts_and_later_ones_reuse_the_verified_copy(tmp_path: Path) -> None:
    source = _source(tmp_path)
    copy, described = converted_copy(source, tmp_path / "run", READABLE, trust_pickles=False)
    assert described is not None and described.startswith("a test layout of 2 rank(s) -> one file: 1 weights")
    assert verify(copy).step == 7 and torch.equal(torch.load(copy / "state.ckpt")["state_dict"]["w"], torch.arange(3.0))
    again, described = converted_copy(source, tmp_path / "run", READABLE, trust_pickles=False, may_convert=False)
    assert again == copy and described is None


def test_a_lock_left_by_a_killed_converter_is_taken_over(tmp_path: Path) -> None:
    source = _source(tmp_path)
    lock = tmp_path / "run" / "converted" / f".{source.name}.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text(f"{socket.gethostname()} {2**22 + 12345}\n")  # no such process
    copy, described = converted_copy(source, tmp_path / "run", READABLE, trust_pickles=False)
    assert described is not None and verify(copy).step == 7 and not lock.exists()


def test_a_live_converter_is_waited_for_and_a_wait_is_bounded(tmp_path: Path, monkeypatch) -> None:
    source = _source(tmp_path)
    lock = tmp_path / "run" / "converted" / f".{source.name}.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text(f"{socket.gethostname()} {os.getpid()}\n")  # held by a process that runs (this one)
    monkeypatch.setattr(conversion, "WAIT_FOR_RANK_ZERO_S", 1.0)
    with pytest.raises(BadInputError, match="did not appear in time"):
        converted_copy(source, tmp_path / "run", READABLE, trust_pickles=False)


def test_a_failed_conversion_is_raised_by_its_converter_and_by_every_waiter(tmp_path: Path) -> None:
    source = _source(tmp_path)

    def unreadable(state: Path, trust: bool) -> dict:
        raise ValueError("the partitions of rank 1 are missing\nmore detail")

    broken = CheckpointLayout("a test layout", unreadable)
    with pytest.raises(ValueError, match="rank 1"):
        converted_copy(source, tmp_path / "run", broken, trust_pickles=False)
    with pytest.raises(BadInputError) as waiter:
        converted_copy(source, tmp_path / "run", broken, trust_pickles=False, may_convert=False)
    assert str(waiter.value) == f"cannot convert {source} (a test layout): the partitions of rank 1 are missing"
    assert waiter.value.said_elsewhere  # the converter said it; the others exit with it silently
    assert not (tmp_path / "run" / "converted" / source.name).exists()


def test_a_converted_copy_names_its_source_and_the_source_commit_time_in_utc(tmp_path: Path) -> None:
    source = _source(tmp_path)
    manifest = Manifest.from_json((source / "manifest.json").read_bytes())
    manifest.created = 1796219593.887  # what resume prints as "saved by converted from ... (committed ...)"
    (source / "manifest.json").write_text(manifest.to_json())
    copy, _ = converted_copy(source, tmp_path / "run", READABLE, trust_pickles=False)
    assert verify(copy).reason == f"converted from {source.resolve()} (committed 2026-12-02 13:53:13.887 UTC)"
    # A step saved again (another commit time) is another checkpoint: converted again, not taken for the copy.
    manifest.created += 0.001
    (source / "manifest.json").write_text(manifest.to_json())
    _, described = converted_copy(source, tmp_path / "run", READABLE, trust_pickles=False)
    assert described is not None and verify(copy).reason.endswith("(committed 2026-12-02 13:53:13.888 UTC)")
