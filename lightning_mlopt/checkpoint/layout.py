"""Checkpoint layouts: what a save asks of a strategy, and what the package knows of the formats strategies write.

A layout is described by the strategy that writes it, in its spec (``strategies/spec.py``): its name, how to
read it as one full state dict, how to recognise its files, which layouts it can resume from. Nothing is
registered: the functions here are given the layouts they judge (the strategies' table,
``lightning_mlopt.strategies.LAYOUTS``, passed in by the floors above), so this package imports no strategy
and works whatever was imported before. The saver writes ``one file`` itself (rank zero saves the whole state,
as Lightning's base strategy does); the other layouts are written by their strategies. A strategy answers the
questions a save asks through :class:`CheckpointingStrategy` (``strategies/contract.py`` declares the full
contract; a strategy that is not ours goes through its adapter there).

Example::

    can_resume(saved="one file", current=LAYOUTS["DCP shards"])  # True: DCP reads a full state dict, shards it
    full = layout_of_folder(state, LAYOUTS.values()).read(state)  # any known layout, as one Lightning dict
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lightning_mlopt.checkpoint.manifest import FileEntry

ONE_FILE = "one file"
DCP_SHARDS = "DCP shards"  # a torch.distributed.checkpoint folder (FSDP, Lightning's ModelParallelStrategy)
ZERO_PARTITIONS = "ZeRO partitions"  # DeepSpeed's checkpoint folder
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
    """A layout a strategy writes, as the checkpoint package needs to know it; part of the strategy's spec.

    Args:
        name: the name manifests record (``"DCP shards"``).
        consolidate: reads a checkpoint of this layout as one full Lightning state dict on CPU, called as
            ``consolidate(state, trust_pickles)``; None for a format no strategy of ours reads.
        recognise: whether a saved ``state`` path (file or folder) is in this layout, by its files alone.
        resumes_from: other layouts a strategy writing this one can resume from.
        written_by: strategy class names whose manifests predate the recorded layout.

    """

    name: str
    consolidate: Callable[..., dict[str, Any]] | None = None
    recognise: Callable[[Path], bool] = lambda _: False
    resumes_from: tuple[str, ...] = ()
    written_by: tuple[str, ...] = ()

    def read(self, state: Path, trust_pickles: bool = False) -> dict[str, Any]:
        """The checkpoint at ``state`` as one full Lightning dict on CPU.

        Raises:
            ValueError: no strategy of ours reads this layout.

        """
        if self.consolidate is None:
            raise ValueError(f"no strategy of ours reads {self.name!r}; resume it with the strategy that wrote it")
        return self.consolidate(state, trust_pickles)


def can_resume(saved: str, current: CheckpointLayout) -> bool:
    """Whether a checkpoint in layout ``saved`` loads into a strategy that writes ``current``."""
    return saved == current.name or saved in current.resumes_from


def layout_of_manifest(layout: str | None, strategy_name: str, known: Iterable[CheckpointLayout]) -> str:
    """The layout a manifest records, or for manifests that predate the field, the one its strategy wrote."""
    if layout:
        return layout
    return next((each.name for each in known if strategy_name in each.written_by), ONE_FILE)


def layout_of_folder(state: Path, known: Iterable[CheckpointLayout]) -> CheckpointLayout:
    """The layout of a saved ``state`` by its files (for checkpoints without a manifest that records it).

    Raises:
        FileNotFoundError: nothing there that any of the ``known`` layouts writes.

    """
    layouts = list(known)
    found = next((each for each in layouts if each.recognise(state)), None)
    if found is None:
        names = ", ".join(each.name for each in layouts)
        raise FileNotFoundError(f"{state}: not a checkpoint in any known layout ({names})")
    return found
