"""Checkpoints on an object store: our transfers against boto3's own, and resume from each tier, in one run.

    python benchmarks/checkpoint/remote/object_store.py                 # a 420 MB checkpoint, 3 repeats
    python benchmarks/checkpoint/remote/object_store.py --megabytes 64 --repeats 1 --no-publish

Against a real S3-compatible server on loopback (moto's standalone server, started here), with the same bytes:

- upload: ``ObjectStore.upload_file`` (parallel multipart, checksummed while it streams) against boto3's
  ``upload_file`` (its managed multipart transfer); goal: >= 0.8 x its throughput;
- download + verify: ``ObjectStore.download_file`` (parallel ranges, checksummed in order while written, fsync)
  against boto3's ``download_file``; goal: >= 0.8 x its throughput;
- resume, local tier against remote tier: choosing and verifying the newest checkpoint of a local folder
  (``CheckpointStore.newest_valid``) against downloading it from the store into an empty local folder
  (``RemoteCheckpoints.download_newest_valid``: a new VM); goal: local >= 5 x faster, for >= 400 MB.

The state is random bytes in the layout a one-file checkpoint has (``state.ckpt``, ``rng/rank-0.pt``, a
manifest). Medians of the repeats; the loopback server is in-memory, so the figures are the client's costs
(hashing, part handling, disk), not a network's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from _common import median, publish  # noqa: E402

MiB = 2**20


def _timed(action: Callable[[], object], repeats: int, reset: Callable[[], object] = lambda: None) -> float:
    """Median seconds of ``action`` over ``repeats`` runs, ``reset`` (untimed) before each."""
    seconds = []
    for _ in range(repeats):
        reset()
        started = time.perf_counter()
        action()
        seconds.append(time.perf_counter() - started)
    return median(seconds)


def _drop_page_cache(path: Path) -> None:
    """Evict a file from the page cache where the OS allows (a resume after a reboot reads from the disk)."""
    with path.open("rb") as handle:
        os.fsync(handle.fileno())
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _local_checkpoint(root: Path, megabytes: int) -> Path:
    from lightning_mlopt.checkpoint.manifest import Manifest, describe_files
    from lightning_mlopt.checkpoint.store import CheckpointStore

    store = CheckpointStore(root)
    staging = store.stage(100)
    with (staging / "state.ckpt").open("wb") as handle:
        for _ in range(megabytes):
            handle.write(os.urandom(MiB))
    (staging / "rng").mkdir()
    (staging / "rng" / "rank-0.pt").write_bytes(os.urandom(4096))
    manifest = Manifest(step=100, epoch=0, world_size=1, strategy="DDPStrategy", reason="every_n_steps")
    manifest.files = describe_files(staging)
    return store.commit(staging, manifest)


def measure(megabytes: int, repeats: int, work: Path) -> str:
    from lightning_mlopt.checkpoint.remote.checkpoints import RemoteCheckpoints
    from lightning_mlopt.checkpoint.remote.object_store import ObjectStore
    from lightning_mlopt.checkpoint.store import CheckpointStore
    from tests.support.s3_server import MotoServer

    with MotoServer() as server:
        os.environ.update(server.environment())
        server.create_bucket("bench")
        client = server.client()
        local = _local_checkpoint(work / "local", megabytes)
        state = local / "state.ckpt"
        size = state.stat().st_size
        ours = ObjectStore.for_url("s3://bench/ours")
        ours.check_access()  # both clients made and connected before anything is timed
        client.list_objects_v2(Bucket="bench", MaxKeys=1)

        upload_ours = _timed(lambda: ours.upload_file(state, "state.ckpt"), repeats)
        upload_boto = _timed(lambda: client.upload_file(str(state), "bench", "boto/state.ckpt"), repeats)

        target = work / "downloaded" / "state.ckpt"
        clear = lambda: shutil.rmtree(target.parent, ignore_errors=True)  # noqa: E731
        download_ours = _timed(lambda: ours.download_file("state.ckpt", target), repeats, clear)

        def boto_download() -> None:
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file("bench", "boto/state.ckpt", str(target))

        download_boto = _timed(boto_download, repeats, clear)

        remote = RemoteCheckpoints(ObjectStore.for_url("s3://bench/run"))
        remote.upload(local)
        resume_local = _timed(
            lambda: CheckpointStore(work / "local").newest_valid(), repeats, lambda: _drop_page_cache(state)
        )
        fresh = work / "new-vm"
        resume_remote = _timed(
            lambda: remote.download_newest_valid(CheckpointStore(fresh)),
            repeats,
            lambda: shutil.rmtree(fresh, ignore_errors=True),
        )

    def rate(seconds: float) -> str:
        return f"{size / MiB / seconds:.0f} MiB/s ({seconds:.2f} s)"

    rows = [
        ("upload", rate(upload_ours), rate(upload_boto), upload_boto / upload_ours, ">= 0.8 x"),
        ("download + verify", rate(download_ours), rate(download_boto), download_boto / download_ours, ">= 0.8 x"),
        (
            "resume: local tier vs remote tier",
            f"{resume_local:.2f} s (local, cold cache)",
            f"{resume_remote:.2f} s (from the store)",
            resume_remote / resume_local,
            ">= 5 x faster",
        ),
    ]
    lines = [
        f"State: {size / MiB:.0f} MiB (`state.ckpt`) + RNG file + manifest; moto {_moto_version()} on loopback; "
        f"median of {repeats}.",
        "",
        "| measure | ours | baseline | ratio | goal |",
        "|---|---|---|---|---|",
        *(f"| {name} | {a} | {b} | {ratio:.2f} x | {goal} |" for name, a, b, ratio, goal in rows),
        "",
    ]
    return "\n".join(lines)


def _moto_version() -> str:
    from importlib.metadata import version

    return version("moto")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=420, help="size of the checkpoint's state file")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-publish", action="store_true", help="print the table; write no result file")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as scratch:
        body = measure(options.megabytes, options.repeats, Path(scratch))
    if options.no_publish:
        print(body)
    else:
        publish("checkpoint_object_store", "cpu-2proc", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
