"""The remote tier: committed checkpoints in an object store, with the same guarantees and no rename.

Layout under ``s3://bucket/prefix``::

    step-000000100/data-<token>/state.ckpt ...   the files, exactly as in the local checkpoint folder
    step-000000100/manifest.json                 the commit: written create-only, after every file is up
    latest                                       names the newest commit; moved by compare-and-swap

The protocol, and why it holds at any instant of a kill:

1. Every file goes up under ``data-<token>/``, checksummed while it streams (multipart uploads are aborted
   on failure). ``<token>`` is derived from the files' checksums, so an upload never changes an object that
   a committed manifest names: a different save of the same step goes to a different folder.
2. The manifest is written with ``If-None-Match: *``; that single PUT is the commit. Until it lands the step
   does not exist for a reader; after it, every file it names is complete.
3. ``latest`` moves with ``If-Match: <the ETag this writer last saw>``: if another run moved it meanwhile,
   two runs share the prefix, and this one stops with one line instead of interleaving with it.
4. Retention deletes only older steps, after the new commit, manifest first (the step is gone for readers
   before any of its files is).

A reader takes the newest manifest whose files download with the recorded sizes and checksums.

Example::

    remote = RemoteCheckpoints(ObjectStore.for_url("s3://ckpt/runs/gpt"), RetentionPolicy(keep_last=3))
    remote.upload(Path("local/checkpoints/step-000000100"))       # a committed local checkpoint
    remote.download_newest_valid(CheckpointStore(Path("local/checkpoints")))   # on another node, after
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from lightning_mlopt.checkpoint.manifest import MANIFEST_NAME, Manifest
from lightning_mlopt.checkpoint.remote.object_store import ObjectStore
from lightning_mlopt.checkpoint.retention import RetentionPolicy
from lightning_mlopt.checkpoint.settings import CHECKPOINT
from lightning_mlopt.checkpoint.store import LATEST_NAME, CheckpointEntry, CheckpointStore
from lightning_mlopt.exceptions import (
    CheckpointInvalidError,
    ConcurrentWriterError,
    ObjectStoreError,
    SupersededCopyError,
)

_MANIFEST_KEY = re.compile(r"^step-(\d{9})/" + re.escape(MANIFEST_NAME) + "$")


def data_folder(manifest: Manifest) -> str:
    """The folder (under the step's) that holds a commit's files, named by their checksums.

    Example::

        >>> from lightning_mlopt.checkpoint.manifest import FileEntry
        >>> manifest = Manifest(step=1, epoch=0, world_size=1, strategy="DDP", reason="manual")
        >>> manifest.files = {"state.ckpt": FileEntry(10, "ab")}
        >>> data_folder(manifest)
        'data-...'
    """
    listing = json.dumps(sorted((name, entry.size, entry.digest) for name, entry in manifest.files.items()))
    return f"data-{xxhash.xxh3_64_hexdigest(listing.encode())}"


class RemoteCheckpoints:
    """Committed checkpoints under one object-store prefix.

    Args:
        store: the bucket and prefix.
        retention: which older checkpoints to delete after each commit (None: keep all).

    """

    def __init__(self, store: ObjectStore, retention: RetentionPolicy | None = None) -> None:
        self.store = store
        self.retention = retention
        self._latest_etag: str | None = None
        self._attached = False
        self._manifests: dict[int, Manifest] = {}  # read or written by this process: small, and never change

    @property
    def url(self) -> str:
        """``s3://bucket/prefix``."""
        return str(self.store.url)

    def attach(self) -> None:
        """Before this process's first commit: check access, note ``latest``'s ETag, abort stale uploads."""
        found = self.store.get_bytes(LATEST_NAME)
        self._latest_etag = None if found is None else found[1]
        self.store.abort_uploads()  # left by a killed save; never read, but they cost storage
        self._attached = True

    # ------------------------------------------------------------------ writing

    def upload(self, local: Path) -> str:
        """Copy a committed local checkpoint folder up and commit it; return the commit's URL.

        The files are checked against the local manifest as they stream; a file that changed (or a disk
        that returned other bytes) fails the upload before anything is committed: ``SupersededCopyError``
        where the step was committed locally again meanwhile (the newer save is the one to copy). The same
        step saved again with other contents (the final save right after a periodic one) replaces the commit
        by compare-and-swap: a reader sees the old commit or the new one, never neither.
        """
        manifest = Manifest.from_json((local / MANIFEST_NAME).read_bytes())
        name = CheckpointStore.name_for(manifest.step)
        manifest_key, folder = f"{name}/{MANIFEST_NAME}", data_folder(manifest)
        if not self._attached:
            self.attach()
        found = self.store.get_bytes(manifest_key)
        previous = _parse(found[0]) if found else None
        if previous is not None and data_folder(previous) == folder:
            return str(self.store.url.child(name))  # these very files are committed (a relaunch after its commit)
        try:
            self._upload_files(local, manifest, f"{name}/{folder}")
        except ObjectStoreError:
            if _saved_again(local, manifest):  # the final save after a periodic one of the same step, mid-copy
                raise SupersededCopyError(f"{local}: saved again while it was copied") from None
            raise
        if found is None:
            try:
                self.store.put_bytes(manifest_key, manifest.to_json().encode(), create_only=True)  # the commit
            except ConcurrentWriterError:
                raise ConcurrentWriterError(
                    f"{self.store.url.child(name)}: another writer committed this step first: two runs are writing "
                    f"to {self.url}. Give each run its own {CHECKPOINT.setting('dirpath')}"
                ) from None
            self._move_latest(name)
        else:
            self._move_latest(name)  # first: a second writer is found before its commit is touched
            self.store.put_bytes(manifest_key, manifest.to_json().encode(), if_match=found[1])
            stale = [key for key in self.store.list_keys(f"{name}/") if not key.startswith(f"{name}/{folder}/")]
            self.store.delete_keys([key for key in stale if key != manifest_key])
        self._manifests[manifest.step] = manifest
        self._apply_retention(protected=manifest.step)
        return str(self.store.url.child(name))

    def _upload_files(self, local: Path, manifest: Manifest, folder: str) -> None:
        """Each file up in parallel with the others (each large one in parallel parts), checked as it streams."""

        def upload(relative: str) -> None:
            entry = self.store.upload_file(local / relative, f"{folder}/{relative}", manifest.checksum)
            if entry != manifest.files[relative]:
                raise ObjectStoreError(
                    f"{local / relative}: changed while it was uploaded (size or checksum differs from the manifest)"
                )

        small = [name for name, entry in manifest.files.items() if entry.size <= self.store.part_bytes]
        large = [name for name in manifest.files if name not in small]
        with ThreadPoolExecutor(self.store.concurrency, thread_name_prefix="s3-files") as pool:
            for done in [pool.submit(upload, relative) for relative in small]:
                done.result()
        for relative in large:  # one at a time: their parts already use every connection
            upload(relative)

    def _move_latest(self, name: str) -> None:
        try:
            self._latest_etag = self.store.put_bytes(
                LATEST_NAME, f"{name}\n".encode(), create_only=self._latest_etag is None, if_match=self._latest_etag
            )
        except ConcurrentWriterError:
            found = self.store.get_bytes(LATEST_NAME)
            now = found[0].decode().strip() if found else "nothing"
            raise ConcurrentWriterError(
                f"{self.store.url.child(LATEST_NAME)}: another writer moved it (to {now}) since this run last did: "
                f"two runs are writing to {self.url}. Give each run its own {CHECKPOINT.setting('dirpath')}"
            ) from None

    def _apply_retention(self, protected: int) -> None:
        """Delete what the policy lets go, oldest first: each step's manifest, then its files."""
        if self.retention is None:
            return
        scored = []
        for step in self.committed():
            manifest = self.read_manifest(step)
            if manifest is not None:
                scored.append((step, None if manifest.metric is None else manifest.metric.get("value")))
        for step in self.retention.to_delete(scored, protected=[protected]):
            self.delete(step)

    def delete(self, step: int) -> None:
        """Remove one committed checkpoint: its manifest first, so no reader ever sees it half deleted."""
        name = CheckpointStore.name_for(step)
        self.store.delete_keys([f"{name}/{MANIFEST_NAME}"])
        self.store.delete_keys(self.store.list_keys(f"{name}/"))
        self._manifests.pop(step, None)

    # ------------------------------------------------------------------ reading

    def committed(self) -> list[int]:
        """Steps with a commit (a manifest), oldest first; not verified."""
        keys = self.store.list_keys("step-")
        return sorted(int(match.group(1)) for key in keys if (match := _MANIFEST_KEY.match(key)))

    def latest_name(self) -> str | None:
        """What ``latest`` names, if anything."""
        found = self.store.get_bytes(LATEST_NAME)
        return found[0].decode().strip() if found else None

    def read_manifest(self, step: int) -> Manifest | None:
        """The manifest of ``step``; None when there is none or it is malformed."""
        if step not in self._manifests:
            found = self.store.get_bytes(f"{CheckpointStore.name_for(step)}/{MANIFEST_NAME}")
            if found is None:
                return None
            manifest = _parse(found[0])
            if manifest is None:
                return None
            self._manifests[step] = manifest
        return self._manifests[step]

    def incomplete(self, step: int) -> str | None:
        """Why ``step``'s commit is not whole, from one listing (sizes, not checksums), or None when it is."""
        name = CheckpointStore.name_for(step)
        manifest = self.read_manifest(step)
        if manifest is None:
            return f"no readable {MANIFEST_NAME}"
        folder = f"{name}/{data_folder(manifest)}"
        sizes = self.store.list_sizes(f"{folder}/")
        for relative, entry in sorted(manifest.files.items()):
            size = sizes.get(f"{folder}/{relative}")
            if size != entry.size:
                found = "missing" if size is None else f"{size} bytes"
                return f"{relative}: {found}, the manifest says {entry.size} bytes"
        return None

    def download(self, step: int, local: CheckpointStore) -> CheckpointEntry:
        """Copy one remote checkpoint into ``local`` (verified while it streams) and commit it there.

        Returns the local entry; ``problem`` says why it was not taken (nothing is committed locally then).
        """
        name = CheckpointStore.name_for(step)
        remote_url = self.store.url.child(name)
        manifest = self.read_manifest(step)
        if manifest is None:
            return CheckpointEntry(local.root / name, step, None, f"{remote_url}: no readable {MANIFEST_NAME}")
        staging = local.stage(step)
        folder = f"{name}/{data_folder(manifest)}"

        def fetch(relative: str) -> str | None:
            entry = self.store.download_file(f"{folder}/{relative}", staging / relative, manifest.checksum)
            expected = manifest.files[relative]
            if entry != expected:
                return (
                    f"{remote_url}: {relative} has {entry.size} bytes / checksum {entry.digest[:12]}, the manifest "
                    f"says {expected.size} / {expected.digest[:12]}"
                )
            return None

        try:
            with ThreadPoolExecutor(self.store.concurrency, thread_name_prefix="s3-files") as pool:
                problems = [p for p in pool.map(fetch, sorted(manifest.files)) if p is not None]
        except (ObjectStoreError, OSError):  # the store failed, or the local disk did (full): no partial copy stays
            local.discard(staging)
            raise
        if problems:
            local.discard(staging)
            return CheckpointEntry(local.root / name, step, None, problems[0])
        path = local.commit(staging, manifest)  # writes the manifest, renames into place, moves local latest
        return CheckpointEntry(path, step, manifest, None)

    def download_newest_valid(
        self, local: CheckpointStore, newer_than: int = -1, skipped: list[CheckpointEntry] | None = None
    ) -> CheckpointEntry | None:
        """The newest remote checkpoint above step ``newer_than`` that verifies, copied into ``local``.

        Remote checkpoints that do not verify are appended to ``skipped`` and the next older is tried.
        """
        for step in reversed(self.committed()):
            if step <= newer_than:
                return None
            entry = self.download(step, local)
            if entry.valid:
                return entry
            if skipped is not None:
                skipped.append(entry)
        return None


def _saved_again(local: Path, started_with: Manifest) -> bool:
    """Whether the local checkpoint's manifest is no longer the one a copy started from (or is gone)."""
    try:
        return Manifest.from_json((local / MANIFEST_NAME).read_bytes()).to_json() != started_with.to_json()
    except (OSError, ValueError):
        return True


def _parse(data: bytes) -> Manifest | None:
    """A manifest read from the store; None when it is malformed (not a commit a reader may take)."""
    try:
        return Manifest.from_json(data)
    except CheckpointInvalidError:
        return None
