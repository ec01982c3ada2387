"""Stale JIT-build locks: found, named and removed before DeepSpeed waits on them forever.

torch builds DeepSpeed's ops (the CPU communication op ``deepspeed_shm_comm``, ``cpu_adam`` for offload, ...)
under ``~/.cache/torch_extensions/<py>_<accelerator>/<op>/`` and serialises the build with a ``lock`` file that
the builder creates and keeps open until it is done. A process killed mid-build leaves the file, and every
later launch on that machine waits for it to disappear, silently, before any watchdog exists. A lock that no
live process holds open is stale. On a network file system another machine may hold it, which /proc here
cannot see, so there a lock must also be older than any build takes.

Example::

    for path in clear_stale_build_locks():
        print(f"removed {path}")
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = "lock"  # torch.utils.cpp_extension's FileBaton file in each extension's build folder
_NETWORK_FS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "fuse.sshfs", "ceph", "wekafs", "panfs"}
_NETWORK_STALE_AFTER_S = 1800.0  # no op build takes half an hour; a younger lock elsewhere may be alive


def extension_roots() -> list[Path]:
    """Where torch builds extensions: ``TORCH_EXTENSIONS_DIR``, or torch's default root (one level more)."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return [Path(configured)]
    from torch.utils.cpp_extension import get_default_build_root

    return [Path(get_default_build_root())]


def find_build_locks(root: Path) -> list[Path]:
    """Lock files of the extension builds under ``root`` (``<op>/lock`` or ``<py>_<acc>/<op>/lock``)."""
    if not root.is_dir():
        return []
    return sorted({*root.glob(f"*/{LOCK_NAME}"), *root.glob(f"*/*/{LOCK_NAME}")})


def is_stale(lock: Path, open_files: set[str] | None = None) -> bool:
    """True when no process on this machine holds ``lock`` open (and, on a network file system, it is old)."""
    held = _open_files() if open_files is None else open_files
    if str(lock.resolve()) in held:
        return False
    if _filesystem_type(lock) in _NETWORK_FS:
        try:
            return time.time() - lock.stat().st_mtime > _NETWORK_STALE_AFTER_S
        except FileNotFoundError:
            return False
    return True


def clear_stale_build_locks(roots: list[Path] | None = None) -> list[Path]:
    """Remove the stale build locks under ``roots``; return the removed paths.

    Processes of ours on one machine do this one at a time (an advisory lock beside the builds, released by
    the kernel if the holder dies), so one never removes a lock another has just taken for a real build.
    """
    removed: list[Path] = []
    for root in roots if roots is not None else extension_roots():
        locks = find_build_locks(root)
        if not locks:
            continue
        with _exclusive(root / ".lightning_mlopt.lock"):
            held = _open_files()
            for lock in find_build_locks(root):
                if is_stale(lock, held):
                    with contextlib.suppress(FileNotFoundError):
                        lock.unlink()
                        removed.append(lock)
    return removed


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _open_files() -> set[str]:
    """Every file path any process on this machine has open (that we may read: ours, or all as root)."""
    held: set[str] = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            entries = list(os.scandir(fd_dir))
        except OSError:  # gone, or not ours to read
            continue
        for entry in entries:
            with contextlib.suppress(OSError):
                held.add(os.readlink(entry.path))
    return held


def _filesystem_type(path: Path) -> str:
    """The type of the mount holding ``path`` (from /proc/mounts; "" when unknown)."""
    target = str(path.resolve())
    best, kind = "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            inside = len(parts) >= 3 and (target == parts[1] or target.startswith(parts[1].rstrip("/") + "/"))
            if inside and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    return kind
