"""A resume that fails on rank zero, on two real ranks: every rank stops with the cause, none waits for it.

Rank zero alone chooses the checkpoint; the others wait in the broadcast of its choice. An error rank zero
raised before that broadcast used to leave them there until the process group's timeout.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_mlopt.checkpoint import CheckpointStore, Manifest
from lightning_mlopt.checkpoint.layout import ONE_FILE
from lightning_mlopt.checkpoint.manifest import describe_files
from lightning_mlopt.checkpoint.remote.checkpoints import RemoteCheckpoints
from lightning_mlopt.checkpoint.remote.object_store import ObjectStore
from lightning_mlopt.checkpoint.resume import ResumingStrategy
from lightning_mlopt.checkpoint.resumption import Resumption
from lightning_mlopt.checkpoint.settings import Resume
from lightning_mlopt.strategies import LAYOUTS
from tests.distributed.two_ranks import on_two_ranks


def _choose_on_each_rank(rank: int, local_root: str, url: str) -> dict[str, Any]:
    import torch.distributed as dist

    def broadcast(obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    trainer = SimpleNamespace(is_global_zero=rank == 0, global_rank=rank, strategy=SimpleNamespace(broadcast=broadcast))
    resumption = Resumption(Resume(), remote_required=True, events=SimpleNamespace(resumed_from=None))
    strategy = ResumingStrategy("DDPStrategy", LAYOUTS[ONE_FILE], tuple(LAYOUTS.values()))
    remote = RemoteCheckpoints(ObjectStore.for_url(url)) if rank == 0 else None
    started = time.monotonic()
    try:
        resumption.choose(trainer, CheckpointStore(Path(local_root)), strategy, remote, saver=SimpleNamespace())
    except Exception as error:
        return {"raised": type(error).__name__, "message": str(error), "seconds": time.monotonic() - started}
    return {"raised": None, "seconds": time.monotonic() - started}


@pytest.mark.slow
def test_a_full_local_disk_while_fetching_from_the_bucket_stops_every_rank_with_the_cause(s3_bucket, tmp_path, tmpfs):
    url = f"s3://{s3_bucket}/runs/q"
    written = CheckpointStore(tmp_path / "written")
    staging = written.stage(4)
    torch.save({"global_step": 4, "w": torch.zeros(1_000_000)}, staging / "state.ckpt")  # 4 MB
    manifest = Manifest(step=4, epoch=0, world_size=2, strategy="DDPStrategy", reason="every_n_steps", layout=ONE_FILE)
    manifest.files = describe_files(staging)
    RemoteCheckpoints(ObjectStore.for_url(url)).upload(written.commit(staging, manifest))
    local = tmpfs("node_disk", size="1m")  # the new node's local tier: too small for the copy

    records = on_two_ranks(functools.partial(_choose_on_each_rank, local_root=str(local / "ckpt"), url=url), tmp_path)

    for rank, record in enumerate(records):
        assert record["raised"] == "CheckpointWriteError", (rank, record)
        assert (
            f"choosing a checkpoint in {local / 'ckpt'} failed: OSError: [Errno 28] No space left" in record["message"]
        ), record
        assert record["seconds"] < 60, f"rank {rank} waited {record['seconds']:.0f} s for rank 0's failure"
    assert not any((local / "ckpt").iterdir()), "the partial copy was removed"
