"""Checkpoint layouts, registered by the strategies that write them, and what a save asks of a strategy.

Every layout belongs to a strategy, which registers it here when its module is imported (:func:`register_layout`:
its name, how to read it as one full state dict, how to recognise its files, which layouts it can resume from),
so this package imports no strategy class; ``import lightning_mlopt.strategies`` registers ours, and a
question asked before any registration fails loudly instead of answering from an empty table. The saver
writes ``one file`` itself (rank zero saves the whole state, as Lightning's base strategy does); the other
layouts are written by their strategies. A strategy answers the
questions a save asks through :class:`CheckpointingStrategy` (``strategies/contract.py`` declares the full
contract; a strategy that is not ours goes through its adapter there).

Example::

    register_layout(CheckpointLayout("DCP shards", FSDPStrategy.consolidate_checkpoint, is_dcp_folder,
                                     resumes_from=(ONE_FILE,), written_by=("FSDPStrategy",)))
    can_resume(saved="one file", current="DCP shards")      # True: DCP reads a full state dict and shards it
    full = consolidator(layout_of_folder(state))(state)     # any registered layout, as one Lightning dict
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lightning_mlopt.checkpoint.manifest import FileEntry

ONE_FILE = "one file"
# Lightning's name for the non-tensor state next to DCP's shards (it loads it from there; so does our tool).
DCP_META_NAME = "meta.pt"


class PendingWrite(Protocol):
    """What ``save_checkpoint_async`` returns: ``result()`` blocks until this rank's files are written and fsynced.

    It returns this rank's files (name -> size and checksum) for the manifest, or raises the write's error.
    """

    def result(self, timeout: float | None = None) -> dict[str, FileEntry]:
        """Block until written; the rank's files with their checksums."""
        ...


@runtime_checkable
class CheckpointingStrategy(Protocol):
    """What a save asks of a strategy: the layout it writes and, where it can, a background save.

    ``background_saves`` says whether ``save_checkpoint_async`` and ``checkpoint_process_group`` work; a
    strategy without them is saved synchronously (``one file`` is always written in the background by the
    saver itself, which needs neither).
    """

    checkpoint_layout: str
    background_saves: bool

    def save_checkpoint_async(self, checkpoint: dict[str, Any], filepath: str | Path) -> PendingWrite:
        """Write ``checkpoint`` under ``filepath`` in the background; all ranks call."""
        ...

    @property
    def checkpoint_process_group(self) -> Any:
        """The process group background writes coordinate over, apart from training's."""
        ...


@dataclass(frozen=True)
class CheckpointLayout:
    """A layout a strategy writes, as the checkpoint package needs to know it.

    Args:
        name: the name manifests record (``"DCP shards"``).
        consolidate: reads a checkpoint of this layout as one full Lightning state dict on CPU, called as
            ``consolidate(state, trust_pickles)``.
        recognise: whether a saved ``state`` path (file or folder) is in this layout, by its files alone.
        resumes_from: other layouts a strategy writing this one can resume from.
        written_by: strategy class names whose manifests predate the recorded layout.

    """

    name: str
    consolidate: Callable[..., dict[str, Any]]
    recognise: Callable[[Path], bool]
    resumes_from: tuple[str, ...] = ()
    written_by: tuple[str, ...] = ()


_LAYOUTS: dict[str, CheckpointLayout] = {}


def _layouts() -> dict[str, CheckpointLayout]:
    if not _LAYOUTS:
        raise RuntimeError("no checkpoint layouts are registered: import lightning_mlopt.strategies first")
    return _LAYOUTS


def register_layout(layout: CheckpointLayout) -> None:
    """Make ``layout`` known to resume, ``checkpoint consolidate`` and ``export`` (a strategy module does this)."""
    _LAYOUTS[layout.name] = layout


def registered_layouts() -> list[str]:
    """The names of every registered layout."""
    return list(_LAYOUTS)


def layout_of_manifest(layout: str | None, strategy_name: str) -> str:
    """The layout a manifest records, or for manifests that predate the field, the one its strategy wrote."""
    if layout:
        return layout
    return next((known.name for known in _layouts().values() if strategy_name in known.written_by), ONE_FILE)


def can_resume(saved: str, current: str) -> bool:
    """Whether a checkpoint in layout ``saved`` loads into a strategy that writes ``current``."""
    if saved == current:
        return True
    layouts = _layouts()
    return current in layouts and saved in layouts[current].resumes_from


def layout_of_folder(state: Path) -> str:
    """The layout of a saved ``state`` by its files (for checkpoints without a manifest that records it).

    Raises:
        FileNotFoundError: nothing there that any registered layout writes.

    """
    found = next((known.name for known in _layouts().values() if known.recognise(state)), None)
    if found is None:
        raise FileNotFoundError(f"{state}: not a checkpoint in any known layout ({', '.join(_LAYOUTS)})")
    return found


def consolidator(layout: str) -> Callable[..., dict[str, Any]]:
    """How to read a checkpoint of ``layout`` as one full state dict: ``consolidator(layout)(state, trust)``.

    Raises:
        ValueError: no registered strategy reads ``layout``.

    """
    layouts = _layouts()
    if layout not in layouts:
        raise ValueError(f"no strategy of ours reads {layout!r}; resume it with the strategy that wrote it")
    return layouts[layout].consolidate
