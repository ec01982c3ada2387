"""DCP's pending write of a sharded checkpoint, completed with the checksums of the shard files this rank wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_mlopt.checkpoint.checksum import digest_of
from lightning_mlopt.checkpoint.manifest import FileEntry


class OwnShards:
    """DCP's pending write, completed with the checksums of this rank's own shard files (``__<rank>_*.distcp``).

    Each rank hashes what it wrote, in parallel and from the page cache it just filled; rank zero does not read
    every rank's shards again at the commit.

    Example::

        pending = OwnShards(async_save(state, checkpoint_id=path), path, rank, {"meta.pt": meta_entry})
        entries = pending.result()  # {"meta.pt": ..., "__0_0.distcp": FileEntry(size, digest)}
    """

    def __init__(self, dcp_write: Any, folder: Path, rank: int, written: dict[str, FileEntry]) -> None:
        self._dcp_write = dcp_write
        self._folder = folder
        self._rank = rank
        self._written = written

    def result(self, timeout: float | None = None) -> dict[str, FileEntry]:
        """Wait for DCP's write (raising its error), then this rank's file entries: given ones and its shards."""
        self._dcp_write.result(timeout)
        entries = dict(self._written)
        for shard in sorted(self._folder.glob(f"__{self._rank}_*.distcp")):
            entries[shard.name] = FileEntry(shard.stat().st_size, digest_of(shard))
        return entries


__all__ = ["OwnShards"]
