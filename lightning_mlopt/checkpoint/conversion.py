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

import os
import shutil
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
from lightning_mlopt.exceptions import BadInputError, CheckpointInvalidError

CONVERTED_DIR = "converted"  # <checkpoints>/converted/step-N: what a resume converted, kept for the next relaunch
_CONVERTED_FROM = "converted from "  # how a converted manifest's reason starts
RNG_DIR = "rng"
WAIT_FOR_RANK_ZERO_S = 1800.0  # other ranks wait this long for rank zero's conversion of a large checkpoint


def convert_to_one_file(source: Path, destination: Path, layout: CheckpointLayout, trust_pickles: bool = False) -> str:
    """Write the step folder ``source`` (in ``layout``) as a one-file step folder at ``destination``; say what.

    ``destination`` is replaced if it exists. Its pickles must have passed the allowlist first
    (``check_trusted``), as for any load.

    Raises:
        CheckpointInvalidError: ``source`` fails verification, or its layout cannot be read whole.

    """
    manifest = verify(source)
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
            reason=f"{_CONVERTED_FROM}{source.resolve()} ({layout.name})",
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
    source: Path, into: Path, layout: CheckpointLayout, trust_pickles: bool, is_rank_zero: bool = True
) -> tuple[Path, str | None]:
    """The one-file copy of ``source`` under ``into/converted/``: made by rank zero, reused when it exists.

    Returns the copy and what was converted (None when an earlier conversion of the same checkpoint was
    reused). Other ranks wait for rank zero's copy to be committed.

    Raises:
        BadInputError: the copy did not appear within :data:`WAIT_FOR_RANK_ZERO_S` (another rank's view).
        CheckpointInvalidError: ``source`` cannot be read whole.

    """
    destination = into / CONVERTED_DIR / source.name
    if _is_copy_of(destination, source):
        return destination, None
    if is_rank_zero:
        return destination, convert_to_one_file(source, destination, layout, trust_pickles)
    deadline = time.monotonic() + WAIT_FOR_RANK_ZERO_S
    while not _is_copy_of(destination, source):
        if time.monotonic() > deadline:
            raise BadInputError(f"rank zero's conversion of {source} into {destination} did not appear")
        time.sleep(0.5)
    return destination, None


def _is_copy_of(destination: Path, source: Path) -> bool:
    """Whether ``destination`` is a committed conversion of ``source`` that verifies."""
    if not (destination / MANIFEST_NAME).is_file():
        return False
    try:
        manifest = verify(destination)
    except CheckpointInvalidError:
        return False
    return manifest.reason.startswith(f"{_CONVERTED_FROM}{source.resolve()} ")
