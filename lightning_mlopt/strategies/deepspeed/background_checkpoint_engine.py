"""A DeepSpeed checkpoint engine that keeps what DeepSpeed hands it and writes it later, on a background thread.

DeepSpeed 0.19's own asynchronous engines (``FastCheckpointEngine`` and the ``DecoupledCheckpointEngine``
built on it) write through DeepSpeed's async-I/O op (libaio, built for the GPU's NVMe path) and, decoupled,
through a subprocess fed by a queue; neither runs on a CPU-only machine. What DeepSpeed passes to an engine's
``save`` is already a CPU copy (its ``clone_tensors_for_torch_save``), so staging is done by the time
``save`` is called: this engine only records ``(state, path)`` pairs, and :meth:`write_in_background` writes
them (checksummed, fsynced) on a thread while training goes on.

Example::

    engine = BackgroundCheckpointEngine()
    deepspeed_engine.checkpoint_engine, original = engine, deepspeed_engine.checkpoint_engine
    deepspeed_engine.save_checkpoint(path, tag="checkpoint")        # returns once every file is staged
    deepspeed_engine.checkpoint_engine = original
    engine.write_in_background(path).result()                       # raises if a write failed
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from lightning_mlopt.checkpoint.manifest import FileEntry
from lightning_mlopt.checkpoint.serialization import cpu_copy, save_file


class BackgroundCheckpointEngine(CheckpointEngine):
    """Collect DeepSpeed's checkpoint files in CPU memory; write them from a thread on request."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "BackgroundCheckpointEngine"
        self._staged: list[tuple[Path, Any]] = []

    def create(self, info: CheckpointCommitInfo) -> None:
        """Nothing to prepare: the files are written by :meth:`write_in_background`."""

    def save(self, state_dict: Any, path: str) -> None:
        """Keep a CPU copy of ``state_dict`` for ``path``.

        Tensors are usually CPU clones already (DeepSpeed clones before calling this); the rest (Python
        containers holding loop and callback state) is copied, since training goes on changing it.
        """
        self._staged.append((Path(path), cpu_copy(state_dict)))

    def load(self, path: str, map_location: Any = None) -> Any:
        """Load as DeepSpeed's own torch engine does (the files were checked against the allowlist first)."""
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """DeepSpeed's end of a save: the files are staged, not yet written; the caller commits later."""
        return True

    def write_in_background(self, root: Path) -> Future[dict[str, FileEntry]]:
        """Write every staged file on a new thread; the future ends when all are on disk (fsynced).

        Its result: each file's path relative to ``root`` with its size and checksum, computed while writing.
        """
        staged, self._staged = self._staged, []
        future: Future[dict[str, FileEntry]] = Future()

        def write() -> None:
            try:
                entries = {path.relative_to(root).as_posix(): save_file(state, path) for path, state in staged}
            except BaseException as error:
                future.set_exception(error)
            else:
                future.set_result(entries)

        # Not a daemon: the interpreter waits for a write in progress rather than cutting it off.
        threading.Thread(target=write, name="deepspeed-checkpoint-writer", daemon=False).start()
        return future
