"""Checksums of checkpoint files: computed while a file is written, verified in one streaming read.

New manifests use xxHash3-128 (tens of GB/s, so it never dominates a save); manifests written before it
record SHA-256 and still verify. The algorithm is recorded in the manifest, so a reader never guesses.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import xxhash

DEFAULT_ALGORITHM = "xxh3_128"
_CHUNK = 8 * 2**20


class _Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


_ALGORITHMS: dict[str, Callable[[], _Hasher]] = {
    "xxh3_128": xxhash.xxh3_128,
    "sha256": hashlib.sha256,
}


def new_hasher(algorithm: str) -> _Hasher:
    """A fresh hasher for ``algorithm`` (``xxh3_128`` or ``sha256``); ValueError for any other name."""
    try:
        return _ALGORITHMS[algorithm]()
    except KeyError:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {sorted(_ALGORITHMS)}") from None


def digest_of(path: Path, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The checksum of a file, read once in 8 MiB chunks."""
    hasher = new_hasher(algorithm)
    with path.open("rb", buffering=0) as handle:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while read := handle.readinto(buffer):
            hasher.update(view[:read])
    return hasher.hexdigest()


class HashingWriter(io.RawIOBase):
    """A write-only file that checksums every byte on its way to the real file.

    ``torch.save`` streams its archive through ``write``; the checksum is ready when the file is, with no
    second pass over the data.

    Example::

        with path.open("wb") as handle:
            writer = HashingWriter(handle)
            torch.save(state, writer)
        writer.hexdigest(), writer.size
    """

    def __init__(self, handle: BinaryIO, algorithm: str = DEFAULT_ALGORITHM) -> None:
        super().__init__()
        self._handle = handle
        self._hasher = new_hasher(algorithm)
        self.algorithm = algorithm
        self.name = getattr(handle, "name", None)  # the real file's path, for messages
        self.size = 0

    def writable(self) -> bool:
        """Always: this is a write-only stream."""
        return True

    def write(self, data: Any) -> int:
        """Checksum ``data`` (any bytes-like object), then write it to the real file."""
        self._hasher.update(data)
        written = self._handle.write(data)
        self.size += len(data) if written is None else written
        return len(data) if written is None else written

    def hexdigest(self) -> str:
        """The checksum of everything written so far."""
        return self._hasher.hexdigest()


@contextmanager
def durable_hashed_file(path: Path, algorithm: str = DEFAULT_ALGORITHM) -> Iterator[HashingWriter]:
    """Open ``path`` for writing through a :class:`HashingWriter`; on a clean exit flush and fsync it.

    The commit that follows relies on the bytes being on disk; the OS error of a failed write (errno 28,
    ...) propagates as itself.
    """
    with path.open("wb") as handle:
        writer = HashingWriter(handle, algorithm)
        yield writer
        handle.flush()
        os.fsync(handle.fileno())
