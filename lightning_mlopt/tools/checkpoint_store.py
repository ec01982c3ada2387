"""``python -m lightning_mlopt checkpoint`` on an object store: ``list``, ``verify``, and a local copy to read.

A checkpoint URL is a run's prefix (``s3://ckpt/runs/gpt``: every commit under it) or one step
(``s3://ckpt/runs/gpt/step-000000500``). ``list`` checks each commit's files by size from one listing;
``verify`` downloads each one and checks every checksum as it streams (nothing is kept); ``consolidate`` and
``export`` read a verified local copy in a temporary folder.

Example::

    python -m lightning_mlopt checkpoint list s3://ckpt/runs/gpt
    python -m lightning_mlopt checkpoint verify s3://ckpt/runs/gpt/step-000000500
    python -m lightning_mlopt checkpoint export s3://ckpt/runs/gpt weights/
"""

from __future__ import annotations

import datetime as dt
import re
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from lightning_mlopt.checkpoint.manifest import Manifest
from lightning_mlopt.checkpoint.remote.checkpoints import RemoteCheckpoints
from lightning_mlopt.checkpoint.remote.object_store import ObjectStore, ObjectURL
from lightning_mlopt.checkpoint.store import CheckpointStore
from lightning_mlopt.exceptions import CheckpointInvalidError

_STEP = re.compile(r"^(.*?)/?step-(\d{9})$")


def open_url(url: str) -> tuple[RemoteCheckpoints, int | None]:
    """The run's remote checkpoints and the step the URL names (None: the whole prefix)."""
    parsed = ObjectURL.parse(url)
    found = _STEP.match(parsed.prefix)
    if found is None:
        return RemoteCheckpoints(ObjectStore(parsed)), None
    return RemoteCheckpoints(ObjectStore(ObjectURL(parsed.bucket, found.group(1)))), int(found.group(2))


def list_remote(url: str, human: Callable[[float], str]) -> int:
    """``list`` for a prefix: step, time, size, and whether each commit's files are all there; 0 if any is."""
    remote, _ = open_url(url)
    steps = remote.committed()
    if not steps:
        print(f"no checkpoints in {url}")
        return 1
    latest = remote.latest_name()
    print(LIST_HEADER)
    complete = 0
    for step in steps:
        manifest = remote.read_manifest(step)
        problem = remote.incomplete(step)
        complete += problem is None
        status = "complete (verify reads the checksums)" if problem is None else f"INCOMPLETE: {problem}"
        size = human(manifest.total_bytes) if manifest is not None else "-"
        print(list_row(step, manifest, size, status, latest=CheckpointStore.name_for(step) == latest))
    return 0 if complete else 1


LIST_HEADER = f"{'step':>10}  {'saved (UTC)':19}  {'size':>10}  {'reason':13}  status"


def list_row(step: int, manifest: Manifest | None, size: str, status: str, latest: bool) -> str:
    """One line of ``checkpoint list``, under :data:`LIST_HEADER`."""
    when = reason = "-"
    if manifest is not None:
        when = dt.datetime.fromtimestamp(manifest.created, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        reason = manifest.reason + (" (final)" if manifest.final else "")
    marker = "  <- latest" if latest else ""
    return f"{step:>10}  {when:19}  {size:>10}  {reason:13}  {status}{marker}"


def verify_remote(url: str) -> int:
    """``verify``: download each commit (or the one named) into a scratch folder, every checksum checked."""
    remote, named = open_url(url)
    steps = [named] if named is not None else remote.committed()
    if not steps:
        print(f"no checkpoints in {url}")
        return 2
    failures = 0
    for step in steps:
        with tempfile.TemporaryDirectory(prefix="verify-") as scratch:
            entry = remote.download(step, CheckpointStore(Path(scratch)))
        where = remote.store.url.child(CheckpointStore.name_for(step))
        if entry.valid:
            assert entry.manifest is not None
            print(f"OK       {where} (step {step}, {len(entry.manifest.files)} files)")
        else:
            failures += 1
            print(f"INVALID  {where}: {entry.problem}")
    return 1 if failures else 0


def local_copy(url: str, stack: ExitStack) -> Path:
    """A verified local copy (in a temporary folder kept open by ``stack``) of the step named, or the newest."""
    remote, named = open_url(url)
    local = CheckpointStore(Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="checkpoint-"))))
    if named is not None:
        entry = remote.download(named, local)
        if not entry.valid:
            raise CheckpointInvalidError(f"{url}: {entry.problem}")
    else:
        found = remote.download_newest_valid(local)
        if found is None:
            raise CheckpointInvalidError(f"{url}: no checkpoint in it verifies (see: checkpoint list)")
        entry = found
    print(f"downloaded and verified {remote.store.url.child(entry.path.name)}")
    return entry.path
