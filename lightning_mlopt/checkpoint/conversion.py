"""A checkpoint of one layout turned into one full file that another strategy resumes: weights, optimizer, position.

The full file is the common ground: every strategy that resumes ``one file`` (DDP and a single device at any
world size; FSDP, TP and 2D, which shard it as they load it) resumes any checkpoint whose layout can be read
whole (ZeRO partitions of any stage and world size, DCP shards). What it carries: the weights in fp32, each
optimizer's state per parameter and its groups' settings (AdamW's moments and step counts), the LR
schedulers, the loops' progress and the data position, callbacks' state, and the RNG files (restored when the
world size is the same). The result is a step folder like any other: a manifest with every file's checksum,
written in a staging folder and renamed into place, so a kill mid-conversion leaves nothing half-written.

Example::

    described = convert_to_one_file(step_folder, out / "step-000000500", layout_of(step_folder))
    # "ZeRO partitions of 2 ranks -> one file: 53 weights, optimizer state of 53 parameters (exp_avg, ...)"
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from lightning_mlopt.checkpoint.layout import ONE_FILE, CheckpointLayout
from lightning_mlopt.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    describe_files,
    fsync_directory,
    library_versions,
    verify,
    write_manifest,
)
from lightning_mlopt.checkpoint.serialization import save_file
from lightning_mlopt.checkpoint.store import STATE_NAME
from lightning_mlopt.exceptions import BadInputError, CheckpointInvalidError, first_line

CONVERTED_DIR = "converted"  # <checkpoints>/converted/step-N: what a resume converted, kept for the next relaunch
_CONVERTED_FROM = "converted from "  # how a converted manifest's reason starts
RNG_DIR = "rng"
WAIT_FOR_RANK_ZERO_S = 6 * 3600.0  # the others wait this long for one process's conversion of a large checkpoint


def convert_to_one_file(source: Path, destination: Path, layout: CheckpointLayout, trust_pickles: bool = False) -> str:
    """Write the step folder ``source`` (in ``layout``) as a one-file step folder at ``destination``; say what.

    ``destination`` is replaced if it exists. ``source`` must have been verified against its manifest and its
    pickles against the allowlist (``check_trusted``) first, as every caller chooses a checkpoint: its bytes are
    read once, here, not hashed again.

    Raises:
        CheckpointInvalidError: its manifest is malformed, or its layout cannot be read whole.

    """
    manifest = Manifest.from_json((source / MANIFEST_NAME).read_bytes())
    full = layout.read(source / STATE_NAME, trust_pickles)
    staging = destination.parent / f".staging-{destination.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        known = {STATE_NAME: save_file(full, staging / STATE_NAME)}
        if (source / RNG_DIR).is_dir():
            shutil.copytree(source / RNG_DIR, staging / RNG_DIR)
        converted = Manifest(
            step=manifest.step,
            epoch=manifest.epoch,
            world_size=manifest.world_size,
            strategy=manifest.strategy,
            layout=ONE_FILE,
            reason=f"{_CONVERTED_FROM}{_identity(source)}",
            final=manifest.final,
            metric=manifest.metric,
            run_ids=manifest.run_ids,
            created=time.time(),
        )
        converted.files = describe_files(staging, known, converted.checksum)
        converted.versions = library_versions()
        write_manifest(staging, converted)
        if destination.exists():
            shutil.rmtree(destination)
        os.replace(staging, destination)
        fsync_directory(destination.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return f"{layout.name} of {manifest.world_size} rank(s) -> one file: {what_it_carries(full)}"


def what_it_carries(full: dict[str, Any]) -> str:
    """``53 weights, optimizer state of 53 parameters (exp_avg, exp_avg_sq, step), 1 LR scheduler``."""
    parts = [f"{len(full.get('state_dict') or {})} weights"]
    for state in full.get("optimizer_states") or []:
        per_parameter = state.get("state") or {}
        keys = sorted({key for value in per_parameter.values() for key in value})
        parts.append(f"optimizer state of {len(per_parameter)} parameters ({', '.join(keys) or 'none yet'})")
    schedulers = len(full.get("lr_schedulers") or [])
    if schedulers:
        parts.append(f"{schedulers} LR scheduler{'s' if schedulers > 1 else ''}")
    position = full.get("data_position") or {}
    if position.get("samples") is not None:
        parts.append(f"data position: {position['samples']} samples of epoch {position.get('epoch')}")
    return ", ".join(parts)


def converted_copy(
    source: Path, into: Path, layout: CheckpointLayout, trust_pickles: bool, may_convert: bool = True
) -> tuple[Path, str | None]:
    """The one-file copy of ``source`` under ``into/converted/``: made by one process, reused when it exists.

    Every process of the job may call it at once (Lightning's launcher, torchrun, srun): the first to create the
    lock file converts, the others wait on the file system, no collective, so a long conversion meets no
    process-group timeout. A converter that fails leaves its reason beside the copy and every waiter raises it;
    one that was killed leaves a lock whose process is gone, which the next caller takes over. Returns the copy
    and what was converted (None when an earlier conversion of the same checkpoint was reused).
    ``may_convert``: False for a process that only waits (a job's ranks but the first, whose failure is said by it).

    Raises:
        BadInputError: another process's conversion failed (its reason), or none appeared within
            :data:`WAIT_FOR_RANK_ZERO_S`.

    """
    destination = into / CONVERTED_DIR / source.name
    identity = _identity(source)
    started, deadline = time.time(), time.monotonic() + WAIT_FOR_RANK_ZERO_S
    while True:
        if _is_copy_of(destination, identity):
            return destination, None
        failure = _failure(destination, identity, since=started)
        if failure is not None:
            refused = BadInputError(failure)
            refused.said_elsewhere = True  # the converting process said it
            raise refused
        if may_convert and _take_lock(destination):
            try:
                if _is_copy_of(destination, identity):
                    return destination, None
                return destination, convert_to_one_file(source, destination, layout, trust_pickles)
            except Exception as error:
                _mark_failed(destination, identity, f"cannot convert {source} ({layout.name}): {first_line(error)}")
                raise
            finally:
                _lock_path(destination).unlink(missing_ok=True)
        if time.monotonic() > deadline:
            raise BadInputError(f"the conversion of {source} into {destination} did not appear in time")
        time.sleep(0.5)


def _identity(source: Path) -> str:
    """What names one checkpoint: its path and its manifest's commit time (a step saved again is another).

    It is the converted copy's ``reason``, which resume prints ("saved by converted from ..."): the time in UTC,
    as people read it, to the millisecond, so that it still tells two commits of one step folder apart.

    Example::

        _identity(Path("ckpt/step-000000004"))  # '/abs/ckpt/step-000000004 (committed 2026-12-02 15:48:57.887 UTC)'
    """
    try:
        created = Manifest.from_json((source / MANIFEST_NAME).read_bytes()).created
    except (OSError, CheckpointInvalidError):
        created = 0.0
    when = dt.datetime.fromtimestamp(created, dt.timezone.utc).isoformat(sep=" ", timespec="milliseconds")
    return f"{source.resolve()} (committed {when.removesuffix('+00:00')} UTC)"


def _is_copy_of(destination: Path, identity: str) -> bool:
    """Whether ``destination`` is a committed conversion of the checkpoint ``identity`` names, and verifies."""
    try:
        manifest = verify(destination)
    except (CheckpointInvalidError, OSError):  # absent, half-removed by a converter, or damaged
        return False
    return manifest.reason == f"{_CONVERTED_FROM}{identity}"


def _lock_path(destination: Path) -> Path:
    return destination.with_name(f".{destination.name}.lock")


def _take_lock(destination: Path) -> bool:
    """Create the lock file (this process converts), or take over one whose process is gone; False if held."""
    lock = _lock_path(destination)
    lock.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if not _holder_is_gone(lock):
                return False
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(descriptor, "w") as handle:
            handle.write(f"{socket.gethostname()} {os.getpid()}\n")
        return True
    return False


def _holder_is_gone(lock: Path) -> bool:
    """A lock written by a process of this host that no longer runs (another host's is trusted to be alive)."""
    try:
        host, pid = lock.read_text().split()
    except (OSError, ValueError):
        return False  # being written, or removed just now
    if host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):
        return False
    return False


def _failure_path(destination: Path) -> Path:
    return destination.with_name(f".{destination.name}.failed")


def _mark_failed(destination: Path, identity: str, message: str) -> None:
    _failure_path(destination).write_text(json.dumps({"identity": identity, "message": message, "at": time.time()}))


def _failure(destination: Path, identity: str, since: float) -> str | None:
    """The reason a conversion of this checkpoint failed since this call began (an older failure is retried)."""
    try:
        failed = json.loads(_failure_path(destination).read_text())
    except (OSError, ValueError):
        return None
    fresh = failed.get("identity") == identity and float(failed.get("at", 0)) >= since - 1.0
    return str(failed.get("message")) if fresh else None
