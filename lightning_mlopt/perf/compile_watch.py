"""What torch.compile costs this process: its compilations, recompilations and the seconds they took.

torch.compile compiles lazily, inside the first step that reaches a compiled region (and the backward on its
first use), and again whenever a guard fails (a new shape, a changed attribute): a recompilation, which a
week-long run pays in silence unless someone counts. The watch counts every compilation in the process, ours
(``CompileModel``) or a user's own ``torch.compile``; ``CompileModel`` prints it after the first step and
PerformanceMonitor writes it into ``perf/summary.json``.

Example::

    watch = compile_watch()          # once, before the first compiled call
    ...                              # training
    watch.record().seconds           # 12.3: compiling, forward and backward
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class CompileRecord:
    """The process's compilations so far.

    Attributes:
        compilations: frames dynamo traced and compiled (recompilations included).
        recompilations: compilations of a frame compiled before (a guard failed: a new shape, a changed value).
        seconds: wall time inside compilation, forward and backward graphs.
        first_recompile: the compile id of the first recompilation (``"<frame>/<attempt>"``), or None.

    """

    compilations: int = 0
    recompilations: int = 0
    seconds: float = 0.0
    first_recompile: str | None = None

    def as_dict(self) -> dict[str, object]:
        """For ``perf/summary.json``."""
        return asdict(self)


@dataclass
class CompileWatch:
    """Counts compilations through dynamo's callbacks; installed once per process by :func:`compile_watch`."""

    _record: CompileRecord = field(default_factory=CompileRecord)
    _started: dict[tuple[str, str], float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # backward graphs compile on autograd's thread

    def started(self, trigger: str, compile_id: str) -> None:
        """Dynamo's callback: a compilation begins (``trigger``: ``DYNAMO`` or ``LAZY_BACKWARD``)."""
        with self._lock:
            self._started[(trigger, compile_id)] = time.perf_counter()

    def ended(self, trigger: str, compile_id: str) -> None:
        """Dynamo's callback: the compilation ``started`` was told of ends."""
        with self._lock:
            began = self._started.pop((trigger, compile_id), None)
            seconds = 0.0 if began is None else time.perf_counter() - began
            record = self._record
            recompiled = trigger == "DYNAMO" and _is_recompilation(compile_id)
            self._record = CompileRecord(
                compilations=record.compilations + (trigger == "DYNAMO"),
                recompilations=record.recompilations + recompiled,
                seconds=record.seconds + seconds,
                first_recompile=record.first_recompile or (compile_id if recompiled else None),
            )

    def record(self) -> CompileRecord:
        """What was compiled so far in this process."""
        with self._lock:
            return self._record


def _is_recompilation(compile_id: str) -> bool:
    """``"3/1"``: frame 3's second compilation (compiled autograd's ids start with ``!``; never ours)."""
    parts = compile_id.lstrip("!").split("/")
    try:
        return int(parts[-1].split("_")[0]) > 0
    except ValueError:
        return False


class CompilingBatches:
    """What a training batch compiled: PerformanceMonitor leaves such a batch out of its figures, CompileModel reports.

    A compiled model's first steps, and any that recompiles, spend seconds compiling: in a step-time window they
    would read as a slow step, and in the run's MFU as a slow run. Validation's compilations happen outside
    training batches and do not count.

    Example::

        batches = CompilingBatches()
        batches.started()        # on_train_batch_start
        batches.in_batch()       # on_train_batch_end: a CompileRecord of what compiled in between
    """

    def __init__(self) -> None:
        self._at_start = CompileRecord()

    def started(self) -> None:
        """A training batch starts."""
        self._at_start = compile_record() or CompileRecord()

    def in_batch(self) -> CompileRecord:
        """What compiled since :meth:`started` (nothing when nothing installed the watch); no ``first_recompile``."""
        now, before = compile_record() or CompileRecord(), self._at_start
        return CompileRecord(
            compilations=now.compilations - before.compilations,
            recompilations=now.recompilations - before.recompilations,
            seconds=now.seconds - before.seconds,
        )

    def compiled(self) -> bool:
        """Whether compilation ran since :meth:`started`."""
        return self.in_batch().seconds > 0


_WATCH: CompileWatch | None = None
_WATCH_LOCK = threading.Lock()


def compile_watch() -> CompileWatch:
    """The process's watch, installed on first call (dynamo's callbacks cannot be removed cheaply: one per process)."""
    global _WATCH
    with _WATCH_LOCK:
        if _WATCH is None:
            from lightning_mlopt._compat import on_compilations

            _WATCH = CompileWatch()
            on_compilations(_WATCH.started, _WATCH.ended)
        return _WATCH


def compile_record() -> CompileRecord | None:
    """What was compiled in this process, or None when nothing installed the watch (no compile configured)."""
    return None if _WATCH is None else _WATCH.record()


__all__ = ["CompileRecord", "CompileWatch", "CompilingBatches", "compile_record", "compile_watch"]
