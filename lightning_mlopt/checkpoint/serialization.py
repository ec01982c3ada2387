"""How lightning_mlopt writes and reads its own checkpoint files.

Writing streams ``torch.save`` straight into the file (no whole-state copy in memory) through a hashing
writer, so the manifest's checksum costs no second pass, and fsyncs before the commit relies on it.
Reading uses ``torch.load(weights_only=True)`` with the allowlist of :mod:`lightning_mlopt.checkpoint.trust`,
unless the user opted in to trusting pickles.

Example::

    entry = save_file(state, staging / "state.ckpt")    # FileEntry(size, digest), on disk and fsynced
    state = load_file(staging / "state.ckpt")           # refuses any type outside the allowlist
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_mlopt.checkpoint.checksum import DEFAULT_ALGORITHM, durable_hashed_file
from lightning_mlopt.checkpoint.manifest import FileEntry
from lightning_mlopt.checkpoint.trust import ALLOWED_GLOBALS


def save_file(obj: Any, path: Path, algorithm: str = DEFAULT_ALGORITHM) -> FileEntry:
    """``torch.save`` into ``path``, checksummed while written and fsynced; returns its manifest entry.

    Through a Python file object, a failed write raises the OS error (errno 28, ...), not torch's
    ``unexpected pos``.
    """
    with durable_hashed_file(path, algorithm) as writer:
        torch.save(obj, writer)
    return FileEntry(size=writer.size, digest=writer.hexdigest())


def load_file(path: Path | Any, trust_pickles: bool = False, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load`` of a checkpoint file: only allowlisted types, unless ``trust_pickles``."""
    if trust_pickles:
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    with allowlisted_loading():
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def cpu_copy(value: Any, clone: bool = True) -> Any:
    """A deep copy with every tensor in CPU memory: the staging copy a background write reads from.

    ``clone``: copy CPU tensors too (False when they are copies already, e.g. DeepSpeed's). Everything
    else is deep-copied, since training goes on changing it.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=clone)
    if isinstance(value, dict):
        return type(value)((key, cpu_copy(item, clone)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_copy(item, clone) for item in value)
    return copy.deepcopy(value)


@contextlib.contextmanager
def allowlisted_loading() -> Iterator[None]:
    """Within it, ``torch.load(weights_only=True)`` also accepts the allowlist's types (and nothing else).

    Only types whose modules are already imported are resolved: what a checkpoint of this process's
    strategy contains is imported by the time it loads, and nothing is imported on a file's behalf.
    """
    with torch.serialization.safe_globals(_resolved_allowlist()):
        yield


def _resolved_allowlist() -> list[Any]:
    resolved = []
    for qualified in sorted(ALLOWED_GLOBALS):
        module_name, _, name = qualified.rpartition(".")
        module = sys.modules.get(module_name)
        if module is None and module_name.startswith("numpy"):  # numpy itself is imported (the RNG state)
            with contextlib.suppress(ImportError):
                module = importlib.import_module(module_name)
        target = getattr(module, name, None) if module is not None else None
        if target is not None:
            resolved.append((target, qualified))  # by the name the pickle uses, wherever the object lives
    return resolved
