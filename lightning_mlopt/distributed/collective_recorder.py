"""Which collectives this rank issued in the current step, in order: op, shapes and dtypes, and who called it.

Ranks that call different collectives (a ``self.log(..., sync_dist=True)`` inside ``if self.global_rank == 0``,
an extra ``all_gather`` for a metric) fall out of step: each waits in a collective the others never join, or
two different collectives pair up and one hangs or garbles. The recorder wraps ``torch.distributed``'s
Python collectives (:data:`RECORDED`) while it is installed and keeps, per segment (a training step, from one
boundary to the next), each call's number, op, signature (``float32[4]``) and call site (the first frame
outside torch, Lightning and DeepSpeed: the user's ``model.py:42``, or ours), plus a running count and an
order-sensitive fingerprint. Ranks compare the count and fingerprint at each step boundary
(:class:`~lightning_mlopt.callbacks.CollectiveSequenceCheck`), and the hang watchdog reads each rank's
records through the store when a step never ends (``collective_reports.py``).

Not recorded, because every rank issues them in the same order by construction: DDP's gradient all-reduce
(C++), DTensor's functional collectives (tensor parallelism), point-to-point sends and receives (a pipeline's
stages legitimately differ), collectives from other threads (an asynchronous checkpoint's), and collectives
called from inside another recorded one (``all_gather_object``'s own ``all_gather``).

Example::

    recorder = CollectiveRecorder().install()
    dist.all_reduce(torch.ones(4))               # recorded: #1 all_reduce(float32[4]) at train.py:12
    summary = recorder.close_segment(next_step=1)  # count 1 and its fingerprint, for the ranks to compare
    recorder.uninstall()
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from lightning_mlopt.distributed.collective_reports import Record, SegmentSummary, to_report
from lightning_mlopt.process import phase

RECORDED = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_single",  # FSDP2's, in torch 2.13
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
)
"""The ``torch.distributed`` functions wrapped while a recorder is installed."""

# Ops whose first tensor may differ by rank (uneven splits and chunks, pickled objects): compared by op alone.
_UNSHAPED = frozenset(
    {"all_to_all", "all_to_all_single", "all_gather_object", "broadcast_object_list", "gather_object"}
    | {"scatter_object_list", "barrier", "scatter", "reduce_scatter"}
)

KEPT_PER_SEGMENT = 4096
"""Records kept per segment for naming a divergence; past it only the count and fingerprint go on."""

FINGERPRINT_BITS = 20
"""Bits of the fingerprint the ranks compare: its square, summed over 8192 ranks, stays exact in float64."""

_LIBRARIES = (
    "torch",
    "lightning",
    "lightning_fabric",
    "pytorch_lightning",
    "lightning_utilities",
    "torchmetrics",
    "deepspeed",
    "typing_extensions",
)


class CollectiveRecorder:
    """Records the collectives this process's training thread issues; see the module docstring.

    Args:
        kept: records kept per segment (past it, only the count and fingerprint go on).

    Attributes:
        step: the step the open segment belongs to.
        count: collectives recorded in the open segment.
        total: collectives recorded since installation (all segments).

    """

    def __init__(self, kept: int = KEPT_PER_SEGMENT) -> None:
        self.kept = kept
        self.step = 0
        self.count = 0
        self.total = 0
        self._fingerprint = 0
        self._records: list[Record] = []
        self._originals: dict[str, Callable[..., Any]] = {}
        self._thread = threading.get_ident()
        self._inside = False  # within a recorded call: nested collectives are its own
        self._calls: dict[Any, tuple[str, bytes]] = {}  # (op, dtype, shape) -> signature, fingerprinted bytes
        self._sites: dict[str, str | None] = {}  # file name -> its short name, None inside a library (cache)
        self._library_folders = _library_folders()

    # ------------------------------------------------------------------ installing

    def install(self) -> CollectiveRecorder:
        """Wrap :data:`RECORDED` in ``torch.distributed``; the installing thread is the one recorded."""
        global _INSTALLED
        if _INSTALLED is not None and _INSTALLED is not self:
            raise RuntimeError("another CollectiveRecorder is installed in this process: uninstall it first")
        if self._originals:
            return self
        self._thread = threading.get_ident()
        for name in RECORDED:
            original = getattr(dist, name, None)
            if original is not None:
                self._originals[name] = original
                setattr(dist, name, self._wrap(name, original))
        _INSTALLED = self
        return self

    def uninstall(self) -> None:
        """Put torch.distributed's functions back."""
        global _INSTALLED
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals = {}
        if _INSTALLED is self:
            _INSTALLED = None

    @property
    def installed(self) -> bool:
        """Whether the wrappers are in place."""
        return bool(self._originals)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        group_at = _parameter_index(original, "group")

        @functools.wraps(original)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            # Not recorded: collectives inside a recorded one, from other threads, through a wrapper kept past
            # uninstall (``from torch.distributed import all_reduce``), and on a group other than the world's:
            # a mesh dimension's (TP, HSDP) is issued alike by construction, and its payload may differ by group.
            if self._inside or threading.get_ident() != self._thread or _INSTALLED is not self:
                return original(*args, **kwargs)
            group = kwargs.get("group", args[group_at] if group_at is not None and len(args) > group_at else None)
            if group is not None and group is not dist.group.WORLD:
                return original(*args, **kwargs)
            self._record(name, args, kwargs)
            self._inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self._inside = False

        return recorded

    # ------------------------------------------------------------------ recording

    def _record(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first = args[0] if args else None
        if isinstance(first, torch.Tensor):  # the common case, cached: a collective's cost is microseconds
            key: Any = (op, first.dtype, first.shape)
            known = self._calls.get(key)
            if known is None:
                known = self._calls[key] = _call_bytes(op, _signature(op, args, kwargs))
        else:
            known = _call_bytes(op, _signature(op, args, kwargs))
        signature, call = known
        self.count += 1
        self.total += 1
        self._fingerprint = zlib.crc32(call, self._fingerprint)
        if len(self._records) < self.kept:
            self._records.append(Record(self.count, op, signature, self._call_site()))

    def _call_site(self) -> str:
        here = inspect.currentframe()  # this function's frame; past it, _record and the wrapper: dist.<op>'s caller
        assert here is not None and here.f_back is not None and here.f_back.f_back is not None
        caller = frame = here.f_back.f_back.f_back
        assert caller is not None
        while frame is not None:
            file = frame.f_code.co_filename
            short = self._sites.get(file, "")
            if short == "":  # first sight of this file: inside a library (None), or its short name
                library = file.startswith(self._library_folders) or file.startswith("<")
                short = self._sites[file] = None if library else _short_path(file)
            if short is not None:
                return f"{short}:{frame.f_lineno}"
            frame = frame.f_back
        # Only library frames (FSDP's own all-gather): name the library's caller, from its package down.
        return f"{_package_path(caller.f_code.co_filename)}:{caller.f_lineno}"

    def last(self) -> Record | None:
        """The open segment's newest record kept (what a stuck rank waits in), or None."""
        records = self._records
        return records[-1] if records else None

    def close_segment(self, next_step: int) -> SegmentSummary:
        """End the open segment (a step boundary) and start the next one, labelled ``next_step``."""
        summary = SegmentSummary(
            self.step, self.count, self._fingerprint & ((1 << FINGERPRINT_BITS) - 1), tuple(self._records)
        )
        self.step, self.count, self._fingerprint, self._records = next_step, 0, 0, []
        return summary

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Collectives issued inside are not recorded (the recorder's own comparison)."""
        inside, self._inside = self._inside, True
        try:
            yield
        finally:
            self._inside = inside

    def hang_report(self) -> str:
        """The rank's report for a hang (:func:`~lightning_mlopt.distributed.collective_reports.to_report`).

        Its open segment, read from the watchdog's thread while the training thread is stuck: a snapshot of
        plain attributes.
        """
        open_segment = SegmentSummary(self.step, self.count, self._fingerprint, tuple(self._records))
        return to_report(open_segment, False, phase.current()[0])


_INSTALLED: CollectiveRecorder | None = None


def installed_recorder() -> CollectiveRecorder | None:
    """The recorder installed in this process, if any."""
    return _INSTALLED


# ---------------------------------------------------------------------- helpers


def _signature(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """What every rank must pass alike: the first tensor (or tensor list) argument's dtype and shape.

    The first is the one every rank gives (a gather's list and a scatter's inputs exist on one rank only).
    All-to-all splits may differ by rank, and objects pickle to sizes of their own: those are the op alone.

    Example::

        >>> _signature("all_reduce", (torch.ones(4),), {})
        'float32[4]'
        >>> _signature("all_gather", ([torch.ones(2, 3)] * 2, torch.ones(2, 3)), {})
        '2x float32[2, 3]'
    """
    if op in _UNSHAPED:
        return ""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return _tensor(value)
        if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
            return f"{len(value)}x {_tensor(value[0])}"
    return ""


def _call_bytes(op: str, signature: str) -> tuple[str, bytes]:
    return signature, f"{op}({signature});".encode()


def _tensor(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}[{', '.join(str(size) for size in tensor.shape)}]"


def _parameter_index(function: Callable[..., Any], name: str) -> int | None:
    """Where ``name`` sits among ``function``'s positional parameters, or None."""
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None
    return parameters.index(name) if name in parameters else None


def _package_path(file: str) -> str:
    """``torch/distributed/fsdp/...``: a library file from its package down."""
    parts = file.replace(os.sep, "/").split("/")
    for index in range(len(parts) - 1, -1, -1):
        if parts[index] in _LIBRARIES:
            return "/".join(parts[index:])
    return os.path.basename(file)


def _library_folders() -> tuple[str, ...]:
    import contextlib

    folders = [contextlib.__file__, functools.__file__, threading.__file__]  # wrappers between a caller and dist
    for name in _LIBRARIES:
        spec = importlib.util.find_spec(name) if name not in sys.modules else sys.modules[name].__spec__
        if spec is not None and spec.origin is not None:
            folder = os.path.dirname(spec.origin)
            folders.append(folder + os.sep if spec.submodule_search_locations else spec.origin)
    folders.append(os.path.abspath(__file__))
    return tuple(folders)


def _short_path(file: str) -> str:
    """A call site's file, relative to the working directory when inside it, else from its package down."""
    try:
        relative = os.path.relpath(file)
    except ValueError:  # another drive
        relative = file
    if not relative.startswith(".."):
        return relative
    marker = f"{os.sep}lightning_mlopt{os.sep}"
    return "lightning_mlopt" + os.sep + file.split(marker, 1)[1] if marker in file else os.path.basename(file)


__all__ = ["RECORDED", "CollectiveRecorder", "installed_recorder"]
