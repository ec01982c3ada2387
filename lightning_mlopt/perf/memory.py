"""Peak memory of this process, and a CUDA memory snapshot written when a run runs out of memory."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

from lightning_mlopt._compat import dump_memory_snapshot, record_memory_history


def peak_memory_bytes(device: torch.device) -> tuple[int, int]:
    """(peak allocated, peak reserved) bytes on a CUDA ``device``; on CPU both are the peak resident set size.

    The CPU figure is the process's whole high-water mark (``getrusage``), the Python interpreter and the
    libraries included: what the machine had to provide, not only the tensors.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # kilobytes on Linux, bytes on macOS
    return peak, peak


class OOMSnapshot:
    """Records CUDA allocations (at most ``max_entries``) and writes them out when the run runs out of memory.

    The snapshot opens in https://pytorch.org/memory_viz and shows which allocations (with their Python stacks)
    held the memory. The entry cap bounds both its memory and the file.

    Example::

        snapshot = OOMSnapshot(Path("runs/x/perf/oom-rank0.pickle"), max_entries=100_000)
        snapshot.start()
        try:
            train()
        except torch.cuda.OutOfMemoryError as error:
            snapshot.write_for(error)  # adds "memory snapshot: <file>" to the error
            raise

    """

    def __init__(self, path: Path, max_entries: int) -> None:
        self.path = path
        self.max_entries = max_entries
        self.recording = False

    def start(self) -> None:
        """Start recording (CUDA only; elsewhere nothing)."""
        if torch.cuda.is_available() and self.max_entries > 0:
            record_memory_history(self.max_entries)
            self.recording = True

    def stop(self) -> None:
        """Stop recording."""
        if self.recording:
            record_memory_history(0)
            self.recording = False

    def write_for(self, error: BaseException) -> Path | None:
        """Write the snapshot and name its file in ``error``; None when not recording or the write failed."""
        if not self.recording:
            return None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            dump_memory_snapshot(str(self.path))
        except OSError as write_error:
            _tell(error, f"the memory snapshot could not be written to {self.path}: {write_error}")
            return None
        finally:
            self.stop()
        _tell(error, f"memory snapshot of this rank: {self.path} (open it in https://pytorch.org/memory_viz)")
        return self.path


def _tell(error: BaseException, note: str) -> None:
    """Add ``note`` to the error (shown under its message; Python 3.11+) and print it (every version)."""
    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        add_note(note)
    print(note, file=sys.stderr, flush=True)
