"""The manifest: what a committed checkpoint holds, with a checksum per file, verified before unpickling."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_mlopt.checkpoint.checksum import DEFAULT_ALGORITHM, digest_of, new_hasher
from lightning_mlopt.exceptions import CheckpointInvalidError

MANIFEST_NAME = "manifest.json"
# 2: checksums by a recorded algorithm (xxh3_128) under "digest"; 1: SHA-256 under "sha256" (still verifies).
FORMAT_VERSION = 2


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its size in bytes and checksum (by the manifest's ``checksum`` algorithm)."""

    size: int
    digest: str


@dataclass
class Manifest:
    """What a committed checkpoint is: its step and position, who wrote it, and every file with its checksum.

    Attributes:
        step: optimizer steps taken (``trainer.global_step``) when it was saved.
        epoch: the epoch it was saved in.
        world_size: processes that wrote it.
        strategy: the strategy class name.
        layout: how the strategy laid the state out (``one file``, ``DCP shards``, ``ZeRO partitions``; see
            ``checkpoint/layout.py``); None in manifests written before it was recorded.
        reason: the trigger that saved it (``every_n_steps``, ``signal``, ``final``, ...).
        final: saved at the end of training; a run resumed from it does not train again.
        metric: the monitored metric's name and value when one is configured, else None.
        files: relative path -> size and checksum of every other file in the checkpoint.
        checksum: the algorithm of the files' checksums: ``xxh3_128``, or ``sha256`` in manifests written
            by lightning_mlopt before format version 2.
        versions: library versions at save time.
        run_ids: the experiment trackers' run ids at save time (``{"wandb": "3f2a9c1e"}``), so a resumed
            job logs into the same tracker run.
        created: UNIX time of the commit.

    """

    step: int
    epoch: int
    world_size: int
    strategy: str
    reason: str
    final: bool = False
    metric: dict[str, float] | None = None
    files: dict[str, FileEntry] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    run_ids: dict[str, str] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    layout: str | None = None
    checksum: str = DEFAULT_ALGORITHM
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        """The size of every file of the checkpoint together."""
        return sum(entry.size for entry in self.files.values())

    def to_json(self) -> str:
        """Serialise (stable key order, so equal manifests are equal bytes)."""
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse a manifest (text, or its file's bytes); raises CheckpointInvalidError on anything malformed."""
        try:
            data: dict[str, Any] = json.loads(text)  # bytes that are not UTF-8: a ValueError too
            if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
                raise TypeError("a JSON object with a 'files' object is expected")
            if data.get("format_version", 1) == 1:  # SHA-256 under "sha256"
                data["checksum"] = "sha256"
                data["files"] = {name: {"size": e["size"], "digest": e["sha256"]} for name, e in data["files"].items()}
            data["files"] = {name: FileEntry(**entry) for name, entry in data["files"].items()}
            manifest = cls(**data)
            new_hasher(manifest.checksum)  # an unknown algorithm is a malformed manifest
            return manifest
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise CheckpointInvalidError(f"manifest is malformed: {error}") from None


def describe_files(
    directory: Path, known: dict[str, FileEntry] | None = None, algorithm: str = DEFAULT_ALGORITHM
) -> dict[str, FileEntry]:
    """Size and checksum of every file under ``directory`` (the manifest itself excluded).

    ``known``: entries already computed while the files were written (relative path -> entry, by
    ``algorithm``); they are taken as they are, after a size check, instead of reading the file again.
    """
    known = known or {}
    entries = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        relative = path.relative_to(directory).as_posix()
        if relative == MANIFEST_NAME:
            continue
        size = path.stat().st_size
        entry = known.get(relative)
        if entry is None or entry.size != size:
            entry = FileEntry(size, digest_of(path, algorithm))
        entries[relative] = entry
    return entries


def library_versions() -> dict[str, str]:
    """Versions that decide whether a checkpoint loads: Python, torch, lightning, deepspeed, ours."""
    import lightning
    import torch

    import lightning_mlopt

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "lightning_mlopt": lightning_mlopt.__version__,
    }
    try:
        from importlib.metadata import version

        versions["deepspeed"] = version("deepspeed")
    except Exception:
        pass
    return versions


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write ``manifest.json`` durably: a temporary file, fsync, then an atomic rename."""
    write_atomically(directory / MANIFEST_NAME, manifest.to_json())


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a reader sees the old content or the new, never a mix."""
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """Make a rename or new entry in ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def verify(directory: Path) -> Manifest:
    """Check a checkpoint against its manifest without unpickling anything.

    Returns:
        The manifest, when every listed file exists with the recorded size and checksum.

    Raises:
        CheckpointInvalidError: naming the first missing, truncated or corrupted file.

    Example::

        manifest = verify(Path("runs/gpt-ddp-1a2b3c4d/checkpoints/step-000000500"))

    """
    manifest_path = directory / MANIFEST_NAME
    if not manifest_path.is_file():
        raise CheckpointInvalidError(f"{directory.name}: no {MANIFEST_NAME} (an interrupted save?)")
    manifest = Manifest.from_json(manifest_path.read_bytes())
    for name, entry in manifest.files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointInvalidError(f"{directory.name}: {name} is missing")
        size = path.stat().st_size
        if size != entry.size:
            raise CheckpointInvalidError(f"{directory.name}: {name} has {size} bytes, the manifest says {entry.size}")
        if digest_of(path, manifest.checksum) != entry.digest:
            raise CheckpointInvalidError(f"{directory.name}: {name} does not match its checksum")
    return manifest
