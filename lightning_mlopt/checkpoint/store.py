"""The commit protocol: stage, confirm, write the manifest, rename into place, then move ``latest``.

A kill at any instant leaves either the previous checkpoint or the new one: a staging folder is never
picked for resume (its name says so, and it has no manifest until the end), a committed folder always
has a manifest that verifies, and ``latest`` is replaced atomically after the rename.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lightning_mlopt.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    fsync_directory,
    verify,
    write_atomically,
    write_manifest,
)
from lightning_mlopt.exceptions import CheckpointInvalidError

LATEST_NAME = "latest"
ROLLED_BACK_DIR = "rolled_back"  # rolled_back/<time>/step-N: a branch a restart from an older checkpoint left
STATE_NAME = "state.ckpt"  # what the strategy writes: a file (DDP) or a folder of shards (FSDP, DeepSpeed)
_COMMITTED = re.compile(r"^step-(\d{9})$")
_STAGING_PREFIX = ".staging-"
# A committed folder moved aside while the same step is saved again. Not a staging name: a kill between the
# two renames leaves it as the step's only committed copy, which the next launch puts back, not removes.
_REPLACED = re.compile(r"^replaced-(step-\d{9})$")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def refuse_url(location: str, key: str | None = None, alternative: str = "") -> None:
    """Raise ValueError when ``location`` is a URL where a folder is expected (``alternative``: what else fits).

    Without it, ``pathlib`` takes ``s3://bucket/x`` for the relative folder ``s3:/bucket/x``, and the
    checkpoints a user believes are in a bucket vanish with the node.

    Example::

        >>> refuse_url("/mnt/shared/run/checkpoints", "checkpoint.tiers.local_dirpath")
        >>> refuse_url("s3://bucket/run", "checkpoint.tiers.local_dirpath")
        Traceback (most recent call last):
        ...
        ValueError: checkpoint.tiers.local_dirpath: 's3://bucket/run' is a URL where a folder is expected: ...
    """
    found = _URL.match(location)
    if found:
        named = f"{key}: " if key else ""
        raise ValueError(
            f"{named}{location!r} is a URL where a folder is expected: give a folder (a local "
            "disk, or a shared filesystem mounted on every node, e.g. /mnt/shared/runs/<name>/checkpoints)"
            f"{alternative}"
        )


@dataclass(frozen=True)
class CheckpointEntry:
    """A committed checkpoint folder and what verification said of it."""

    path: Path
    step: int
    manifest: Manifest | None
    problem: str | None

    @property
    def valid(self) -> bool:
        """True when the manifest and every checksum verified."""
        return self.problem is None


class CheckpointStore:
    """Checkpoint folders under one root: ``step-000000100/``, ``latest``, and transient staging folders.

    Args:
        root: the folder holding the checkpoints (created on first save).

    Example::

        store = CheckpointStore(Path("runs/x/checkpoints"))
        staging = store.stage(step=100)          # every rank writes into it
        store.commit(staging, manifest)          # rank zero, after every rank confirmed
        store.newest_valid()                     # what auto-resume picks

    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._commit_listeners: list[Callable[[Manifest, Path], None]] = []

    def add_commit_listener(self, listener: Callable[[Manifest, Path], None]) -> None:
        """Call ``listener(manifest, folder)`` after each commit, on the thread that commits.

        That is a background writer's thread for asynchronous saves. The goodput ledger records which step
        survives a kill from then on.
        """
        if listener not in self._commit_listeners:
            self._commit_listeners.append(listener)

    @staticmethod
    def name_for(step: int) -> str:
        """Folder name of the checkpoint at ``step``."""
        return f"step-{step:09d}"

    def staging_path(self, step: int) -> Path:
        """Where the checkpoint at ``step`` is written before it is committed."""
        return self.root / f"{_STAGING_PREFIX}{self.name_for(step)}"

    def stage(self, step: int) -> Path:
        """Create an empty staging folder for ``step`` (removing one left by an interrupted save)."""
        path = self.staging_path(step)
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        return path

    def commit(self, staging: Path, manifest: Manifest) -> Path:
        """Write the manifest into ``staging``, rename it into place, then move ``latest`` to it."""
        write_manifest(staging, manifest)
        fsync_directory(staging)
        target = self.root / self.name_for(manifest.step)
        if target.exists():
            # Saving the same step twice (e.g. the final save after an epoch's last): the new one replaces
            # it. Move the old aside first, so a kill between the renames still leaves a committed copy
            # (restore_replaced puts it back).
            aside = self.root / f"replaced-{target.name}"
            if aside.exists():
                shutil.rmtree(aside)
            os.replace(target, aside)
            os.replace(staging, target)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(staging, target)
        fsync_directory(self.root)
        write_atomically(self.root / LATEST_NAME, target.name + "\n")
        for listener in self._commit_listeners:
            listener(manifest, target)
        return target

    def step_of(self, folder: Path) -> int | None:
        """The step of ``folder`` when it is one of this store's committed folders, else None."""
        found = _COMMITTED.match(folder.name)
        return int(found.group(1)) if found and folder.parent.resolve() == self.root.resolve() else None

    def set_aside_newer_than(self, step: int) -> list[Path]:
        """Move committed checkpoints newer than ``step`` into ``rolled_back/<time>/``; return where they went.

        A run restarted from an older checkpoint of its own (an explicit ``ckpt_path``: a rollback past a loss
        spike) would otherwise leave the abandoned branch's checkpoints in place: the next auto-resume would take
        the newest of them, and retention would count them among the last K and delete the new branch's. They
        are moved, never deleted; ``latest`` names ``step``'s folder.
        """
        newer = [path for found, path in self.committed() if found > step]
        if not newer:
            return []
        folder = self.root / ROLLED_BACK_DIR / time.strftime("%Y%m%d-%H%M%S")
        folder.mkdir(parents=True, exist_ok=True)
        for path in newer:
            os.replace(path, folder / path.name)
        fsync_directory(self.root)
        write_atomically(self.root / LATEST_NAME, self.name_for(step) + "\n")
        return [folder / path.name for path in newer]

    def discard(self, staging: Path) -> None:
        """Remove a staging folder whose save failed or was abandoned."""
        shutil.rmtree(staging, ignore_errors=True)

    def restore_replaced(self) -> list[Path]:
        """Put back a committed folder a kill left moved aside mid-replacement; return what was put back.

        A copy whose replacement landed is the older one: it is removed instead.
        """
        if not self.root.is_dir():
            return []
        restored = []
        for aside in sorted(self.root.iterdir()):
            if not (found := _REPLACED.match(aside.name)):
                continue
            target = self.root / found.group(1)
            if target.exists():
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.replace(aside, target)
                restored.append(target)
        if restored:
            fsync_directory(self.root)
        return restored

    def clean_staging(self) -> list[Path]:
        """Remove staging folders left by interrupted saves; return what was removed."""
        if not self.root.is_dir():
            return []
        leftovers = [p for p in self.root.iterdir() if p.name.startswith(_STAGING_PREFIX)]
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
        return leftovers

    def committed(self) -> list[tuple[int, Path]]:
        """Committed checkpoint folders as (step, path), oldest first (not verified)."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _COMMITTED.match(p.name)) and p.is_dir()]
        return sorted(found)

    def entries(self) -> list[CheckpointEntry]:
        """Every committed checkpoint with its verification result, oldest first."""
        return [self.inspect(step, path) for step, path in self.committed()]

    @staticmethod
    def inspect(step: int, path: Path) -> CheckpointEntry:
        """Verify one committed folder."""
        try:
            return CheckpointEntry(path, step, verify(path), None)
        except CheckpointInvalidError as error:
            return CheckpointEntry(path, step, None, str(error))

    def newest_valid(self, skipped: list[CheckpointEntry] | None = None) -> CheckpointEntry | None:
        """The newest checkpoint that verifies; newer invalid ones are appended to ``skipped``."""
        for step, path in reversed(self.committed()):
            entry = self.inspect(step, path)
            if entry.valid:
                return entry
            if skipped is not None:
                skipped.append(entry)
        return None

    def latest_name(self) -> str | None:
        """What the ``latest`` pointer names, if anything."""
        pointer = self.root / LATEST_NAME
        return pointer.read_text().strip() if pointer.is_file() else None

    def recorded_run_id(self, tracker: str) -> str | None:
        """The newest committed checkpoint's run id for ``tracker`` (e.g. ``"wandb"``), if any.

        Reads manifests only, without verifying checksums: a tracker's run id is the job's, whichever
        checkpoint the job then resumes from.
        """
        for _, path in reversed(self.committed()):
            try:
                manifest = Manifest.from_json((path / MANIFEST_NAME).read_bytes())
            except (OSError, CheckpointInvalidError):
                continue
            if manifest.run_ids.get(tracker):
                return manifest.run_ids[tracker]
        return None
